"""minidp.optim.LARS, LAMB and NovoGrad against the published formulas, written out plainly in float64."""
import copy

import pytest
import torch
from torch import nn

from minidp.train.optim import LAMB, LARS, NovoGrad, exclude_bias_and_norm
from training import max_abs_diff, train

F64 = torch.float64
TOL = 1e-12
STEPS = 6
LRS = [0.5, 0.5, 0.8, 1.2, 1.2, 0.3]  # lr changes mid-way: LARS keeps lr inside its momentum buffer


def lars_reference(w, grads, lrs, momentum, weight_decay, eta, eps, trust_ratio):
    """You, Gitman, Ginsburg 2017, Algorithm 1 (plus eps, and local lr 1 when a norm is 0)."""
    v = torch.zeros_like(w)
    for g, lr in zip(grads, lrs):
        w_norm, g_norm = w.norm().item(), g.norm().item()
        local_lr = 1.0
        if trust_ratio and w_norm > 0 and g_norm > 0:
            local_lr = eta * w_norm / (g_norm + weight_decay * w_norm + eps)
        v = momentum * v + lr * local_lr * (g + weight_decay * w)
        w = w - v
    return w


def lamb_reference(w, grads, lrs, betas, eps, weight_decay, trust_ratio, clamp=None, bias_correction=True):
    """You et al. 2019, Algorithm 2 (ratio 1 when a norm is 0)."""
    (b1, b2), m, v = betas, torch.zeros_like(w), torch.zeros_like(w)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = (m / (1 - b1 ** t), v / (1 - b2 ** t)) if bias_correction else (m, v)
        r = m_hat / (v_hat.sqrt() + eps) + weight_decay * w
        phi = w.norm().item() if clamp is None else min(max(w.norm().item(), clamp[0]), clamp[1])
        ratio = phi / r.norm().item() if trust_ratio and phi > 0 and r.norm().item() > 0 else 1.0
        w = w - lr * ratio * r
    return w


def novograd_reference(weights, grads, lr, betas, eps, decays, averaging=False):
    """Ginsburg et al. 2019, Algorithm 1, one step for a list of layers; `weights` and the state are plain lists.

    Returns the new weights; the state (v, m per layer) lives in `novograd_reference.state`, reset by the caller.
    """
    (b1, b2), state, new = betas, novograd_reference.state, []
    for i, (w, g, d) in enumerate(zip(weights, grads, decays)):
        norm_sq = float((g * g).sum())
        if i not in state:  # t = 1: v_1 = ||g_1||^2, m_1 = g_1 / sqrt(v_1) + d * w_1
            v = norm_sq
            m = g / (v ** 0.5 + eps) + d * w
        else:
            v_prev, m_prev = state[i]
            v = b2 * v_prev + (1 - b2) * norm_sq
            m = b1 * m_prev + (1 - b1 if averaging else 1.0) * (g / (v ** 0.5 + eps) + d * w)
        state[i] = (v, m)
        new.append(w - lr * m)
    return new


def _problem(seed):
    """Parameters (one of them all zeros) and their gradients for each step (one of them zero)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(4, 3, generator=gen, dtype=F64), torch.zeros(2, 2, dtype=F64),
              torch.randn(3, generator=gen, dtype=F64), torch.randn(5, generator=gen, dtype=F64)]
    grads = [[torch.randn(p.shape, generator=gen, dtype=F64) for p in params] for _ in range(STEPS)]
    grads[2][0].zero_()
    return params, grads


def _run(make_optimizer, params, grads):
    params = [nn.Parameter(p.clone()) for p in params]
    optimizer = make_optimizer([{"params": params[:2]},
                                {"params": params[2:], "weight_decay": 0.0, "trust_ratio": False}])
    for step_grads, lr in zip(grads, LRS):
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("seed", [0, 1])
def test_lars_matches_paper(seed):
    params, grads = _problem(seed)
    kw = dict(momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, eps=1e-9)
    ours = _run(lambda groups: LARS(groups, **kw), params, grads)
    reference = [
        lars_reference(p, [g[i] for g in grads], LRS, kw["momentum"], kw["weight_decay"] if i < 2 else 0.0,
                       kw["trust_coefficient"], kw["eps"], trust_ratio=i < 2)
        for i, p in enumerate(params)]
    assert max_abs_diff(ours, reference) <= TOL
    assert not torch.equal(ours[1], params[1])  # the all-zero tensor moved (local lr 1)


@pytest.mark.parametrize("clamp, bias_correction", [(None, True), ((0.5, 2.0), True), (None, False)])
def test_lamb_matches_paper(clamp, bias_correction):
    params, grads = _problem(2)
    kw = dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.02)
    ours = _run(lambda groups: LAMB(groups, weight_norm_clamp=clamp, bias_correction=bias_correction, **kw),
                params, grads)
    reference = [
        lamb_reference(p, [g[i] for g in grads], LRS, kw["betas"], kw["eps"], kw["weight_decay"] if i < 2 else 0.0,
                       trust_ratio=i < 2, clamp=clamp, bias_correction=bias_correction)
        for i, p in enumerate(params)]
    assert max_abs_diff(ours, reference) <= TOL


def _steps_like_torch(ours, theirs, seed=3):
    gen = torch.Generator().manual_seed(seed)
    a = nn.Parameter(torch.randn(6, 4, generator=gen, dtype=F64))
    b = nn.Parameter(a.detach().clone())
    opt_a, opt_b = ours([a]), theirs([b])
    for _ in range(STEPS):
        a.grad = torch.randn(a.shape, generator=gen, dtype=F64)
        b.grad = a.grad.clone()
        opt_a.step(), opt_b.step()
    return (a - b).abs().max().item()


def test_without_trust_ratio_they_are_torch_sgd_and_adamw():
    # At a constant lr, LARS without trust ratio is momentum SGD with L2 decay, LAMB is AdamW.
    lars = lambda p: LARS([{"params": p, "trust_ratio": False}], lr=0.1, momentum=0.9, weight_decay=0.01)  # noqa: E731
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)  # noqa: E731
    lamb = lambda p: LAMB([{"params": p, "trust_ratio": False}], lr=0.01, eps=1e-8, weight_decay=0.1)  # noqa: E731
    adamw = lambda p: torch.optim.AdamW(p, lr=0.01, eps=1e-8, weight_decay=0.1)  # noqa: E731
    assert _steps_like_torch(lars, sgd) <= TOL
    assert _steps_like_torch(lamb, adamw) <= TOL


def _train(make_optimizer, steps=60):
    """The loss at each of `steps` full-batch steps on a small regression task."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=gen)
    y = torch.sin(x @ torch.randn(8, 1, generator=gen))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = make_optimizer(exclude_bias_and_norm(model))
    return [loss.item() for loss in train(model, optimizer, [(x, y)] * steps)]


