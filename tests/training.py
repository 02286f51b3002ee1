"""The training loop the engine tests share, and the small pieces around it (batches, snapshots, comparisons).

Most engine tests train the same model for a few steps under minidp.DDP and under torch DDP, then
compare what each ends with. The loop is the one a user's script runs; what differs from test to test
is the data, the loss, gradient accumulation and what is recorded along the way, so those are the
arguments. Example:

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, rank_batches(4, dist.get_rank()))
    params = snapshot(model.module)
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def mse(model, batch):
    """The default loss: `batch` is (inputs, targets); the mean squared error of model(inputs)."""
    x, y = batch
    return F.mse_loss(model(x), y)


def mean_square(model, x):
    """A loss for batches of inputs alone: the mean of model(x) squared (x.square() is this same op)."""
    return model(x).pow(2).mean()


def train(model, optimizer, batches, loss_fn=mse, *, accumulate=1, set_to_none=True, per_step=None):
    """Forward, backward and optimizer step over `batches`; returns every batch's loss, detached.

    Batch k runs `loss_fn(model, batch).backward()`; every `accumulate`-th batch ends an optimizer step,
    and the batches before it run forward and backward under `model.no_sync()` (gradient accumulation,
    as DDP's documentation writes it). After each step: `per_step(step)`, then
    `optimizer.zero_grad(set_to_none=set_to_none)`. Trailing batches that do not fill a step still run
    their backward under no_sync(), with no optimizer step.

    Args:
        model: a DDP engine (minidp.DDP, torch DDP) or, with accumulate=1, any module.
        optimizer: steps the model's parameters.
        batches: an iterable; each item is handed to `loss_fn` as it is.
        loss_fn: `loss_fn(model, batch) -> scalar loss` (default: mse, for (inputs, targets) batches).
        accumulate: batches per optimizer step (default 1: no accumulation).
        set_to_none: passed to optimizer.zero_grad (default True).
        per_step: called as per_step(step) after each optimizer.step(), step counting from 0 (default
            None). `.grad` still holds the gradients that step used (the optimizers here leave them
            as they are): the place to record them, or to run what comes after a step (DiLoCo, averaging).
    """
    losses = []
    for k, batch in enumerate(batches):
        syncs = (k + 1) % accumulate == 0
        with contextlib.nullcontext() if syncs else model.no_sync():
            loss = loss_fn(model, batch)
            loss.backward()
        losses.append(loss.detach())
        if syncs:
            optimizer.step()
            if per_step is not None:
                per_step(k // accumulate)
            optimizer.zero_grad(set_to_none=set_to_none)
    return losses


def rank_batches(steps, rank, *, seed=100, inputs=(4, 8), targets=(4, 4)):
    """`steps` batches (inputs, targets) of normal noise from a generator seeded `seed + rank`: each rank
    its own data, the same on every call. With targets=None, each batch is the inputs alone."""
    gen = torch.Generator().manual_seed(seed + rank)
    if targets is None:
        return [torch.randn(inputs, generator=gen) for _ in range(steps)]
    return [(torch.randn(inputs, generator=gen), torch.randn(targets, generator=gen)) for _ in range(steps)]


def shard_of(tensors, rank, size):
    """This rank's rows of a global batch: rows rank * size to (rank + 1) * size of each tensor."""
    return tuple(t[rank * size:(rank + 1) * size] for t in tensors)


def offset_by_rank(module, rank, scale=0.01):
    """Adds rank * scale to every parameter: each rank starts from other weights, so the engine under test
    must broadcast rank 0's for the ranks to train alike."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * rank)
    return module


def snapshot(module, buffers=False):
    """Copies of the module's parameters (then its buffers, with buffers=True), detached from autograd."""
    tensors = list(module.parameters()) + (list(module.buffers()) if buffers else [])
    return [t.detach().clone() for t in tensors]


def bitwise_equal(a, b):
    """Whether two sequences of tensors are equally long and equal element by element, bit for bit."""
    a, b = list(a), list(b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def max_abs_diff(a, b):
    """The largest absolute difference between corresponding tensors of two sequences."""
    return max((x - y).abs().max().item() for x, y in zip(a, b))
