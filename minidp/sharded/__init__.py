"""Sharded data parallelism: each rank keeps a shard of the optimizer state, gradients or weights.

ZeRO-1 (minidp.ZeroRedundancyOptimizer) and fully_shard (ZeRO-2/3, FSDP2's API: the fsdp/ folder,
its own reading order in fsdp/__init__.py). Read in this order (README.md is the chapter: what ZeRO-1
and fully_shard are, and maps to torch's functions):
  zero.py         ZeroRedundancyOptimizer: local optimizer over this rank's shard, step, broadcasts
  partition.py    which rank steps which parameter (torch's sorted-greedy rule), pure functions
  flat_params.py  parameters_as_bucket_view=True: a rank's shard as views into one flat buffer
  state_dicts.py  consolidate (gather on one rank), merge to global numbering, load this rank's part
  arguments.py    the constructor's checks, with torch's messages
"""
