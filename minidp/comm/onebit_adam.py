"""1-bit Adam: exact Adam for a warm-up, then the variance frozen and the momentum sent as signs.

Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed" (arXiv 2102.02888), Algorithm 1, with DeepSpeed's arithmetic (deepspeed/runtime/fp16/onebit/
adam.py): no bias correction, eps outside the square root, weight decay added to the update. An
optimizer that does its own communication: use it without DDP's gradient all-reduce (under
model.no_sync(), or with no wrapper), every rank starting from the same parameters. Per step t:

    steps 1..freeze_step (warm-up), with g the average of every rank's gradient:
        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
    after (v frozen), with g this rank's own gradient:
        m = beta1 * m + (1 - beta1) * g
        m = compressed average of every rank's m (comm.Sign's worker and server stages, with the
            worker error and this rank's server error fed back: see sign.py)
    every step: p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)

The momenta of a parameter group travel as one flat tensor (DeepSpeed's fp16 path flattens a group
too): one scale per group and stage. The warm-up all-gathers the flat gradients and sums them in
rank order, so every rank, and a plain reference, computes the same bits at any world size: it
hands collectives the bytes DDP's all-reduce does, but receives world_size times them. At world
size 1 the momentum is not compressed (DeepSpeed's rule).
"""
from __future__ import annotations

import torch

from ..validate import check_int, check_number
from .context import Context
from .exchange import Channel, Job
from .sign import Sign
from .transports import TorchDist


