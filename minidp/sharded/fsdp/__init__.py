"""fully_shard: FSDP2 (ZeRO-2/3) from scratch. The chapter: minidp/sharded/README.md. In order:
  unit.py           a unit's step: pre_forward, post_forward, pre_backward, post_backward, prefetch
  collectives.py    the unit's all-gather and reduce-scatter (FSDP2's flat layout and division),
                    and the reduce-scatters in flight (ReducesInFlight, shared under one root)
  prefetch.py       backward's default prefetch target: the order of this step's forwards
  sharded_param.py  one parameter: its padded dim-0 shard as a DTensor, its gathered copy
  state.py          the hooks on a module, the Root the states under it share, the callback that
                    closes each backward
  api.py            fully_shard(): which modules and parameters a call manages, the public methods
"""
from .api import fully_shard

__all__ = ["fully_shard"]
