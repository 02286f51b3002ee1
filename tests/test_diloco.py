"""comm.DiLoCo (Douillard et al. 2023, arXiv 2311.08105) on real gloo processes at world size 2.

Against a straightforward reference written here from the paper's Algorithm 1 (inner AdamW on each
rank; every H steps: all-reduced mean of the parameters, delta = global - mean, outer Nesterov SGD on
delta), on a plain module, minidp.DDP and torch DDP; with outer SGD at lr 1 against parameter
averaging every H steps (PeriodicAverager's arithmetic); bytes; a bitwise resume. One launch runs
every case; the tests below check what the workers returned.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import error_of, run_ranks
from minidp import comm
from models import build
from training import bitwise_equal, max_abs_diff, rank_batches, snapshot, train

ENGINES = ("plain", "minidp", "views", "torch")  # a plain module, minidp.DDP (also with bucket views), torch DDP
PERIOD, STEPS = 3, 8  # syncs after steps 3 and 6; the run ends mid-period (ranks differ at the end)


def _model(noise):
    """The MLP with a frozen first bias; with noise, rank r's weights are all shifted by r / 100."""
    module = build("mlp")
    module.net[0].bias.requires_grad_(False)
    if noise:
        with torch.no_grad():
            for p in module.parameters():
                p.add_(dist.get_rank() / 100)
    return module


def _trainable(module):
    return [p for p in module.parameters() if p.requires_grad]


def _nesterov(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _reference(frozen_noise):
    """The paper's Algorithm 1, written out: global weights theta, H inner steps, the outer step on theta.

    Its own loop, not tests/training.train: the reference is the algorithm in full, sharing no code with
    what it checks.
    """
    module = build("mlp")
    frozen = module.net[0].bias.requires_grad_(False)
    if frozen_noise:  # as _model(noise=True) after DiLoCo broadcast rank 0's trainable weights
        with torch.no_grad():
            frozen.add_(dist.get_rank() / 100)
    params = _trainable(module)
    inner = torch.optim.AdamW(params, lr=0.01)
    theta = [p.detach().clone() for p in params]
    outer = _nesterov(theta)
    for t, (x, y) in enumerate(rank_batches(STEPS, dist.get_rank()), 1):
        inner.zero_grad()
        F.mse_loss(module(x), y).backward()
        inner.step()
        if t % PERIOD == 0:
            for g, p in zip(theta, params):
                mean = p.detach().clone()
                dist.all_reduce(mean)  # ranks meet here
                mean /= dist.get_world_size()
                g.grad = g - mean
            outer.step()
            with torch.no_grad():
                for p, g in zip(params, theta):
                    p.copy_(g)
    return [p.detach().clone() for p in module.parameters()], theta


def _diloco_run(engine):
    """DiLoCo on `engine` (None: the plain module); what the tests check, gathered along the way."""
    module = _model(noise=True)
    model = module if engine is None else engine(module)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = comm.DiLoCo(model, _nesterov(model.parameters()), PERIOD)
    out = {"synced": [], "grads_kept": True}

    def outer_step(step):
        before = [(p.grad, p.grad.clone()) for p in _trainable(module)]
        out["synced"].append(diloco.step())
        # the inner optimizer never sees the pseudo-gradient: the same .grad tensors, the same values
        out["grads_kept"] &= all(p.grad is g and torch.equal(g, v) for p, (g, v) in zip(_trainable(module), before))
        if step + 1 == 2 * PERIOD:
            out["after_sync"] = snapshot(module)
    train(model, inner, rank_batches(STEPS, dist.get_rank()), per_step=outer_step)
    out["params"] = snapshot(module)
    out["global"] = [g.clone() for g in diloco.global_params]
    out["stats"] = diloco.stats()
    out["elements"] = sum(p.numel() for p in _trainable(module))
    return out


def _bucket_views(module):
    return minidp.DDP(module, gradient_as_bucket_view=True)  # .grad tensors are views DiLoCo must not replace


def _against_reference():
    return {"reference_ddp": _reference(False), "reference_plain": _reference(True),
            **{name: _diloco_run(engine) for name, engine in
               (("plain", None), ("minidp", minidp.DDP), ("views", _bucket_views), ("torch", TorchDDP))}}


def _against_averaging():
    """Outer SGD at lr 1 vs. averaging the parameters after every PERIOD-th step (PeriodicAverager.average)."""
    return {name: _outer_sgd_or_averaging(name) for name in ("diloco", "averaging")}


def _outer_sgd_or_averaging(name):
    module = build("mlp")
    model = minidp.DDP(module)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    if name == "diloco":
        diloco = comm.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=1.0), PERIOD)
    else:  # its hook keeps gradients local (warmup_steps=0); its own schedule averages at step 1,
        averager = comm.PeriodicAverager(model, PERIOD)  # so the average is called here, after every H-th

    def after_step(step):
        if name == "diloco":
            diloco.step()
        elif (step + 1) % PERIOD == 0:
            averager.average()
    train(model, inner, rank_batches(STEPS, dist.get_rank()), per_step=after_step)
    return snapshot(module)


