"""`minidp.hooks`: the comm-hook contract, GradBucket and the default all-reduce hook; and
hook_with_zero_step(_interleaved), the hooks that run minidp.ZeroRedundancyOptimizer's step inside
backward.

Their homes are minidp/engine/hooks.py (the engine's first read) and minidp/sharded/zero/overlap.py;
this module gives them their public name.
"""
from minidp.engine.hooks import *  # noqa: F401, F403
from minidp.engine.hooks import __all__ as _engine_names
from minidp.sharded.zero.overlap import (  # noqa: F401
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
)

__all__ = [*_engine_names, "hook_with_zero_step", "hook_with_zero_step_interleaved"]
