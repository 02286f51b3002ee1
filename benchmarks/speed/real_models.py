"""Real models, engine against engine: minidp's DDP, ZeRO and fully_shard beside torch's, step by step.

    python benchmarks/speed/real_models.py                         # world sizes 2 and 4, CPU/gloo (long)
    python benchmarks/speed/real_models.py --world-sizes 2 --models resnet50 --pairs ddp zero
    python benchmarks/speed/real_models.py --quick                 # tiny inputs, narrow models (seconds)
    python benchmarks/speed/real_models.py --device cuda           # the same table on GPUs (NCCL)

Models: torchvision's resnet50 (SGD, momentum 0.9) and vit_b_16 (AdamW), and GPT-2 124M in nanoGPT's
shape (gpt2.py beside this file; AdamW). On CPU the inputs are cut (--image, --seq, --batch; the table's
header says which); ViT-B/16 keeps 224x224 (its position embedding is for 14x14 patches). --quick uses
narrow versions (ResNet-50's layout at base width 8, one bottleneck a stage; ViT and GPT-2 with 2 layers,
width 32) on tiny inputs.

Pairs (torch's engine first, minidp's second), each in the same processes, taking turns every step (a
barrier before each step, the order flipped every step, so drift of a shared machine hits both alike):
  ddp           torch DDP vs minidp.DDP, default keywords
  ddp_gbv       both with gradient_as_bucket_view=True
  ddp_static    both with static_graph=True
  ddp_compile   torch.compile of each DDP (only with --compile: minutes of compilation per model on CPU)
  zero          DDP + ZeroRedundancyOptimizer, each engine's own, plain step()
  zero_hook     the step inside backward: torch's ddp_zero_hook.hook_with_zero_step (its gloo refusal
                bypassed, as tests/test_zero_overlap.py does) vs minidp.hooks.hook_with_zero_step, both
                around torch's allreduce_hook, ZeRO built with overlap_with_ddp=True
  fsdp          torch FSDP2 fully_shard vs minidp.fully_shard, one unit per block (ResNet bottleneck, ViT
                encoder layer, GPT-2 block) then the root, reshard_after_forward=True
  fsdp_keep     the same with reshard_after_forward=False
For each pair: --runs runs of --steps timed steps per engine (the first after --warmup untimed steps);
a run's median per engine; the ratio minidp/torch of each run's medians; printed: the median of the run
ratios and their min-max (the spread). Collectives and bytes: one profiled step per engine (torch's
profiler records every c10d collective, whoever issued it); "MB" is the collectives' payload (the
tensor each collective is given, all-gather: its output, reduce-scatter: its input; not ring-scaled).
Memory, rank 0: "held" = bytes of the engine's parameters (local shards), gradients and optimizer state
after a step, each storage once (shared/rank_memory.py), beside "pred" = predict_peak's weights +
gradients + optimizer (DDP, ZeRO-1: its partition of whole tensors; fully_shard: predict_memory's ZeRO-3
row, what both reshard settings hold between steps); "peak" = held + the rise of the process's peak
during one step of that engine (CPU: VmHWM after resetting it via /proc/self/clear_refs, less VmRSS
before; GPU: max_memory_allocated less memory_allocated) beside predict_peak's "total" (which leaves out
activations: the rise has them). On CPU "peak" is a lower bound: the rise is 0 where malloc reuses
memory freed earlier in the process (both engines' earlier steps), and buffers an engine keeps between
steps outside its parameters, gradients and optimizer (torch DDP's C++ buckets when
gradient_as_bucket_view=False) are in neither figure (the prediction counts them). torch's profiler
records no allocations under profile_all_threads, which the collective count needs.
Load: /proc/loadavg's 1-minute figure when a pair starts and ends.
Controls: --control puts torch's engine on both sides (the "minidp" column is a second torch engine, built
second), so its ratio is the harness's own bias on that model and world size; --minidp-first builds
minidp's engine before torch's (the default builds torch's first). --split-backward times each backward's
tail, from its last gradient to its end (the wait for the collectives, and the write-back).

The JSON goes to runs/real_models/ (ignored) unless --json says where; --results-md FILE writes the
table into FILE's section (the only way this script changes a tracked file).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.join(ROOT, "benchmarks", "shared")]
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop lines (step_cost.py says why)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from collective_tally import tally  # noqa: E402  (shared/)
from rank_memory import launch_json, storage_bytes  # noqa: E402  (shared/)
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import minidp  # noqa: E402
from minidp.study.memory_model import predict_memory, predict_peak  # noqa: E402

MODELS = ("resnet50", "vit_b_16", "gpt2")
PAIRS = ("ddp", "ddp_gbv", "ddp_static", "ddp_compile", "zero", "zero_hook", "fsdp", "fsdp_keep")
DEFAULT_PAIRS = tuple(p for p in PAIRS if p != "ddp_compile")
SIDES = ("torch", "minidp")
COLUMNS = ("model", "N", "pair", "torch_ms", "minidp_ms", "ratio", "ratio_min", "ratio_max",
           "colls_torch", "colls_minidp", "mb_torch", "mb_minidp", "held_torch", "held_minidp", "held_pred",
           "peak_torch", "peak_minidp", "peak_pred", "load_start", "load_end")
STAGE = {"ddp": "DDP", "ddp_gbv": "DDP", "ddp_static": "DDP", "ddp_compile": "DDP", "zero": "ZeRO-1",
         "zero_hook": "ZeRO-1", "fsdp": "ZeRO-3", "fsdp_keep": "ZeRO-2"}
ALL_THREADS = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)


# ----------------------------------------------------------------------------- models and batches
def narrow_resnet50(width: int, classes: int) -> nn.Module:
    """ResNet-50's stem, bottlenecks and head at base `width`, one bottleneck a stage (--quick)."""
    from torchvision.models.resnet import Bottleneck, ResNet

    model = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=classes)
    model.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
    model.bn1, model.inplanes = nn.BatchNorm2d(width), width
    for i, mult in enumerate((1, 2, 4, 8), start=1):
        setattr(model, f"layer{i}", model._make_layer(Bottleneck, width * mult, 1, stride=1 if i == 1 else 2))
    model.fc = nn.Linear(8 * width * Bottleneck.expansion, classes)
    return model


