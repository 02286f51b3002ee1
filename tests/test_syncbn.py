"""minidp.SyncBatchNorm against one process running torch BatchNorm on the concatenated batch.

torch.nn.SyncBatchNorm cannot be the reference on this machine: it accepts only GPU input and its
kernels (batch_norm_stats, ...) have no CPU implementation. Everything runs in float64, so the
comparisons are tight (TOL); tests/test_gpu.py compares with torch.nn.SyncBatchNorm itself.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minidp
import minidp.train.syncbn as syncbn
from harness import run_ranks
from minidp.train.syncbn import SyncBatchNorm, convert_sync_batchnorm

TOL = 1e-10
F64 = torch.float64
C = 3
_REF = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}

# (per-rank batch sizes, spatial dims after (N, C), momentum); None is the cumulative average.
CASES = {
    2: [([4, 4], (5, 3), 0.1), ([2, 5], (), None), ([3, 1], (4,), 0.3)],
    3: [([3, 3, 3], (2, 2, 2), 0.1), ([1, 4, 2], (5,), None), ([0, 3, 4], (3, 2), 0.1)],
}


def _reference(tail, momentum, gen):
    ref = _REF[len(tail) + 2](C, momentum=momentum, dtype=F64)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(C, generator=gen, dtype=F64))
        ref.bias.copy_(torch.randn(C, generator=gen, dtype=F64))
    return ref


class _CountAllReduce:
    """Record the size of every dist.all_reduce call made inside the block."""

    def __enter__(self):
        self.sizes, self.real = [], dist.all_reduce
        dist.all_reduce = lambda t, *a, **k: (self.sizes.append(t.numel()), self.real(t, *a, **k))[1]
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.real


def _max_diff(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


def _train_step(ours, ref, x, g, lo, hi, group=None):
    """One forward/backward of both; returns the all_reduce sizes and the max differences."""
    for m in (ours, ref):
        m.zero_grad()
    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    (y_ref * g).sum().backward()
    local = x[lo:hi].clone()
    if local.dim() == 4:
        local = local.to(memory_format=torch.channels_last)  # any memory layout works
    local.requires_grad_()
    with _CountAllReduce() as calls:
        y = ours(local)
        (y * g[lo:hi]).sum().backward()
    gw, gb = ours.weight.grad.clone(), ours.bias.grad.clone()
    if group is None or dist.get_rank(group) >= 0:  # -1: this rank is outside `group`
        dist.all_reduce(gw, group=group)  # ranks meet here: the sum of local grads is the full-batch grad
        dist.all_reduce(gb, group=group)  # ranks meet here
    return calls.sizes, {
        "output": _max_diff(y, y_ref[lo:hi]), "input grad": _max_diff(local.grad, xr.grad[lo:hi]),
        "weight grad": _max_diff(gw, ref.weight.grad), "bias grad": _max_diff(gb, ref.bias.grad),
        "running_mean": _max_diff(ours.running_mean, ref.running_mean),
        "running_var": _max_diff(ours.running_var, ref.running_var),
        "num_batches_tracked": abs(int(ours.num_batches_tracked) - int(ref.num_batches_tracked)),
    }


def _eval_without_collectives(ours, ref, x, lo, hi):
    """Eval forward on this rank alone, with every collective made to raise."""
    ours.eval(), ref.eval()
    saved = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast", "reduce")}

    def refuse(*args, **kwargs):
        raise AssertionError("SyncBatchNorm called a collective in eval mode")

    try:
        for name in saved:
            setattr(dist, name, refuse)
        return _max_diff(ours(x[lo:hi]), ref(x)[lo:hi])
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _run_case(sizes, tail, momentum, seed, group=None, group_rank=None):
    """Two training steps and one eval step; returns {quantity: max difference} and the calls."""
    rank = dist.get_rank() if group_rank is None else group_rank
    gen = torch.Generator().manual_seed(seed)
    ref = _reference(tail, momentum, gen)
    ours = convert_sync_batchnorm(copy.deepcopy(ref), process_group=group)
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    diffs, calls = {}, []
    for _ in range(2):
        x = torch.randn(sum(sizes), C, *tail, generator=gen, dtype=F64)
        g = torch.randn(x.shape, generator=gen, dtype=F64)
        step_calls, step_diffs = _train_step(ours, ref, x, g, lo, hi, group)
        calls.append(step_calls)
        diffs = {k: max(v, diffs.get(k, 0.0)) for k, v in step_diffs.items()}
    x = torch.randn(sum(sizes), C, *tail, generator=gen, dtype=F64)
    if dist.get_rank() == 0:  # the other ranks skip eval: a collective here would hang, then time out
        diffs["eval output"] = _eval_without_collectives(ours, ref, x, lo, hi)
    dist.barrier()  # ranks meet here
    return {"diffs": diffs, "calls": calls}


# ---- the CUDA path's plumbing on CPU: torch's fused kernels replaced by their formulas --------------
# torch.batch_norm_stats & co. have no CPU kernels. These follow the CUDA kernels' arithmetic (the
# gather merges ranks in order, as aten/src/ATen/native/cuda/Normalization.cuh does), so that the
# gather, the ordering of empty batches, the counts and the backward all-reduce are tested here;
# tests/test_gpu.py compares the real kernels with torch.nn.SyncBatchNorm.

def _dims(t):
    return [d for d in range(t.dim()) if d != 1]


def _view(t, like):
    return t.view(1, -1, *([1] * (like.dim() - 2)))


def _fake_stats(x, eps):
    return x.mean(_dims(x)), (x.var(_dims(x), unbiased=False) + eps).rsqrt()


def _fake_gather_stats(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    avg, var_n, n = torch.zeros_like(mean_all[0]), torch.zeros_like(mean_all[0]), 0
    for m, invstd, count in zip(mean_all, invstd_all, counts):
        factor = 1.0 / (n + count)  # inf for an empty batch merged first: the kernel's 0/0
        var_n = var_n + ((1 / invstd) ** 2 - eps) * count + (avg - m) ** 2 * n * count * factor
        avg, n = n * factor * avg + count * factor * m, n + count
    if running_mean is not None:
        running_mean.copy_((1 - momentum) * running_mean + momentum * avg)
        running_var.copy_((1 - momentum) * running_var + momentum * var_n / (n - 1))
    return avg, (var_n / n + eps).rsqrt()


def _fake_elemt(x, weight, bias, mean, invstd, eps):
    return (x - _view(mean, x)) * _view(invstd, x) * _view(weight, x) + _view(bias, x)


def _fake_backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    sum_dy, sum_dy_xmu = dy.sum(_dims(x)), (dy * (x - _view(mean, x))).sum(_dims(x))
    return sum_dy, sum_dy_xmu, sum_dy_xmu * invstd, sum_dy


def _fake_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, counts):
    total = counts.sum().to(dy.dtype)
    xmu_term = (x - _view(mean, x)) * _view(invstd * invstd * sum_dy_xmu / total, x)
    return (dy - _view(sum_dy / total, x) - xmu_term) * _view(invstd * weight, x)


def _fused_cases():
    """The CASES of world size 3, with SyncBatchNorm on the CUDA path's function (fake kernels)."""
    fakes = {"batch_norm_stats": _fake_stats, "batch_norm_gather_stats_with_counts": _fake_gather_stats,
             "batch_norm_elemt": _fake_elemt, "batch_norm_backward_reduce": _fake_backward_reduce,
             "batch_norm_backward_elemt": _fake_backward_elemt}
    saved = {name: getattr(torch, name) for name in fakes} | {"fn": syncbn._SyncBatchNormFn}
    try:
        for name, fake in fakes.items():
            setattr(torch, name, fake)
        syncbn._SyncBatchNormFn = syncbn._FusedSyncBatchNormFn  # what forward picks for CPU input
        return {f"fused sizes={sizes}": _run_case(sizes, (5,), 0.1, seed=i)
                for i, sizes in enumerate([[0, 3, 4], [3, 0, 4], [2, 2, 3]])}
    finally:
        syncbn._SyncBatchNormFn = saved.pop("fn")
        for name, fn in saved.items():
            setattr(torch, name, fn)


