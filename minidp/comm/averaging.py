"""PeriodicAverager: local SGD after a warm-up, parameters averaged every `period` steps (post-local SGD).

The baseline every gradient-compression method is compared with (Lin et al. 2020, "Don't use large
mini-batches, use local SGD"). It does what torch's post_localSGD_hook (with
post_local_gradient_allreduce=False) plus PeriodicModelAverager do, with the same arithmetic:
  - for the first `warmup_steps` steps gradients are averaged as usual (divide, then all-reduce);
  - after that each rank steps on its own gradients, and every `period` steps the parameters
    (those with a gradient) are averaged: flattened, divided by the world size, all-reduced.

    model = minidp.DDP(model)
    averager = comm.PeriodicAverager(model, period=4, warmup_steps=100)
    for x, y in batches:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        averager.step()                         # after the optimizer step
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..validate import check_int


class PeriodicAverager:
    """Average parameters every `period` steps after `warmup_steps` steps of exact gradient averaging.

    Args:
        model: a minidp.DDP or torch DDP model (a comm hook that skips gradient averaging after
            the warm-up is registered on it), or a plain module (then only parameters are averaged).
        period: steps between parameter averages, >= 1.
        warmup_steps: steps of ordinary DDP before local SGD starts, >= 0. Default 0.
        process_group: the ranks to average over. Default None: the model's group, else the world.
    """

    def __init__(self, model: nn.Module, period: int, warmup_steps: int = 0, process_group=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model={type(model).__name__} must be a torch.nn.Module")
        self.period = check_int("period", period, low=1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, low=0)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group={process_group!r} must be a torch.distributed.ProcessGroup or None")
        self.model, self.steps, self.bytes_sent, self.bytes_dense = model, 0, 0, 0
        self.group = process_group or getattr(model, "process_group", None) or dist.group.WORLD
        if hasattr(model, "register_comm_hook"):
            model.register_comm_hook(self, local_steps_hook)

    def step(self) -> bool:
        """Call after each optimizer step; averages the parameters when it is time. Returns whether it did."""
        due = self.steps >= self.warmup_steps and (self.steps - self.warmup_steps) % self.period == 0
        self.steps += 1
        if due:
            self.average()
        return due

    @torch.no_grad()
    def average(self) -> None:
        """Average the parameters (those with a gradient) now, e.g. before evaluating; every rank calls it."""
        params = [p for p in self.model.parameters() if p.grad is not None]  # as torch's averager
        if not params:
            return
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        flat /= dist.get_world_size(self.group)
        dist.all_reduce(flat, group=self.group)  # ranks meet here
        self.bytes_sent += flat.numel() * flat.element_size()
        torch._foreach_copy_(params, [piece.view_as(p) for piece, p in zip(flat.split([p.numel() for p in params]),
                                                                             params)])

    def stats(self) -> dict:
        """This rank since the start: steps, bytes sent (gradients in warm-up, then parameters), exact's bytes."""
        sent, dense = self.bytes_sent, self.bytes_dense
        return {"steps": self.steps, "bytes_sent": sent, "bytes_dense": dense, "ratio": sent / dense if dense else 0.0}

    def state_dict(self) -> dict:
        return {"steps": self.steps, "bytes_sent": self.bytes_sent, "bytes_dense": self.bytes_dense}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.bytes_sent, self.bytes_dense = state["steps"], state["bytes_sent"], state["bytes_dense"]


def local_steps_hook(averager, bucket):  # no annotations: torch DDP accepts only its exact ones, or none
    """Average gradients during the warm-up (torch's allreduce_hook arithmetic); afterwards keep them local.

    The hook of every method that trains locally between syncs (PeriodicAverager, DiLoCo): `averager` has
    steps, warmup_steps, group and the byte counters.
    """
    buffer = bucket.buffer()
    averager.bytes_dense += buffer.numel() * buffer.element_size()  # what exact averaging would have sent
    if averager.steps < averager.warmup_steps:
        averager.bytes_sent += buffer.numel() * buffer.element_size()
        buffer.div_(dist.get_world_size(averager.group))
        fut = dist.all_reduce(buffer, group=averager.group, async_op=True).get_future()  # ranks meet here
        return fut.then(lambda _: buffer)
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut
