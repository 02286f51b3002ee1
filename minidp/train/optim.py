"""Layer-wise adaptive optimizers for large batches: LARS, LAMB and NovoGrad, as published.

LARS and LAMB give each parameter tensor (a "layer") its own step size from the ratio of its norm
to the norm of its update, so that no layer takes a step that is large relative to its weights;
NovoGrad normalises each layer's gradient by a running average of its norm. Either way no layer's
step depends on the scale of its gradient, which keeps very large learning rates (large batches) stable.

Parameter groups may set `weight_decay` and `trust_ratio` (True/False) on their own;
`exclude_bias_and_norm(model)` builds the usual two groups, where biases and normalisation
weights get neither weight decay nor the trust ratio (as in You et al.'s experiments).

Example:
    optimizer = minidp.optim.LARS(minidp.optim.exclude_bias_and_norm(model), lr=4.8,
                                  momentum=0.9, weight_decay=1e-6)
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.optim import Optimizer

from ..validate import check_bool, check_number


def exclude_bias_and_norm(model: nn.Module) -> List[Dict]:
    """Parameter groups with biases and normalisation weights excluded from decay and trust ratio.

    A parameter with at most one dimension (every bias; the weight of BatchNorm, LayerNorm,
    GroupNorm, ...) goes in a group with weight_decay=0 and trust_ratio=False, so LARS/LAMB give
    it the plain momentum-SGD/Adam step. The others go in a group that takes the optimizer's
    defaults. Empty groups are left out.

    Args:
        model: the module whose parameters (model.parameters(), shared ones once) to split.

    Returns:
        a list of param-group dicts, to pass as the optimizer's first argument.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"exclude_bias_and_norm() expects an nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    regular = [p for p in params if p.dim() > 1]
    excluded = [p for p in params if p.dim() <= 1]
    groups = [{"params": regular}, {"params": excluded, "weight_decay": 0.0, "trust_ratio": False}]
    return [g for g in groups if g["params"]]


def _check_group(name: str, group: Dict) -> None:
    """Raise TypeError/ValueError naming the first bad hyper-parameter of `group` (`name`: the optimizer)."""
    def pair(key: str) -> List[float]:  # betas, weight_norm_clamp: two numbers
        value = group[key]
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"{name}: {key}={value!r} must be a pair of numbers")
        if len(value) != 2:
            raise ValueError(f"{name}: {key}={value!r} must be a pair of numbers")
        return [check_number(f"{name}: {key}[{i}]", v) for i, v in enumerate(value)]

    check_number(f"{name}: lr", group["lr"], low=0)
    check_number(f"{name}: eps", group["eps"], positive=True)
    check_number(f"{name}: weight_decay", group["weight_decay"], low=0)
    if "momentum" in group and not 0 <= check_number(f"{name}: momentum", group["momentum"]) < 1:
        raise ValueError(f"{name}: momentum={group['momentum']!r} must be in [0, 1)")
    if "trust_coefficient" in group:
        check_number(f"{name}: trust_coefficient", group["trust_coefficient"], positive=True)
    if "betas" in group and not all(0 <= b < 1 for b in pair("betas")):
        raise ValueError(f"{name}: betas={group['betas']!r} must be two numbers in [0, 1)")
    if group.get("weight_norm_clamp") is not None:
        low, high = pair("weight_norm_clamp")
        if not 0 <= low <= high:
            raise ValueError(f"{name}: weight_norm_clamp={group['weight_norm_clamp']!r} must be (low, high) "
                             "with 0 <= low <= high")
    for flag in ("trust_ratio", "bias_correction", "grad_averaging"):
        if flag in group:
            check_bool(f"{name}: {flag}", group[flag])


class _LayerwiseOptimizer(Optimizer):
    """Shared plumbing: validation of every param group, closure, per-parameter loop."""

    def add_param_group(self, param_group: Dict) -> None:
        # Validate before torch stores the group, with the defaults the group will inherit.
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        _check_group(type(self).__name__, merged)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One update of every parameter that has a gradient; returns closure()'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                self._update(p, p.grad, self.state[p], group)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: Dict, group: Dict) -> None:
        raise NotImplementedError


class LARS(_LayerwiseOptimizer):
    """LARS: momentum SGD with a layer-wise learning rate (You, Gitman, Ginsburg 2017, Algorithm 1).

    For every parameter tensor w with gradient g, at each step:

        local_lr = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)
                   (1 when ||w|| or ||g|| is 0, or when the group has trust_ratio=False)
        v = momentum * v + lr * local_lr * (g + weight_decay * w)         (v starts at 0)
        w = w - v

    As in the paper, the global lr sits inside the momentum buffer (torch's SGD puts it outside:
    the two differ only while lr changes, e.g. during warm-up). The paper has no eps; it only
    guards the division.

    Args:
        params: parameters or param groups; groups may set any argument below, and trust_ratio.
        lr: global learning rate (the paper's gamma). Default 1.0.
        momentum: in [0, 1). Default 0.9.
        weight_decay: L2 coefficient beta, >= 0. Default 0.
        trust_coefficient: eta, > 0. Default 0.001 (the paper's value).
        eps: > 0, added to the denominator of local_lr. Default 1e-8.
    """

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, trust_ratio=True)
        super().__init__(params, defaults)

    def _update(self, p, grad, state, group) -> None:
        wd = group["weight_decay"]
        update = grad.add(p, alpha=wd) if wd else grad.clone()
        if group["trust_ratio"]:
            w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(grad)
            ok = (w_norm > 0) & (g_norm > 0)  # else there is no scale to compare the step with
            local_lr = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
            update.mul_(torch.where(ok, local_lr, 1.0))
        update.mul_(group["lr"])
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(update)
        p.sub_(buf)