def build(name: str, cfg: dict) -> nn.Module:
    """A fresh model, seeded (every rank and both engines start equal)."""
    import torchvision

    torch.manual_seed(0)
    quick = cfg["quick"]
    if name == "resnet50":
        return narrow_resnet50(8, 10) if quick else torchvision.models.resnet50()
    if name == "vit_b_16":
        if quick:
            from torchvision.models.vision_transformer import VisionTransformer
            return VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32,
                                     mlp_dim=64, num_classes=10)
        return torchvision.models.vit_b_16()
    if name == "gpt2":
        import gpt2
        return gpt2.GPT(256, 16, 2, 2, 32) if quick else gpt2.GPT()
    raise ValueError(f"model={name!r} must be one of {MODELS}")


def blocks(name: str, model: nn.Module) -> list:
    """The per-block units for fully_shard, in forward order."""
    if name == "resnet50":
        return [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]
    if name == "vit_b_16":
        return list(model.encoder.layers)
    return list(model.blocks)


def batch(name: str, cfg: dict, rank: int, device) -> tuple:
    """A fixed random batch per rank: (input, target)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    b = cfg["batch"][name]
    if name == "gpt2":
        vocab = 256 if cfg["quick"] else 50304
        x = torch.randint(0, vocab, (b, cfg["seq"]), generator=gen)
        y = torch.randint(0, vocab, (b, cfg["seq"]), generator=gen)
    else:
        size = cfg["image"] if name == "resnet50" else (32 if cfg["quick"] else 224)
        x = torch.randn(b, 3, size, size, generator=gen)
        y = torch.randint(0, 10 if cfg["quick"] else 1000, (b,), generator=gen)
    return x.to(device), y.to(device)


def optimizer_of(name: str, choice: str = "default"):
    """(class, keywords): SGD+momentum for ResNet-50, AdamW for the transformers; choice "sgd":
    plain SGD for every model (no state: GPT-2's DDP pairs fit 4 ranks in 23 GiB)."""
    if choice == "sgd":
        return torch.optim.SGD, {"lr": 1e-3}
    if name == "resnet50":
        return torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 1e-4}


