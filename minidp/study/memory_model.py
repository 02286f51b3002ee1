"""Memory and communication per rank for DDP and ZeRO stages 1, 2 and 3: the ZeRO paper's model, as arithmetic.

    predict_memory(7.5e9, ranks=64)[3]["total"]   # 1.875e9 bytes: ZeRO-3's 1.9 GB in the paper's Figure 1

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC 2020).
Mixed-precision training keeps fp16 weights (2 bytes a parameter) and gradients (2 bytes), and an
optimizer state of K bytes a parameter (Adam: fp32 master weights, momentum and variance, K = 12).
With Ψ parameters and N ranks, each rank holds (sections 5.1 and 5.2, Figure 1):

    DDP     (baseline)     2Ψ   + 2Ψ   + KΨ          = (2 + 2 + K)Ψ
    ZeRO-1  (P_os)         2Ψ   + 2Ψ   + KΨ/N
    ZeRO-2  (P_os+g)       2Ψ   + 2Ψ/N + KΨ/N        = 2Ψ + (2 + K)Ψ/N
    ZeRO-3  (P_os+g+p)     2Ψ/N + 2Ψ/N + KΨ/N        = (2 + 2 + K)Ψ/N

Communication (section 7), in elements a rank moves per step. DDP's all-reduce is a reduce-scatter
(Ψ) and an all-gather (Ψ): 2Ψ. ZeRO-1 and ZeRO-2 reduce-scatter the gradients (Ψ) and all-gather the
updated parameters (Ψ): 2Ψ, as DDP. ZeRO-3 all-gathers the parameters in forward (Ψ), again in
backward (Ψ), and reduce-scatters the gradients (Ψ): 3Ψ, 1.5 times DDP. The paper counts each
collective of Ψ elements as Ψ; a ring (or any bandwidth-optimal algorithm) sends (N - 1)/N of that
from each rank, nothing at N = 1. `sent` below is those bytes; `volume` is the paper's count.

Left out: activations, temporary buffers and fragmentation (the paper's "residual states").
No torch here: `python -m minidp.simulate --memory` starts without it (memory_table.py prints this).
"""
from __future__ import annotations

from ..validate import check_int, check_number

# (name, the paper's name, shards the optimizer state, the gradients, the weights)
STAGES = (("DDP", "baseline", False, False, False),
          ("ZeRO-1", "P_os", True, False, False),
          ("ZeRO-2", "P_os+g", True, True, False),
          ("ZeRO-3", "P_os+g+p", True, True, True))

PAPER_FIGURE_1 = {"params": 7_500_000_000, "ranks": 64, "k": 12}  # Ψ = 7.5 B, N = 64, K = 12


def predict_memory(params: float, ranks: int, k: float = 12, weight_bytes: int = 2, grad_bytes: int = 2) -> list:
    """Bytes per rank of weights, gradients and optimizer state, and bytes sent per step, for each stage.

    Args:
        params: the parameter count Ψ, > 0 (e.g. 7.5e9).
        ranks: the data-parallel ranks N, >= 1.
        k: optimizer state bytes per parameter, >= 0. Default 12 (mixed-precision Adam).
        weight_bytes: bytes of a weight as the model holds and all-gathers it. Default 2 (fp16).
        grad_bytes: bytes of a gradient as it is held and reduced. Default 2 (fp16).

    Returns:
        list of dicts, one per stage in STAGES' order (DDP, ZeRO-1, ZeRO-2, ZeRO-3): stage (0 for DDP),
        name, paper_name, weights, gradients, optimizer, total (bytes per rank), sent (bytes a rank
        sends per step in a ring), volume (the paper's elements per step, in units of Ψ: 2, 2, 2, 3).
    """
    check_number("params", params, positive=True)
    ranks = check_int("ranks", ranks, 1)
    check_number("k", k, low=0)
    check_int("weight_bytes", weight_bytes, 1)
    check_int("grad_bytes", grad_bytes, 1)
    ring = (ranks - 1) / ranks  # of a collective's Ψ elements, the share each rank sends
    rows = []
    for stage, (name, paper_name, shard_optimizer, shard_grads, shard_weights) in enumerate(STAGES):
        weights = weight_bytes * params / (ranks if shard_weights else 1)
        gradients = grad_bytes * params / (ranks if shard_grads else 1)
        optimizer = k * params / (ranks if shard_optimizer else 1)
        if stage == 0:  # all-reduce = reduce-scatter + all-gather, both of gradients
            collectives = [grad_bytes, grad_bytes]
        elif not shard_weights:  # reduce-scatter gradients, all-gather updated weights
            collectives = [grad_bytes, weight_bytes]
        else:  # all-gather weights in forward and again in backward, reduce-scatter gradients
            collectives = [weight_bytes, weight_bytes, grad_bytes]
        rows.append({"stage": stage, "name": name, "paper_name": paper_name, "weights": weights,
                     "gradients": gradients, "optimizer": optimizer, "total": weights + gradients + optimizer,
                     "sent": ring * params * sum(collectives), "volume": len(collectives)})
    return rows
