"""Counting the collectives a check issues, so that a row that communicated nothing cannot pass.

gpu_check.py installs one CollectiveCounter per worker process, before anything else runs. It wraps
torch.distributed's public collectives (the names minidp, its SyncBatchNorm and minidp.comm call as
`dist.<name>`) and CupyNccl's three collectives; each call adds one, from any thread. torch's own
internal calls (through torch.distributed.distributed_c10d's globals, or C++) are not wrapped, so a
collective made of others (all_gather_object) counts once, and torch DDP's C++ reducer not at all.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch.distributed as dist

NAMES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_to_all",
         "all_to_all_single", "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
         "scatter", "barrier", "all_gather_object", "broadcast_object_list", "gather_object",
         "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv")
CUPY_NAMES = ("all_reduce", "all_gather", "all_to_all")


class CollectiveCounter:
    """The number of collectives issued in this process since install(), from every thread."""

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def install(self) -> "CollectiveCounter":
        """Wrap the collectives (once per process, before any transport or model is made)."""
        for name in NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(fn))
        from minidp.comm.cupy_nccl import CupyNccl  # importable without CuPy (it loads CuPy when made)

        for name in CUPY_NAMES:
            setattr(CupyNccl, name, self._wrap(getattr(CupyNccl, name)))
        return self

    def _wrap(self, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            with self._lock:
                self.count += 1
            return fn(*args, **kwargs)
        return counted

    @contextlib.contextmanager
    def window(self):
        """`with counter.window() as seen:` ... `seen[0]` is the number issued inside the block."""
        seen, start = [0], self.count
        try:
            yield seen
        finally:
            seen[0] = self.count - start
