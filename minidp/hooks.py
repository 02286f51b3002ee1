"""`minidp.hooks`: the comm-hook contract, GradBucket and the default all-reduce hook.

Their home is minidp/engine/hooks.py (the engine's first read); this module gives them their public name.
"""
from minidp.engine.hooks import *  # noqa: F401, F403
from minidp.engine.hooks import __all__  # noqa: F401
