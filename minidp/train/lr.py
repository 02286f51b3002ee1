"""Learning rates for large batches: the linear scaling rule with gradual warm-up.

Goyal et al. 2017 ("Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"): when the
global batch grows k-fold, multiply the learning rate by k; since the first steps cannot take
that rate, start at the small-batch rate and raise it linearly to k times it over the first
`warmup_steps` steps. With a fixed per-rank batch, k = world_size / reference_world_size, where
the reference is the number of processes the base learning rate was tuned with.

rule="sqrt" scales by sqrt(k) instead, the usual choice for Adam-type optimizers (LAMB).

Example (base lr 0.1 tuned on one GPU, 8 GPUs now, 5 epochs of warm-up):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = minidp.lr.warmup_scheduler(optimizer, warmup_steps=5 * len(loader))
    for batch in loader:
        ...; optimizer.step(); scheduler.step()   # lr 0.1 -> 0.8 over 5 epochs, then 0.8
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from ..runtime.ranks import get_world_size
from ..validate import check_choice, check_int, check_number

RULES = ("linear", "sqrt")


def scale_factor(world_size: Optional[int] = None, reference_world_size: int = 1, rule: str = "linear") -> float:
    """How much larger the learning rate should be at `world_size` than at the reference.

    Args:
        world_size: processes now (each with the same per-rank batch). Default: the process
            group's size, else WORLD_SIZE, else 1.
        reference_world_size: processes the base learning rate was tuned with. Default 1.
        rule: "linear" (k, Goyal et al.) or "sqrt" (sqrt(k)). Default "linear".
    """
    world_size = get_world_size() if world_size is None else world_size
    k = check_int("world_size", world_size, 1) / check_int("reference_world_size", reference_world_size, 1)
    check_choice("rule", rule, RULES)
    return k if rule == "linear" else math.sqrt(k)


def scaled_lr(base_lr: float, world_size: Optional[int] = None, reference_world_size: int = 1,
              rule: str = "linear") -> float:
    """`base_lr` times scale_factor(world_size, reference_world_size, rule): the lr after warm-up.

    Example: scaled_lr(0.1, world_size=8) == 0.8; scaled_lr(1e-3, 16, 4, rule="sqrt") == 2e-3.
    """
    check_number("base_lr", base_lr, low=0)
    return base_lr * scale_factor(world_size, reference_world_size, rule)


def warmup_factor(step: int, warmup_steps: int, world_size: Optional[int] = None, reference_world_size: int = 1,
                  rule: str = "linear") -> float:
    """Multiplier of the base lr at `step` (0-based): 1 at step 0, rising linearly to k at warmup_steps.

    factor(step) = 1 + (k - 1) * min(step, warmup_steps) / warmup_steps, with k = scale_factor(...);
    warmup_steps=0 gives k from the first step.

    Args:
        step: optimizer steps taken so far, >= 0.
        warmup_steps: length of the ramp, >= 0 (Goyal et al.: 5 epochs).
        world_size, reference_world_size, rule: as in scale_factor().
    """
    k = scale_factor(world_size, reference_world_size, rule)
    step, warmup_steps = check_int("step", step, 0), check_int("warmup_steps", warmup_steps, 0)
    if step >= warmup_steps:
        return k
    return 1.0 + (k - 1.0) * step / warmup_steps


def _schedule(step: int, warmup_steps: int, k_args: tuple, decay: Optional[Callable[[int], float]]) -> float:
    factor = warmup_factor(step, warmup_steps, *k_args)
    if decay is not None and step >= warmup_steps:
        factor *= decay(step - warmup_steps)
    return factor


def warmup_scheduler(optimizer: Optimizer, warmup_steps: int, world_size: Optional[int] = None,
                     reference_world_size: int = 1, rule: str = "linear",
                     decay: Optional[Callable[[int], float]] = None) -> LambdaLR:
    """A LambdaLR that scales every param group's lr by warmup_factor(step, ...).

    Build the optimizer with the base (reference) learning rates; call scheduler.step() after each
    optimizer.step(). Param groups keep their ratios (each is multiplied by the same factor).

    Args:
        optimizer: its groups' current lr are the base learning rates.
        warmup_steps, world_size, reference_world_size, rule: as in warmup_factor().
            world_size is read once, here. Default: the process group's size.
        decay: optional multiplier after warm-up, called with the steps since warm-up ended
            (0, 1, ...), e.g. lambda s: 0.1 ** (s // 30_000). Default None: constant.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer={type(optimizer).__name__} must be a torch.optim.Optimizer")
    world_size = get_world_size() if world_size is None else world_size
    warmup_factor(0, warmup_steps, world_size, reference_world_size, rule)  # validate now, not at step()
    if decay is not None and not callable(decay):
        raise TypeError(f"decay={decay!r} must be a function of the step or None")
    schedule = functools.partial(_schedule, warmup_steps=warmup_steps,
                                 k_args=(world_size, reference_world_size, rule), decay=decay)
    return LambdaLR(optimizer, schedule)
