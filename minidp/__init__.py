"""minidp: a from-scratch data-parallel training engine for PyTorch."""
import sys

from . import comm, data, lr, optim
from .checkpoint import load_checkpoint, save_checkpoint
from .data.sampler import DistributedSampler
from .engine import hooks
from .engine.ddp import DDP, DistributedDataParallel
from .engine.timeline import Timeline
from .env import DistEnv, init, shutdown
from .launch import WorkerFailed, launch
from .metrics import all_reduce_sums
from .ranks import barrier, get_logger, get_rank, get_world_size, is_main, local_rank_zero_first, print0
from .syncbn import SyncBatchNorm, convert_sync_batchnorm

# `minidp.hooks` is public (README); its code lives in the engine. Register the alias so that
# `import minidp.hooks` and `from minidp.hooks import GradBucket` work as well as the attribute.
sys.modules[__name__ + ".hooks"] = hooks

__all__ = [
    "DDP",
    "DistEnv",
    "DistributedDataParallel",
    "DistributedSampler",
    "SyncBatchNorm",
    "Timeline",
    "WorkerFailed",
    "all_reduce_sums",
    "barrier",
    "comm",
    "convert_sync_batchnorm",
    "data",
    "get_logger",
    "get_rank",
    "get_world_size",
    "hooks",
    "init",
    "is_main",
    "launch",
    "load_checkpoint",
    "local_rank_zero_first",
    "lr",
    "optim",
    "print0",
    "save_checkpoint",
    "shutdown",
]
__version__ = "0.1.0"
