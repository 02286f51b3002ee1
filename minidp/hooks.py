"""`minidp.hooks`: the comm-hook contract, GradBucket and the default all-reduce hook;
hook_with_zero_step(_interleaved), the hooks that run minidp.ZeroRedundancyOptimizer's step inside
backward; and hook_with_zero_reduce_scatter, ZeRO-1 at DDP's bytes (reduce_scatter=True).

Their homes are minidp/engine/hooks.py (the engine's first read), minidp/sharded/zero/overlap.py and
minidp/sharded/zero/reduce_scatter.py; this module gives them their public name.
"""
from minidp.engine.hooks import *  # noqa: F401, F403
from minidp.engine.hooks import __all__ as _engine_names
from minidp.sharded.zero.overlap import (  # noqa: F401
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
)
from minidp.sharded.zero.reduce_scatter import hook_with_zero_reduce_scatter  # noqa: F401

__all__ = [*_engine_names, "hook_with_zero_step", "hook_with_zero_step_interleaved",
           "hook_with_zero_reduce_scatter"]
