"""minidp: a from-scratch data-parallel training engine for PyTorch."""
from . import hooks
from .ddp import DDP, DistributedDataParallel
from .env import DistEnv, init, shutdown
from .launch import WorkerFailed, launch
from .ranks import barrier, get_logger, get_rank, get_world_size, is_main, local_rank_zero_first, print0

__all__ = [
    "DDP",
    "DistributedDataParallel",
    "hooks",
    "DistEnv", "init", "shutdown", "launch", "WorkerFailed",
    "barrier", "get_logger", "get_rank", "get_world_size", "is_main", "local_rank_zero_first", "print0",
]
__version__ = "0.1.0"
