"""fully_shard: FSDP2 (ZeRO-2/3) from scratch. The chapter: minidp/sharded/README.md. In order:
  api.py            fully_shard(): which modules and parameters a call manages, the public methods
  state.py          the hooks on a module, the root, the callback that closes each backward
  unit.py           a unit's step: pre_forward, post_forward, pre_backward, post_backward
  sharded_param.py  one parameter: its padded dim-0 shard as a DTensor, its gathered copy
  collectives.py    the unit's all-gather and reduce-scatter (FSDP2's flat layout and division)
"""
from .api import fully_shard

__all__ = ["fully_shard"]
