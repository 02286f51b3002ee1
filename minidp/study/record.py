"""What explain runs on every rank: a few real steps under minidp, then under torch DDP, recorded.

minidp's side is read through its public API (bucket_plan(), enable_timeline()); torch DDP's through
a communication hook that notes, per bucket index, which parameters the bucket holds and when the
hook was called (its launch). Both engines see the same model (same seed), input and settings.
"""
from __future__ import annotations

import importlib
import os
import sys
import time

import torch
from torch import nn

from ..engine.ddp import DistributedDataParallel
from ..runtime.env import init, shutdown


def build_model(spec: str) -> nn.Module:
    """A torchvision model by name (random weights, nothing downloaded), or `module:factory`.

    Raises:
        ValueError: unknown torchvision name (with close matches), module or factory not found.
        TypeError: the factory returned something that is not an nn.Module.
    """
    if ":" in spec:
        module_name, _, factory_name = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"MODEL={spec!r}: cannot import module {module_name!r} ({e}); "
                             "is its folder on PYTHONPATH or the current directory?") from None
        factory = getattr(module, factory_name, None)
        if not callable(factory):
            raise ValueError(f"MODEL={spec!r}: module {module_name!r} has no callable "
                             f"{factory_name!r}")
        model = factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"MODEL={spec!r}: {factory_name}() returned {type(model).__name__}, "
                            "not an nn.Module")
        return model
    import torchvision

    names = torchvision.models.list_models()
    if spec not in names:
        import difflib

        close = difflib.get_close_matches(spec, names, n=4)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"MODEL={spec!r} is not a torchvision model.{hint} "
                         "Give a name from torchvision.models.list_models(), or module:factory")
    return torchvision.models.get_model(spec, weights=None)


def scalar_loss(output) -> torch.Tensor:
    """Mean square of every floating tensor in the output (tensors, tuples, lists, dicts)."""
    if isinstance(output, torch.Tensor):
        if not output.is_floating_point():
            return output.new_zeros((), dtype=torch.float)
        return output.float().pow(2).mean()
    parts = output.values() if isinstance(output, dict) else output
    losses = [scalar_loss(o) for o in parts if isinstance(o, (torch.Tensor, tuple, list, dict))]
    if not losses:
        raise TypeError(f"the model returned {type(output).__name__}: explain needs tensors to "
                        "backpropagate from")
    return sum(losses)


def make_input(batch: int, shape, rank: int) -> torch.Tensor:
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(1000 + rank))


def _seeded_model(cfg) -> nn.Module:
    torch.manual_seed(0)
    return build_model(cfg["model"])


def run_minidp(cfg, x, progress) -> dict:
    """Plans and timeline events of each step; the plan a step used is read after its forward."""
    model = DistributedDataParallel(_seeded_model(cfg), bucket_cap_mb=cfg["bucket_cap_mb"],
                       find_unused_parameters=cfg["find_unused"])
    if cfg.get("zero_overlap"):
        opt = _zero_stepping_in_backward(model, cfg["zero_overlap"])
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    plans, events = [], []
    for step in range(cfg["steps"]):
        timeline = model.enable_timeline()
        timeline.record("forward_start")
        loss = scalar_loss(model(x))
        plans.append(model.bucket_plan())  # after the forward: the rebuild happens there
        timeline.record("backward_start")
        loss.backward()
        if not cfg.get("zero_overlap"):  # else the step ran inside backward
            opt.step()
        opt.zero_grad()
        timeline.record("step_end")
        events.append(timeline.snapshot())
        progress(f"minidp step {step + 1}/{cfg['steps']}")
    model.disable_timeline()
    return {"plans": plans, "events": events}


def _zero_stepping_in_backward(model, variant: str):
    """ZeroRedundancyOptimizer(SGD, overlap_with_ddp=True), stepped inside backward from step 3 by
    hook_with_zero_step ("end": all buckets in the last bucket's hook) or its interleaved
    variant."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from ..sharded.zero import ZeroRedundancyOptimizer, overlap
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True,
                                   lr=1e-3)
    make_hook = (overlap.hook_with_zero_step_interleaved if variant == "interleaved"
                 else overlap.hook_with_zero_step)
    model.register_comm_hook(None, make_hook(allreduce_hook, model, zero))
    return zero


def run_torch_ddp(cfg, x, progress) -> dict:
    """Per step: the parameters of each bucket (by index) and when DDP called the hook for it.

    torch DDP here is the reference explain compares minidp with ("does torch DDP build the same
    buckets?"), imported only for that; minidp's engine never uses it.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    module = _seeded_model(cfg)
    names = {id(p): n for n, p in module.named_parameters()}
    model = TorchDDP(module, bucket_cap_mb=cfg["bucket_cap_mb"],
                     find_unused_parameters=cfg["find_unused"])
    steps = []

    def recording_hook(state, bucket):
        steps[-1]["buckets"][bucket.index()] = [names[id(p)] for p in bucket.parameters()]
        steps[-1]["launch"][bucket.index()] = time.perf_counter_ns()
        return default_hooks.allreduce_hook(state, bucket)  # ranks meet here (DDP's own all-reduce)

    model.register_comm_hook(None, recording_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(cfg["steps"]):
        steps.append({"buckets": {}, "launch": {}})
        loss = scalar_loss(model(x))
        steps[-1]["backward_start"] = time.perf_counter_ns()
        loss.backward()
        steps[-1]["backward_end"] = time.perf_counter_ns()
        opt.step()
        opt.zero_grad()
        progress(f"torch DDP step {step + 1}/{cfg['steps']}")
    for s in steps:
        s["plan"] = [s["buckets"][i] for i in sorted(s["buckets"])]
    return {"steps": steps}


def worker(local_rank: int, cfg: dict, out_dir: str) -> None:
    """One rank: minidp, then torch DDP, on the same input; results saved as rank<r>.pt."""
    torch.set_num_threads(cfg["threads"])
    sys.path[:0] = [p for p in cfg["sys_path"] if p not in sys.path]  # for module:factory models
    env = init(backend="gloo", timeout=cfg["timeout"])

    def progress(text):
        if env.rank == 0:
            print(f"explain: {text}", file=sys.stderr, flush=True)

    x = make_input(cfg["batch"], cfg["input_shape"], env.rank)
    result = {"minidp": run_minidp(cfg, x, progress), "ddp": run_torch_ddp(cfg, x, progress)}
    torch.save(result, os.path.join(out_dir, f"rank{env.rank}.pt"))
    shutdown()
