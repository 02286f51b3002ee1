"""minidp.DDP as a drop-in for torch DDP: the comm-hook contract's errors, pickling, deepcopy.

Side by side with torch DDP in the same processes: where torch raises, minidp raises the same
exception type (with a message that names the hook and what was wrong).
"""
import copy
import inspect
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import done, error_of, run_ranks
from models import build
from training import bitwise_equal, mean_square, snapshot, train

# ---- the comm-hook contract ---------------------------------------------------------------------


def torch_typed(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return default_hooks.allreduce_hook(state, bucket)


def minidp_typed(state, bucket: minidp.hooks.GradBucket) -> torch.futures.Future:
    return default_hooks.allreduce_hook(state, bucket)


def string_typed(state, bucket: "dist.GradBucket") -> "torch.futures.Future[torch.Tensor]":
    return default_hooks.allreduce_hook(state, bucket)


def other_names(process_group, grads):  # torch looks the annotation up by the name `bucket` (KeyError)
    return default_hooks.allreduce_hook(process_group, grads)


def bucket_is_int(state, bucket: int):
    return done(bucket.buffer())


def returns_int(state, bucket) -> int:
    return done(bucket.buffer())


def returns_tensor(state, bucket):
    return bucket.buffer()


def returns_none(state, bucket):  # torch DDP crashes the process (segfault): minidp only
    return None


def too_short(state, bucket):
    return done(bucket.buffer()[:-1].clone())


def value_is_int(state, bucket):
    return done(3)


def value_is_double(state, bucket):  # torch copies it into the float buffer: the same gradients
    return done(bucket.buffer().double() / dist.get_world_size())


def _outcome(fn, *args):
    """fn(*args)'s result, or harness.error_of's (exception type name, message) of what it raised."""
    result = []
    return error_of(lambda: result.append(fn(*args))) or result[0]


def _register_and_step(engine, hook, twice=False):
    model = engine(build("mlp"))
    model.register_comm_hook(None, hook)
    if twice:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    model(torch.randn(4, 8)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


HOOK_CASES = {  # name: (hook, register twice, also run under torch DDP)
    "not_callable": (42, False, True),
    "bucket_annotated_int": (bucket_is_int, False, True),
    "returns_annotated_int": (returns_int, False, True),
    "registered_twice": (default_hooks.allreduce_hook, True, True),
    "returns_tensor": (returns_tensor, False, True),
    "returns_none": (returns_none, False, False),
    "value_too_short": (too_short, False, True),
    "value_is_int": (value_is_int, False, True),
    "value_is_double": (value_is_double, False, True),
    "torch_typed": (torch_typed, False, True),
    "minidp_typed": (minidp_typed, False, False),
    "string_typed": (string_typed, False, False),
    "other_names": (other_names, False, False),
}


def _logged_error(engine):
    """_get_ddp_logging_data()'s error keys after a call whose error torch DDP logs (a bad sample rate)."""
    model = engine(build("mlp"))
    error_of(model._set_ddp_runtime_logging_sample_rate, 0)
    data = model._get_ddp_logging_data()
    return data.get("has_error"), data.get("error")


def _logged_hook_errors(engine):
    """The logging data's error after a hook refused at registration, and after a second registration."""
    logged = []
    for hooks in ([returns_int], [default_hooks.allreduce_hook, default_hooks.allreduce_hook]):
        model = engine(build("mlp"))
        for hook in hooks:
            error_of(model.register_comm_hook, None, hook)
        data = model._get_ddp_logging_data()
        logged.append((data.get("has_error"), data.get("error")))
    return logged


def _hook_worker():
    out = {label: _logged_error(engine) for label, engine in (("minidp", minidp.DDP), ("torch", TorchDDP))}
    out["hook_logged"] = {label: _logged_hook_errors(engine) for label, engine in (("minidp", minidp.DDP),
                                                                                   ("torch", TorchDDP))}
    for name, (hook, twice, with_torch) in HOOK_CASES.items():
        engines = {"minidp": minidp.DDP, "torch": TorchDDP} if with_torch else {"minidp": minidp.DDP}
        for label, engine in engines.items():
            torch.manual_seed(dist.get_rank())
            out[name, label] = _outcome(_register_and_step, engine, hook, twice)
    return out


def test_comm_hook_contract_errors_as_torch_ddp():
    results = run_ranks(_hook_worker, 2, timeout=200)
    for res in results:  # an error torch DDP logs (_log_and_throw) is in the logging data, as torch's
        assert res["minidp"] == res["torch"] == (
            1, "<class 'ValueError'>: DDP runtime logging sample rate should be equal or greater than 1")
        # a refused hook is logged too (torch's test_ddp_invalid_comm_hook_return_type reads it); minidp's
        # message starts with torch's sentence and then names the hook
        for (ours, our_error), (theirs, their_error) in zip(*res["hook_logged"].values()):
            assert ours == theirs == 1 and our_error.startswith(their_error.split(" minidp")[0]), (our_error,
                                                                                                  their_error)
        for name, (_, _, with_torch) in HOOK_CASES.items():
            ours = res[name, "minidp"]
            if with_torch:  # the same outcome: the same exception type, or gradients bitwise equal
                theirs = res[name, "torch"]
                if isinstance(theirs, tuple):
                    assert isinstance(ours, tuple) and ours[0] == theirs[0], (name, ours, theirs)
                else:
                    assert isinstance(ours, list), (name, ours)
                    assert bitwise_equal(ours, theirs), name
        expected = {
            # Each message starts with torch DDP's own sentence (torch's test_c10d_gloo.py matches on it).
            "not_callable": ("TypeError", ["Communication hook must be callable.", "hook=42"]),
            "bucket_annotated_int": ("ValueError", ["Communication hook: bucket annotation should be "
                                                    "dist.GradBucket.", "bucket_is_int", "'bucket'", "int"]),
            "returns_annotated_int": ("ValueError", ["Communication hook: return annotation should be "
                                                     "torch.futures.Future[torch.Tensor].", "returns_int", "int"]),
            "registered_twice": ("RuntimeError", ["register_comm_hook or register_builtin_comm_hook can only be "
                                                  "called once.", "allreduce_hook"]),
            "returns_tensor": ("RuntimeError", ["callback must return a torch.futures.Future object, but got",
                                                "returns_tensor", "Tensor"]),
            "returns_none": ("RuntimeError", ["callback must return a torch.futures.Future object, but got",
                                              "returns_none", "NoneType"]),
            "value_too_short": ("RuntimeError", ["too_short", "1476 elements", "shape (1475,)"]),
            "value_is_int": ("RuntimeError", ["value_is_int", "int: 3"]),
        }
        for name, (error, words) in expected.items():
            got = res[name, "minidp"]
            assert isinstance(got, tuple) and got[0] == error, (name, got)
            for word in words:
                assert word in got[1], (name, word, got[1])
            if name not in ("value_too_short", "value_is_int"):  # torch's sentence comes first
                assert got[1].startswith(words[0]), (name, got[1])
        for name in ("torch_typed", "minidp_typed", "string_typed", "other_names", "value_is_double"):
            assert isinstance(res[name, "minidp"], list), (name, res[name, "minidp"])


# ---- pickling (torch.save(model)) and deepcopy, as torch DDP ------------------------------------

SAVED_AT, STEPS = 3, 6
ENGINES = {"minidp": minidp.DDP, "torch": TorchDDP}


def _step(model, opt, step):
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())  # each rank its own shard
    model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _sgd(model, state=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if state is not None:
        opt.load_state_dict(state)
    return opt


def _save_worker(folder):
    """Save each engine's model before any step and after SAVED_AT steps; train on unsaved and deep copies."""
    out = {}
    for label, engine in ENGINES.items():
        kwargs = {"bucket_cap_mb": 0.002}  # several buckets, rebuilt after the first iteration
        for hooked in (False, True):
            model = engine(build("mlp", seed=dist.get_rank()), **kwargs)  # different weights: rank 0's win
            if hooked:
                model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            name = f"{label}{'_fp16' if hooked else ''}"
            torch.save(model, os.path.join(folder, f"{name}_fresh_{dist.get_rank()}.pt"))
            opt = _sgd(model)
            for step in range(SAVED_AT):
                _step(model, opt, step)
            torch.save({"model": model, "opt": opt.state_dict()},
                       os.path.join(folder, f"{name}_trained_{dist.get_rank()}.pt"))
            twin = copy.deepcopy(model)
            twin_opt = _sgd(twin, copy.deepcopy(opt.state_dict()))
            for step in range(SAVED_AT, STEPS):
                _step(model, opt, step)
                _step(twin, twin_opt, step)
            out[name, "unsaved"], out[name, "deepcopy"] = snapshot(model), snapshot(twin)
        subgroup = dist.new_group([0, 1])  # not the default group: neither engine pickles it
        out[label, "subgroup"] = _outcome(torch.save, engine(build("mlp"), process_group=subgroup),
                                          os.path.join(folder, f"never_{dist.get_rank()}.pt"))
    return out


def _load_worker(folder):
    """In a fresh process group (new processes): load each saved model and train on to STEPS."""
    out = {}
    for name in ("minidp", "minidp_fp16", "torch", "torch_fp16"):
        model = torch.load(os.path.join(folder, f"{name}_fresh_{dist.get_rank()}.pt"), weights_only=False)
        opt = _sgd(model)
        for step in range(STEPS):
            _step(model, opt, step)
        out[name, "loaded_fresh"] = snapshot(model)
        saved = torch.load(os.path.join(folder, f"{name}_trained_{dist.get_rank()}.pt"), weights_only=False)
        model, opt = saved["model"], _sgd(saved["model"], saved["opt"])
        for step in range(SAVED_AT, STEPS):
            _step(model, opt, step)
        out[name, "loaded_trained"] = snapshot(model)
    return out


def test_pickled_model_trains_on_in_a_fresh_process_group_as_torch_ddp(tmp_path):
    saved = run_ranks(_save_worker, 2, str(tmp_path), timeout=200)
    loaded = run_ranks(_load_worker, 2, str(tmp_path), timeout=200)
    for before, after in zip(saved, loaded):
        for name in ("minidp", "minidp_fp16", "torch"):
            unsaved = before[name, "unsaved"]
            for copy_kind in ("deepcopy", "loaded_fresh", "loaded_trained"):
                got = before.get((name, copy_kind)) or after[name, copy_kind]
                assert bitwise_equal(got, unsaved), (name, copy_kind)
        assert bitwise_equal(before["minidp", "unsaved"], before["torch", "unsaved"])
        # torch DDP drops a registered comm hook from the reducer it rebuilds on load; minidp keeps it.
        assert not bitwise_equal(after["torch_fp16", "loaded_trained"], before["torch_fp16", "unsaved"])
        for label in ENGINES:
            error = before[label, "subgroup"]
            assert isinstance(error, tuple) and error[0] == "RuntimeError", (label, error)
        assert "default process group" in before["minidp", "subgroup"][1]


# ---- the rest of torch DDP's public surface: attributes, buffers at init, ignored parameters ------

class _RankLocal(nn.Module):
    """A Linear and BatchNorm, plus a buffer that holds this rank's number (e.g. a per-rank RNG offset)."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(6, 4), nn.BatchNorm1d(4)
        self.register_buffer("mine", torch.full((2,), float(dist.get_rank())))

    def forward(self, x):
        return self.bn(self.lin(x))


def _plain(obj):
    """Containers as they are, tensors as (device, values): comparable with ==."""
    if isinstance(obj, torch.Tensor):
        return "tensor", str(obj.device), obj.tolist()
    if isinstance(obj, dict):
        return type(obj).__name__, {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj).__name__, [_plain(v) for v in obj]
    return obj


def _helpers(model):
    """torch DDP's to_kwargs / scatter / gather, called as old scripts call them (results or errors)."""
    x, y = torch.arange(4.0).reshape(2, 2), torch.ones(3)
    return {"to_kwargs": _plain(model.to_kwargs((x, [y]), {"k": y}, 0)),
            "to_kwargs_args_only": _plain(model.to_kwargs((x,), {}, 0)),
            "to_kwargs_kwargs_only": _plain(model.to_kwargs((), {"k": y}, 0)),
            "to_kwargs_empty": _plain(model.to_kwargs((), {}, 0)),
            "scatter": _plain(_outcome(model.scatter, (x,), {"k": y}, [0])),
            "scatter_none": _plain(_outcome(model.scatter, (x,), {}, None)),
            "gather": _plain(_outcome(model.gather, [x, x], "cpu"))}


def _sgd_steps(model, steps: int, seed: int, shape: tuple) -> torch.Generator:
    """`steps` SGD steps on this rank's own random batches; returns their generator, to draw more."""
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    batches = [torch.randn(*shape, generator=gen) for _ in range(steps)]
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, mean_square)
    return gen


def _surface(engine, ignore=(), mesh=False, **kwargs):
    """What a script may read or rely on after DDP(module, **kwargs), then after two steps."""
    torch.manual_seed(dist.get_rank())  # every rank starts from different weights
    module = _RankLocal()
    if ignore:
        engine._set_params_and_buffers_to_ignore_for_model(module, list(ignore))
    if mesh:  # DDP(module, device_mesh=a 1-D mesh over the world)
        kwargs["device_mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
    model = engine(module, **kwargs)
    state_at_init = {k: v.clone() for k, v in module.state_dict().items()}
    seen = {"bucket_bytes_cap": model.bucket_bytes_cap, "device": model.device, "device_type": model.device_type,
            "parameters_to_ignore": set(model.parameters_to_ignore), "sync": model.will_sync_module_buffers(),
            "group_is_world": model.process_group is dist.group.WORLD,
            "group_ranks": dist.get_process_group_ranks(model.process_group), **_helpers(model),
            "mixed_precision": model.mixed_precision, "is_multi_device_module": model.is_multi_device_module,
            "skip_all_reduce_unused_params": model.skip_all_reduce_unused_params,
            "bucket_bytes_cap_default": model.bucket_bytes_cap_default,
            "named_module_buffers": list(model.named_module_buffers),
            "modules_buffers": [b is dict(module.named_buffers())[n] for n, b in model.named_module_buffers.items()],
            "modules_buffers_list": [id(b) for b in model.modules_buffers] == [id(b) for b in
                                                                                model.named_module_buffers.values()]}
    gen = _sgd_steps(model, 2, seed=10, shape=(5, 6))
    with model.no_sync():
        model(torch.randn(5, 6, generator=gen))
    seen["sync_after_no_sync"] = model.will_sync_module_buffers()
    return seen, state_at_init, {k: v.clone() for k, v in module.state_dict().items()}


def _surface_worker(cases):
    return {(label, name): _surface(engine, **case)
            for name, case in cases.items() for label, engine in ENGINES.items()}


SURFACE_CASES = {
    "default": {},
    "broadcast_buffers_off": {"broadcast_buffers": False},  # buffers stay each rank's, at init too
    "cap_5": {"bucket_cap_mb": 5},
    "ignored": {"ignore": ("lin.bias", "mine")},  # neither broadcast nor averaged: stays each rank's own
    "device_mesh": {"mesh": True},
}
if "forward_sync_buffers" in inspect.signature(TorchDDP.__init__).parameters:  # torch >= 2.14
    SURFACE_CASES["forward_sync_off"] = {"forward_sync_buffers": False}  # synced at init, not in forward
    SURFACE_CASES["batched_grad_copy"] = {"batched_grad_copy": True}


def test_public_surface_buffers_at_init_and_ignored_parameters_as_torch_ddp():
    results = run_ranks(_surface_worker, 2, SURFACE_CASES, timeout=200)
    for name in SURFACE_CASES:
        for rank, result in enumerate(results):
            ours, theirs = result["minidp", name], result["torch", name]
            assert ours[0] == theirs[0], (name, rank)
            for at in (1, 2):  # the state after construction, and after training
                assert ours[at].keys() == theirs[at].keys()
                for key in theirs[at]:
                    assert torch.equal(ours[at][key], theirs[at][key]), (name, rank, at, key)
    # The cases did what they claim: without broadcast_buffers (and for an ignored buffer) each
    # rank keeps its own buffer; an ignored parameter is neither broadcast nor averaged.
    for name in ("broadcast_buffers_off", "ignored"):
        assert [r["torch", name][1]["mine"][0].item() for r in results] == [0.0, 1.0], name
    assert [r["torch", "default"][1]["mine"][0].item() for r in results] == [0.0, 0.0]
    bias = [r["torch", "ignored"][2]["lin.bias"] for r in results]
    assert not torch.equal(bias[0], bias[1])


def _mesh_errors_worker():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    square = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("a", "b"))
    cases = {"both": dict(process_group=dist.group.WORLD, device_mesh=mesh), "two_d": dict(device_mesh=square)}
    return {(label, name): _outcome(lambda e, c: e(nn.Linear(2, 2), **c) and "built", engine, case)
            for name, case in cases.items() for label, engine in ENGINES.items()}


def test_device_mesh_errors_as_torch_ddp():
    out = run_ranks(_mesh_errors_worker, 2)[0]
    for name in ("both", "two_d"):
        assert out["minidp", name] == out["torch", name] and out["torch", name][0] == "RuntimeError", out
    assert "Only 1D device mesh" in out["torch", "two_d"][1]


# ---- torch DDP's built-in (C++) comm hooks, registered by type ---------------------------------------

def _builtin_hook_worker():
    out = {}
    for hook_type in (dist.BuiltinCommHookType.ALLREDUCE, dist.BuiltinCommHookType.FP16_COMPRESS):
        params = {}
        for label, engine in ENGINES.items():
            torch.manual_seed(0)
            model = engine(build("mlp"), bucket_cap_mb=0.001)  # several buckets
            model._register_builtin_comm_hook(hook_type)
            _sgd_steps(model, 4, seed=1, shape=(8, 8))
            params[label] = torch.cat([p.detach().flatten() for p in model.parameters()])
        out[hook_type.name] = torch.equal(params["minidp"], params["torch"])
    out["bad_type"] = _outcome(minidp.DDP(nn.Linear(2, 2))._register_builtin_comm_hook, "ALLREDUCE")
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_builtin_comm_hooks_bitwise_as_torch_ddp(world_size):
    for out in run_ranks(_builtin_hook_worker, world_size, timeout=200):
        assert out["ALLREDUCE"] and out["FP16_COMPRESS"], out
        assert out["bad_type"][0] == "TypeError" and "comm_hook_type='ALLREDUCE'" in out["bad_type"][1]


# ---- training-loop shapes seen in real scripts ------------------------------------------------------

class _KeywordsOnly(nn.Module):
    """forward(*, x, scale) returning a tuple with a None and a string in it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, *, x, scale=1.0):
        return self.b(torch.relu(self.a(x))) * scale, None, "tag"


def _loop(engine, shape):
    torch.manual_seed(0)
    model = engine(_KeywordsOnly() if shape == "keyword_inputs_tuple_output" else build("mlp"), bucket_cap_mb=0.001)
    second = engine(build("mlp"), bucket_cap_mb=0.002) if shape == "two_models" else None
    if shape == "comm_hook_and_no_sync":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    params = list(model.parameters()) + (list(second.parameters()) if second else [])
    opt = torch.optim.SGD(params, lr=0.05)
    scaler = torch.amp.GradScaler("cpu")  # enabled: scales the loss, unscales before the step
    gen = torch.Generator().manual_seed(dist.get_rank())
    for step in range(6):
        x = torch.randn(4, 8, generator=gen)
        if shape == "bf16_autocast_grad_scaler":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            continue
        if shape == "comm_hook_and_no_sync" and step % 2 == 0:
            with model.no_sync():  # accumulate locally every other step
                model(x).square().mean().backward()
            continue
        if shape == "keyword_inputs_tuple_output":
            loss = model(x=x, scale=2.0)[0].square().mean()
        elif shape == "two_forwards_one_backward":
            loss = model(x).square().mean() + model(x * 2).square().mean()
        elif shape == "forward_without_backward":
            model(x * 3)  # e.g. a logging forward with grad enabled; its graph is dropped
            loss = model(x).square().mean()
        elif shape == "two_models":
            loss = model(x).square().mean() + second(x).square().mean()
        elif shape == "eval_under_no_grad":  # a validation forward between steps
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
            loss = model(x).square().mean()
        else:  # "comm_hook_and_no_sync", a synced step
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in params])


LOOP_SHAPES = ("two_forwards_one_backward", "forward_without_backward", "two_models", "eval_under_no_grad",
               "bf16_autocast_grad_scaler", "comm_hook_and_no_sync", "keyword_inputs_tuple_output")


def _loops_worker():
    return {shape: torch.equal(_loop(minidp.DDP, shape), _loop(TorchDDP, shape)) for shape in LOOP_SHAPES}


def test_training_loop_shapes_bitwise_as_torch_ddp():
    for out in run_ranks(_loops_worker, 3, timeout=200):  # 3 ranks: the bucket layouts must agree too
        assert out == dict.fromkeys(LOOP_SHAPES, True), out
