"""minidp.DDP behaviour beyond parity: bucket layout = DDP's, real overlap, errors instead of hangs."""
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.distributed import _MixedPrecision

import minidp
from harness import error_of, run_ranks
from models import MLP, build

# ---- bucket layout, as seen by a comm hook, equals torch DDP's ---------------------------------

LAYOUT_CASES = {
    "mlp_default_cap": (lambda: build("mlp"), {}),
    "wide_mlp_first_bucket_1MiB": (lambda: (torch.manual_seed(0), MLP(width=600))[1], {}),
    "wide_mlp_cap_1MiB": (lambda: (torch.manual_seed(0), MLP(width=600))[1], {"bucket_cap_mb": 1}),
    "mlp_small_cap": (lambda: build("mlp"), {"bucket_cap_mb": 0.002}),
    "mixed_dtypes_find_unused": (lambda: build("mixed"), {"bucket_cap_mb": 0.001, "find_unused_parameters": True}),
    "tied": (lambda: build("tied"), {"bucket_cap_mb": 0.0001}),
    "cap_zero_one_bucket_per_tensor": (lambda: build("mlp"), {"bucket_cap_mb": 0}),  # torch accepts 0
}


# Buckets per iteration (3 iterations, 2 ranks), as measured from torch DDP: one bucket in iteration 1
# unless find_unused_parameters (DDP's policy), then the rebuilt layout with its small first bucket.
EXPECTED_BUCKET_COUNTS = {
    "mlp_default_cap": [1, 1, 1],
    "wide_mlp_first_bucket_1MiB": [1, 2, 2],
    "wide_mlp_cap_1MiB": [1, 2, 2],
    "mlp_small_cap": [1, 2, 2],
    "mixed_dtypes_find_unused": [2, 2, 2],
    "tied": [1, 2, 2],
    "cap_zero_one_bucket_per_tensor": [1, 6, 6],
}


def _layouts(engine, make_model, kwargs):
    model = make_model()
    names = {id(p): n for n, p in model.named_parameters()}
    wrapped = engine(model, **kwargs)
    log = []

    def recording_hook(state, bucket):
        log[-1].append([names[id(p)] for p in bucket.parameters()])
        return default_hooks.allreduce_hook(state, bucket)

    wrapped.register_comm_hook(None, recording_hook)
    for _ in range(3):
        log.append([])
        x = torch.randn(4, 8)
        wrapped(x).sum().backward()
    return log


def _layout_worker():
    return {name: (_layouts(minidp.DDP, make, kw), _layouts(TorchDDP, make, kw))
            for name, (make, kw) in LAYOUT_CASES.items()}


# ---- overlap: proven by the order of recorded events --------------------------------------------

def _overlap_worker():
    model = minidp.DDP(build("mlp"), bucket_cap_mb=0.0005)  # three buckets once rebuilt
    for step in range(2):  # step 0 uses one bucket (DDP's policy); step 1 the rebuilt layout
        timeline = model.enable_timeline() if step == 1 else None
        model(torch.randn(4, 8)).sum().backward()
    return timeline.events, model.bucket_plan()


# ---- errors on every rank, within the timeout ---------------------------------------------------

def _unused_without_flag():
    model = minidp.DDP(build("unused"))  # `rare` and `never` get no gradient
    model(torch.randn(4, 8)).sum().backward()


def _error_worker():
    rank = dist.get_rank()
    errors = {
        "mismatch": error_of(lambda: minidp.DDP(MLP(width=32 if rank == 0 else 31))),
        "unused": error_of(_unused_without_flag),
        "bucket_cap_negative": error_of(lambda: minidp.DDP(build("mlp"), bucket_cap_mb=-5)),
        "no_trainable": error_of(lambda: minidp.DDP(build("mlp").requires_grad_(False))),
        "device_ids_on_cpu": error_of(lambda: minidp.DDP(build("mlp"), device_ids=[0])),
        "not_a_module": error_of(lambda: minidp.DDP(lambda x: x)),
        "lazy_module": error_of(lambda: minidp.DDP(torch.nn.Sequential(torch.nn.LazyLinear(3)))),
        "torch_syncbn_on_cpu": error_of(lambda: minidp.DDP(torch.nn.SyncBatchNorm.convert_sync_batchnorm(
            build("cnn_bn")))),
        "torch_syncbn_on_cpu_torch": error_of(lambda: TorchDDP(torch.nn.SyncBatchNorm.convert_sync_batchnorm(
            build("cnn_bn")))),
        "unsupported_kwarg": error_of(lambda: minidp.DDP(
            build("mlp"), find_unused_parameters=True, mixed_precision=_MixedPrecision(torch.bfloat16, torch.float32))),
    }
    # After all those errors the group still works: a clean model trains (nothing left half-done).
    ok = minidp.DDP(build("mlp"))
    ok(torch.randn(2, 8)).sum().backward()
    return errors


