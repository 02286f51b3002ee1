"""minidp.comm: custom gradient communication inside DDP's overlapped buckets, every byte counted.

    from minidp import comm
    state, hook = comm.compression_hook(comm.TopK(ratio=0.01), memory=comm.ErrorFeedback(),
                                        transport=comm.TorchDist(), start_iter=10)
    model.register_comm_hook(state, hook)       # minidp.DDP or torch DDP
    state.stats()                               # {"steps", "bytes_sent", "bytes_dense", "ratio"}

The reference (wire formats, byte formulas, error feedback, transports): minidp/comm/README.md.
The pieces (GRACE's split, run inside DDP's buckets):
  interfaces.py   the two kinds of method: Compressor (compress/decompress; one round, exchanged by
                  minidp.comm) and MultiRound (reduce: its own collectives); payload_bytes optional
  context.py      Context (rank, world size, step, the bucket's shapes, a private generator), handed
                  to every method; RandomStream, the hook's checkpointable generator
  compressors.py  FP16, BF16 (all-reduced), TopK, QSGD (all-gathered), RandomK (shared seed, all-reduced)
  sign.py         Sign (MultiRound): 1 bit + a scale, worker then server stage (DeepSpeed's)
  powersgd.py     PowerSGD(rank) (MultiRound): P then Q, warm start, torch's arithmetic
  memory.py       Memory, ErrorFeedback; per-parameter state that survives bucket rebuilds
  transports.py   Transport, TorchDist; allreduce_hook (exact average over any transport)
  cupy_nccl.py    CupyNccl: raw NCCL through CuPy, on its own stream (the caller waits at the future)
  exchange.py     Job (one bucket), Channel (a transport that counts bytes), single_round (the
                  exchange of every Compressor)
  hook.py         compression_hook, CompressionState (the worker thread and its side stream, the
                  contexts, the byte check)
  averaging.py    PeriodicAverager (local SGD, the baseline)
  diloco.py       DiLoCo (local steps, an outer optimizer on the pseudo-gradient every `period` steps)
  streaming_diloco.py  StreamingDiLoCo (DiLoCo synced fragment by fragment, overlapped, in 4 bits)
  demo.py         DeMo (an optimizer: each rank's momentum, top-k DCT coefficients all-gathered, sign steps)
  onebit_adam.py  OneBitAdam (an optimizer: Adam for a warm-up, then 1-bit momentum through Sign's stages)
"""
from .averaging import PeriodicAverager
from .compressors import BF16, FP16, QSGD, RandomK, TopK
from .context import Context
from .cupy_nccl import CupyNccl
from .demo import DeMo
from .diloco import DiLoCo
from .exchange import Channel, Job
from .hook import CompressionState, compression_hook
from .interfaces import Compressor, MultiRound
from .memory import ErrorFeedback, Memory
from .onebit_adam import OneBitAdam
from .powersgd import PowerSGD
from .sign import Sign
from .streaming_diloco import StreamingDiLoCo
from .transports import TorchDist, Transport, allreduce_hook

__all__ = [
    "BF16",
    "FP16",
    "QSGD",
    "Channel",
    "CompressionState",
    "Compressor",
    "Context",
    "CupyNccl",
    "DeMo",
    "DiLoCo",
    "ErrorFeedback",
    "Job",
    "Memory",
    "MultiRound",
    "OneBitAdam",
    "PeriodicAverager",
    "PowerSGD",
    "RandomK",
    "Sign",
    "StreamingDiLoCo",
    "TopK",
    "TorchDist",
    "Transport",
    "allreduce_hook",
    "compression_hook",
]
