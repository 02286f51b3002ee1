"""What a round averages and what committing it means: gradients (DDP's step) or DiLoCo's sync.

A policy answers four questions for the Replica, which runs the protocol around them:
  contribution()  the flat tensors this participant adds to the round's mean
  commit(mean)    apply the mean: the optimizer's step (or DiLoCo's outer step)
  discard()       forget the round: gradients dropped (DiLoCo: back to the round's start)
  state_dict()    what a joiner must load besides the model to continue exactly as its peers
The mean is `ordered_mean`: every participant gathers all contributions and sums them in rank
order (id order), then divides by their count. Every participant does the same additions in the
same order, so any replay of the same membership gives the same bits (a ring all-reduce's order
depends on the group's size and the element's place; this does not). The price: each participant
receives (N - 1) copies instead of a ring's 2 (N - 1) / N.
"""
from __future__ import annotations

import copy

import torch


def ordered_mean(contributions: list[torch.Tensor], group, rank: int, count: int,
                 buffers: list | None = None) -> list[torch.Tensor]:
    """The mean over `count` participants of each flat tensor, summed in rank order.

    Args:
        contributions: this participant's flat tensors (the same shapes on every participant).
        group: a torch ProcessGroup over the participants (unused when count == 1).
        rank: this participant's rank in `group`.
        count: the participants.
        buffers: a list to append the receive buffers to (the caller keeps them alive if the
            collective fails: a late peer's data may still land in them). Default None.
    """
    means = []
    for mine in contributions:
        if count == 1:
            gathered = [mine]
        else:
            sent = mine.cpu()  # gloo between replicas; the sums below happen where `mine` lives
            gathered = [torch.empty_like(sent) for _ in range(count)]
            if buffers is not None:
                buffers.append((sent, gathered))
            group.allgather([gathered], [sent]).wait()  # ranks meet: every participant's tensor
            gathered = [g.to(mine.device) for g in gathered]
        # gathered[0] is a fresh receive buffer when count > 1: sum into it (no copy on the step's path)
        total = gathered[0] if count > 1 else mine.clone()
        for other in gathered[1:]:
            total.add_(other)
        means.append(total.div_(count))
    return means


def _flat_groups(params: list) -> dict:
    """Parameter indices grouped by dtype, in registration order: one flat tensor per dtype."""
    groups: dict = {}
    for i, p in enumerate(params):
        groups.setdefault(p.dtype, []).append(i)
    return groups


class AverageGradients:
    """DDP's step across replicas: the participants' gradients averaged, then the optimizer steps.

    A parameter no participant produced a gradient for keeps `.grad = None` (each contribution
    carries a 0/1 mark per parameter), so the optimizer skips it as it would under DDP.

    Args:
        optimizer: the torch optimizer over the model's parameters.
    """

    inner_steps = 1

    def __init__(self, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer={type(optimizer).__name__} must be a torch.optim.Optimizer")
        self.optimizer = optimizer
        self.params: list = []

    def attach(self, model) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.groups = _flat_groups(self.params)

    def begin(self) -> None:
        pass

    def contribution(self, failed: bool = False) -> list[torch.Tensor]:
        """Gradients then a 0/1 mark per parameter, one flat tensor per dtype (zeros if `failed`)."""
        flats = []
        for dtype, idx in self.groups.items():
            parts, marks = [], []
            for i in idx:
                p = self.params[i]
                g = None if failed else p.grad
                parts.append(torch.zeros(p.numel(), dtype=dtype, device=p.device) if g is None
                             else g.detach().reshape(-1))
                marks.append(0.0 if g is None else 1.0)
            flats.append(torch.cat(parts + [torch.tensor(marks, dtype=dtype, device=parts[0].device)]))
        return flats

    def commit(self, means: list[torch.Tensor]) -> None:
        for idx, mean in zip(self.groups.values(), means):
            marks, offset = mean[-len(idx):], 0
            for k, i in enumerate(idx):
                p = self.params[i]
                value = mean[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if marks[k] == 0:
                    p.grad = None
                elif p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def discard(self) -> None:
        self.optimizer.zero_grad()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


class DiLoCo:
    """DiLoCo across replicas: `period` local inner steps a round, then the pseudo-gradient's mean.

    In the round's body the user runs `period` inner steps (forward, backward, inner.step(),
    inner.zero_grad()). At its end each participant contributes global - local parameters; on
    commit the mean is the global parameters' gradient for the outer optimizer (built over the
    model's parameters, as minidp.comm.DiLoCo's), and every participant goes on from the new
    global parameters. A discarded round puts the parameters and the inner optimizer's state back
    as they were at the round's start: its inner steps are trained again.

    Args:
        inner_optimizer: the local optimizer (AdamW in the paper).
        outer_optimizer: over the same parameters (SGD, lr 0.7, momentum 0.9, nesterov in the paper).
        period: inner steps per round (the paper's H), >= 1.
    """

    def __init__(self, inner_optimizer, outer_optimizer, period: int):
        for name, opt in (("inner_optimizer", inner_optimizer), ("outer_optimizer", outer_optimizer)):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"{name}={type(opt).__name__} must be a torch.optim.Optimizer")
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(f"period={period!r} must be an int >= 1")
        self.inner, self.outer, self.inner_steps = inner_optimizer, outer_optimizer, period
        self.params: list = []

    def attach(self, model) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.groups = _flat_groups(self.params)
        self.global_params = [p.detach().clone() for p in self.params]

    def begin(self) -> None:
        self.inner_at_start = copy.deepcopy(self.inner.state_dict())

    def contribution(self, failed: bool = False) -> list[torch.Tensor]:
        flats = [torch.cat([(self.global_params[i] - self.params[i].detach()).reshape(-1) for i in idx])
                 for idx in self.groups.values()]
        return [torch.zeros_like(f) for f in flats] if failed else flats

    def commit(self, means: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for idx, mean in zip(self.groups.values(), means):
                offset = 0
                for i in idx:
                    p = self.params[i]
                    p.copy_(self.global_params[i])
                    p.grad = mean[offset:offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
        self.outer.step()
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params):
                g.copy_(p)
                p.grad = None

    def discard(self) -> None:
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params):
                p.copy_(g)
                p.grad = None
        self.inner.load_state_dict(self.inner_at_start)

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "outer": self.outer.state_dict(),
                "global": [g.clone() for g in self.global_params]}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        self.outer.load_state_dict(state["outer"])
        for g, s in zip(self.global_params, state["global"]):
            g.copy_(s)
