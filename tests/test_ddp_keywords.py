"""torch DDP's later keywords, each bitwise against torch DDP: one launch per world size for all
cases.

Each case trains the same model under minidp.DDP and torch DDP with the same keywords and compares
what torch shows of its buckets (`_get_ddp_logging_data()`: the bucket sizes, the rebuilt layout),
which `.grad` are None after each step, the number of all-reduces (torch's profiler) and the final
weights (torch.equal). mixed_precision runs in torch DDP on an accelerator only: on the CPU it is
checked against the arithmetic written out (_mixed_reference), on a GPU against torch DDP.
"""
import inspect
import pickle
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile

import minidp
from harness import error_of, run_ranks
from models import MixedDtype
from training import bitwise_equal, rank_batches, snapshot, train

STEPS = 6


class Stack(nn.Module):
    """Four layers of different sizes (a few KiB each): small caps cut them into several buckets.
    `skip` leaves the last layer out of forward (an unused parameter on every rank)."""

    def __init__(self, skip=False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 64), nn.Linear(64, 48), nn.Linear(48, 32)
        self.d, self.e = nn.Linear(32, 4), nn.Linear(32, 4)
        self.skip = skip

    def forward(self, x):
        h = torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))
        return self.d(h) if self.skip else self.d(h) + self.e(h)


def _torch_layout(model) -> dict:
    """What torch DDP reports of its buckets: sizes in bytes and, once rebuilt, parameter
    indices."""
    data = model._get_ddp_logging_data()
    return {"sizes": data.get("bucket_sizes"),
            "rebuilt": data.get("rebuilt_per_bucket_param_indices"),
            "rebuilt_sizes": data.get("rebuilt_bucket_sizes")}


def _minidp_layout(model, initial) -> dict:
    """minidp's buckets in torch's report format (torch reports the initial sizes, then the
    rebuilt)."""
    sizes = {n: p.numel() * p.element_size() for n, p in model.module.named_parameters()}
    # the reducer's numbering: as torch's, less the ignored parameters
    index = {n: i for i, n in enumerate(model.reducer.names)}
    plan = model.bucket_plan()
    if plan == initial:
        rebuilt = rebuilt_sizes = None
    else:
        rebuilt = ", ".join(" ".join(str(index[n]) for n in b) for b in plan)
        rebuilt_sizes = ", ".join(str(sum(sizes[n] for n in b)) for b in plan)
    return {"sizes": ", ".join(str(sum(sizes[n] for n in b)) for b in initial),
            "rebuilt": rebuilt, "rebuilt_sizes": rebuilt_sizes}


def _run(engine, build, kwargs, steps=STEPS, accumulate=1):
    """Train `steps` steps: which .grad are None after each; then the layout and the weights.

    `kwargs` is the DDP keywords, or a function of the module that returns them."""
    torch.manual_seed(0)
    module = build()
    model = engine(module, **(kwargs(module) if callable(kwargs) else kwargs))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    initial = model.bucket_plan() if engine is minidp.DDP else None
    seen = []

    def record(step):
        seen.append([p.grad is None for p in model.module.parameters()])

    with profile(activities=[ProfilerActivity.CPU]) as prof:  # counts every c10d collective
        train(model, opt, rank_batches(steps * accumulate, dist.get_rank(), targets=(4, 4)),
              per_step=record, accumulate=accumulate)
    allreduces = sum(event.name == "c10d::allreduce_" for event in prof.events())
    # torch's report of the rebuilt buckets is updated by the forward after the rebuild: read at
    # the end
    layout = _minidp_layout(model, initial) if initial is not None else _torch_layout(model)
    return {"layout": layout, "nones": seen, "params": snapshot(model.module),
            "allreduces": allreduces}


