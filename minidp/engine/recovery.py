"""Failed-backward recovery: a backward that raises on one rank never lets the ranks diverge.

Why: a backward that raises after its first gradient hook (an error in the model, an out-of-memory
caught and retried) may have launched only some of the step's bucket all-reduces on this rank, while
ranks whose backward succeeded launched all of them and now wait for this rank. Before this rank
issues any other collective (which would pair with theirs), the next forward calls
`close_failed_step`: it launches the missing buckets (zeros) and reports the failure in the step's
status all-reduce. Every rank then discards the step, and ranks whose backward had succeeded raise
from it too: every rank's loop sees the same error, skips the same optimizer step, and the ranks
stay equal. Zeros rather than a partial buffer: the values are discarded everywhere.

The status all-reduce runs at the end of every synced step (reducer.end_step): one flag per rank
(did its backward fail?) and, when the readiness policy counts use, how many ranks produced each
parameter's gradient. Whether to raise is a decision of the host, so the host reads the status once
per step. By default the status is a tensor on the model's device, all-reduced on the model's group:
on CUDA that read waits until the GPU has finished backward and every bucket (backward() returns
only then; torch DDP lets the host queue the optimizer step and the next forward meanwhile).
`status_on_host(model)` moves the status to CPU tensors on a gloo copy of the group: the host then
waits for the other ranks' hosts to reach the end of their backward, never for its GPU. Same
guarantee, same results (the status does not touch the gradients); a GPU session measures the two
(benchmarks/gpu_check.py, "status" rows) to choose the default on CUDA.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import debug as debug_mode
from .progress import report


def close_failed_step(reducer) -> None:
    """First in every forward: if this rank's last backward raised mid-step, close that step with the others."""
    step = reducer.open_step
    if step is None:
        return
    reducer.step = None
    for bucket in reducer.layout.buckets[len(step.futures):]:  # ranks meet here: the buckets not launched
        step.futures.append(reducer.reduce(bucket, bucket.zeros()))
    reducer.end_step(step, failed=True)
    reducer.recorder.event("failed_iteration_closed")


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


def start_status(reducer, step, failed: bool):
    """Start the step's status all-reduce: (status tensor, its work, or None at world size 1).

    No host-to-device copy from pageable memory (it would make the host wait): the flag is written
    by a fill on the device, the use counts (find_unused_parameters) come from pinned memory.
    """
    counts_use, world_size = reducer.readiness.counts_use, reducer.world_size
    group = getattr(reducer, "status_group", None)  # status_on_host(): a gloo group, CPU tensors
    device = torch.device("cpu") if group is not None else reducer.device
    status = torch.zeros(world_size + len(reducer.params) * counts_use, dtype=torch.int32, device=device)
    if failed:
        status[reducer.rank].fill_(1)  # a fill with a host scalar: a kernel argument, no copy
    if counts_use:
        pinned = device.type == "cuda"
        ready = torch.tensor(step.ready, dtype=torch.int32, pin_memory=pinned)
        status[world_size:].copy_(ready, non_blocking=pinned)
    if world_size == 1:
        return status, None  # one rank: the sum is this rank's status itself
    group = group if group is not None else reducer.process_group
    return status, dist.all_reduce(status, group=group, async_op=True)  # ranks meet here


def read_status(reducer, status: torch.Tensor, work) -> tuple[list[int], list[int] | None]:
    """Wait for the status: (ranks whose backward failed, by parameter how many ranks used it, or None)."""
    try:
        if work is not None:
            work.wait()
    except RuntimeError as exc:
        raise RuntimeError(
            f"minidp.DDP on rank {reducer.rank}: iteration {reducer.iteration}: the end-of-backward status "
            f"all-reduce failed; likely {debug_mode.LIKELY_CAUSES}, or a rank's backward raised and it "
            f"ran no forward afterwards (MINIDP_DEBUG=1 checks every step). Cause: {exc}"
            + report(reducer, "the end-of-backward status all-reduce")) from exc
    # The one host read per step (free on gloo, whose wait already blocked; with the status on CUDA it
    # waits for the reduction, behind the whole backward): whether to raise is a decision of the host.
    counts = status.tolist()
    return [r for r in range(reducer.world_size) if counts[r]], counts[reducer.world_size:] or None


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
