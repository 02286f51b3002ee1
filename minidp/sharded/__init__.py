"""Sharded data parallelism: each rank keeps a shard of the optimizer state, gradients or weights.

Two siblings, each with its own reading order (README.md is the chapter: what they are, and maps
to torch's functions):
  zero/   ZeroRedundancyOptimizer: ZeRO-1, the optimizer state sharded (and its step inside DDP's
          backward, overlap_with_ddp=True)
  fsdp/   fully_shard: ZeRO-2/3 with FSDP2's API, the gradients and the weights sharded too
"""