@pytest.mark.parametrize("make_optimizer", [
    lambda groups: LARS(groups, lr=0.5, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.02),
    lambda groups: LAMB(groups, lr=0.05, weight_decay=0.01),
    lambda groups: NovoGrad(groups, lr=0.03, weight_decay=1e-3),
], ids=["LARS", "LAMB", "NovoGrad"])
def test_trains_a_small_model(make_optimizer):
    losses = _train(make_optimizer)
    assert losses[-1] < 0.3 * losses[0], losses[::10]


def _novograd_model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


@pytest.mark.parametrize("weight_decay, averaging", [(0.0, False), (0.01, False), (0.01, True)])
def test_novograd_matches_paper_over_20_steps(weight_decay, averaging):
    # A model of several layers trained by NovoGrad and, from the same start and data, by the paper's
    # update written out above (its own gradients, its own weights): 20 steps, lr changing mid-way.
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=gen, dtype=F64), torch.randint(0, 3, (32,), generator=gen)
    ours, theirs = _novograd_model(), _novograd_model()
    groups = exclude_bias_and_norm(ours)  # decay on the three weight matrices only, as the examples do
    opt = NovoGrad(groups, lr=0.01, betas=(0.9, 0.98), eps=1e-8, weight_decay=weight_decay, grad_averaging=averaging)
    decays = [weight_decay if p.dim() > 1 else 0.0 for p in theirs.parameters()]
    novograd_reference.state = {}
    for step in range(20):
        lr = 0.01 if step < 10 else 0.004
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        nn.functional.cross_entropy(ours(x), y).backward()
        opt.step()
        theirs.zero_grad()
        nn.functional.cross_entropy(theirs(x), y).backward()
        params = list(theirs.parameters())
        new = novograd_reference([p.detach() for p in params], [p.grad for p in params], lr, (0.9, 0.98), 1e-8,
                                 decays, averaging)
        with torch.no_grad():
            for p, w in zip(params, new):
                p.copy_(w)
    assert max_abs_diff(list(ours.parameters()), list(theirs.parameters())) <= 1e-6
    assert max_abs_diff(list(ours.parameters()), list(_novograd_model().parameters())) > 1e-3  # it did train


def test_novograd_state_is_one_number_per_layer_and_a_zero_gradient_keeps_it_finite():
    w = nn.Parameter(torch.ones(3, 2))
    opt = NovoGrad([w], lr=0.1)
    w.grad = torch.zeros(3, 2)
    opt.step()
    assert opt.state[w]["exp_avg_sq"].shape == () and torch.equal(w, torch.ones(3, 2))
    w.grad = torch.full((3, 2), 2.0)
    opt.step()  # v = 0.98 * 0 + 0.02 * 24, m = 0.95 * 0 + g / sqrt(v)
    assert torch.allclose(w, torch.full((3, 2), 1 - 0.1 * 2.0 / (0.02 * 24) ** 0.5))


@pytest.mark.parametrize("cls", [LAMB, NovoGrad])
def test_closure_and_state_dict_round_trip(cls):
    params, grads = _problem(4)
    p = nn.Parameter(params[0].clone())
    opt = cls([p], lr=0.1)
    p.grad = grads[0][0].clone()
    assert opt.step(lambda: 3.0) == 3.0
    clone = copy.deepcopy(p)
    opt2 = cls([clone], lr=0.1)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as after torch.save/load: no shared tensors
    for q, o in ((p, opt), (clone, opt2)):
        q.grad = grads[1][0].clone()
        o.step()
    assert torch.equal(p, clone)


