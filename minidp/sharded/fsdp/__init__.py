"""fully_shard: FSDP2 (ZeRO-2/3, HSDP) from scratch. Chapter: minidp/sharded/README.md. In order:
  unit.py           a unit's step: pre_forward, post_forward, pre_backward, post_backward, prefetch
  collectives.py    the unit's all-gather and reduce-scatter (FSDP2's flat layout and division),
                    and the reduce-scatters in flight (ReducesInFlight, shared under one root)
  replicas.py       HSDP: the all-reduce across replicas after the reduce-scatter within one
  prefetch.py       backward's default prefetch target: the order of this step's forwards
  sharded_param.py  one parameter: its padded shard as a DTensor, its gathered copy
  mesh.py           the shard and replicate groups of a 1-D or 2-D mesh; int reshard_after_forward
  state.py          the hooks on a module, the Root the states under it share, the callback that
                    closes each backward
  module.py         FSDPModule: the class a sharded module becomes, FSDP2's public methods
  api.py            fully_shard(): which modules and parameters a call manages
"""
from .api import fully_shard
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
           "share_comm_ctx"]