def _worker():
    world_size, results = dist.get_world_size(), {}
    for i, (sizes, tail, momentum) in enumerate(CASES[world_size]):
        results[f"sizes={sizes} tail={tail} momentum={momentum}"] = _run_case(sizes, tail, momentum, seed=i)
    if world_size == 3:
        results.update(_fused_cases())
    if world_size == 3:
        # process_group=: ranks 0 and 1 share statistics; rank 2 is outside and runs plain BatchNorm.
        group = dist.new_group([0, 1])  # ranks meet here (every rank creates every group)
        rank = dist.get_rank()
        if rank < 2:
            results["group [0, 1]"] = _run_case([2, 3], (4,), 0.1, seed=7, group=group)
        else:
            results["outside group"] = _run_case([5], (4,), 0.1, seed=8, group=group, group_rank=0)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_batchnorm_on_concatenated_batch(world_size):
    for rank, results in enumerate(run_ranks(_worker, world_size)):
        for case, result in results.items():
            bad = {k: v for k, v in result["diffs"].items() if not v <= TOL}  # NaN is bad too
            assert not bad, f"rank {rank}, {case}: {bad}"
            per_step = [2 * C] if case.startswith("fused") else [2 * C + 1, 2 * C]  # fused: all-gather, then this
            expected = [[] if case == "outside group" else per_step] * 2
            assert result["calls"] == expected, f"rank {rank}, {case}: all_reduce sizes {result['calls']}"
        assert all("eval output" in r["diffs"] for r in results.values()) == (rank == 0)


