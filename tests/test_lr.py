"""minidp.lr: the linear scaling rule and gradual warm-up, as values at chosen steps."""
import math

import pytest
import torch

from minidp.train import lr


def test_scaled_lr():
    assert lr.scaled_lr(0.1, world_size=8) == pytest.approx(0.8)
    assert lr.scaled_lr(0.1, world_size=8, reference_world_size=2) == pytest.approx(0.4)
    assert lr.scaled_lr(1e-3, world_size=16, reference_world_size=4, rule="sqrt") == pytest.approx(2e-3)
    assert lr.scaled_lr(0.1, world_size=1) == 0.1
    assert lr.scale_factor(2, 8) == 0.25  # fewer processes than the reference: a smaller lr


def test_world_size_defaults_to_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # no process group in the test process
    assert lr.scale_factor() == 4.0 and lr.scaled_lr(0.05) == pytest.approx(0.2)


@pytest.mark.parametrize("step, expected", [(0, 1.0), (1, 1.7), (5, 4.5), (9, 7.3), (10, 8.0), (11, 8.0), (10**6, 8.0)])
def test_warmup_factor_goyal(step, expected):
    # k = 8, ramp of 10 steps: 1 + 7 * step / 10, then 8.
    assert lr.warmup_factor(step, warmup_steps=10, world_size=8) == pytest.approx(expected)


def test_warmup_factor_edges():
    assert lr.warmup_factor(0, warmup_steps=0, world_size=4) == 4.0  # no warm-up
    assert lr.warmup_factor(2, warmup_steps=4, world_size=1) == 1.0  # nothing to ramp to
    assert lr.warmup_factor(2, 4, world_size=16, reference_world_size=4, rule="sqrt") == pytest.approx(1.5)


def test_scheduler_values_per_step():
    params = [torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD([{"params": params, "lr": 0.1}, {"params": [], "lr": 0.01}], momentum=0.9)
    decay = lambda s: 0.5 ** (s // 2)  # noqa: E731 (halve every 2 steps after warm-up)
    scheduler = lr.warmup_scheduler(optimizer, warmup_steps=4, world_size=4, decay=decay)
    seen = []
    for _ in range(9):
        seen.append([g["lr"] for g in optimizer.param_groups])  # the lr this step uses
        optimizer.step()
        scheduler.step()
    expected = [0.1, 0.175, 0.25, 0.325, 0.4, 0.4, 0.2, 0.2, 0.1]
    assert [s[0] for s in seen] == pytest.approx(expected)
    assert [s[1] for s in seen] == pytest.approx([e / 10 for e in expected])  # groups keep their ratio


@pytest.mark.parametrize("call, error, match", [
    (lambda: lr.scaled_lr(-0.1, 2), ValueError, r"base_lr=-0.1 must be >= 0"),
    (lambda: lr.scaled_lr("0.1", 2), TypeError, r"base_lr='0.1' must be a number"),
    (lambda: lr.scale_factor(0), ValueError, r"world_size=0 must be >= 1"),
    (lambda: lr.scale_factor(2.0), TypeError, r"world_size=2.0 must be an int"),
    (lambda: lr.scale_factor(2, 0), ValueError, r"reference_world_size=0 must be >= 1"),
    (lambda: lr.scaled_lr(float("nan"), 2), ValueError, r"base_lr=nan must not be NaN"),
    (lambda: lr.scaled_lr(0.1, world_size=True), TypeError, r"world_size=True must be an int"),
    (lambda: lr.scale_factor(2, rule="cube"), ValueError, r"rule='cube' must be one of"),
    (lambda: lr.scale_factor(2, rule=["sqrt"]), TypeError, r"rule=\['sqrt'\] must be one of"),
    (lambda: lr.warmup_factor(-1, 5, 2), ValueError, r"step=-1 must be >= 0"),
    (lambda: lr.warmup_factor(0, -5, 2), ValueError, r"warmup_steps=-5 must be >= 0"),
    (lambda: lr.warmup_scheduler(object(), 5, 2), TypeError, r"optimizer=object must be a torch.optim.Optimizer"),
    (lambda: lr.warmup_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), -1, 2),
     ValueError, r"warmup_steps=-1 must be >= 0"),
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_sqrt_rule_is_square_root_of_linear():
    assert lr.scale_factor(32, 2, rule="sqrt") == pytest.approx(math.sqrt(lr.scale_factor(32, 2)))
