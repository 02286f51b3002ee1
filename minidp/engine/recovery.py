"""Failed-backward recovery: a backward that raises on one rank never lets the ranks diverge.

Why: a backward that raises after its first gradient hook (an error in the model, an out-of-memory
caught and retried) may have launched only some of the step's bucket all-reduces on this rank, while
ranks whose backward succeeded launched all of them and now wait for this rank. Before this rank
issues any other collective (which would pair with theirs), the next forward calls
`close_failed_step`: it launches the missing buckets filled with NaN (zeros for a sparse one). The
last bucket is always among them (the reducer launches it only at the end of a successful backward),
so every rank's last reduced bucket starts with a NaN, and every rank then exchanges the step's
status (`exchange_status`: one flag per rank, did its backward fail?). Every rank discards the step,
and ranks whose backward had succeeded raise too: every rank's loop sees the same error, skips the
same optimizer step, and the ranks stay equal.

When the status is exchanged (`status_needed`, the same answer on every rank): after a NaN in the
last bucket (a failure, or a gradient that is NaN itself: then the status says nobody failed), and
on every step where the readiness policy counts which ranks used each parameter
(find_unused_parameters, as torch DDP's unused-parameter all-reduce), or a comm hook reduces the
buckets (its result may not carry the NaN: one all-reduce a step more than torch DDP's). On CUDA the
check reads one element of the last bucket on the host, which waits for that bucket's all-reduce
(gloo's wait has blocked already on CPU). `status_on_host(model)` moves an exchanged status to CPU
tensors on a gloo copy of the group (the host then never reads the GPU for it).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import debug as debug_mode
from .progress import report


def close_failed_step(reducer) -> None:
    """First in every forward: if this rank's last backward raised mid-step, close it with the others."""
    step = reducer.open_step
    if step is None:
        return
    reducer.step = None
    for bucket in reducer.layout.buckets[len(step.futures):]:  # ranks meet here: those not launched
        step.futures.append(reducer.reduce(bucket, failure_payload(bucket)))
    reducer.end_step(step, failed=True)
    reducer.recorder.event("failed_iteration_closed")


def failure_payload(bucket) -> torch.Tensor:
    """What a failed rank sends for a bucket it had not launched: NaNs (a sparse bucket: zeros)."""
    return bucket.zeros() if bucket.sparse else torch.full_like(bucket.buffer, math.nan)


def status_on_host(model, enabled: bool = True) -> None:
    """Exchange `model`'s end-of-backward status on the host (CPU tensors, a gloo group), or back on its device.

    Every rank must call it, with the same `enabled` (making the gloo group is a collective of the world).

    Args:
        model: a minidp.DDP.
        enabled: True (default): on a gloo copy of the model's group; False: on the model's group and device.
    """
    reducer = getattr(model, "reducer", None)
    if reducer is None or not hasattr(reducer, "end_step"):
        raise TypeError(f"status_on_host: model={type(model).__name__} must be a minidp.DDP")
    group = None
    if enabled:
        ranks = dist.get_process_group_ranks(reducer.process_group or dist.group.WORLD)
        group = dist.new_group(ranks, backend="gloo")  # ranks meet here (every rank of the world)
    reducer.status_group = group


def status_needed(reducer, results: list) -> bool:
    """Whether this step exchanges its status; every rank gets the same answer from the same values."""
    if reducer.readiness.counts_use or reducer.comm_hook is not None:
        return True
    if not results or reducer.layout.buckets[-1].sparse:
        return bool(results)  # no bucket: world size 1, no one to hear from; sparse: no NaN to read
    return math.isnan(results[-1].reshape(-1)[0].item())  # the one host read of the default step


def exchange_status(reducer, step, failed: bool) -> tuple[list[int], list[int] | None]:
    """All-reduce the step's status: (ranks whose backward failed, by parameter how many ranks used it).

    No host-to-device copy from pageable memory (it would make the host wait): the flag is written
    by a fill on the device, the use counts (find_unused_parameters) come from pinned memory.
    """
    counts_use, world_size = reducer.readiness.counts_use, reducer.world_size
    group = reducer.status_group  # status_on_host(): a gloo group, CPU tensors
    device = torch.device("cpu") if group is not None else reducer.device
    status = torch.zeros(world_size + len(reducer.params) * counts_use, dtype=torch.int32, device=device)
    if failed:
        status[reducer.rank].fill_(1)  # a fill with a host scalar: a kernel argument, no copy
    if counts_use:
        pinned = device.type == "cuda"
        ready = torch.tensor(step.ready, dtype=torch.int32, pin_memory=pinned)
        status[world_size:].copy_(ready, non_blocking=pinned)
    if world_size > 1:
        try:
            group = group if group is not None else reducer.process_group
            dist.all_reduce(status, group=group)  # ranks meet here
        except RuntimeError as exc:
            raise RuntimeError(
                f"minidp.DDP on rank {reducer.rank}: iteration {reducer.iteration}: the end-of-backward status "
                f"all-reduce failed; likely {debug_mode.LIKELY_CAUSES}, or a rank's backward raised and it "
                f"ran no forward afterwards (MINIDP_DEBUG=1 checks every step). Cause: {exc}"
                + report(reducer, "the end-of-backward status all-reduce")) from exc
    counts = status.tolist()  # whether to raise is a decision of the host
    return [r for r in range(world_size) if counts[r]], counts[world_size:] or None


def failed_message(reducer, failed_ranks: list[int]) -> str:
    return (f"minidp.DDP on rank {reducer.rank}: the backward of iteration {reducer.iteration} raised on rank(s) "
            f"{failed_ranks}, so every rank discards this iteration's gradients (none were averaged). "
            "Skip optimizer.step() and call optimizer.zero_grad(), as those ranks do after their own "
            "error, then go on: the ranks stay equal.")


def wait_failed_message(reducer, bucket, exc: Exception) -> str:
    return (f"minidp.DDP on rank {reducer.rank}: iteration {reducer.iteration}: the all-reduce of bucket "
            f"{bucket.index} [{debug_mode.describe_bucket(reducer.layout, bucket.index)}] failed; likely "
            f"{debug_mode.LIKELY_CAUSES} (MINIDP_DEBUG=1 checks every step). Cause: {exc}"
            + report(reducer, f"the all-reduce of bucket {bucket.index}"))
