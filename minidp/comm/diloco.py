"""DiLoCo: local inner steps, and every `period` steps an outer optimizer step on the pseudo-gradient.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv 2311.08105), the baseline low-communication training is compared with (torchft and OpenDiLoCo
ship it). Every rank trains alone with its inner optimizer; after every `period`-th step the ranks
meet once: the pseudo-gradient, the global parameters minus the mean of the ranks' parameters, is
set as the gradient of the global parameters, the user's outer optimizer (Nesterov SGD in the paper)
steps them, and every rank goes on from the new global parameters. With outer SGD at lr 1 and no
momentum this is parameter averaging every `period` steps.

    model = minidp.DDP(model)
    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    diloco = comm.DiLoCo(model, outer, period=500)
    for x, y in batches:
        loss_fn(model(x), y).backward(); inner.step(); inner.zero_grad()
        diloco.step()                           # after the inner optimizer's step
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..engine.collectives import broadcast_coalesced
from ..validate import check_int
from .averaging import local_steps_hook


class DiLoCo:
    """Local training with an outer optimizer on the pseudo-gradient every `period` steps (DiLoCo).

    The global parameters (a detached copy, the same on every rank) start as rank 0's parameters,
    broadcast to every rank when local training starts (at construction, or after the warm-up), as
    DDP's constructor does. At each sync the parameters' `.grad` tensors are put back as they were
    (the same tensor objects, so gradient-as-bucket-view stays intact): the inner optimizer never
    sees the pseudo-gradient. Parameters with requires_grad=False are left alone.

    Args:
        model: a minidp.DDP or torch DDP model (a comm hook that skips gradient averaging after the
            warm-up is registered on it), or a plain module (then only the syncs communicate).
        outer_optimizer: a torch.optim.Optimizer built over exactly the model's trainable
            parameters, e.g. SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True).
        period: inner steps between syncs (the paper's H), >= 1; a sync follows every
            `period`-th call of step() after the warm-up.
        warmup_steps: steps of ordinary DDP (averaged gradients) before local training starts,
            >= 0, as PeriodicAverager's. Default 0.
        process_group: the ranks to sync over. Default None: the model's group, else the world.

    Example:
        diloco = comm.DiLoCo(ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.7, momentum=0.9,
                             nesterov=True), period=100)
        ...; inner.step(); diloco.step()
    """

    def __init__(self, model: nn.Module, outer_optimizer: torch.optim.Optimizer, period: int,
                 warmup_steps: int = 0, process_group=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model={type(model).__name__} must be a torch.nn.Module")
        if not isinstance(outer_optimizer, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer={type(outer_optimizer).__name__} must be a torch.optim.Optimizer, "
                            "e.g. torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)")
        self.period = check_int("period", period, low=1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, low=0)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group={process_group!r} must be a torch.distributed.ProcessGroup or None")
        self.params = [p for p in model.parameters() if p.requires_grad]
        _check_outer_params(outer_optimizer, list(model.parameters()), self.params)
        if not dist.is_initialized():
            raise RuntimeError("DiLoCo needs an initialised process group: call minidp.init() first")
        self.model, self.outer_optimizer = model, outer_optimizer
        self.group = process_group or getattr(model, "process_group", None) or dist.group.WORLD
        self.steps, self.bytes_sent, self.bytes_dense = 0, 0, 0
        self.global_params: list[torch.Tensor] | None = None  # set when local training starts
        # One flat buffer per (dtype, device), so a mixed-precision model is never cast to one dtype.
        kinds: dict = {}
        for i, p in enumerate(self.params):
            kinds.setdefault((p.dtype, p.device), []).append(i)
        self._kinds = list(kinds.values())
        if hasattr(model, "register_comm_hook"):
            model.register_comm_hook(self, local_steps_hook)
        if self.warmup_steps == 0:
            self._start_local()  # ranks meet here (a broadcast)

    def step(self) -> bool:
        """Call after each inner optimizer step; syncs (an outer step) when it is due. Returns whether it did."""
        self.steps += 1
        local = self.steps - self.warmup_steps
        if local == 0:
            self._start_local()  # ranks meet here: the warm-up is over
        due = local > 0 and local % self.period == 0
        if due:
            self.sync()
        return due

    @torch.no_grad()
    def sync(self) -> bool:
        """An outer step now (every rank calls it), e.g. before evaluating; no-op during the warm-up.

        Returns whether it synced. The next scheduled sync stays where step() counts it.
        """
        if self.global_params is None:
            return False
        every = range(len(self.params))
        means = self._finish_mean(self._start_mean(every))  # ranks meet here
        # global - mean: the paper's outer gradient
        self._outer_step(every, torch._foreach_sub(self.global_params, [means[i] for i in every]))
        return True

    def _outer_step(self, indices, pseudo: list[torch.Tensor]) -> None:
        """The outer optimizer steps the global parameters self.params[i], i in `indices`, on `pseudo`.

        The parameters take the global values and step (the others' .grad is None meanwhile, so the
        optimizer skips them); their .grad tensors are put back, and the result is the new global.
        """
        params = [self.params[i] for i in indices]
        kept = [p.grad for p in self.params]
        torch._foreach_copy_(params, [self.global_params[i] for i in indices])
        for p in self.params:
            p.grad = None
        for p, g in zip(params, pseudo):
            p.grad = g
        try:
            self.outer_optimizer.step()
        finally:
            for p, g in zip(self.params, kept):  # the same tensor objects as before: the inner gradients
                p.grad = g
        torch._foreach_copy_([self.global_params[i] for i in indices], params)

    def _start_mean(self, indices) -> list:
        """Start the mean over ranks of self.params[i], i in `indices` (async; divide, then sum).

        One flat buffer per (dtype, device); its bytes are counted now. _finish_mean waits for it.
        """
        chosen, world, pending = set(indices), dist.get_world_size(self.group), []
        for kind in self._kinds:
            mine = [i for i in kind if i in chosen]
            if not mine:
                continue
            flat = torch.cat([self.params[i].detach().reshape(-1) for i in mine])
            flat /= world  # as torch's PeriodicModelAverager: divide first, then sum
            work = dist.all_reduce(flat, group=self.group, async_op=True)  # ranks meet here
            self.bytes_sent += flat.numel() * flat.element_size()
            pending.append((mine, flat, work))
        return pending

    def _finish_mean(self, pending: list) -> dict[int, torch.Tensor]:
        """Wait for what _start_mean started; the mean of each parameter, by its index in self.params."""
        means = {}
        for mine, flat, work in pending:
            work.wait()  # every rank's parameters summed
            for i, piece in zip(mine, flat.split([self.params[i].numel() for i in mine])):
                means[i] = piece.view_as(self.params[i])
        return means

    @torch.no_grad()
    def _start_local(self) -> None:
        """Broadcast rank 0's parameters into every rank and keep them as the global parameters."""
        broadcast_coalesced(self.params, self.group)  # ranks meet here: rank 0's parameters, as DDP's constructor
        self.bytes_sent += sum(p.numel() * p.element_size() for p in self.params)
        self.global_params = [p.detach().clone() for p in self.params]

    def stats(self) -> dict:
        """This rank since the start: steps, bytes_sent, bytes_dense and their ratio.

        bytes_sent: warm-up gradients, the broadcast that starts local training, each sync's parameters.
        bytes_dense: what exact gradient averaging would have sent (counted by the hook; 0 on a plain module).
        """
        sent, dense = self.bytes_sent, self.bytes_dense
        return {"steps": self.steps, "bytes_sent": sent, "bytes_dense": dense, "ratio": sent / dense if dense else 0.0}

    def state_dict(self) -> dict:
        """Steps, byte counters, the global parameters (cloned) and the outer optimizer's state_dict()."""
        global_params = None if self.global_params is None else [g.clone() for g in self.global_params]
        return {"steps": self.steps, "bytes_sent": self.bytes_sent, "bytes_dense": self.bytes_dense,
                "global_params": global_params, "outer_optimizer": self.outer_optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned; load the model's own parameters separately (each rank its own)."""
        saved = state["global_params"]
        if saved is not None and [tuple(g.shape) for g in saved] != [tuple(p.shape) for p in self.params]:
            raise ValueError(f"global_params of shapes {[tuple(g.shape) for g in saved]} do not match the model's "
                             f"trainable parameters {[tuple(p.shape) for p in self.params]}")
        self.steps, self.bytes_sent, self.bytes_dense = state["steps"], state["bytes_sent"], state["bytes_dense"]
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.global_params = None if saved is None else [
            g.detach().to(device=p.device, dtype=p.dtype, copy=True) for g, p in zip(saved, self.params)]


def _check_outer_params(optimizer: torch.optim.Optimizer, every: list, trainable: list) -> None:
    """Refuse an outer optimizer that misses a trainable parameter (it would never move) or holds a foreign one.

    Frozen parameters of the model may be listed: they never get a pseudo-gradient, so it skips them.
    """
    theirs = {id(p) for group in optimizer.param_groups for p in group["params"]}
    foreign, missing = len(theirs - {id(p) for p in every}), len({id(p) for p in trainable} - theirs)
    if foreign or missing:
        raise ValueError(f"outer_optimizer={type(optimizer).__name__} must be built over the model's trainable "
                         f"parameters: it holds {foreign} tensor(s) not of the model and misses {missing} trainable "
                         "one(s); build it as e.g. torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, "
                         "nesterov=True)")
