"""A backward that raised on one rank, learned by the others with no host read and no collective.

Why this exists: torch DDP leaves the ranks out of step when one rank's backward raises (the others
wait in all-reduces it never joins). minidp closes the step instead (Reducer.close_failed_step:
the failed rank, at its next forward, sends NaNs for the buckets it had not launched, the last one
always among them). The ranks whose backward succeeded must then learn that the step failed, and
which rank failed, before their optimizer steps. What it costs, and where:
  * the failed rank posts "iteration i failed on rank r" to the process group's key-value store
    (`FailureBoard.post`) *before* it sends anything: whoever sees its NaN finds the post there;
  * every other rank computes, on the device, one flag a step: does the last reduced bucket start
    with a NaN (under a comm hook: hold a NaN anywhere, since a compressor may move it)? The flag is
    copied to host memory behind the all-reduce, never waited for (`Verdicts`). Only when a flag
    says NaN does the rank ask the store (a NaN gradient of the model's own is no failure);
  * on the CPU (gloo) the flag is in host memory when the wait returns: every rank learns in the
    same step, raises, and skips the optimizer step with the failed rank: the ranks stay equal.
    On CUDA the flag arrives later; a rank acts on it at the first forward or end of backward
    after it has arrived, which can be after its optimizer stepped on the NaNs: it then raises,
    saying the ranks now differ. `same_step_recovery(model)` buys the CPU behaviour on a GPU for
    one wait a step (the old cost). While the bucket layout may still change (before the rebuild,
    during bucket_cap_mb="auto"), the flag is waited for anyway, so every rank rebuilds alike.
find_unused_parameters (and static_graph's first step) all-reduce a use count a step, as torch DDP
does; the failed rank's flag rides in it (`status_on_host` moves it to a gloo group on CPU tensors).
"""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist


class FailureBoard:
    """Where a rank whose backward raised says so, in the store every rank of the group reaches.

    Args:
        process_group: the reducer's group (its name keys the posts).
        rank, world_size: this rank's place in it, and its size.
    """

    def __init__(self, process_group, rank: int, world_size: int):
        store = dist.distributed_c10d._get_default_store()  # torch has no public accessor
        base = f"minidp/ddp/{getattr(process_group, 'group_name', '')}/{world_size}"
        # The n-th minidp.DDP this rank built on this group (unpickled copies too): every rank
        # builds its wrappers in the same order, so the n-th is the same wrapper on every rank.
        number = store.add(f"{base}/built/{rank}", 1)  # a counter of this rank's, no collective
        self.store = dist.PrefixStore(f"{base}/{number}/", store)
        self.world_size = world_size

    def post(self, iteration: int, rank: int) -> None:
        """Rank `rank`'s backward of `iteration` raised (called before its NaNs are sent)."""
        self.store.set(f"{iteration}/{rank}", "failed")
        self.store.set(f"{iteration}/any", "failed")

    def failed_ranks(self, iteration: int) -> list[int]:
        """The ranks that posted `iteration`: one store round trip if none did."""
        if not self.store.check([f"{iteration}/any"]):
            return []
        return [r for r in range(self.world_size) if self.store.check([f"{iteration}/{r}"])]


