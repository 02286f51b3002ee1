"""`minidp.hooks`, the public name of minidp.engine.hooks (GradBucket, the default all-reduce hook).

`import minidp.hooks`, `from minidp.hooks import GradBucket` and `minidp.hooks` all give the engine's
module itself, not a copy, so its names have one home.
"""
import sys

from .engine import hooks as _engine_hooks

sys.modules[__name__] = _engine_hooks