class LAMB(_LayerwiseOptimizer):
    """LAMB: Adam with a layer-wise trust ratio (You et al. 2019, "Large Batch Optimization for
    Deep Learning: Training BERT in 76 minutes", Algorithm 2).

    For every parameter tensor w with gradient g, at step t = 1, 2, ...:

        m = beta1 * m + (1 - beta1) * g          v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1^t)                v_hat = v / (1 - beta2^t)      (bias_correction)
        r = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
        w = w - lr * phi(||w||) / ||r|| * r

    phi is the identity, or clamp(., low, high) with weight_norm_clamp=(low, high). The ratio
    phi(||w||) / ||r|| is 1 when phi(||w||) or ||r|| is 0 (a zero-initialised tensor still moves) and when
    the group has trust_ratio=False (then the step is Adam's with decoupled weight decay).

    Args:
        params: parameters or param groups; groups may set any argument below, and trust_ratio.
        lr: learning rate eta, >= 0. Default 1e-3.
        betas: (beta1, beta2), each in [0, 1). Default (0.9, 0.999).
        eps: > 0. Default 1e-6 (the value of the paper's experiments).
        weight_decay: lambda, >= 0. Default 0.01.
        bias_correction: divide the moments by (1 - beta^t), as Algorithm 2 does. Default True.
        weight_norm_clamp: (low, high) bounds of phi, or None for the identity. Default None.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, bias_correction: bool = True,
                 weight_norm_clamp: Optional[Tuple[float, float]] = None) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, weight_norm_clamp=weight_norm_clamp, trust_ratio=True)
        super().__init__(params, defaults)

    def _update(self, p, grad, state, group) -> None:
        beta1, beta2 = group["betas"]
        if not state:
            state["step"] = 0
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        state["step"] += 1
        m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        c1, c2 = (1 - beta1 ** t, 1 - beta2 ** t) if group["bias_correction"] else (1.0, 1.0)
        r = (m / c1) / ((v / c2).sqrt() + group["eps"])
        if group["weight_decay"]:
            r.add_(p, alpha=group["weight_decay"])
        if group["trust_ratio"]:
            w_norm = torch.linalg.vector_norm(p)
            if group["weight_norm_clamp"] is not None:
                w_norm = w_norm.clamp(*group["weight_norm_clamp"])
            r_norm = torch.linalg.vector_norm(r)
            ok = (w_norm > 0) & (r_norm > 0)  # else there is no scale to compare the step with
            r.mul_(torch.where(ok, w_norm / torch.where(ok, r_norm, 1.0), 1.0))
        p.sub_(r * group["lr"])


class NovoGrad(_LayerwiseOptimizer):
    """NovoGrad: layer-wise second moments (Ginsburg et al. 2019, "Stochastic Gradient Methods with
    Layer-wise Adaptive Moments for Training of Deep Networks", Algorithm 1).

    For every parameter tensor w (a layer) with gradient g, at step t = 1, 2, ...:

        v = ||g||^2                                   (t = 1)
        v = beta2 * v + (1 - beta2) * ||g||^2         (t > 1; v is one number per layer)
        u = g / (sqrt(v) + eps) + weight_decay * w
        m = u                                         (t = 1)
        m = beta1 * m + a * u                         (t > 1; a = 1 - beta1 with grad_averaging, else 1)
        w = w - lr * m

    Choices where implementations differ, all the paper's: the first step sets v and m from the first
    gradient (no zero start, so no bias correction); weight decay is added to the normalised gradient,
    inside the first moment; no gradient averaging by default (grad_averaging=True gives apex's and
    OpenSeq2Seq's option, which makes m an average rather than a sum: the lr to use is 1/(1-beta1) times
    larger). eps sits outside the square root. Groups that set trust_ratio (exclude_bias_and_norm) are
    accepted: NovoGrad has no trust ratio, the group's weight_decay=0 is what applies.

    Args:
        params: parameters or param groups; groups may set any argument below.
        lr: learning rate lambda, >= 0. Default 0.01.
        betas: (beta1, beta2), each in [0, 1). Default (0.95, 0.98) (the paper's).
        eps: > 0, guards a layer whose gradient is zero. Default 1e-8.
        weight_decay: d, >= 0. Default 0.
        grad_averaging: multiply the new term of m by (1 - beta1) after the first step. Default False.
    """

    def __init__(self, params, lr: float = 0.01, betas: Tuple[float, float] = (0.95, 0.98), eps: float = 1e-8,
                 weight_decay: float = 0.0, grad_averaging: bool = False) -> None:
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging)
        super().__init__(params, defaults)

    def _update(self, p, grad, state, group) -> None:
        beta1, beta2 = group["betas"]
        # The layer's squared norm in float32 at least: a float16 sum of squares overflows at 256.
        sq = torch.linalg.vector_norm(grad, dtype=torch.promote_types(grad.dtype, torch.float32)) ** 2
        first = not state
        if first:
            state["step"], state["exp_avg_sq"] = 0, sq
        else:
            state["exp_avg_sq"].mul_(beta2).add_(sq, alpha=1 - beta2)
        state["step"] += 1
        u = grad / (state["exp_avg_sq"].sqrt() + group["eps"]).to(grad.dtype)
        if group["weight_decay"]:
            u.add_(p, alpha=group["weight_decay"])
        if first:
            state["exp_avg"] = u
        else:
            state["exp_avg"].mul_(beta1).add_(u, alpha=1 - beta1 if group["grad_averaging"] else 1.0)
        p.sub_(state["exp_avg"] * group["lr"])


__all__ = ["LARS", "LAMB", "NovoGrad", "exclude_bias_and_norm"]