def loss_of(out, y):
    if out.dim() == 3:  # GPT-2's logits (B, T, V)
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.cross_entropy(out, y)


# ----------------------------------------------------------------------------- the engines of a pair
def torch_zero_hook(model, zero):
    """torch's hook_with_zero_step, past its gloo refusal (its only backend check; tests/test_zero_overlap.py)."""
    with mock.patch.object(ddp_zero_hook.dist, "get_backend", lambda group=None: "nccl"):
        return ddp_zero_hook.hook_with_zero_step(allreduce_hook, model, zero)


def make(pair: str, side: str, name: str, cfg: dict, device, mesh):
    """(model, optimizer, step_in_backward) of one side of a pair, on a fresh seeded model.
    `side` names the table's column; cfg["engine_of"] which engine fills it (--control: torch's in both)."""
    side = cfg.get("engine_of", {}).get(side, side)
    net = build(name, cfg).to(device)
    opt_cls, opt_kw = optimizer_of(name, cfg.get("optimizer", "default"))
    ids = {"device_ids": [device.index]} if device.type == "cuda" else {}
    ddp = TorchDDP if side == "torch" else minidp.DDP
    if pair.startswith("ddp"):
        kw = {"ddp_gbv": {"gradient_as_bucket_view": True}, "ddp_static": {"static_graph": True}}.get(pair, {})
        model = ddp(net, **ids, **kw)
        if pair == "ddp_compile":
            model = torch.compile(model)
        return model, opt_cls(model.parameters(), **opt_kw), False
    if pair.startswith("zero"):
        zero_cls = TorchZero if side == "torch" else minidp.ZeroRedundancyOptimizer
        model = ddp(net, **ids)
        hooked = pair == "zero_hook"
        zero = zero_cls(net.parameters(), opt_cls, overlap_with_ddp=hooked, **opt_kw)
        if hooked:
            hook = torch_zero_hook(model, zero) if side == "torch" else minidp.hooks.hook_with_zero_step(
                allreduce_hook, model, zero)
            model.register_comm_hook(None, hook)
        return model, zero, hooked
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = torch_fully_shard if side == "torch" else minidp.fully_shard
    reshard = pair == "fsdp"
    for block in blocks(name, net):
        shard(block, mesh=mesh, reshard_after_forward=reshard)
    shard(net, mesh=mesh, reshard_after_forward=reshard)
    return net, opt_cls(net.parameters(), **opt_kw), False


def step(engine, x, y) -> None:
    """One training step, untimed: zero_grad, forward, backward, step (inside backward for zero_hook).
    timed_step's, without its device syncs."""
    timed_step(engine, x, y, torch.device("cpu"))


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PHASES = ("forward", "backward", "tail", "step", "gc", "cpu", "faults")
LAST_GRAD = [0.0]  # when the last gradient of this backward arrived (--split-backward's hooks write it)
IN_GC = {"since": 0.0, "total": 0.0}  # seconds this process has spent in Python's garbage collector


def time_the_collector(phase: str, _info: dict) -> None:
    """gc.callbacks' hook: add each collection's wall time to IN_GC. A Python engine makes objects in
    every step (a C++ one does not), and each few hundred of them set off a collection, which may walk
    every object of the process: time that belongs to no phase of either engine in particular."""
    if phase == "start":
        IN_GC["since"] = time.perf_counter()
    else:
        IN_GC["total"] += time.perf_counter() - IN_GC["since"]


