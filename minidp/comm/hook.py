"""compression_hook: any compressor, memory and transport as a DDP comm hook, overlapped with backward.

    state, hook = comm.compression_hook(comm.TopK(ratio=0.01), memory=comm.ErrorFeedback(), start_iter=10)
    model.register_comm_hook(state, hook)     # minidp.DDP or torch DDP
    state.stats()                             # {"steps", "bytes_sent", "bytes_dense", "ratio"}

The hook itself only queues the bucket and returns a future. One worker thread per state takes
buckets in the order DDP launched them and runs each one's whole exchange (compress, collectives,
decompress, memory update) while backward goes on. Why one thread: multi-round methods (PowerSGD's
P then Q, Sign's worker then server stage) must issue their collectives in the same order on every
rank; chaining them in the transport's callbacks would interleave buckets differently per rank.

Streams on CUDA: the worker runs every exchange on a side stream of its own (one per device), which
first waits on an event recorded on the launching (compute) stream when the bucket was launched, so
it reads the finished bucket. The compute stream never waits on the exchange's collectives except
where the engine's finalize waits on the bucket's future. Why: if the compute stream waited on each
collective as it went (a collective's wait() makes the *current* stream wait), a blocking collective
of the model's own group in backward (SyncBatchNorm's all-reduce) could be ordered before a bucket's
exchange on one rank and after it on another, on that one stream: a cycle between the ranks (a hang).

The state owns what a method must not reach for globally: each bucket's Context (rank, world size,
step) and its random generator (seeded from the compressor's seed, saved in state_dict()).
"""
from __future__ import annotations

import contextlib
import queue
import threading

import torch

from ..validate import check_int
from .context import Context, RandomStream
from .exchange import Channel, Job, single_round
from .interfaces import Compressor, MultiRound
from .memory import Memory
from .transports import TorchDist, Transport


