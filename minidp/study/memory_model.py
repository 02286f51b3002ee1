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
predict_peak (below) adds what an engine holds at its peak beside the stage's shards: the gathered
unit and its unsharded gradients, the collectives' flat buffers, DDP's buckets, ZeRO-1's uneven
partition, HSDP's shard group.
No torch here: `python -m minidp.simulate --memory` starts without it (memory_table.py prints this).
"""
from __future__ import annotations

from ..validate import check_bool, check_choice, check_int, check_number

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


def zero1_beside_ddp(params: float, ranks: int, k: float = 12, weight_bytes: int = 2,
                     grad_bytes: int = 2) -> dict:
    """ZeRO-1 as it runs beside DDP, by how its weights come back: {mode: predict_memory's ZeRO-1 row}.

    "reduce_scatter" (minidp's ZeroRedundancyOptimizer(reduce_scatter=True), the paper's stage 1,
    Megatron's distributed optimizer): the row above as it is, 2(N-1)/N Ψ sent (a reduce-scatter of the
    gradients, an all-gather of the weights). "broadcast" (torch's ZeroRedundancyOptimizer, minidp's
    plain one): DDP's all-reduce, then the shards' broadcasts: 3(N-1)/N Ψ, volume 3. Memory: ZeRO-1's,
    both (the flat buffers either keeps beside it are predict_peak's business).
    """
    row = predict_memory(params, ranks, k, weight_bytes, grad_bytes)[1]
    ring = (ranks - 1) / ranks
    broadcast = dict(row, sent=ring * params * (2 * grad_bytes + weight_bytes), volume=3)
    return {"reduce_scatter": dict(row), "broadcast": broadcast}


def _partition_max(tensors: list, ranks: int) -> int:
    """Parameters on the fullest rank when whole tensors are dealt out as ZeroRedundancyOptimizer deals
    them (torch's rule, minidp's too): largest first, each to the rank holding the fewest so far (the
    first such rank on a tie)."""
    sizes = [0] * ranks
    for numel in sorted(tensors, reverse=True):
        sizes[sizes.index(min(sizes))] += numel
    return max(sizes)


def predict_peak(units: list, ranks: int, stage: str, k: float = 12, weight_bytes: int = 2,
                 grad_bytes: int = 2, replicate: int = 1, bucket_views: bool = True) -> dict:
    """Bytes per rank at the peak of a training step: the stage's shards plus what the step holds then.

    predict_memory is the ZeRO paper's steady state. A rank also holds, at its peak, what the step
    itself needs: the working set below, derived from what minidp.fully_shard (minidp/sharded/fsdp)
    and torch's FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, _fsdp_collectives.py)
    and the two ZeroRedundancyOptimizers hold, moment by moment. Ψ is the sum of `units`, U_j a
    unit's parameters, S = ranks / replicate the ranks a parameter is sharded over; w, g, K are
    weight_bytes, grad_bytes and k. Each rank keeps its shards, w Ψ / S, and its optimizer state,
    K Ψ / S, all the step (from the first step on; ZeRO-2/3).

    ZeRO-3 (fully_shard, reshard_after_forward=True). Forward gathers unit j (its flat all-gather
    output, w U_j, is copied out into the unit's gathered weights, w U_j, then freed) and frees it
    after the unit's forward. Backward runs the units in reverse; while unit j computes its backward
    a rank holds:
      - unit j's gathered weights, w U_j (gathered again at its pre-backward);
      - the all-gather output of unit j - 1, w U_{j-1}: the prefetch, started at unit j's
        pre-backward, copied out only at unit j - 1's (minidp: in flight; FSDP2 on CPU: finished,
        its output kept in _all_gather_result until then);
      - unit j's unsharded gradients, g U_j, complete just before its post-backward;
      - unit j + 1's reduce-scatter input, g U_{j+1}, padded to S rows (FSDP2 keeps it in
        reduce_scatter_states, minidp in its ReduceScatter in flight, until unit j's post-backward);
      - the sharded gradients of units j + 1 ... (g U / S each; minidp holds unit j + 1's as its
        reduce-scatter output until unit j's post-backward waits for it: the same bytes).
    In unit j's post-backward the gathered weights are freed and unit j + 1's input retired before
    unit j's own input (g U_j) is filled from its unsharded gradients: that moment is counted too.
    For equal units the peak is the second-last unit's backward (j = 1): the stage's (w + g + K) Ψ / S
    less the two sharded gradients not yet there, 2 g U / S, plus 2 w U + 2 g U.

    ZeRO-2 (reshard_after_forward=False): the same, but a unit stays gathered from its forward to its
    post-backward, so while unit j computes its backward units 0 ... j are all gathered (w Σ U_0..j)
    and no prefetch buffer is held. For equal units the peak is the second unit of backward
    (j = L - 2, unit L - 1's reduce-scatter input still held): (w + K) Ψ / S + w (Ψ - U) + g U / S
    + 2 g U; without the buffers, the start of backward: (w + K) Ψ / S + w Ψ + g U.

    A root holding parameters of its own gathers them before every other unit and keeps them until
    its post-backward at the very end: not modelled apart (the benchmarks' root holds none); given
    as units[0] they are counted as the first unit's, a lower bound.

    HSDP (fully_shard on a (replicate R, shard S) mesh): replicate=R. A parameter is sharded over the S
    ranks of its shard group, so every term above is over S, not N; the gradients' all-reduce across
    the R replicas runs in place on the reduce-scatter output (FSDP2's foreach_reduce), so nothing is
    added. (N ranks of HSDP hold what S ranks of fully_shard hold.)

    ZeRO-1 (DDP + ZeroRedundancyOptimizer): every rank holds all weights, w Ψ, and all gradients,
    g Ψ, at the end of backward and through the step; its optimizer holds the state of its share of
    whole tensors, dealt largest first to the least-loaded rank (torch's partition, minidp's too):
    K times the fullest rank's parameters, which is K Ψ / N only where the tensors divide evenly.
    DDP: the same with all the state, K Ψ. Both DDPs (torch's C++ reducer, minidp.DDP's Bucket) keep
    flat buckets beside the gradients, g Ψ more, unless gradient_as_bucket_view=True
    (bucket_views=True, the default: the gradients are the buckets).

    Not counted (as predict_memory): activations and autograd's other saved tensors, the optimizer
    step's temporaries, AdamW's 0-d `step` tensors (4 bytes a tensor), the shards' padding to S
    rows, and what the collectives allocate inside the backend (gloo copies a reduce-scatter's
    input; see benchmarks/RESULTS.md's issue 41).

    Args:
        units: the model's parameters as [[numel of each parameter tensor], ...], one list per
            fully_shard unit in forward order (e.g. [[4194304, 2048]] * 6: six Linear(2048, 2048)).
            ZeRO-1/DDP read only the tensors (for the partition).
        ranks: N, the ranks, >= 1.
        stage: "DDP", "ZeRO-1", "ZeRO-2" (reshard_after_forward=False) or "ZeRO-3" (True).
        k, weight_bytes, grad_bytes: as predict_memory (defaults 12, 2, 2).
        replicate: R of an HSDP (R, S) mesh (ZeRO-2/3 only); default 1 (a 1-D mesh). N % R == 0.
        bucket_views: DDP and ZeRO-1: DDP's gradients are views of its buckets (default True); False
            adds the buckets, g Ψ.

    Returns:
        dict: stage, params (Ψ), shard_ranks (S), where (the peak's moment, in words), and its bytes:
        weights (shards, or all the weights), gradients (sharded, or all), optimizer, gathered (weights
        gathered beside the shards), unsharded_grads (full gradients before their reduce-scatter),
        buffers (the collectives' flat buffers: all-gather output, reduce-scatter input; DDP's
        buckets), total (their sum: the peak), and without_buffers (the most any moment holds
        without the buffers: what a count of parameters, gradients and optimizer state alone sees).
    """
    check_choice("stage", stage, tuple(name for name, *_ in STAGES))
    ranks = check_int("ranks", ranks, 1)
    replicate = check_int("replicate", replicate, 1)
    check_number("k", k, low=0)
    w = check_int("weight_bytes", weight_bytes, 1)
    g = check_int("grad_bytes", grad_bytes, 1)
    check_bool("bucket_views", bucket_views)
    if not isinstance(units, (list, tuple)) or not units or not all(
            isinstance(u, (list, tuple)) and u for u in units):
        raise ValueError(f"units={units!r} must be a non-empty list of non-empty lists of tensor sizes")
    for u in units:
        for numel in u:
            check_int("a tensor's numel in units", numel, 1)
    if ranks % replicate:
        raise ValueError(f"replicate={replicate} must divide ranks={ranks}")
    if replicate > 1 and stage in ("DDP", "ZeRO-1"):
        raise ValueError(f"replicate={replicate}: HSDP is fully_shard's (ZeRO-2/3), not {stage}'s")
    sizes = [sum(u) for u in units]
    psi = sum(sizes)
    base = {"stage": stage, "params": psi, "shard_ranks": ranks // replicate}
    if stage in ("DDP", "ZeRO-1"):
        held = psi if stage == "DDP" else _partition_max([n for u in units for n in u], ranks)
        parts = {"weights": w * psi, "gradients": g * psi, "optimizer": k * held, "gathered": 0,
                 "unsharded_grads": 0, "buffers": 0 if bucket_views else g * psi}
        total = sum(parts.values())
        return {**base, "where": "after backward and in the step: all weights and gradients", **parts,
                "total": total, "without_buffers": total - parts["buffers"]}
    s = ranks // replicate
    zero3 = stage == "ZeRO-3"
    steady = {"weights": w * psi / s, "optimizer": k * psi / s}
    moments = []  # (where, gradients, gathered, unsharded_grads, buffers)
    last = len(sizes) - 1
    for j, u in enumerate(sizes):  # forward: unit j's all-gather output beside its gathered weights
        moments.append((f"forward, unit {j}'s copy-out", 0, w * (u if zero3 else sum(sizes[:j + 1])), 0,
                        w * u))
    for j in range(last, -1, -1):  # backward: units in reverse
        sharded = g * sum(sizes[j + 1:]) / s
        gathered = w * (sizes[j] if zero3 else sum(sizes[:j + 1]))
        prefetch = w * sizes[j - 1] if zero3 and j > 0 else 0
        previous = g * sizes[j + 1] if j < last else 0  # unit j + 1's reduce-scatter input
        moments.append((f"backward, unit {j} of 0..{last}: its gradients complete", sharded, gathered,
                        g * sizes[j], prefetch + previous))
        moments.append((f"backward, unit {j}'s reduce-scatter copy-in", sharded, gathered - w * sizes[j],
                        g * sizes[j], prefetch + g * sizes[j]))
    moments.append(("after backward and the step", g * psi / s, 0, 0, 0))
    parts_of = [dict(steady, gradients=grads, gathered=gathered, unsharded_grads=full, buffers=buffers)
                for _, grads, gathered, full, buffers in moments]
    totals = [sum(p.values()) for p in parts_of]
    top = max(range(len(moments)), key=lambda i: (totals[i], -i))  # the first moment at the most
    return {**base, "where": moments[top][0], **parts_of[top], "total": totals[top],
            "without_buffers": max(t - p["buffers"] for t, p in zip(totals, parts_of))}
