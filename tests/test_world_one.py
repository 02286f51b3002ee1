"""World size 1: no communication and no copies on the default path, the rest of DDP's behaviour kept.

All cases run in one 1-rank launch. Bitwise parity with torch DDP at world size 1 for every parity
scenario is in test_ddp_parity.py (world1); here: what torch DDP computes at world size 1 is the local
gradient bit for bit, minidp issues no collective and keeps autograd's gradient tensors, and no_sync,
join, find_unused_parameters, gradient_as_bucket_view, comm hooks, debug mode and the timeline behave.
"""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import error_of, run_ranks
from models import build

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "broadcast_object_list", "reduce_scatter", "barrier")


class _CountCollectives:
    """Counts calls of torch.distributed's collectives (minidp calls them as dist.<name> at run time)."""

    def __enter__(self):
        self.calls, self.saved = [], {name: getattr(dist, name) for name in COLLECTIVES}
        for name, fn in self.saved.items():
            setattr(dist, name, lambda *a, _name=name, _fn=fn, **k: (self.calls.append(_name), _fn(*a, **k))[1])
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
        return False


def _step(model, x):
    model(x).pow(2).mean().backward()


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _autograd_places(module):
    """Record, per parameter, the gradient tensor autograd leaves (a hook registered before the engine's)."""
    places = {}
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda p: places.__setitem__(id(p), p.grad.data_ptr()))
    return places


def _default_path():
    """No collective at construction or in 3 steps; gradients where autograd put them, equal to local ones."""
    x = torch.randn(6, 3, 4, 4)
    local = build("cnn_bn")
    _step(local, x)
    module = build("cnn_bn")
    places = _autograd_places(module)
    with _CountCollectives() as counted:
        model = minidp.DDP(module)
        for _ in range(3):
            model.zero_grad()
            _step(model, x)
    theirs = TorchDDP(build("cnn_bn"))
    _step(theirs, x)
    return {"collectives": counted.calls, "buckets": len(model.reducer.layout.buckets),
            "in_place": all(p.grad.data_ptr() == places[id(p)] for p in module.parameters()),
            "minidp_equals_local": _equal(_grads(model), _grads(local)),
            "torch_ddp_equals_local": _equal(_grads(theirs), _grads(local))}


def _equal(a, b):
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def _hook_sees_every_bucket():
    """A comm hook registered at world size 1 is called for every bucket, as torch DDP calls it."""
    seen = {}
    for engine in (minidp.DDP, TorchDDP):
        model = engine(build("mlp"), bucket_cap_mb=0.0005)
        calls = seen[engine.__module__] = []

        def counting_hook(state, bucket, calls=calls):
            calls.append((len(calls), bucket.buffer().numel()))
            return default_hooks.allreduce_hook(state, bucket)
        model.register_comm_hook(None, counting_hook)
        for _ in range(3):
            calls.append("step")
            _step(model, torch.randn(4, 8))
    return seen["minidp.engine.ddp"], seen["torch.nn.parallel.distributed"]


def _behaviours():
    out = {"default_path": _default_path(), "hook": _hook_sees_every_bucket()}
    unused = minidp.DDP(build("unused"))
    out["unused_error"] = error_of(lambda: _step(unused, torch.randn(4, 8)))
    finder = minidp.DDP(build("unused"), find_unused_parameters=True)
    _step(finder, torch.randn(4, 8))
    out["unused_grads_none"] = [p.grad is None for p in finder.parameters()]
    model = minidp.DDP(build("mlp"), debug=True)
    timeline = model.enable_timeline()
    with model.join():
        for _ in range(2):
            with model.no_sync():
                _step(model, torch.randn(4, 8))
            _step(model, torch.randn(4, 8))
    out["timeline_kinds"] = sorted({kind for kind, _, _ in timeline.snapshot()})
    out["grad_ready_buckets"] = sorted({f["bucket"] for kind, _, f in timeline.snapshot() if kind == "grad_ready"})
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_behaviours, 1)[0]


def test_default_path_communicates_and_copies_nothing(results):
    r = results["default_path"]
    assert r["collectives"] == [] and r["buckets"] == 0
    assert r["in_place"], "a gradient moved: minidp copied it at world size 1"
    assert r["torch_ddp_equals_local"] and r["minidp_equals_local"]  # averaging over one rank: the identity


def test_comm_hook_is_called_for_every_bucket(results):
    ours, theirs = results["hook"]
    assert ours == theirs and len(theirs) > 3 + 3  # 1 bucket in step 1, then the rebuilt small buckets


def test_unused_parameters_still_raise_and_find_unused_keeps_none(results):
    kind, message = results["unused_error"]
    assert kind == "RuntimeError" and "rare.weight" in message and "find_unused_parameters=True" in message
    assert results["unused_grads_none"] == [False, False, True, True, True, True, False, False]


def test_join_no_sync_debug_and_timeline(results):
    # The timeline records what happens: gradients ready (with the bucket they would be in) and the
    # end of backward; nothing is launched, so there is no "launch" or "done".
    assert results["timeline_kinds"] == ["backward_end", "finalize_end", "grad_ready"]
    assert results["grad_ready_buckets"] == [0]