class Verdicts:
    """Each step's flag, "did its last bucket come back with a NaN?", read once on the host."""

    def __init__(self):
        self.pending = collections.deque()  # (iteration, flag in host memory, CUDA event or None)

    def record(self, iteration: int, flag: torch.Tensor) -> None:
        """Keep `flag` (one bool, on the reduced bucket's device) to read when it has arrived."""
        event = None
        if flag.device.type == "cuda":  # behind the all-reduce: a copy queued, nothing waited for
            host = torch.empty(1, dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = flag.cpu()  # the CPU: the flag itself (another accelerator: a copy that waits)
        self.pending.append((iteration, host, event))

    def arrived(self, wait: bool) -> list[int]:
        """The iterations, among the flags on the host now, that came back with a NaN (forgotten
        after this).

        Args:
            wait: wait for flags still on their way (one synchronisation on CUDA), else leave them.
        """
        nan = []
        while self.pending:
            iteration, host, event = self.pending[0]
            if event is not None and not event.query():
                if not wait:
                    break
                event.synchronize()
            self.pending.popleft()
            if host.numpy()[0]:  # host memory: numpy refuses device tensors, so this never waits
                nan.append(iteration)
        return nan


def exchange_status(failed: bool, used: list[bool] | None, rank: int, world_size: int, group,
                    device) -> tuple[list[int], list[int] | None]:
    """All-reduce one step's status: (ranks whose backward failed, by parameter how many used it).

    Args:
        failed: this rank's backward raised. used: by parameter, whether this rank used it (None:
            the mode counts no use). rank, world_size, group: where. device: of the status.
    """
    status = torch.zeros(world_size + len(used or ()), dtype=torch.int32, device=device)
    if failed:
        status[rank].fill_(1)  # a fill with a host scalar: a kernel argument, no copy
    if used is not None:  # from pinned memory: a copy from pageable memory would wait
        pinned = device.type == "cuda"
        status[world_size:].copy_(torch.tensor(used, dtype=torch.int32, pin_memory=pinned),
                                  non_blocking=pinned)
    if world_size > 1:
        dist.all_reduce(status, group=group)  # ranks meet here
    counts = status.tolist()  # with use counts only: torch DDP's step reads them too
    return [r for r in range(world_size) if counts[r]], counts[world_size:] or None


def failure_payload(bucket) -> torch.Tensor:
    """What a failed rank sends for a bucket it had not launched: NaNs (a sparse bucket: zeros)."""
    return bucket.zeros() if bucket.sparse else torch.full_like(bucket.buffer, float("nan"))


def same_step_recovery(model, enabled: bool = True) -> None:
    """Read each step's flag at the end of its backward, waiting for it on a GPU (one wait a step).

    A backward that raises on any rank then raises on every rank in the same step, before any
    optimizer steps, as on the CPU, where this costs nothing and is always the case.

    Args:
        model: a minidp.DDP.
        enabled: True (default), or False for the default (flags read when they have arrived).
    """
    _reducer_of(model, "same_step_recovery").wait_for_verdicts(enabled)


def status_on_host(model, enabled: bool = True) -> None:
    """Exchange `model`'s use counts (find_unused_parameters) on the host: CPU tensors, gloo.

    Every rank must call it, with the same `enabled` (making the gloo group is a collective of
    the world).

    Args:
        model: a minidp.DDP.
        enabled: True (default): on a gloo copy of the model's group; False: on the model's group
            and device.
    """
    reducer = _reducer_of(model, "status_on_host")
    group = None
    if enabled:
        ranks = dist.get_process_group_ranks(model.process_group or dist.group.WORLD)
        group = dist.new_group(ranks, backend="gloo")  # ranks meet here (every rank of the world)
    reducer.exchange_status_on(group)


def _reducer_of(model, caller: str):
    reducer = getattr(model, "reducer", None)
    if reducer is None or not hasattr(reducer, "close_failed_step"):
        raise TypeError(f"{caller}: model={type(model).__name__} must be a minidp.DDP")
    return reducer


def failed_message(rank: int, iteration: int, failed_ranks: list[int]) -> str:
    return (f"minidp.DDP on rank {rank}: the backward of iteration {iteration} raised on rank(s) "
            f"{failed_ranks}, so every rank discards this iteration's gradients (some .grad may "
            "hold averages, some this rank's own: use none). "
            "Skip optimizer.step() and call optimizer.zero_grad(), as those ranks do after their "
            "own error, then go on: the ranks stay equal.")


def late_message(rank: int, iteration: int, now: int, failed_ranks: list[int]) -> str:
    return (f"minidp.DDP on rank {rank}: the backward of iteration {iteration} raised on rank(s) "
            f"{failed_ranks}; this rank learned it at iteration {now}, after its optimizer may "
            "have stepped on that iteration's NaN gradients, so the ranks may now differ: restore "
            "the last checkpoint. To have every rank raise in the failed iteration on a GPU (one "
            "wait a step), call minidp.engine.failures.same_step_recovery(model) after wrapping.")