class ReceivingChannel(Channel):
    """A Channel that also counts the bytes of each collective's output here (bytes_received)."""

    def __init__(self, transport):
        super().__init__(transport)
        self.bytes_received = 0

    def _received(self, out: torch.Tensor) -> torch.Tensor:
        self.bytes_received += out.numel() * out.element_size()
        return out

    def all_reduce(self, tensor):
        return self._received(super().all_reduce(tensor))

    def all_gather(self, tensor):
        return self._received(super().all_gather(tensor))

    def all_to_all(self, tensor):
        return self._received(super().all_to_all(tensor))


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam (Tang et al. 2021): Adam, then 1-bit momentum with error feedback on both sides.

    Every rank must construct it (its transport makes a process group) and call step() for the
    same parameters: a missing gradient counts as zero. The trainable parameters of a group must
    share one dtype and device (they travel as one flat tensor).

    Args:
        params: parameters or parameter groups (a group may set lr, betas, eps, weight_decay).
        lr: learning rate, > 0. Default 1e-3.
        betas: (beta1, beta2), each in [0, 1). Default (0.9, 0.999).
        eps: added to sqrt(v), >= 0. Default 1e-8.
        weight_decay: added to the update times p (decoupled, as DeepSpeed's), >= 0. Default 0.0.
        freeze_step: warm-up steps of exact Adam, >= 0; step freeze_step + 1 is the first
            compressed one. Default 100000 (DeepSpeed's).
        process_group: the ranks to communicate with. Default None: the world.

    Example:
        opt = comm.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=400)
        loss_fn(model(x), y).backward()       # a plain module, or under ddp_model.no_sync()
        opt.step(); opt.zero_grad()
        opt.stats()                           # {"steps", "bytes_sent", "bytes_received", ...}
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100000, process_group=None):
        check_number("lr", lr, positive=True)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"betas={betas!r} must be a pair (beta1, beta2)")
        for i, beta in enumerate(betas):
            check_number(f"betas[{i}]", beta, low=0.0)
            if not beta < 1:
                raise ValueError(f"betas[{i}]={beta!r} must be < 1")
        check_number("eps", eps, low=0.0)
        check_number("weight_decay", weight_decay, low=0.0)
        self.freeze_step = check_int("freeze_step", freeze_step, low=0)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        # ranks meet here: TorchDist makes a private process group
        self.channel = ReceivingChannel(TorchDist(process_group))
        self.sign = Sign()  # keeps this rank's server error, per parameter key
        self.steps, self.bytes_dense = 0, 0

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        kinds = {(p.dtype, p.device) for p in self.param_groups[-1]["params"] if p.requires_grad}
        if len(kinds) > 1:
            self.param_groups.pop()  # refused: the optimizer stays as it was
            raise ValueError(f"a parameter group holds trainable parameters of {len(kinds)} "
                             f"dtypes or devices ({sorted(map(str, kinds))}): its momenta travel "
                             "as one flat tensor; put each dtype and device in a group of its own")

    @property
    def compressing(self) -> bool:
        """Whether the next step sends the momentum compressed (the warm-up is over)."""
        return self.steps >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        """One step: exact Adam in the warm-up, compressed momentum after (every rank calls it)."""
        loss = None if closure is None else torch.enable_grad()(closure)()  # as torch's optimizers
        compressing = self.compressing
        self.steps += 1
        key = 0  # a parameter's key: its place among the trainable parameters of every group
        for group in self.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            keys, key = list(range(key, key + len(params))), key + len(params)
            if not params:
                continue
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            states = [self._state(p) for p in params]
            if compressing:
                self._compressed_momentum(group, params, grads, states, keys)
            else:
                self._exact_moments(group, grads, states)
            self.bytes_dense += sum(p.numel() * p.element_size() for p in params)
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p, state in zip(params, states):
                update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + eps)
                if weight_decay != 0:
                    update.add_(weight_decay * p)
                p.add_(-lr * update)
        return loss

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state

    def _exact_moments(self, group: dict, grads: list, states: list) -> None:
        """Both moments from the average gradient: all-gathered, summed in rank order, divided."""
        beta1, beta2 = group["betas"]
        rows = self.channel.all_gather(torch.cat([g.reshape(-1) for g in grads]))  # ranks meet here
        mean = rows[0].clone()
        for row in rows[1:]:
            mean.add_(row)
        mean.div_(len(rows))
        for state, g in zip(states, mean.split([g.numel() for g in grads])):
            g = g.view_as(state["exp_avg"])
            state["exp_avg"].mul_(beta1).add_((1 - beta1) * g)
            state["exp_avg_sq"].mul_(beta2).add_((1 - beta2) * g * g)

    def _compressed_momentum(self, group: dict, params: list, grads: list, states: list,
                             keys: list) -> None:
        """The local momentum plus the worker error, averaged by comm.Sign; errors kept."""
        beta1 = group["betas"][0]
        for state, g in zip(states, grads):
            state["exp_avg"].mul_(beta1).add_((1 - beta1) * g)
            if "worker_error" not in state:
                state["worker_error"] = torch.zeros_like(state["exp_avg"])
        transport = self.channel.transport
        if transport.world_size == 1:
            return
        x = torch.cat([(s["exp_avg"] + s["worker_error"]).reshape(-1) for s in states])
        ctx = Context(transport.rank, transport.world_size, self.steps - 1,
                      [p.shape for p in params], x.dtype, x.device)
        numels = [p.numel() for p in params]
        job = Job(x, keys, numels, True, ctx)  # True: the residual back, server errors kept
        residual = self.sign.reduce(job, self.channel)  # ranks meet here: worker, server stage
        for state, m, error in zip(states, x.split(numels), residual.split(numels)):
            state["exp_avg"].copy_(m.view_as(state["exp_avg"]))  # every rank: the same momentum
            state["worker_error"].copy_(error.view_as(state["exp_avg"]))

    def stats(self) -> dict:
        """This rank since the start: steps, bytes handed to collectives and received, DDP's bytes.

        bytes_received: the bytes of every collective's output here (an all-gather's includes this
        rank's own part). bytes_dense: what DDP's gradient all-reduce would have sent.
        """
        sent, dense = self.channel.bytes_sent, self.bytes_dense
        return {"steps": self.steps, "bytes_sent": sent,
                "bytes_received": self.channel.bytes_received, "bytes_dense": dense,
                "ratio": sent / dense if dense else 0.0}

    def state_dict(self) -> dict:
        """torch's optimizer state (exp_avg, exp_avg_sq, worker_error), server errors, counters."""
        state = super().state_dict()
        state["onebit"] = {"steps": self.steps, "bytes_sent": self.channel.bytes_sent,
                           "bytes_received": self.channel.bytes_received,
                           "bytes_dense": self.bytes_dense, "sign": self.sign.state_dict()}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what state_dict() returned on this rank (errors differ from rank to rank)."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("onebit")
        super().load_state_dict(state_dict)
        self.steps, self.bytes_dense = saved["steps"], saved["bytes_dense"]
        self.channel.bytes_sent = saved["bytes_sent"]
        self.channel.bytes_received = saved["bytes_received"]
        self.sign.load_state_dict(saved["sign"])
