"""ZeroRedundancyOptimizer: ZeRO-1, each rank keeps the optimizer state of its shard only. The
chapter: minidp/sharded/README.md. In order (the first five are plain ZeRO-1):
  optimizer.py    the class: local optimizer over this rank's shard, step, broadcasts
  partition.py    which rank steps which parameter (torch's sorted-greedy rule), pure functions
  flat_params.py  parameters_as_bucket_view=True: a rank's shard as views into one flat buffer
  state_dicts.py  consolidate (gather on one rank), merge to global numbering, load this rank's
  arguments.py    the constructor's checks, with torch's messages
  overlap.py      overlap_with_ddp=True: hook_with_zero_step, the step inside DDP's backward
"""
from .optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
