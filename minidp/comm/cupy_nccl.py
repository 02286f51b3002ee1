"""CupyNccl: raw NCCL through cupy.cuda.nccl.NcclCommunicator, on torch CUDA tensors, in place.

Streams, as torch's own NCCL process group: every collective runs on this transport's own stream,
which first waits on an event recorded on the caller's current stream (the inputs are ready there).
The returned future is already complete on the host, with stream semantics: its wait() makes the
waiting stream wait on an event recorded on the NCCL stream after the collective. So the caller's
stream waits only where it waits on the future, and kernels queued meanwhile (the rest of backward)
run beside the collective instead of behind the slowest rank. The tensors are kept alive here until
the GPU has finished with them (the caching allocator must not hand their memory out before).

`import cupy` only, never a wheel name: cupy-cuda12x and cupy-cuda13x both install the `cupy` module.
"""
from __future__ import annotations

import itertools
import threading

import torch
import torch.distributed as dist

from .transports import Transport, _check_group

_instances = itertools.count()  # the n-th CupyNccl of this process meets the n-th one of the others


def _load_nccl():
    """cupy.cuda.nccl, or RuntimeError saying what is missing (CuPy, its NCCL, or CUDA)."""
    missing = []
    nccl = None
    try:
        from cupy.cuda import nccl
        if not getattr(nccl, "available", True):
            missing.append("a CuPy built with NCCL (cupy.cuda.nccl.available is False)")
    except ImportError as exc:
        missing.append(f"CuPy (`import cupy` failed: {exc}; pip install cupy-cuda12x or cupy-cuda13x)")
    if not torch.cuda.is_available():
        missing.append("a CUDA device (torch.cuda.is_available() is False)")
    if missing:
        raise RuntimeError("CupyNccl() needs " + " and ".join(missing))
    return nccl


def _nccl_dtypes(nccl) -> dict:
    return {torch.float32: nccl.NCCL_FLOAT32, torch.float16: nccl.NCCL_FLOAT16,
            torch.bfloat16: nccl.NCCL_BFLOAT16, torch.float64: nccl.NCCL_FLOAT64, torch.uint8: nccl.NCCL_UINT8,
            torch.int8: nccl.NCCL_INT8, torch.int32: nccl.NCCL_INT32, torch.int64: nccl.NCCL_INT64}


def _share_unique_id(nccl, group, ranks: list[int]) -> bytes:
    """Rank 0 of the group makes the NCCL id; the others read it from torch.distributed's store."""
    key = f"minidp/comm/cupy_nccl/{next(_instances)}/{'-'.join(map(str, ranks))}"
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store init_process_group made
    if dist.get_rank(group) == 0:
        uid = nccl.get_unique_id()
        # CuPy >= 14 returns bytes; older CuPy a tuple of signed chars.
        store.set(key, bytes(uid) if isinstance(uid, bytes) else bytes(c % 256 for c in uid))
    return store.get(key)  # ranks meet here: waits until rank 0 has written it (store timeout)


class CupyNccl(Transport):
    """Raw NCCL between the ranks of `group`, one GPU per rank (the current CUDA device).

    Args:
        group: which ranks (a ProcessGroup; its backend does not matter). Default None: the world.

    Raises:
        RuntimeError: without CuPy, without NCCL in CuPy, or without CUDA; the message says which.

    Example:
        model = minidp.DDP(model, transport=comm.CupyNccl())
        state, hook = comm.compression_hook(comm.TopK(0.01), transport=comm.CupyNccl())
    """

    def __init__(self, group=None):
        nccl = _load_nccl()
        _check_group(group)
        parent = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(parent)
        self.rank, self.world_size = dist.get_rank(parent), len(ranks)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._nccl, self._dtypes = nccl, _nccl_dtypes(nccl)
        uid = _share_unique_id(nccl, parent, ranks)
        import cupy

        with cupy.cuda.Device(self.device.index):
            uid = uid if _takes_bytes() else tuple(b - 256 if b > 127 else b for b in uid)
            self.comm = nccl.NcclCommunicator(self.world_size, uid, self.rank)  # ranks meet here
        self.stream = torch.cuda.Stream(device=self.device)  # NCCL's own stream (see the module docstring)
        self._inflight, self._lock = [], threading.Lock()

    def check_device(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda" or (device.index is not None and device.index != self.device.index):
            raise ValueError(f"transport={self!r} runs on tensors of {self.device}, got tensors on {device}")

    def _ptr(self, tensor: torch.Tensor) -> int:
        self.check_device(tensor.device)
        if not tensor.is_contiguous():
            raise ValueError(f"transport={self!r} needs contiguous tensors")
        if tensor.dtype not in self._dtypes:
            raise TypeError(f"transport={self!r} cannot send dtype {tensor.dtype}")
        return tensor.data_ptr()

    def _begin(self) -> int:
        """The NCCL stream, made to wait on the caller's current stream (where the inputs were written)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # NCCL stream waits on the caller's
        return self.stream.cuda_stream

    def _done(self, result: torch.Tensor, *keep: torch.Tensor) -> torch.futures.Future:
        """A completed future (stream semantics); `keep` stays referenced until the GPU is past the op."""
        event = torch.cuda.Event()
        event.record(self.stream)
        with self._lock:
            self._inflight = [(e, t) for e, t in self._inflight if not e.query()] + [(event, (result, *keep))]
        fut = torch.futures.Future(devices=[result.device])
        with torch.cuda.stream(self.stream):
            # Records an event on the NCCL stream: a wait() makes the waiting stream wait on the collective.
            fut.set_result(result)
        return fut

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        ptr = self._ptr(tensor)
        self.comm.allReduce(ptr, ptr, tensor.numel(), self._dtypes[tensor.dtype], self._nccl.NCCL_SUM,
                            self._begin())  # ranks meet here (async, on the NCCL stream)
        return self._done(tensor)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.futures.Future:
        src, dst = self._ptr(input), self._ptr(output)
        self.comm.allGather(src, dst, input.numel(), self._dtypes[input.dtype],
                            self._begin())  # ranks meet here (async, on the NCCL stream)
        return self._done(output, input)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.futures.Future:
        """Grouped send/recv (NCCL has no all-to-all call): chunk r of input to rank r."""
        chunk = input.numel() // self.world_size
        src, dst, size = self._ptr(input), self._ptr(output), chunk * input.element_size()
        kind, stream = self._dtypes[input.dtype], self._begin()
        self._nccl.groupStart()
        for peer in range(self.world_size):  # ranks meet here (async, on the NCCL stream)
            self.comm.send(src + peer * size, chunk, kind, peer, stream)
            self.comm.recv(dst + peer * size, chunk, kind, peer, stream)
        self._nccl.groupEnd()
        return self._done(output, input)

    def __repr__(self) -> str:
        return f"CupyNccl(world_size={self.world_size}, device={self.device})"


def _takes_bytes() -> bool:
    """CuPy >= 14 takes the unique id as bytes; older CuPy as a tuple of signed chars."""
    import cupy

    return int(cupy.__version__.split(".")[0]) >= 14