def test_exclude_bias_and_norm():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2, bias=False), nn.LayerNorm(2))
    regular, excluded = exclude_bias_and_norm(model)
    assert regular == {"params": [model[0].weight, model[2].weight]}
    assert excluded["params"] == [model[0].bias, model[1].weight, model[1].bias, model[3].weight, model[3].bias]
    assert excluded["weight_decay"] == 0.0 and excluded["trust_ratio"] is False
    assert len(exclude_bias_and_norm(nn.Linear(2, 2, bias=False))) == 1
    with pytest.raises(TypeError, match="expects an nn.Module, got list"):
        exclude_bias_and_norm([nn.Parameter(torch.ones(1))])


@pytest.mark.parametrize("cls, kwargs, error, match", [
    (LARS, dict(lr=-0.1), ValueError, r"LARS: lr=-0.1 must be >= 0"),
    (LARS, dict(lr="0.1"), TypeError, r"LARS: lr='0.1' must be a number"),
    (LARS, dict(momentum=1.0), ValueError, r"LARS: momentum=1.0 must be in \[0, 1\)"),
    (LARS, dict(momentum=-0.5), ValueError, r"LARS: momentum=-0.5 must be in \[0, 1\)"),
    (LARS, dict(eps=0.0), ValueError, r"LARS: eps=0.0 must be > 0"),
    (LARS, dict(weight_decay=-1e-4), ValueError, r"LARS: weight_decay=-0.0001 must be >= 0"),
    (LARS, dict(trust_coefficient=0), ValueError, r"LARS: trust_coefficient=0 must be > 0"),
    (LARS, dict(trust_coefficient=None), TypeError, r"LARS: trust_coefficient=None must be a number"),
    (LAMB, dict(lr=-1), ValueError, r"LAMB: lr=-1 must be >= 0"),
    (LAMB, dict(eps=-1e-6), ValueError, r"LAMB: eps=-1e-06 must be > 0"),
    (LAMB, dict(betas=(0.9, 1.0)), ValueError, r"LAMB: betas=\(0.9, 1.0\) must be two numbers in \[0, 1\)"),
    (LAMB, dict(betas=(-0.1, 0.9)), ValueError, r"LAMB: betas=\(-0.1, 0.9\) must be two numbers in \[0, 1\)"),
    (LAMB, dict(betas=(0.9, 0.99, 0.999)), ValueError, r"LAMB: betas=\(0.9, 0.99, 0.999\) must be a pair"),
    (LAMB, dict(betas=(0.9, "0.99")), TypeError, r"LAMB: betas\[1\]='0.99' must be a number"),
    (LAMB, dict(weight_decay=-0.01), ValueError, r"LAMB: weight_decay=-0.01 must be >= 0"),
    (LAMB, dict(weight_norm_clamp=(2.0, 1.0)), ValueError, r"weight_norm_clamp=\(2.0, 1.0\) must be \(low, high\)"),
    (LAMB, dict(weight_norm_clamp=1.0), TypeError, r"LAMB: weight_norm_clamp=1.0 must be a pair of numbers"),
    (LAMB, dict(bias_correction=1), TypeError, r"LAMB: bias_correction=1 must be True or False"),
    (NovoGrad, dict(lr=-0.01), ValueError, r"NovoGrad: lr=-0.01 must be >= 0"),
    (NovoGrad, dict(eps=0), ValueError, r"NovoGrad: eps=0 must be > 0"),
    (NovoGrad, dict(betas=(0.95, 1.5)), ValueError, r"NovoGrad: betas=\(0.95, 1.5\) must be two numbers in \[0, 1\)"),
    (NovoGrad, dict(betas=0.9), TypeError, r"NovoGrad: betas=0.9 must be a pair of numbers"),
    (NovoGrad, dict(weight_decay=-1), ValueError, r"NovoGrad: weight_decay=-1 must be >= 0"),
    (NovoGrad, dict(weight_decay="0"), TypeError, r"NovoGrad: weight_decay='0' must be a number"),
    (NovoGrad, dict(grad_averaging="yes"), TypeError, r"NovoGrad: grad_averaging='yes' must be True or False"),
])
def test_bad_input(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls([nn.Parameter(torch.ones(2))], **kwargs)


def test_bad_param_group():
    with pytest.raises(ValueError, match=r"LARS: momentum=2 must be in \[0, 1\)"):
        LARS([{"params": [nn.Parameter(torch.ones(2))], "momentum": 2}])
    with pytest.raises(TypeError, match=r"LAMB: trust_ratio='no' must be True or False"):
        LAMB([{"params": [nn.Parameter(torch.ones(2))], "trust_ratio": "no"}])
    with pytest.raises(ValueError, match=r"NovoGrad: betas=\(0.95, -0.5\) must be two numbers in \[0, 1\)"):
        NovoGrad([{"params": [nn.Parameter(torch.ones(2))], "betas": (0.95, -0.5)}])