def mark_gradient_arrivals(model) -> None:
    """--split-backward: a hook on every parameter notes when its gradient is accumulated, so a step's
    backward splits into computing (until the last gradient) and its tail (the wait for collectives
    and their write-back). The hooks are Python on both sides, so both engines pay them alike. Where
    each runs: for torch DDP before its reducer's hook (a C++ hook on the accumulator node, after the
    tensor's), for minidp after its own (registered first), so torch's tail holds its last gradient's
    copy into the bucket and minidp's does not: the split flatters minidp's tail by that copy."""
    def note(_param):
        LAST_GRAD[0] = time.perf_counter()
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(note)


def timed_step(engine, x, y, device) -> dict:
    """One training step, timed: wall seconds of forward (with zero_grad), backward (with the wait for
    its collectives; `tail`: its part after the last gradient, with --split-backward, else 0) and the
    optimizer step, the seconds of it spent in Python's garbage collector (in any phase), the process's CPU
    seconds (all its threads: the collectives' too; a rank whose wall time rises while its CPU time does
    not is waiting), and its minor page faults (first touches of
    memory the allocator got fresh from the OS)."""
    model, opt, in_backward = engine
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu, in_gc, start = time.process_time(), IN_GC["total"], time.perf_counter()
    opt.zero_grad()
    loss = loss_of(model(x), y)
    synchronize(device)
    forward = time.perf_counter()
    LAST_GRAD[0] = 0.0
    loss.backward()
    synchronize(device)
    backward = time.perf_counter()
    tail = backward - LAST_GRAD[0] if LAST_GRAD[0] > forward else 0.0  # 0: not split
    if not in_backward:
        opt.step()
    synchronize(device)
    end = time.perf_counter()
    return {"wall": end - start, "forward": forward - start, "backward": backward - forward, "tail": tail,
            "step": end - backward, "gc": IN_GC["total"] - in_gc, "cpu": time.process_time() - cpu,
            "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 1e3}


# ----------------------------------------------------------------------------- what is measured
def alternate(engines: dict, x, y, cfg: dict, device) -> dict:
    """Per run: each side's step times; the sides take turns every step, the order flipped each step."""
    runs, sequence = [], []
    for _ in range(cfg["warmup"]):
        for side in SIDES:
            step(engines[side], x, y)
    phases = {side: {phase: [] for phase in PHASES} for side in SIDES}
    for r in range(cfg["runs"]):
        times = {side: [] for side in SIDES}
        for i in range(cfg["steps"]):
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                dist.barrier()  # ranks meet here: each timed step starts together
                synchronize(device)
                took = timed_step(engines[side], x, y, device)
                times[side].append(took["wall"])
                for phase in PHASES:
                    phases[side][phase].append(took[phase])
                if r == 0:
                    sequence.append(side[0])
        runs.append({side: 1e3 * statistics.median(t) for side, t in times.items()})
    # each phase's median over every timed step (the phases' medians need not add up to the step's),
    # the collector's mean (a collection comes every few steps: its median is 0); times in ms, faults
    # a count (timed_step gives thousands, as it gives seconds)
    medians = {side: {phase: 1e3 * (statistics.mean if phase == "gc" else statistics.median)(v)
                      for phase, v in per.items()} for side, per in phases.items()}
    # every rank's CPU ms a step (rank 0's phases alone cannot tell a rank doing more work from cores
    # left idle while ranks wait: on a machine with fewer cores than ranks, the two differ)
    cpu_by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(cpu_by_rank, {side: medians[side]["cpu"] for side in SIDES})  # ranks meet here
    return {"runs": runs, "sequence": "".join(sequence), "phases": medians,
            "cpu_by_rank": {side: [c[side] for c in cpu_by_rank] for side in SIDES}}


def collectives(engine, x, y) -> dict:
    """{count, bytes} of the c10d collectives of one step (zero_bytes.py's count, payload not ring-scaled)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, experimental_config=ALL_THREADS) as prof:
        step(engine, x, y)
    whole, gloo, count = tally(prof.events())
    if "c10d::allreduce_" in whole and not whole["c10d::allreduce_"]:  # tensor lists record no shapes
        whole["c10d::allreduce_"] = gloo["gloo:all_reduce"] - whole.get("c10d::_reduce_scatter_base_", 0)
    if "c10d::broadcast_" in whole and not whole["c10d::broadcast_"]:
        whole["c10d::broadcast_"] = gloo["gloo:broadcast"]
    return {"count": count, "bytes": 4 * sum(whole.values()), "by_op": whole}


def top_ops(engine, x, y, device, steps: int) -> str:
    """torch.profiler's table of `steps` steps (this rank's thread), the ops with most self CPU time first."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            dist.barrier()  # ranks meet here: the profiled steps start together
            step(engine, x, y)
            synchronize(device)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50)