def _warmup_run():
    """warmup_steps=2: gradients averaged for 2 steps, then syncs after local steps 3 and 6 (calls 5 and 8)."""
    module = build("mlp")
    model = minidp.DDP(module)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = comm.DiLoCo(model, _nesterov(model.parameters()), PERIOD, warmup_steps=2)
    out = {"early_sync": diloco.sync(), "synced": []}

    def outer_step(step):
        out["synced"].append(diloco.step())
        if step + 1 == 2:
            out["after_warmup"] = snapshot(module)
    train(model, inner, rank_batches(STEPS, dist.get_rank()), per_step=outer_step)
    out["stats"], out["elements"] = diloco.stats(), sum(p.numel() for p in module.parameters())
    return out


def _setup():
    module = build("mlp")
    model = minidp.DDP(module)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    return module, model, inner, comm.DiLoCo(model, _nesterov(model.parameters()), PERIOD)


def _train(model, inner, diloco, batches):
    train(model, inner, batches, per_step=lambda step: diloco.step())


def _resume(folder):
    """Train 4 steps (one sync, then mid-period), save; fresh objects loaded from the file go on as the first run."""
    batches, path = rank_batches(STEPS, dist.get_rank()), os.path.join(folder, f"{dist.get_rank()}.pt")
    module, model, inner, diloco = _setup()
    _train(model, inner, diloco, batches[:4])
    torch.save({"model": module.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()}, path)
    _train(model, inner, diloco, batches[4:])
    module2, model2, inner2, diloco2 = _setup()  # its constructor broadcasts: load after it
    saved = torch.load(path, weights_only=True)
    module2.load_state_dict(saved["model"])
    inner2.load_state_dict(saved["inner"])
    diloco2.load_state_dict(saved["diloco"])
    _train(model2, inner2, diloco2, batches[4:])
    same = bitwise_equal(module.parameters(), module2.parameters())
    same_global = bitwise_equal(diloco.global_params, diloco2.global_params)
    bad = dict(saved["diloco"], global_params=[torch.zeros(3)])
    return {"same": same, "same_global": same_global, "stats": (diloco.stats(), diloco2.stats()),
            "bad_shapes": error_of(lambda: diloco2.load_state_dict(bad))}


def _world_of_two(folder):
    return {"reference": _against_reference(), "averaging": _against_averaging(), "warmup": _warmup_run(),
            "resume": _resume(folder)}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(_world_of_two, 2, str(tmp_path_factory.mktemp("diloco")), timeout=120)


def _trainable_of(run):
    """The run's parameter lists without the frozen first bias (index 1 in module.parameters())."""
    return {key: run[key][:1] + run[key][2:] for key in ("after_sync", "params")}