CASES = {
    "cap_list": (Stack, dict(bucket_cap_mb_list=[0.002, 0.006, 0.003])),
    "cap_list_one": (Stack, dict(bucket_cap_mb_list=[0.012], bucket_cap_mb=3)),
    "cap_list_unused": (lambda: Stack(skip=True),
                        dict(bucket_cap_mb_list=[0.001, 0.01], find_unused_parameters=True)),
    "cap_list_static": (Stack, dict(bucket_cap_mb_list=[0.02, 0.005], static_graph=True)),
    # `e` unused on every rank; 0.0005 MiB puts e.weight with d.bias, e.bias in a bucket of its own
    "skip_unused": (lambda: Stack(skip=True),
                    dict(bucket_cap_mb=0.0005, find_unused_parameters=True,
                         skip_all_reduce_unused_params=True)),
    "no_skip_unused": (lambda: Stack(skip=True),
                       dict(bucket_cap_mb=0.0005, find_unused_parameters=True)),
    "skip_used": (Stack, dict(skip_all_reduce_unused_params=True)),  # nothing unused: no change
    # c's parameters averaged apart, when a.weight's gradient (the last computed) is
    "delayed": (Stack, lambda m: dict(delay_all_reduce_named_params=list(m.c.named_parameters("c")),
                                      param_to_hook_all_reduce=m.a.weight, bucket_cap_mb=0.01)),
    "delayed_no_sync": (Stack, lambda m: dict(delay_all_reduce_named_params=[("b.bias", m.b.bias)],
                                              param_to_hook_all_reduce=m.a.weight),
                        {"accumulate": 2}),
}


def _waited_all_reduce(tensor, *args, async_op=False, **kwargs):
    """dist.all_reduce, waited for at once. torch DDP's delayed all-reduce (its only Python one) is
    launched async and never waited for: under no_sync() the next backward accumulates into the
    buffer while it may still be reduced, so torch's own results vary from run to run. Waited for,
    they are what torch computes when that race is lost by nobody; minidp waits at the end of the
    backward, which gives the same values."""
    work = _ALL_REDUCE(tensor, *args, async_op=async_op, **kwargs)
    if async_op:
        work.wait()
    return work


_ALL_REDUCE = dist.all_reduce


def _torch_run(*args, **kwargs):
    with mock.patch.object(dist, "all_reduce", _waited_all_reduce):
        return _run(TorchDDP, *args, **kwargs)


class Scaled(Stack):
    """Stack with a float buffer in forward: mixed_precision casts it to buffer_dtype."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((32,), 0.5))

    def forward(self, x):
        h = torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))
        return self.d(h * self.scale) + self.e(h)


def _float_loss(model, batch):
    """The mean squared error, in float32 whatever the output's dtype."""
    x, y = batch
    return (model(x).float() - y).pow(2).mean()


MIXED = {  # name -> (param_dtype, reduce_dtype, buffer_dtype, micro-batches a step)
    "bf16_reduce_fp32": (torch.bfloat16, torch.float32, torch.bfloat16, 1),
    "bf16_reduce_bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16, 1),
    "fp16_no_sync": (torch.float16, torch.float32, torch.float16, 2),
}


