"""Sharded data parallelism: each rank keeps a shard of the optimizer state, gradients or weights.

Empty for now: the sharded optimizer (ZeroRedundancyOptimizer, ZeRO-1) and fully_shard (ZeRO-2/3)
come here, beside the engine, sharing its collectives and planning; README.md says what goes where.
"""
