"""ZeroRedundancyOptimizer: ZeRO-1, each rank keeps the optimizer state of its shard only. The
chapter: minidp/sharded/README.md. In order (the first five are plain ZeRO-1):
  optimizer.py          the class: local optimizer over this rank's shard, step, broadcasts; it
                        holds a policy that says whether step() steps (StepAfterBackward here)
  partition.py          which rank steps which parameter (torch's sorted-greedy rule), pure
  flat_params.py        parameters_as_bucket_view=True: a rank's shard as views into one buffer
  state_dicts.py        consolidate (gather on one rank), merge to global numbering, load a shard
                        (whole tensors, or reduce_scatter=True's pieces joined and cut again)
  arguments.py          the constructor's checks, with torch's messages
  overlap.py            overlap_with_ddp=True, beside the class: hook_with_zero_step and its
                        policy StepInBackward (the step inside DDP's backward)
  bucket_assignment.py  overlap_with_ddp=True's partition: who steps which DDP bucket, pure
  reduce_scatter.py     reduce_scatter=True, beside the class: hook_with_zero_reduce_scatter and its
                        policy ReduceScatterStep (reduce-scatter, step the shard, all-gather)
"""
from .optimizer import ZeroRedundancyOptimizer
from .reduce_scatter import hook_with_zero_reduce_scatter

__all__ = ["ZeroRedundancyOptimizer", "hook_with_zero_reduce_scatter"]