def _mixed(dtypes, device="cpu"):
    """minidp.DDP(mixed_precision=...) for STEPS steps: final weights, dtypes of weights, grads,
    buffer."""
    from torch.nn.parallel.distributed import _MixedPrecision

    *config, accumulate = dtypes
    torch.manual_seed(0)
    model = minidp.DDP(Scaled().to(device), mixed_precision=_MixedPrecision(*config),
                       bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dtypes_seen = []
    batches = [tuple(t.to(device) for t in b)
               for b in rank_batches(STEPS * accumulate, dist.get_rank())]
    train(model, opt, batches, loss_fn=_float_loss, accumulate=accumulate,
          per_step=lambda step: dtypes_seen.append(
              {(p.dtype, p.grad.dtype) for p in model.parameters()}))
    return {"params": snapshot(model.module), "dtypes": dtypes_seen,
            "buffer": model.module.scale.dtype}


def _mixed_reference(dtypes):
    """What mixed precision computes, written out: fp32 masters; each micro-batch a param_dtype copy
    for forward and backward, its gradients summed in param_dtype; the sum cast to reduce_dtype,
    all-reduced (SUM) and divided by the world size there; cast up as the fp32 .grad; SGD."""
    param_dtype, reduce_dtype, buffer_dtype, accumulate = dtypes
    torch.manual_seed(0)
    module = Scaled()
    if buffer_dtype is not None:
        module.scale.data = module.scale.to(buffer_dtype)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    batches = rank_batches(STEPS * accumulate, dist.get_rank())
    for step in range(STEPS):
        summed = None
        for x, y in batches[step * accumulate:(step + 1) * accumulate]:
            low = {n: p.detach().to(param_dtype).requires_grad_()
                   for n, p in module.named_parameters()}
            out = torch.func.functional_call(module, {**low, "scale": module.scale},
                                             (x.to(param_dtype),))
            grads = torch.autograd.grad((out.float() - y).pow(2).mean(), list(low.values()))
            summed = list(grads) if summed is None else [a + g for a, g in zip(summed, grads)]
        for p, g in zip(module.parameters(), summed):
            reduced = g.to(reduce_dtype)
            dist.all_reduce(reduced)
            p.grad = reduced.div_(dist.get_world_size()).to(p.dtype)
        opt.step()
        opt.zero_grad()
    return snapshot(module)


LOGGED = {  # name -> (model, DDP keywords, sample rate or None, comm hook or None)
    "default": (Stack, {}, None, None),
    "static": (Stack, dict(static_graph=True, bucket_cap_mb=0.01), None, None),
    "skip": (lambda: Stack(skip=True), dict(bucket_cap_mb=0.0005, find_unused_parameters=True,
                                            skip_all_reduce_unused_params=True), None, None),
    "cap_list_rate3": (Stack, dict(bucket_cap_mb_list=[0.001, 0.002]), 3, None),
    # no rebuild: torch orders the leftover buckets of several dtypes by hash, minidp by first seen
    "two_dtypes": (MixedDtype, dict(find_unused_parameters=True), None, None),
    "hooked": (Stack, dict(bucket_cap_mb=0.01), None, "allreduce"),
    "builtin_hook": (Stack, {}, None, dist.BuiltinCommHookType.ALLREDUCE),
}
LOGGING_STEPS = 13


def _logged(engine, build, kwargs, rate, hook):
    """_get_ddp_logging_data() after construction, after registering a hook, after each step."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = engine(build(), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = [model._get_ddp_logging_data()]
    if rate is not None:
        model._set_ddp_runtime_logging_sample_rate(rate)
    if hook == "allreduce":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook is not None:
        model._register_builtin_comm_hook(hook)
    seen.append(model._get_ddp_logging_data())
    train(model, opt, rank_batches(LOGGING_STEPS, dist.get_rank(), targets=(4, 4)),
          per_step=lambda step: seen.append(model._get_ddp_logging_data()))
    return seen


def _worker():
    torch.set_num_threads(1)
    logged = {name: {"minidp": _logged(minidp.DDP, *case), "torch": _logged(TorchDDP, *case)}
              for name, case in LOGGED.items()}
    results = {name: {"minidp": _run(minidp.DDP, build, kwargs, **train_args),
                      "torch": _torch_run(build, kwargs, **train_args)}
               for name, (build, kwargs, *more) in CASES.items()
               for train_args in [more[0] if more else {}]}
    module = Stack()
    delayed = minidp.DDP(module, delay_all_reduce_named_params=[("b.bias", module.b.bias)],
                         param_to_hook_all_reduce=module.a.weight)
    results["pickle_delayed"] = error_of(pickle.dumps, delayed)
    results["logged"] = logged
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel.distributed import _MixedPrecision

    mixed = minidp.DDP(Stack(), mixed_precision=_MixedPrecision(torch.bfloat16, torch.float32))
    results["pickle_mixed"] = error_of(pickle.dumps, mixed)
    # torch raises here: it has its own
    mixed.register_comm_hook(None, default_hooks.allreduce_hook)
    results["hook_mixed"] = error_of(mixed, torch.randn(4, 8))
    results["mixed"] = {name: {"minidp": _mixed(dtypes), "reference": _mixed_reference(dtypes)}
                        for name, dtypes in MIXED.items()}
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def results(request):
    return run_ranks(_worker, request.param, timeout=240)


@pytest.mark.parametrize("case", list(CASES))
def test_buckets_and_weights_are_torch_ddps(results, case):
    """Layout, None grads, weights and all-reduce count as torch DDP's; with
    skip_all_reduce_unused_params the skipped bucket's all-reduce is not issued."""
    for rank_results in results:
        got, want = rank_results[case]["minidp"], rank_results[case]["torch"]
        assert got["layout"] == want["layout"]
        assert got["nones"] == want["nones"]
        assert bitwise_equal(got["params"], want["params"])
        assert got["allreduces"] == want["allreduces"]

    if case == "skip_unused":  # one all-reduce fewer a step than without the keyword
        plain = results[0]["no_skip_unused"]
        assert plain["minidp"]["allreduces"] == plain["torch"]["allreduces"]
        assert results[0][case]["minidp"]["allreduces"] == plain["minidp"]["allreduces"] - STEPS


_MIXED_PRECISION = torch.nn.parallel.distributed._MixedPrecision


@pytest.mark.parametrize("kwargs, error", [
    (dict(bucket_cap_mb_list="25"), TypeError), (dict(bucket_cap_mb_list=[1, -1]), ValueError),
    (dict(bucket_cap_mb_list=[float("inf")]), ValueError),
    (dict(bucket_cap_mb_list=[True]), TypeError),
    (dict(bucket_cap_mb_list=[1], bucket_cap_mb="auto"), ValueError),
    (dict(skip_all_reduce_unused_params="yes"), TypeError),
    (dict(mixed_precision="bf16"), TypeError),
    (dict(mixed_precision=_MIXED_PRECISION(torch.bfloat16)), ValueError),
    (dict(mixed_precision=_MIXED_PRECISION(torch.int8, torch.float32)), TypeError),
    (dict(skip_all_reduce_unused_params=True, static_graph=True), ValueError)])
def test_bad_keyword_values_are_refused_before_any_collective(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        # no process group here: it raises before one is needed
        minidp.DDP(nn.Linear(2, 2), **kwargs)


def _delay_errors(model):
    """What each wrong use of delay_all_reduce_named_params raises, before any collective."""
    named = list(model[0].named_parameters("0"))
    cases = {"alone": dict(delay_all_reduce_named_params=named),
             "hook_alone": dict(param_to_hook_all_reduce=model[1].weight),
             "wrong_name": dict(delay_all_reduce_named_params=[("1.weight", model[0].weight)],
                                param_to_hook_all_reduce=model[0].weight),
             "not_a_pair": dict(delay_all_reduce_named_params=[model[0].weight],
                                param_to_hook_all_reduce=model[0].weight),
             "foreign_hook": dict(delay_all_reduce_named_params=named,
                                  param_to_hook_all_reduce=nn.Parameter(torch.zeros(1))),
             "every_parameter": dict(delay_all_reduce_named_params=list(model.named_parameters()),
                                     param_to_hook_all_reduce=model[0].weight)}
    errors = {}
    for name, kwargs in cases.items():
        with pytest.raises((TypeError, ValueError)) as info:
            minidp.DDP(model, **kwargs)  # no process group here: it raises before one is needed
        errors[name] = (info.type.__name__, str(info.value))
    return errors


# What minidp reports of torch's logging data (the rest is torch's timings and process-group
# settings)
REPORTED = {"backend_name", "module_name", "device_ids", "dtypes", "bucket_sizes",
            "broadcast_buffers", "bucket_cap_bytes", "find_unused_parameters",
            "gradient_as_bucket_view", "has_sync_bn", "is_multi_device_module", "iteration",
            "num_parameter_tensors", "output_device", "rank", "world_size",
            "total_parameter_size_bytes", "master_addr", "master_port", "cuda_visible_devices",
            "torch_distributed_debug", "gloo_socket_ifname", "gloo_device_transport"}
SAMPLED = {"has_rebuilt_buckets", "num_buckets_reduced"}  # from the first sample on


@pytest.mark.parametrize("case", list(LOGGED))
def test_ddp_logging_data_has_torch_ddps_values(results, case):
    for rank_results in results:
        got, want = rank_results["logged"][case]["minidp"], rank_results["logged"][case]["torch"]
        assert len(got) == len(want) == LOGGING_STEPS + 2
        for when, (mine, torchs) in enumerate(zip(got, want)):
            assert REPORTED <= set(mine) and (SAMPLED <= set(mine) or when < 3)
            assert {k: torchs.get(k, "<absent>") for k in mine} == mine, f"after call/step {when}"
        assert got[-1]["iteration"] == want[-1]["iteration"] > 0
        if case != "default":  # the keys only some configurations have
            extra = {"static": "static_graph", "cap_list_rate3": "rebuilt_per_bucket_param_indices",
                     "hooked": "comm_hook", "builtin_hook": "comm_hook",
                     "skip": "num_buckets_reduced", "two_dtypes": "dtypes"}
            assert extra[case] in got[-1]


@pytest.mark.parametrize("case", list(MIXED))
def test_mixed_precision_is_the_written_out_reference(results, case):
    param_dtype, reduce_dtype, buffer_dtype, _ = MIXED[case]
    for rank_results in results:
        got = rank_results["mixed"][case]
        # at 2 ranks a sum does not depend on where it sits in a bucket
        if dist_world(results) == 2:
            assert bitwise_equal(got["minidp"]["params"], got["reference"])
        assert all(seen == {(torch.float32, torch.float32)} for seen in got["minidp"]["dtypes"])
        assert got["minidp"]["buffer"] == (buffer_dtype or torch.float32)
    assert bitwise_equal(results[0]["mixed"][case]["minidp"]["params"],
                         results[-1]["mixed"][case]["minidp"]["params"])


def dist_world(results):
    return len(results)


def _mixed_against_torch():
    """On a GPU, where torch DDP runs its mixed precision: minidp's and torch's weights after
    STEPS."""
    from torch.nn.parallel.distributed import _MixedPrecision

    out = {}
    for name, (*config, accumulate) in MIXED.items():
        weights = []
        for engine in (minidp.DDP, TorchDDP):
            torch.manual_seed(0)
            device = torch.device("cuda", torch.cuda.current_device())
            model = engine(Scaled().to(device), mixed_precision=_MixedPrecision(*config),
                           bucket_cap_mb=0.01)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            batches = [tuple(t.to(device) for t in b)
                       for b in rank_batches(STEPS * accumulate, dist.get_rank())]
            train(model, opt, batches, loss_fn=_float_loss, accumulate=accumulate)
            weights.append([w.cpu() for w in snapshot(model.module)])
        out[name] = weights
    return out


@pytest.mark.gpu
def test_mixed_precision_is_torch_ddps_on_a_gpu():
    for name, (mine, torchs) in run_ranks(_mixed_against_torch, 1, timeout=240)[0].items():
        assert bitwise_equal(mine, torchs), name


def test_a_wrapper_with_delayed_parameters_or_mixed_precision_is_not_pickled(results):
    assert results[0]["pickle_delayed"][0] == "RuntimeError"
    assert "delay_all_reduce_named_params cannot be pickled" in results[0]["pickle_delayed"][1]
    assert results[0]["pickle_mixed"][0] == "RuntimeError"
    assert "mixed_precision cannot be pickled" in results[0]["pickle_mixed"][1]


def test_mixed_precision_refuses_a_comm_hook_as_torch_does(results):
    assert results[0]["hook_mixed"][0] == "RuntimeError"
    assert "can only be called once" in results[0]["hook_mixed"][1]


def test_wrong_delay_all_reduce_keywords_are_refused_before_any_collective():
    errors = _delay_errors(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    both = ("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the "
            "same time.")
    assert errors["alone"] == ("ValueError", both) and errors["hook_alone"] == ("ValueError", both)
    assert errors["wrong_name"][0] == "ValueError"
    assert "'1.weight' is not the name" in errors["wrong_name"][1]
    assert errors["not_a_pair"][0] == "TypeError"
    assert "param_to_hook_all_reduce must be a parameter of the module" in errors["foreign_hook"][1]
    assert "naming every parameter" in errors["every_parameter"][1]


def test_the_engines_list_of_torch_ddp_keywords_is_the_installed_torchs():
    """minidp.DDP accepts torch DDP's keywords from a list of its own (the engine imports no torch
    DDP)."""
    from minidp.engine.arguments import TORCH_DDP_SIGNATURE
    torch_keywords = [k for k in inspect.signature(TorchDDP.__init__).parameters if k != "self"]
    assert list(TORCH_DDP_SIGNATURE) == torch_keywords