class CompressionState:
    """The hook's state: compressor, memory, transport, byte counters, and the worker thread.

    Build it with compression_hook(); see that function for the arguments.
    """

    def __init__(self, compressor: Compressor | MultiRound, memory: Memory | None, transport: Transport,
                 start_iter: int):
        self.compressor, self.memory, self.transport, self.start_iter = compressor, memory, transport, start_iter
        self.channel = Channel(transport)
        # One stream per state, not per device: seeded alike on every rank only if the compressor asks.
        self.random = RandomStream(compressor.seed + (0 if compressor.shared_seed else transport.rank))
        self.steps = 0  # iterations launched (counted at each iteration's last bucket)
        self.bytes_dense = 0  # what exact all-reduce would have sent
        self.bytes_analytical = 0  # what payload_bytes declared (checked per bucket), or the count where none
        self._keys: dict[int, int] = {}  # id(parameter) -> stable key, in order of first appearance
        self._key_params: list = []  # keeps the parameters alive, so their ids stay theirs
        self._key_numels: list[int] = []
        self._checked: set = set()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._streams: dict = {}  # CUDA device -> the worker's side stream (made on first use)

    # ---- on the autograd thread ---------------------------------------------------------------

    def launch(self, bucket) -> torch.futures.Future:
        """Queue one bucket; the future's value is the bucket buffer, averaged, once the worker is done."""
        buffer = bucket.buffer()
        self._check(buffer)
        params = list(bucket.parameters())
        numels = [p.numel() for p in params]
        if sum(numels) != buffer.numel():
            raise RuntimeError(f"compression_hook: bucket {bucket.index()} holds {buffer.numel()} elements, "
                               f"its parameters {sum(numels)}")
        ctx = Context(self.transport.rank, self.transport.world_size, self.steps, [p.shape for p in params],
                      buffer.dtype, buffer.device, self.random.on(buffer.device))
        compress = self.steps >= self.start_iter
        if bucket.is_last():
            self.steps += 1
        job = Job(buffer, [self._key(p) for p in params], numels, compress and self.memory is not None, ctx)
        cuda = buffer.device.type == "cuda"
        future = torch.futures.Future(devices=[buffer.device]) if cuda else torch.futures.Future()
        launched = None
        if cuda:  # the bucket is complete on the compute stream here: the side stream starts from this point
            launched = torch.cuda.Event()
            launched.record(torch.cuda.current_stream(buffer.device))
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="minidp-comm", daemon=True)
            self._thread.start()
        self._queue.put((job, compress, future, launched))
        return future

    def _check(self, buffer: torch.Tensor) -> None:
        kind = (buffer.device, buffer.dtype)
        if kind not in self._checked:  # once per device and dtype: these raise on bad input
            self.compressor.check(buffer)
            self.transport.check_device(buffer.device)
            self._checked.add(kind)

    def _key(self, param) -> int:
        key = self._keys.get(id(param))
        if key is None:
            key = self._keys[id(param)] = len(self._key_params)
            self._key_params.append(param)
            self._key_numels.append(param.numel())
        return key

    def key_of(self, param) -> int | None:
        """The key of this parameter's entries in state_dict() (None until it has reached the hook)."""
        return self._keys.get(id(param))

    # ---- on the worker thread -----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # close()
                self._queue.task_done()
                return
            job, compress, future, launched = item
            try:
                if self._error:  # a failed bucket leaves the ranks out of step: do not start more collectives
                    raise RuntimeError(f"compression_hook: an earlier bucket failed: {self._error}")
                with _on(self._side_stream(job.tensor.device, launched)):
                    self._reduce(job, compress)
                    # On CUDA: records an event on the side stream; the finalize's future.wait() makes the
                    # compute stream wait on it: the one place the compute stream waits on the exchange.
                    future.set_result(job.tensor)
            except Exception as exc:  # noqa: BLE001 - handed to whoever waits on the bucket
                self._error = self._error or f"{type(exc).__name__}: {exc}"
                future.set_exception(exc)
            finally:
                self._queue.task_done()

    def _side_stream(self, device: torch.device, launched):
        """The worker's side stream on `device`, waiting for the launch event (None on CPU)."""
        if launched is None:
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_event(launched)  # side stream waits on the compute stream: the bucket is complete
        return stream

    def _reduce(self, job: Job, compress: bool) -> None:
        dense = job.tensor.numel() * job.tensor.element_size()
        if not compress:  # before start_iter: exact average, torch's allreduce_hook arithmetic
            job.tensor.div_(job.ctx.world_size)
            self.channel.all_reduce(job.tensor)  # ranks meet here
            self.bytes_analytical += dense
        else:
            if job.with_memory:
                self.memory.compensate(job.tensor, job.keys, job.numels)
            before = self.channel.bytes_sent
            if isinstance(self.compressor, MultiRound):
                residual = self.compressor.reduce(job, self.channel)  # ranks meet here (one or more rounds)
            else:
                residual = single_round(self.compressor, job, self.channel)  # ranks meet here
            if job.with_memory:
                self.memory.update(residual, job.keys, job.numels)
            self.bytes_analytical += self._declared_bytes(job.ctx, self.channel.bytes_sent - before)
        self.bytes_dense += dense

    def _declared_bytes(self, ctx: Context, sent: int) -> int:
        """payload_bytes(ctx) checked against the bytes the channel counted (`sent` when not declared)."""
        declared = self.compressor.payload_bytes(ctx)
        if declared is None:
            return sent
        if declared != sent:  # the same on every rank (same shapes): every rank raises, none waits
            raise RuntimeError(f"compressor={self.compressor!r}: payload_bytes declares {declared} bytes for a "
                               f"bucket of shapes {[tuple(s) for s in ctx.shapes]} ({ctx.dtype}, world size "
                               f"{ctx.world_size}), but {sent} were handed to collectives; fix payload_bytes, or "
                               "remove it (the channel counts the bytes)")
        return declared

    # ---- between steps ------------------------------------------------------------------------

    def _idle(self) -> None:
        """Wait until no bucket is queued; on CUDA the caller's stream then waits for the side streams.

        Why: the memories and residuals are written on the side streams; the caller reads or overwrites
        them on its own stream (state_dict, load_state_dict), so its stream must wait first.
        """
        self._queue.join()
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)  # caller's stream waits on the side stream

    def stats(self) -> dict:
        """This rank since the start: steps, bytes handed to collectives, bytes exact all-reduce would send."""
        self._idle()
        sent, dense = self.channel.bytes_sent, self.bytes_dense
        return {"steps": self.steps, "bytes_sent": sent, "bytes_dense": dense, "ratio": sent / dense if dense else 0.0}

    def state_dict(self) -> dict:
        """Residuals, memories, the random generator and counters of this rank (tensors and plain values only)."""
        self._idle()  # no bucket in flight
        return {"steps": self.steps, "bytes_sent": self.channel.bytes_sent, "bytes_dense": self.bytes_dense,
                "bytes_analytical": self.bytes_analytical, "param_numels": list(self._key_numels),
                "memory": self.memory.state_dict() if self.memory is not None else None,
                "compressor": self.compressor.state_dict(), "generator": self.random.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned (on the same rank), before the next step."""
        self._idle()
        known = self._key_numels[:len(state["param_numels"])]
        if known != state["param_numels"][:len(known)]:
            raise ValueError(f"state_dict: parameter sizes {state['param_numels']} do not match this model's "
                             f"{self._key_numels}")
        if (state["memory"] is None) != (self.memory is None):
            raise ValueError(f"state_dict: memory={'none' if state['memory'] is None else 'saved'} does not "
                             f"match this hook's memory={self.memory!r}")
        self.steps, self.channel.bytes_sent = state["steps"], state["bytes_sent"]
        self.bytes_dense, self.bytes_analytical = state["bytes_dense"], state["bytes_analytical"]
        if self.memory is not None:
            self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state["compressor"])
        if "generator" in state:  # absent in states saved before the hook owned the generator
            self.random.load_state_dict(state["generator"])

    def close(self) -> None:
        """Stop the worker thread once the queued buckets are done; a later bucket starts a new one.

        For a process that goes on without the hook (e.g. after training, or before os.fork(): a
        thread running at a fork can leave the child waiting on a lock nobody releases).
        """
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def __repr__(self) -> str:
        return (f"CompressionState(compressor={self.compressor!r}, memory={self.memory!r}, "
                f"transport={self.transport!r}, start_iter={self.start_iter}, steps={self.steps})")


def _on(stream):
    """Run on `stream` and its device (this thread's defaults are device 0 and its default stream)."""
    if stream is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(stream.device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def hook(state, bucket):  # no annotations: torch DDP accepts only its exact ones, or none
    """The comm hook compression_hook returns: DDP's contract, hook(state, bucket) -> Future[Tensor]."""
    return state.launch(bucket)  # ranks meet on the worker thread (async)


def compression_hook(compressor: Compressor | MultiRound, memory: Memory | None = None,
                     transport: Transport | None = None, start_iter: int = 0):
    """(state, hook) for model.register_comm_hook(state, hook): compressed averaging of every bucket.

    Every rank must call it (the default transport makes a process group).

    Args:
        compressor: a comm method (FP16(), BF16(), TopK(r), RandomK(r), QSGD(s), Sign(), PowerSGD(r)), or
            your own comm.Compressor (single round) or comm.MultiRound subclass.
        memory: comm.ErrorFeedback() or another Memory; None (default): no error feedback.
        transport: comm.TorchDist(group) or comm.CupyNccl(); None (default): TorchDist() over the world.
        start_iter: iterations averaged exactly before compression starts. Default 0.
    """
    if not isinstance(compressor, (Compressor, MultiRound)):
        raise TypeError(f"compressor={compressor!r} must be a minidp.comm Compressor or MultiRound "
                        "(e.g. comm.TopK(0.01))")
    if memory is not None and not isinstance(memory, Memory):
        raise TypeError(f"memory={memory!r} must be a minidp.comm Memory (e.g. comm.ErrorFeedback()) or None")
    if transport is not None and not isinstance(transport, Transport):
        raise TypeError(f"transport={transport!r} must be a minidp.comm Transport (TorchDist(), CupyNccl()) or None")
    start_iter = check_int("start_iter", start_iter, low=0)
    return CompressionState(compressor, memory, transport if transport is not None else TorchDist(), start_iter), hook