def _dropin_worker():
    """state_dict keys, accepted keywords, and a subgroup of the world."""
    model = build("cnn_bn")
    ours = minidp.DDP(model, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                      process_group=None, bucket_cap_mb=25, find_unused_parameters=False,
                      gradient_as_bucket_view=False, static_graph=True)
    theirs = TorchDDP(build("cnn_bn"))
    keys_equal = list(ours.state_dict()) == list(theirs.state_dict())
    subgroup = dist.new_group([0, 1])  # every rank must create it, members or not
    if dist.get_rank() == 2:
        return keys_equal, None
    results = []
    for engine in (minidp.DDP, TorchDDP):
        m = engine(build("mlp"), process_group=subgroup)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(3):
            torch.manual_seed(10 * step + dist.get_rank())
            m(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in m.parameters()])
    return keys_equal, all(torch.equal(a, b) for a, b in zip(*results))


def _early_write_back_worker():
    """Were the first buckets' gradients written back before the last bucket's reduction completed?

    A comm hook hands back every bucket reduced to 7s at once, but the last one's future only 0.3 s
    later, from a thread that first looks at the other buckets' `.grad` (3 steps: the buckets are
    rebuilt after the first). As torch's reducer, minidp writes each bucket back once it is reduced."""
    model = minidp.DDP(build("mlp"), bucket_cap_mb=0.002)
    first_buckets, seen = [], []

    def hook(state, bucket):
        future, reduced = torch.futures.Future(), torch.full_like(bucket.buffer(), 7.0)
        if not bucket.is_last():
            first_buckets.extend(bucket.parameters())
            future.set_result(reduced)
            return future

        def later():
            time.sleep(0.3)
            seen.append(all(p.grad is not None and bool((p.grad == 7).all()) for p in first_buckets))
            future.set_result(reduced)
        threading.Thread(target=later).start()
        return future

    model.register_comm_hook(None, hook)
    for _ in range(3):
        first_buckets.clear()
        model.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
    return seen, len(model.bucket_plan())


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_rank_checks, 2, timeout=300)


def _two_rank_checks():
    return {"layout": _layout_worker(), "overlap": _overlap_worker(), "errors": _error_worker(),
            "early write-back": _early_write_back_worker()}


def test_buckets_are_written_back_as_they_are_reduced(two_ranks):
    seen, buckets = two_ranks[0]["early write-back"]
    assert buckets > 1 and seen[-1] is True, (seen, buckets)


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_bucket_layout_equals_torch_ddp(two_ranks, case):
    ours, theirs = two_ranks[0]["layout"][case]
    assert ours == theirs
    assert [len(iteration) for iteration in ours] == EXPECTED_BUCKET_COUNTS[case]
    for iteration in ours:  # every parameter reduced once per iteration
        names = [name for bucket in iteration for name in bucket]
        assert len(names) == len(set(names)), iteration


def test_first_iteration_is_one_bucket_then_rebuilt_in_ready_order(two_ranks):
    ours, _ = two_ranks[0]["layout"]["mlp_small_cap"]
    assert len(ours[0]) == 1 and len(ours[1]) > 1
    # Rebuilt in the order gradients became ready: the last layer first.
    assert ours[1][0][0].startswith("net.4.")


def test_overlap_first_bucket_launched_before_last_gradient(two_ranks):
    events, plan = two_ranks[0]["overlap"]
    kinds = [kind for kind, _, _ in events]
    assert len(plan) == 3
    first_launch = kinds.index("launch")
    last_ready = len(kinds) - 1 - kinds[::-1].index("grad_ready")
    assert first_launch < last_ready, kinds
    for b in range(len(plan)):  # each bucket: launched after its last gradient, done after launch
        ready = [i for i, (k, _, f) in enumerate(events) if k == "grad_ready" and f["bucket"] == b]
        launch = [i for i, (k, _, f) in enumerate(events) if k == "launch" and f["bucket"] == b]
        done = [i for i, (k, _, f) in enumerate(events) if k == "done" and f["bucket"] == b]
        assert len(launch) == 1 and len(done) == 1 and max(ready) < launch[0] < done[0]
    assert kinds.index("backward_end") < kinds.index("finalize_end")


