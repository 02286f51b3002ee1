"""minidp: a from-scratch data-parallel training engine for PyTorch.

The public names below are imported on first use (PEP 562), so that `python -m minidp.run`, the
launcher, starts without importing torch: torch costs seconds of CPU per process, and a launcher
only starts, watches and restarts workers. `import minidp; minidp.DDP` works as always.
"""
import importlib

# Imported now: the function launch() has the name of its module, minidp/launch.py, and an import of
# that module (`from minidp.launch import free_port`) would otherwise leave the module at minidp.launch.
# (It imports no torch.)
from .launch import WorkerFailed as WorkerFailed
from .launch import launch as launch

# public name -> the module that defines it (relative to this package)
_PUBLIC = {
    "comm": ".comm", "data": ".data", "lr": ".lr", "optim": ".optim", "hooks": ".hooks",
    "load_checkpoint": ".checkpoint", "save_checkpoint": ".checkpoint",
    "DistributedSampler": ".data.sampler",
    "DDP": ".engine.ddp", "DistributedDataParallel": ".engine.ddp",
    "Timeline": ".engine.timeline",
    "DistEnv": ".env", "init": ".env", "shutdown": ".env",
    "all_reduce_sums": ".metrics",
    "barrier": ".ranks", "get_logger": ".ranks", "get_rank": ".ranks", "get_world_size": ".ranks",
    "is_main": ".ranks", "local_rank_zero_first": ".ranks", "print0": ".ranks",
    "SyncBatchNorm": ".syncbn", "convert_sync_batchnorm": ".syncbn",
}
__all__ = sorted([*_PUBLIC, "WorkerFailed", "launch"])
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'minidp' has no attribute {name!r}")
    module = importlib.import_module(_PUBLIC[name], __name__)
    value = module if _PUBLIC[name].rpartition(".")[2] == name else getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