def held_bytes(engine) -> int:
    """Parameters (local shards), gradients and optimizer state of this rank, each storage once."""
    model, opt, _ = engine
    local_opt = getattr(opt, "optim", opt)  # ZeRO's local optimizer holds this rank's state
    seen, params = set(), list(model.parameters())
    state = [v for s in local_opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return storage_bytes(params, seen) + storage_bytes([p.grad for p in params], seen) + storage_bytes(state, seen)


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return float("nan")


def step_rise(engine, x, y, device) -> float:
    """Bytes the process's peak rises above its level before one step (see the module docstring)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step(engine, x, y)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to VmRSS (Linux >= 4.0)
    before = _status("VmRSS:")
    step(engine, x, y)
    return _status("VmHWM:") - before


def predicted(pair: str, name: str, net: nn.Module, n: int, optimizer: str = "default") -> dict:
    """predict_peak for the pair's stage: fp32 weights and gradients; SGD momentum k=4, AdamW k=8,
    plain SGD (--optimizer sgd) k=0."""
    k = 0 if optimizer == "sgd" else 4 if name == "resnet50" else 8
    if pair.startswith("fsdp"):
        in_blocks = {id(p) for b in blocks(name, net) for p in b.parameters()}
        units = [[p.numel() for p in net.parameters() if id(p) not in in_blocks]]
        units += [[p.numel() for p in b.parameters()] for b in blocks(name, net)]
    else:
        units = [[p.numel() for p in net.parameters()]]
    p = predict_peak(units, n, STAGE[pair], k=k, weight_bytes=4, grad_bytes=4,
                     bucket_views=pair == "ddp_gbv")
    held = p["weights"] + p["gradients"] + p["optimizer"]  # DDP, ZeRO-1: the same all the step
    if pair.startswith("fsdp"):  # after the step both reshard settings hold ZeRO-3's shards
        held = predict_memory(sum(map(sum, units)), n, k=k, weight_bytes=4, grad_bytes=4)[3]["total"]
    return {"held": held, "peak": p["total"]}


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run_pair(pair: str, name: str, cfg: dict, rank: int, device, mesh) -> dict:
    """Both sides of one pair on one model: times, collectives, memory (rank 0's)."""
    load_start = loadavg()
    x, y = batch(name, cfg, rank, device)
    with warnings.catch_warnings():  # ZeRO's and FSDP2's notices, once per rank and pair
        warnings.simplefilter("ignore")
        built = {side: make(pair, side, name, cfg, device, mesh) for side in cfg.get("build_order", SIDES)}
        engines = {side: built[side] for side in SIDES}
        if cfg.get("split_backward"):
            for side in SIDES:
                mark_gradient_arrivals(engines[side][0])
    timing = alternate(engines, x, y, cfg, device)
    colls = {side: collectives(engines[side], x, y) for side in SIDES}
    held = {side: held_bytes(engines[side]) for side in SIDES}
    rise = {side: step_rise(engines[side], x, y, device) for side in SIDES}
    pred = predicted(pair, name, build(name, cfg), dist.get_world_size(), cfg.get("optimizer", "default"))
    ratios = [r["minidp"] / r["torch"] for r in timing["runs"]]
    mib = 2.0 ** 20
    row = {"model": name, "N": dist.get_world_size(), "pair": pair,
           "torch_ms": statistics.median(r["torch"] for r in timing["runs"]),
           "minidp_ms": statistics.median(r["minidp"] for r in timing["runs"]),
           "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "load_start": load_start, "load_end": loadavg(), "held_pred": pred["held"] / mib,
           "peak_pred": pred["peak"] / mib}
    for side in SIDES:
        row[f"colls_{side}"] = colls[side]["count"]
        row[f"mb_{side}"] = colls[side]["bytes"] / 1e6
        row[f"held_{side}"] = held[side] / mib
        row[f"peak_{side}"] = (held[side] + rise[side]) / mib
    row["engines"] = {side: " + ".join(engine_name(part) for part in engines[side][:2]) for side in SIDES}
    row.update(runs=timing["runs"], sequence=timing["sequence"], by_op={s: colls[s]["by_op"] for s in SIDES},
               phases=timing["phases"], cpu_by_rank=timing["cpu_by_rank"])
    if cfg.get("profile"):
        row["profile"] = {side: top_ops(engines[side], x, y, device, cfg["profile"]) for side in SIDES}
    del engines
    gc.collect()
    release_freed_memory()
    return row


def engine_name(part) -> str:
    """Whose engine a model or optimizer is: the first class of its MRO from torch.distributed,
    torch.nn.parallel or minidp (fully_shard's classes are made on the fly above the model's own)."""
    part = getattr(part, "_orig_mod", part)  # torch.compile's wrapper: the module it compiled
    for cls in type(part).__mro__:
        if cls.__module__.startswith(("minidp", "torch.distributed", "torch.nn.parallel")):
            return f"{cls.__module__}.{cls.__qualname__}"
    return f"{type(part).__module__}.{type(part).__qualname__}"


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS (glibc keeps them): the next pair's two engines
    then fit where the last pair's were (4 ranks of ViT-B/16 were OOM-killed at the third pair)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _rank(local_rank, cfg, out_path):
    torch.set_num_threads(cfg["threads"])
    gc.callbacks.append(time_the_collector)
    env = minidp.init(backend="nccl" if cfg["device"] == "cuda" else "gloo")
    device = torch.device("cuda", env.local_rank % torch.cuda.device_count()) if cfg["device"] == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    rows = []
    for name in cfg["models"]:
        for pair in cfg["pairs"]:
            if pair in cfg.get("skip", {}).get(name, ()):
                continue
            try:
                rows.append(run_pair(pair, name, cfg, env.rank, device, mesh))
            except Exception as e:  # noqa: BLE001 - a pair that fails is reported, the others still run
                rows.append({"model": name, "N": dist.get_world_size(), "pair": pair,
                             "error": f"{type(e).__name__}: {str(e)[:300]}"})
                raise
            if env.rank == 0 and cfg["verbose"]:
                print(format_row(rows[-1]), flush=True)
                print(format_phases(rows[-1]), flush=True)
                for side, table in rows[-1].get("profile", {}).items():
                    print(f"-- {name} {pair} {side}: {cfg['profile']} profiled steps, rank 0\n{table}", flush=True)
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    minidp.shutdown()


# ----------------------------------------------------------------------------- the table
HEADER = (f"{'model':9} {'N':>1} {'pair':11} {'torch ms':>9} {'minidp ms':>9} {'ratio':>6} {'spread':>13} "
          f"{'colls t/m':>9} {'MB t/m':>13} {'held MiB t/m (pred)':>21} {'peak MiB t/m (pred)':>21} "
          f"{'load':>9}")


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:9} {r['N']:>1} {r['pair']:11} error: {r['error']}"
    return (f"{r['model']:9} {r['N']:>1} {r['pair']:11} {r['torch_ms']:9.1f} {r['minidp_ms']:9.1f} "
            f"{r['ratio']:6.3f} {r['ratio_min']:6.3f}-{r['ratio_max']:6.3f} "
            f"{r['colls_torch']:>4}/{r['colls_minidp']:<4} {r['mb_torch']:6.1f}/{r['mb_minidp']:<6.1f} "
            f"{r['held_torch']:6.4g}/{r['held_minidp']:<6.4g}({r['held_pred']:5.4g}) "
            f"{r['peak_torch']:6.4g}/{r['peak_minidp']:<6.4g}({r['peak_pred']:5.4g}) "
            f"{r['load_start']:4.1f}-{r['load_end']:<4.1f}")


def format_phases(r: dict) -> str:
    """The row's phases, rank 0's medians, torch/minidp: where a step's time goes; then every rank's CPU."""
    if "phases" not in r:
        return ""
    ph, cpu = r["phases"], r["cpu_by_rank"]
    by_rank = "  ".join(f"{t:.0f}/{m:.0f}" for t, m in zip(cpu["torch"], cpu["minidp"]))
    return "    ms t/m: " + "  ".join(f"{phase} {ph['torch'][phase]:.1f}/{ph['minidp'][phase]:.1f}"
                                      for phase in PHASES[:-1] if phase != "tail" or ph["torch"]["tail"]) + \
        f"  page faults t/m: {ph['torch']['faults'] / 1e3:.1f}/{ph['minidp']['faults'] / 1e3:.1f} thousand\n" \
        f"    cpu ms by rank t/m: {by_rank}  (all ranks {sum(cpu['torch']):.0f}/{sum(cpu['minidp']):.0f})"


def markdown(rows: list) -> str:
    lines = ["| model | N | pair | torch ms | minidp ms | ratio minidp/torch (min-max of 3+ runs) | "
             "collectives t/m | MB/step t/m | held MiB t/m (pred) | peak MiB t/m (pred) | load 1-min |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['N']} | {r['pair']} | error: {r['error']} |||||||| |")
            continue
        lines.append(f"| {r['model']} | {r['N']} | {r['pair']} | {r['torch_ms']:.0f} | {r['minidp_ms']:.0f} | "
                     f"{r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | "
                     f"{r['colls_torch']}/{r['colls_minidp']} | {r['mb_torch']:.1f}/{r['mb_minidp']:.1f} | "
                     f"{r['held_torch']:.0f}/{r['held_minidp']:.0f} ({r['held_pred']:.0f}) | "
                     f"{r['peak_torch']:.0f}/{r['peak_minidp']:.0f} ({r['peak_pred']:.0f}) | "
                     f"{r['load_start']:.1f}-{r['load_end']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="narrow models, tiny inputs, 2 steps a run")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world-sizes", type=int, nargs="+", default=None, help="default 2 4 (--quick: 2)")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--pairs", nargs="+", choices=PAIRS, default=list(DEFAULT_PAIRS))
    p.add_argument("--compile", action="store_true", help="add the ddp_compile pair")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="timed steps per engine per run (default 5; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per engine (default 3; quick 2)")
    p.add_argument("--image", type=int, default=None, help="ResNet-50's image side (default 64 on CPU, 224 "
                   "on GPU; quick 32); ViT-B/16 always 224 (quick 32)")
    p.add_argument("--seq", type=int, default=None, help="GPT-2's sequence (default 64 on CPU, 1024 on GPU)")
    p.add_argument("--batch", type=int, nargs=3, default=None, metavar=("RESNET", "VIT", "GPT2"),
                   help="per-rank batch of each model (default 2 1 1 on CPU, 32 16 8 on GPU; quick 2 1 1)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS steps of each engine (torch.profiler, rank 0's table printed)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--optimizer", choices=["default", "sgd"], default="default",
                   help="default: SGD+momentum (ResNet-50), AdamW (ViT, GPT-2); sgd: plain SGD for all "
                        "(no optimizer state: two GPT-2 engines in each of 4 ranks fit 23 GiB)")
    p.add_argument("--control", action="store_true",
                   help="torch's engine on both sides (the minidp column is a second torch engine): the "
                        "ratio then is the harness's own bias (which engine was built second, memory placement)")
    p.add_argument("--split-backward", action="store_true",
                   help="time each backward's tail (from its last gradient to its end: the wait for the "
                        "collectives) by a Python hook on every parameter, on both sides")
    p.add_argument("--minidp-first", action="store_true",
                   help="build minidp's engine before torch's (default: torch's first)")
    p.add_argument("--note", default="", help="a line for the header and the JSON (real_models_ablate.py's)")
    p.add_argument("--json", default=os.path.join(ROOT, "runs", "real_models", "real_models.json"))
    p.add_argument("--results-md", default=None, help="write the table into this file's section")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    pairs = list(args.pairs) + (["ddp_compile"] if args.compile and "ddp_compile" not in args.pairs else [])
    cfg = {"quick": args.quick, "device": args.device, "models": args.models, "pairs": pairs,
           "runs": args.runs, "threads": args.threads, "verbose": True, "profile": args.profile,
           "optimizer": args.optimizer, "note": args.note, "build_order": SIDES[::-1] if args.minidp_first else SIDES,
           "engine_of": {"minidp": "torch"} if args.control else {}, "split_backward": args.split_backward,
           "steps": args.steps or (2 if args.quick else 5), "warmup": args.warmup or (2 if args.quick else 3),
           "image": args.image or (32 if args.quick else 224 if gpu else 64),
           "seq": args.seq or (16 if args.quick else 1024 if gpu else 64)}
    b = args.batch or ((2, 1, 1) if args.quick or not gpu else (32, 16, 8))
    cfg["batch"] = dict(zip(MODELS, b))
    sizes = args.world_sizes or ([2] if args.quick else [2, 4])
    versions = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                "cpus": os.cpu_count()}
    from importlib.metadata import version  # not `import torchvision`: seconds the GPT-2-only run needs not
    versions["torchvision"] = version("torchvision")
    print(f"torch {torch.__version__}, torchvision {versions['torchvision']}, {args.device}, "
          f"{'quick (narrow models) ' if args.quick else ''}inputs per rank: resnet50 {cfg['batch']['resnet50']}x3x"
          f"{cfg['image']}x{cfg['image']}, vit_b_16 {cfg['batch']['vit_b_16']}x3x"
          f"{32 if args.quick else 224}x{32 if args.quick else 224}, gpt2 {cfg['batch']['gpt2']}x{cfg['seq']} "
          f"tokens (nanoGPT: 12x1024); {cfg['runs']} runs x {cfg['steps']} steps per engine after "
          f"{cfg['warmup']} warm-up; {args.threads} thread(s) a rank"
          f"{'; plain SGD for every model' if args.optimizer == 'sgd' else ''}"
          f"{'; minidp built first' if args.minidp_first else ''}"
          f"{'; CONTROL: the minidp column is a second torch engine' if args.control else ''}"
          f"{'; ' + args.note if args.note else ''}")
    print(HEADER, flush=True)
    rows, loads = [], []
    for n in sizes:
        before = open("/proc/loadavg").read().split()[:3]
        got = launch_json(_rank, n, (cfg,))
        after = open("/proc/loadavg").read().split()[:3]
        loads.append({"N": n, "before": before, "after": after})
        rows += got
        print(f"world size {n}: /proc/loadavg before {' '.join(before)}, after {' '.join(after)}", flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": sys.argv[1:] if argv is None else argv, "config": cfg, "versions": versions,
              "loadavg": loads, "columns": list(COLUMNS), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"JSON: {args.json}")
    if args.results_md:
        from results_md import write_section  # shared/
        write_section(args.results_md, "real_models", markdown(rows))
        print(f"table written to {args.results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
