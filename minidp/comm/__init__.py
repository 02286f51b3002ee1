"""minidp.comm: custom gradient communication inside DDP's overlapped buckets, every byte counted.

    from minidp import comm
    state, hook = comm.compression_hook(comm.TopK(ratio=0.01), memory=comm.ErrorFeedback(),
                                        transport=comm.TorchDist(), start_iter=10)
    model.register_comm_hook(state, hook)       # minidp.DDP or torch DDP
    state.stats()                               # {"steps", "bytes_sent", "bytes_dense", "ratio"}

The pieces (GRACE's split, run inside DDP's buckets):
  compressors.py  Compressor; FP16, BF16 (all-reduced), TopK, QSGD (all-gathered), RandomK (shared
                  seed, all-reduced)
  sign.py         Sign: 1 bit + a scale, worker then server stage (DeepSpeed's compressed all-reduce)
  powersgd.py     PowerSGD(rank): P then Q, warm start, torch's arithmetic
  memory.py       Memory, ErrorFeedback; per-parameter state that survives bucket rebuilds
  transports.py   Transport, TorchDist; allreduce_hook (exact average over any transport)
  cupy_nccl.py    CupyNccl: raw NCCL through CuPy on torch's current stream
  exchange.py     Job (one bucket) and Channel (a transport that counts bytes)
  hook.py         compression_hook, CompressionState (the worker thread)
  averaging.py    PeriodicAverager (local SGD, the baseline)
"""
from .averaging import PeriodicAverager
from .compressors import BF16, FP16, QSGD, Compressor, RandomK, TopK
from .cupy_nccl import CupyNccl
from .exchange import Channel, Job
from .hook import CompressionState, compression_hook
from .memory import ErrorFeedback, Memory
from .powersgd import PowerSGD
from .sign import Sign
from .transports import TorchDist, Transport, allreduce_hook, sum_hook

__all__ = [
    "BF16",
    "FP16",
    "QSGD",
    "Channel",
    "CompressionState",
    "Compressor",
    "CupyNccl",
    "ErrorFeedback",
    "Job",
    "Memory",
    "PeriodicAverager",
    "PowerSGD",
    "RandomK",
    "Sign",
    "TopK",
    "TorchDist",
    "Transport",
    "allreduce_hook",
    "compression_hook",
    "sum_hook",
]
