"""Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True): a bucket kind of their own.

What it changes in the core: nothing but the bucket. A sparse tensor cannot be packed into a flat
buffer, so each such parameter gets a `SparseBucket` (planning.py gives it a bucket of its own) whose
buffer *is* the gradient, set each iteration, divided in place on the default path and all-reduced
as it is (gloo has a sparse all-reduce; NCCL has none: refused at construction, naming the
parameter). It answers the same calls as buckets.Bucket, so the reducer does not tell them apart.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class SparseBucket:
    """One parameter whose gradient is sparse; `buffer` is that gradient (or an empty one).

    Args: as buckets.Bucket's (param_indices holds one index).
    """

    sparse = True

    def __init__(self, index: int, param_indices: list[int], params: list):
        self.index, self.param_indices, self.offsets, self.views = index, list(param_indices), [0], []
        self.like = params[param_indices[0]]
        self.buffer = no_sparse_gradient(self.like)

    def copy_in(self, slot, param, grad, divisor) -> None:
        """The gradient becomes the buffer: divided in place on the default path (as DDP), reduced, copied back."""
        self.buffer = grad if divisor is None else grad.div_(divisor.value)

    def zero_slot(self, slot: int) -> None:
        self.buffer = no_sparse_gradient(self.like)

    def zeros(self) -> torch.Tensor:
        return no_sparse_gradient(self.like)

    def write_back(self, result: torch.Tensor, params: list, unused: set) -> None:
        """As DDP: the reduced values go into the gradient tensor itself (a new one if this rank had none)."""
        index = self.param_indices[0]
        param = params[index]
        if index in unused:
            return
        if param.grad is None:  # unused on this rank only
            param.grad = result.clone()
        elif result is not param.grad:
            param.grad.copy_(result)


def no_sparse_gradient(like: torch.Tensor) -> torch.Tensor:
    """An all-zero sparse gradient (nnz=0) shaped like an embedding's: one sparse dimension, as the
    real ones have (gloo's sparse all-reduce requires the same sparse/dense dimensions on all ranks)."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=like.device),
                                   torch.empty(0, *like.shape[1:], dtype=like.dtype, device=like.device),
                                   like.shape)


def sparse_gradient_flags(module: torch.nn.Module, params: list, names: list, group, transport) -> list[bool]:
    """By parameter, whether its gradient will be sparse, refused where nothing can reduce it (check_sparse).

    DDP's rule: its module is an nn.Embedding or nn.EmbeddingBag with sparse=True (for a shared
    parameter, the first module that has it).
    """
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    if not any(isinstance(sub, kinds) and sub.sparse for sub in module.modules()):
        return [False] * len(params)  # the common case: no sparse embedding at all
    sparse_owner: dict = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            sparse_owner.setdefault(p, isinstance(sub, kinds) and sub.sparse)
    flags = [sparse_owner.get(p, False) for p in params]
    check_sparse(params, names, flags, dist.get_backend(group), transport)
    return flags


def check_sparse(params: list, names: list, sparse: Sequence[bool], backend: str, transport) -> None:
    """Refuse sparse gradients where nothing can all-reduce them, naming the parameter.

    Only gloo has a sparse all-reduce: torch DDP on NCCL constructs, then fails in backward
    ("allreduce_sparse is only available in the NCCL experimental branch"). A minidp.comm transport
    carries dense buckets only.

    Args:
        backend: the process group's, e.g. "gloo", "nccl", or one per device type "cpu:gloo,cuda:nccl".
    """
    if transport is not None and any(sparse):
        raise ValueError(f"transport={transport!r} carries dense buckets only, but parameter "
                         f"{names[list(sparse).index(True)]} has a sparse gradient")
    per_device = dict(part.split(":") for part in backend.split(",")) if ":" in backend else {}
    for p, name, is_sparse in zip(params, names, sparse):
        used = per_device.get(p.device.type, backend)
        if is_sparse and used != "gloo":
            raise ValueError(
                f"parameter {name!r} gets sparse gradients (nn.Embedding/EmbeddingBag with sparse=True) on "
                f"{p.device.type}, where the process group's backend is {used!r}: only gloo can all-reduce "
                "sparse tensors. Use sparse=False, or a gloo process group.")


def mismatch_message(name: str, got_sparse: bool) -> str:
    kinds = ("sparse", "dense") if got_sparse else ("dense", "sparse")
    return (f"minidp: parameter {name!r} has a {kinds[0]} gradient, but a {kinds[1]} one was expected (only "
            "nn.Embedding / nn.EmbeddingBag with sparse=True produce sparse gradients)")
