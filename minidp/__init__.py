"""minidp: a from-scratch data-parallel training engine for PyTorch.

The public names below are imported on first use (PEP 562), so that `python -m minidp.run`, the
launcher, starts without importing torch: torch costs seconds of CPU per process, and a launcher
only starts, watches and restarts workers. `import minidp; minidp.DDP` works as always.

The package by layer (each folder's __init__ lists its files; tests/test_layout.py checks the
arrows, which point down this list only):
  study/, integrations/          explain and simulate; Lightning and Accelerate
  comm/, train/, data/, sharded/ research communication; training helpers; samplers and DALI;
                                 sharding
  engine/                        DDP
  runtime/                       inside a rank: init, backend, rendezvous, rank helpers, watchdog
  launcher/                      spawn, supervise, restart (no torch)
  validate.py                    argument checks, imported by all
Beside them, one-line public names: run.py explain.py simulate.py (`python -m minidp.X`), hooks.py,
lightning.py, accelerate.py.

dir(minidp) lists the public names only: no module this file uses, nor the subpackages that
importing a public name loads (Python sets each as an attribute of the package).
"""

# public name -> the module that defines it (relative to this package)
_PUBLIC = {
    "comm": ".comm", "data": ".data", "ft": ".ft", "hooks": ".hooks",
    "lr": ".train.lr", "optim": ".train.optim",
    "launch": ".launcher.spawn", "WorkerFailed": ".launcher.supervisor",
    "load_checkpoint": ".train.checkpoint", "save_checkpoint": ".train.checkpoint",
    "DistributedSampler": ".data.sampler",
    "DDP": ".engine.ddp", "DistributedDataParallel": ".engine.ddp",
    "Timeline": ".engine.timeline",
    "DistEnv": ".runtime.env", "init": ".runtime.env", "shutdown": ".runtime.env",
    "all_reduce_sums": ".train.metrics",
    "barrier": ".runtime.ranks", "get_logger": ".runtime.ranks", "get_rank": ".runtime.ranks",
    "get_world_size": ".runtime.ranks", "is_main": ".runtime.ranks",
    "local_rank_zero_first": ".runtime.ranks", "print0": ".runtime.ranks",
    "SyncBatchNorm": ".train.syncbn", "convert_sync_batchnorm": ".train.syncbn",
    "ZeroRedundancyOptimizer": ".sharded.zero.optimizer",
    "fully_shard": ".sharded.fsdp.api", "FSDPModule": ".sharded.fsdp.module",
    "register_fsdp_forward_method": ".sharded.fsdp.module", "share_comm_ctx": ".sharded.fsdp.module",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    from importlib import import_module  # here, not at the top: dir(minidp) shows no `importlib`

    if name not in _PUBLIC:
        raise AttributeError(f"module 'minidp' has no attribute {name!r}")
    module = import_module(_PUBLIC[name], __name__)
    value = module if _PUBLIC[name].rpartition(".")[2] == name else getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return [*__all__, "__version__"]