@pytest.mark.parametrize("case, error, words", [
    ("mismatch", "RuntimeError", ["ranks [1] differ from rank 0", "net.0.weight", "(31, 8)", "(32, 8)"]),
    ("unused", "RuntimeError", ["rare.weight", "never.bias", "find_unused_parameters=True"]),
    ("bucket_cap_negative", "ValueError", ["bucket_cap_mb=-5"]),
    ("no_trainable", "RuntimeError", ["no parameter that requires a gradient"]),
    ("device_ids_on_cpu", "ValueError", ["device_ids=[0]"]),
    ("not_a_module", "TypeError", ["module=function"]),
    ("lazy_module", "RuntimeError", ["uninitialized parameters", "dummy forward pass"]),  # torch DDP's words
    ("torch_syncbn_on_cpu", "ValueError", ["SyncBatchNorm layers only work with GPU modules",
                                           "minidp.convert_sync_batchnorm"]),
    ("torch_syncbn_on_cpu_torch", "ValueError", ["SyncBatchNorm layers only work with GPU modules"]),  # the same
    ("unsupported_kwarg", "ValueError", ["does not support mixed_precision with find_unused_parameters=True"]),
])
def test_errors_on_every_rank(two_ranks, case, error, words):
    for rank, result in enumerate(two_ranks):
        got = result["errors"][case]
        assert got is not None, f"rank {rank}: no error for {case}"
        assert got[0] == error, got
        for word in words:
            assert word in got[1], (rank, got)


# Constructor checks that need no process group: they raise before any collective, in this process.
NO_GROUP_CASES = [
    # "auto" is the one string (autotune): any other is a bad value, naming it.
    ("bucket_cap_mb_str", dict(bucket_cap_mb="25"), ValueError, ["bucket_cap_mb='25' must be a number", '"auto"']),
    ("bucket_cap_mb_auto_typo", dict(bucket_cap_mb="Auto"), ValueError, ["bucket_cap_mb='Auto'", '"auto"']),
    ("bucket_cap_mb_inf", dict(bucket_cap_mb=float("inf")), ValueError, ["bucket_cap_mb=inf must be finite"]),
    ("bucket_cap_mb_list", dict(bucket_cap_mb=[25]), TypeError, ["bucket_cap_mb=[25] must be a number"]),
    ("bucket_cap_mb_nan", dict(bucket_cap_mb=float("nan")), ValueError, ["bucket_cap_mb=nan must not be NaN"]),
    ("bucket_cap_mb_bool", dict(bucket_cap_mb=True), TypeError, ["bucket_cap_mb=True"]),
    ("flag_str", dict(find_unused_parameters="yes"), TypeError, ["find_unused_parameters='yes'", "True or False"]),
    ("flag_int", dict(broadcast_buffers=1), TypeError, ["broadcast_buffers=1"]),
    ("flag_none", dict(static_graph=None), TypeError, ["static_graph=None"]),
    ("debug_str", dict(debug="1"), TypeError, ["debug='1'"]),
    ("process_group_str", dict(process_group="world"), TypeError, ["process_group='world'"]),
]


@pytest.mark.parametrize("kwargs, error, words", [c[1:] for c in NO_GROUP_CASES], ids=[c[0] for c in NO_GROUP_CASES])
def test_bad_constructor_argument_is_named(kwargs, error, words):
    assert not dist.is_initialized()  # so these fail in the argument checks, not on a missing group
    with pytest.raises(error) as info:
        minidp.DDP(torch.nn.Linear(2, 2), **kwargs)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"  # not a subclass
    assert all(word in str(info.value) for word in words), str(info.value)


def test_comm_hook_must_be_callable():
    ddp = minidp.DDP.__new__(minidp.DDP)  # the check comes before any state is used
    with pytest.raises(TypeError, match="hook=42"):
        minidp.DDP.register_comm_hook(ddp, None, 42)


def test_dropin_state_dict_keys_kwargs_and_subgroup():
    results = run_ranks(_dropin_worker, 3, timeout=200)
    assert all(keys_equal for keys_equal, _ in results)
    assert results[0][1] is True and results[1][1] is True and results[2][1] is None


def _nccl_worker():
    minidp.init(backend="nccl", timeout=60)  # the suite sets MINIDP_BACKEND=gloo: ask for NCCL by name
    device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for engine in (minidp.DDP, TorchDDP):
        model = engine(build("cnn_bn").to(device), device_ids=[device.index])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(3)
        for _ in range(5):
            model(torch.randn(4, 3, 4, 4)).pow(2).mean().backward()  # inputs moved by device_ids
            opt.step()
            opt.zero_grad()
        results.append([p.detach().cpu() for p in model.parameters()])
    return dist.get_backend(), all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.gpu
def test_nccl_on_one_gpu_equals_torch_ddp():
    backend, equal = run_ranks(_nccl_worker, 1, init=False)[0]
    assert backend == "nccl" and equal