def test_without_process_group_is_plain_batchnorm():
    gen = torch.Generator().manual_seed(0)
    ref = _reference((4, 5), None, gen)
    ours = convert_sync_batchnorm(copy.deepcopy(ref))
    for training in (True, True, False):
        ours.train(training), ref.train(training)
        x = torch.randn(6, C, 4, 5, generator=gen, dtype=F64)
        assert torch.equal(ours(x), ref(x))
    assert torch.equal(ours.running_var, ref.running_var) and int(ours.num_batches_tracked) == 2


@pytest.mark.parametrize("affine", [True, False])
def test_autograd_function_passes_gradcheck(affine):
    # group=None: the same arithmetic as the synchronised path, without the collectives.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, C, 3, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(C, generator=gen, dtype=F64, requires_grad=True) if affine else None
    b = torch.randn(C, generator=gen, dtype=F64, requires_grad=True) if affine else None
    inputs = (x, w, b) if affine else (x,)

    def fn(x, w=None, b=None):
        return syncbn._SyncBatchNormFn.apply(x, w, b, None, None, 1e-5, 0.1, None)

    assert torch.autograd.gradcheck(fn, inputs)


def test_convert_shares_parameters_and_buffers():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=None),
                          nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4 * 9, affine=False)))
    model[1].weight.requires_grad_(False)
    model[1].running_mean.fill_(0.5)
    model.eval()
    keys, bn, conv = list(model.state_dict()), model[1], model[0]
    converted = convert_sync_batchnorm(model)
    assert converted is model and converted[0] is conv
    assert isinstance(converted[1], SyncBatchNorm) and isinstance(converted[2][1], SyncBatchNorm)
    new = converted[1]
    assert new.weight is bn.weight and not new.weight.requires_grad and new.bias is bn.bias
    assert new.running_mean is bn.running_mean and new.num_batches_tracked is bn.num_batches_tracked
    assert new.momentum is None and not new.training and converted[2][1].weight is None
    assert list(converted.state_dict()) == keys
    layer = nn.BatchNorm3d(2, eps=1e-3)
    single = SyncBatchNorm.convert_sync_batchnorm(layer, process_group=None)  # torch's spelling
    assert isinstance(single, SyncBatchNorm) and single is not layer and single.eps == 1e-3