def test_diloco_equals_the_papers_algorithm_on_every_engine(two):
    for result in two:
        cases = result["reference"]
        for name in ENGINES:
            params, theta = cases["reference_plain" if name == "plain" else "reference_ddp"]
            run = cases[name]
            # bitwise (measured max abs difference 0.0): at world size 2 a sum of two terms has one order
            assert max_abs_diff(run["params"], params) == 0 and max_abs_diff(run["global"], theta) == 0, name
            assert run["synced"] == [t % PERIOD == 0 for t in range(1, STEPS + 1)], name
            assert run["grads_kept"], name
    for name in ENGINES:  # every rank ends a sync bitwise identical; local steps then differ
        runs = [_trainable_of(two[r]["reference"][name]) for r in (0, 1)]
        assert bitwise_equal(runs[0]["after_sync"], runs[1]["after_sync"]), name
        assert max_abs_diff(runs[0]["params"], runs[1]["params"]) > 0, name
    # the plain module: trainable weights came from rank 0; the frozen bias (index 1) was left alone
    plain = [two[r]["reference"]["plain"]["params"][1] for r in (0, 1)]
    assert torch.allclose(plain[1] - plain[0], torch.full_like(plain[0], 0.01))


def test_outer_sgd_at_lr_1_is_parameter_averaging_every_period_steps(two):
    for result in two:  # not bitwise: global - (global - mean) rounds (measured 3.7e-9)
        assert max_abs_diff(result["averaging"]["diloco"], result["averaging"]["averaging"]) <= 1e-6


def test_bytes_are_the_broadcast_and_the_syncs_and_dense_is_every_gradient(two):
    for result in two:
        run = result["reference"]["minidp"]
        size = 4 * run["elements"]  # fp32 trainable parameters
        # one broadcast as local training starts, then one all-reduce of the parameters per sync
        assert run["stats"] == {"steps": STEPS, "bytes_sent": 3 * size, "bytes_dense": STEPS * size,
                                "ratio": 3 / STEPS}
        assert result["reference"]["plain"]["stats"]["bytes_dense"] == 0  # no hook, nothing to count it


def test_warmup_averages_gradients_then_syncs_every_period_local_steps(two):
    warm = [result["warmup"] for result in two]
    size = 4 * warm[0]["elements"]
    for run in warm:
        assert run["early_sync"] is False
        assert run["synced"] == [False, False, False, False, True, False, False, True]
        # 2 warm-up steps of gradients, the broadcast after them, 2 syncs
        assert run["stats"]["bytes_sent"] == 5 * size and run["stats"]["bytes_dense"] == STEPS * size
    assert bitwise_equal(warm[0]["after_warmup"], warm[1]["after_warmup"])


def test_resume_from_a_checkpoint_is_bitwise_the_uninterrupted_run(two):
    for result in two:
        resume = result["resume"]
        assert resume["same"] and resume["same_global"] and resume["stats"][0] == resume["stats"][1]
        assert resume["bad_shapes"][0] == "ValueError" and "global_params of shapes [(3,)]" in resume["bad_shapes"][1]


def _other_optimizer():
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)


def _linear_and_outer():
    linear = nn.Linear(2, 2)
    return linear, torch.optim.SGD(linear.parameters(), lr=1.0)


@pytest.mark.parametrize("make, error, words", [
    (lambda: comm.DiLoCo("model", _other_optimizer(), 2), TypeError, "model=str"),
    (lambda: comm.DiLoCo(nn.Linear(2, 2), "sgd", 2), TypeError, "outer_optimizer=str"),
    (lambda: comm.DiLoCo(*_linear_and_outer(), 0), ValueError, "period=0"),
    (lambda: comm.DiLoCo(*_linear_and_outer(), 2.0), TypeError, "period=2.0"),
    (lambda: comm.DiLoCo(*_linear_and_outer(), 2, warmup_steps=-1), ValueError, "warmup_steps=-1"),
    (lambda: comm.DiLoCo(*_linear_and_outer(), 2, process_group="world"), TypeError, "process_group='world'"),
    (lambda: comm.DiLoCo(nn.Linear(2, 2), _other_optimizer(), 2), ValueError,
     "outer_optimizer=SGD must be built over the model's trainable parameters: it holds 2 tensor(s) not of the "
     "model and misses 2 trainable one(s)"),
    (lambda: comm.DiLoCo(*_linear_and_outer(), 2), RuntimeError, "needs an initialised process group"),
])
def test_bad_arguments_are_refused_with_their_name_and_value(make, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        make()