def test_bad_input():
    with pytest.raises(ValueError, match="Linear is not a BatchNorm layer and contains none"):
        convert_sync_batchnorm(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="expects an nn.Module, got list"):
        convert_sync_batchnorm([nn.BatchNorm1d(2)])
    for kwargs, error, match in [
        (dict(num_features=0), ValueError, r"num_features=0 must be >= 1"),
        (dict(num_features=3.0), TypeError, r"num_features=3.0 must be an int"),
        (dict(num_features=3, eps=0.0), ValueError, r"eps=0.0 must be > 0"),
        (dict(num_features=3, eps="1e-5"), TypeError, r"eps='1e-5' must be a number"),
        (dict(num_features=3, eps=float("nan")), ValueError, r"eps=nan must not be NaN"),
        (dict(num_features=3, momentum=1.5), ValueError, r"momentum=1.5 must be <= 1"),
        (dict(num_features=3, momentum=-0.1), ValueError, r"momentum=-0.1 must be >= 0"),
        (dict(num_features=3, momentum="0.1"), TypeError, r"momentum='0.1' must be a number"),
    ]:
        with pytest.raises(error, match=match):
            SyncBatchNorm(**kwargs)
    assert SyncBatchNorm(3, momentum=None).momentum is None  # a cumulative average, as torch allows
    with pytest.raises(ValueError, match=r"at least 2 dims \(N, C, ...\), got shape \(3,\)"):
        SyncBatchNorm(3)(torch.randn(3))
    with pytest.raises(ValueError, match="got input with 4 channels"):
        SyncBatchNorm(3)(torch.randn(2, 4))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        syncbn._SyncBatchNormFn.apply(torch.randn(1, 3), None, None, None, None, 1e-5, 0.1, None)


def _small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1)).double()


def _ddp_worker():
    """minidp.DDP + SyncBatchNorm + LARS on 2 x 4 samples against one process on the 8 samples."""
    from minidp.train.optim import LARS, exclude_bias_and_norm

    rank, ref = dist.get_rank(), _small_model()
    ours = minidp.DDP(convert_sync_batchnorm(_small_model()))
    opts = [LARS(exclude_bias_and_norm(m), lr=0.5, trust_coefficient=0.02, weight_decay=1e-3)
            for m in (ref, ours.module)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=gen, dtype=F64), torch.randn(8, 1, generator=gen, dtype=F64)
        for model, opt, sl in ((ref, opts[0], slice(0, 8)), (ours, opts[1], slice(4 * rank, 4 * rank + 4))):
            opt.zero_grad()
            nn.functional.mse_loss(model(x[sl]), y[sl]).backward()  # DDP's mean of means = the full mean
            opt.step()
    pairs = zip(ref.state_dict().values(), ours.module.state_dict().values())
    return max(_max_diff(a.double(), b.double()) for a, b in pairs)


def test_with_ddp_and_lars_equals_one_process():
    assert max(run_ranks(_ddp_worker, 2)) <= TOL


def test_the_fused_all_gather_uses_torchs_current_name_without_a_warning(monkeypatch):
    """torch 2.14 deprecates dist.all_gather_into_tensor (a FutureWarning) for dist.all_gather_single."""
    import warnings

    from minidp.train import syncbn_autograd

    calls = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    if hasattr(dist, "all_gather_single"):
        monkeypatch.setattr(dist, "all_gather_single", lambda out, t, group=None: calls.append("single"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning from the old name fails the test
        out = syncbn_autograd._all_gather(torch.ones(3), group=object())
    assert out.shape == (2, 3) and calls == (["single"] if hasattr(dist, "all_gather_single") else [])
