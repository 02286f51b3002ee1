"""The checks gpu_check.py runs, each in fresh worker processes; every row says how many collectives it issued.

Each check returns rows (see row()). A row's `collectives` is counted (collective_count.py) around
the minidp run it judges, never assumed; gpu_check.py fails a row that issued none.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

# benchmarks/ is not a package: shared/ (the workloads) goes on the path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shared"))

import minidp  # noqa: E402
import workloads  # noqa: E402 - benchmarks/ is not a package
from minidp import comm  # noqa: E402
from minidp.engine.failures import status_on_host  # noqa: E402

COMPRESSORS = {"FP16": comm.FP16, "BF16": comm.BF16, "TopK 1%": lambda: comm.TopK(0.01),
               "RandomK 1%": lambda: comm.RandomK(0.01), "QSGD 16": lambda: comm.QSGD(16), "Sign": comm.Sign,
               "PowerSGD 1": lambda: comm.PowerSGD(1)}
RANDOM = {"RandomK 1%", "QSGD 16"}  # drawn from the device's generator: CUDA and CPU draw different numbers
CLOSE_TO_CPU = 0.05  # |w_device - w_cpu| / |w_cpu - w_start|, both max over elements: rounding, not a bug


def row(check: str, ok: bool | None, detail: str, collectives: int = 0) -> dict:
    """One line of the table; ok=None means skipped. `world` is filled in by the worker."""
    return {"check": check, "result": "skipped" if ok is None else ("ok" if ok else "FAIL"),
            "collectives": collectives, "detail": detail}


def device_of(args) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(times: list) -> float:
    return statistics.median(times[3:] if len(times) > 4 else times) * 1e3


def _max_diff(a: list, b: list) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def _models(args, quick: bool) -> list:
    """(name, workload or None, why skipped): the MLP, and ResNet-18 unless --quick (torchvision needed)."""
    out = []
    for name in ["mlp"] + ([] if args.quick else ["resnet18"]):
        work = workloads.get(name, quick=quick)
        try:
            work.build()
        except ImportError as exc:  # torchvision missing: ResNet-18 is skipped, not failed
            out.append((name, None, str(exc)))
            continue
        out.append((name, work, ""))
    return out


def train(counter, engine, module, batch, device, steps: int, hook=None, setup=None, **kwargs):
    """(weights, per-step seconds, collectives issued during the steps) of `steps` steps under `engine`."""
    module = module.to(device)
    model = engine(module, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)
    if hook is not None:
        model.register_comm_hook(*hook)
    if setup is not None:
        setup(model)
    opt = workloads.make_optimizer(model)
    x, y = (t.to(device) for t in batch)
    with counter.window() as seen:
        times = [_timed_step(model, opt, (x, y), device) for _ in range(steps)]
    return [p.detach().cpu() for p in module.parameters()], times, seen[0]


def _timed_step(model, opt, batch, device) -> float:
    """Seconds of one training step, the device drained before and after."""
    _sync(device)
    start = time.perf_counter()
    workloads.train_step(model, opt, *batch)
    _sync(device)
    return time.perf_counter() - start


def _batch(work) -> tuple:
    return work.batch_for(dist.get_rank(), "cpu")


def ranks_equal(weights: list) -> bool:
    """Whether every rank holds these weights bitwise (ranks meet here: one all-gather on CPU tensors)."""
    flat = torch.cat([w.reshape(-1).double() for w in weights])
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.distributed_c10d.all_gather(parts, flat)  # not counted: it checks, it is not the checked run
    return all(torch.equal(parts[0], p) for p in parts[1:])


# ----------------------------------------------------------------------------- world size 1
def check_engine_world_one(args, counter) -> list:
    """minidp.DDP over a transport (world size 1 communicates only so) against torch DDP: bitwise, step ratio."""
    device, rows = device_of(args), []
    for name, work, why in _models(args, args.quick):
        if work is None:
            rows.append(row(f"{name} minidp.DDP(transport=TorchDist()) vs torch DDP", None, why))
            continue
        theirs, t_times, _ = train(counter, TorchDDP, work.build(), _batch(work), device, args.steps + 3)
        ours, m_times, n = train(counter, minidp.DDP, work.build(), _batch(work), device, args.steps + 3,
                                 transport=comm.TorchDist())
        diff = _max_diff(theirs, ours)
        rows.append(row(f"{name} minidp.DDP(transport=TorchDist()) vs torch DDP", diff == 0.0,
                        f"max weight diff {diff:.3g}; step {_median_ms(m_times):.2f} vs {_median_ms(t_times):.2f} ms "
                        f"(ratio {_median_ms(m_times) / _median_ms(t_times):.2f})", n))
    return rows


def _sync_warnings(device, model, opt, batch, steps: int) -> tuple[int, bool]:
    """(host syncs in `steps` steps, whether a known .item() was seen): torch.cuda.set_sync_debug_mode("warn")."""
    x, y = batch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                workloads.train_step(model, opt, x, y)
            before_control = len(caught)
            torch.ones(1, device=device).item()  # the control: a sync the detector must see
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught[:before_control] if "synchroniz" in str(w.message)]
    return len(syncs), any("synchroniz" in str(w.message) for w in caught[before_control:])


def check_status(args, counter) -> list:
    """The default step's host syncs and time, as built ("device") and after status_on_host ("host")."""
    device, rows, work = device_of(args), [], workloads.get("mlp", quick=args.quick)
    times = {}
    for mode in ("device", "host"):
        model = minidp.DDP(work.build().to(device), device_ids=[device.index] if device.type == "cuda" else None,
                           transport=comm.TorchDist())
        if mode == "host":
            status_on_host(model)  # ranks meet here (a gloo group)
        opt, batch = workloads.make_optimizer(model), tuple(t.to(device) for t in _batch(work))
        with counter.window() as seen:
            times[mode] = _median_ms([_timed_step(model, opt, batch, device) for _ in range(args.steps + 3)])
            if device.type == "cuda":
                syncs, control = _sync_warnings(device, model, opt, batch, 2)
        # 0: a default step reads nothing on the host (engine/failures.py: the NaN flag is copied
        # to pinned memory behind the all-reduce and read once it has arrived); status_on_host moves
        # only find_unused_parameters' use-count all-reduce to gloo, which a default step lacks.
        expected = 0
        if device.type != "cuda":
            ok, verdict = True, "host syncs not checked on cpu"
        else:
            ok = control and syncs == expected
            verdict = (f"{syncs} host syncs in 2 steps (documented: {expected})"
                       + ("" if control else "; the detector missed a known .item(): cannot tell"))
        rows.append(row(f"default step, status on the {mode}", ok, f"{verdict}; step {times[mode]:.2f} ms", seen[0]))
    ratio = times["host"] / times["device"]
    rows[-1]["detail"] += f" (status on the device: {times['device']:.2f} ms; host / device {ratio:.2f})"
    return rows


def check_cupy(args, counter) -> list:
    """CupyNccl at world size 1 (NCCL refuses two ranks on one GPU): bitwise to torch's NCCL, and in DDP."""
    try:
        transport = comm.CupyNccl()
    except RuntimeError as exc:
        return [row("CupyNccl", None, str(exc))]
    device, bad, rows = device_of(args), [], []
    with counter.window() as seen:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            for size in (1, 4099, 1 << 20):
                x = torch.randn(size, device=device).to(dtype)
                ours, theirs = x.clone(), x.clone()
                transport.all_reduce(ours).wait()
                dist.distributed_c10d.all_reduce(theirs)  # torch's NCCL, not counted
                bad += [] if torch.equal(ours, theirs) else [f"{dtype} x {size}"]
        x = torch.arange(256, device=device, dtype=torch.uint8)
        gathered, exchanged = torch.empty_like(x), torch.empty_like(x)
        transport.all_gather(gathered, x).wait()
        transport.all_to_all(exchanged, x).wait()
    ok = not bad and torch.equal(gathered, x) and torch.equal(exchanged, x)
    rows.append(row("CupyNccl all-reduce = torch NCCL; all-gather, all-to-all", ok,
                    "bitwise, 4 dtypes x 3 sizes" if ok else f"differs: {bad}", seen[0]))
    work = workloads.get("mlp", quick=args.quick)
    reference, t_times, _ = train(counter, TorchDDP, work.build(), _batch(work), device, args.steps + 3)
    mine, m_times, n = train(counter, minidp.DDP, work.build(), _batch(work), device, args.steps + 3,
                             transport=transport)
    rows.append(row("mlp minidp.DDP(transport=CupyNccl()) vs torch DDP", _max_diff(reference, mine) == 0,
                    f"max weight diff {_max_diff(reference, mine):.3g}; step ratio "
                    f"{_median_ms(m_times) / _median_ms(t_times):.2f}", n))
    for cname, make in COMPRESSORS.items():
        state, hook = comm.compression_hook(make(), memory=comm.ErrorFeedback(), transport=transport, start_iter=1)
        weights, _, n = train(counter, minidp.DDP, work.build(), _batch(work), device, args.steps + 3,
                              hook=(state, hook))
        stats = state.stats()
        ok = all(torch.isfinite(w).all() for w in weights) and stats["bytes_sent"] == state.bytes_analytical
        rows.append(row(f"{cname}+EF over CupyNccl", ok, f"bytes {stats['bytes_sent']:,} = declared", n))
        state.close()
    return rows


# ----------------------------------------------------------------------------- world size 2 (gloo)
# Over gloo the GPU's tensors go through host memory: these checks are about results, not speed, so
# they run the quick models for a few steps (the full MLP's 84 MB per step would take minutes).
def _gloo_steps(args) -> int:
    return min(args.steps, 4) + 3


def _compressed(counter, args, make, device, transport) -> tuple:
    """(weights, start weights, bytes sent, collectives) of the MLP trained with `make()`+EF on `device`."""
    work = workloads.get("mlp", quick=True)
    state, hook = comm.compression_hook(make(), memory=comm.ErrorFeedback(), transport=transport, start_iter=1)
    start = [p.detach().clone() for p in work.build().parameters()]
    weights, _, n = train(counter, minidp.DDP, work.build(), _batch(work), device, _gloo_steps(args),
                          hook=(state, hook))
    sent = state.stats()["bytes_sent"]
    ok_bytes = sent == state.bytes_analytical > 0
    state.close()
    return weights, start, sent if ok_bytes else -1, n


def check_compressors(args, counter) -> list:
    """Every compressor with error feedback at world size 2 on the device, against the same run on CPU tensors."""
    device, rows = device_of(args), []
    transport = comm.TorchDist()  # one gloo group for every run (each takes CPU and CUDA tensors)
    for cname, make in COMPRESSORS.items():
        weights, start, sent, n = _compressed(counter, args, make, device, transport)
        same_ranks = ranks_equal(weights)
        if device.type == "cpu":
            cpu_weights, cpu_sent, versus = weights, sent, "the device is the CPU: no second run"
        else:
            cpu_weights, _, cpu_sent, _ = _compressed(counter, args, make, torch.device("cpu"), transport)
            moved = max(_max_diff(cpu_weights, start), 1e-30)
            rel = _max_diff(weights, cpu_weights) / moved
            versus = f"vs CPU run: diff / update {rel:.2g}"
            versus += " (random draws differ by device)" if cname in RANDOM else ""
        close = device.type == "cpu" or cname in RANDOM or rel < CLOSE_TO_CPU
        ok = same_ranks and sent > 0 and sent == cpu_sent and close and all(torch.isfinite(w).all() for w in weights)
        rows.append(row(f"{cname}+EF on {args.device} tensors over gloo", ok,
                        f"ranks equal: {same_ranks}; bytes {sent:,} (CPU run {cpu_sent:,}); {versus}", n))
    return rows


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 10))


def check_world_two(args, counter) -> list:
    """Engine parity with torch DDP at world size 2, FP16() beside torch's hook, SyncBatchNorm beside a hook."""
    device, rows = device_of(args), []
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    for name, work, why in _models(args, quick=True):
        if work is None:
            rows.append(row(f"{name} minidp.DDP vs torch DDP", None, why))
            continue
        theirs, t_times, _ = train(counter, TorchDDP, work.build(), _batch(work), device, _gloo_steps(args))
        ours, m_times, n = train(counter, minidp.DDP, work.build(), _batch(work), device, _gloo_steps(args))
        diff = _max_diff(theirs, ours)
        rows.append(row(f"{name} minidp.DDP vs torch DDP", diff == 0.0 and ranks_equal(ours),
                        f"max weight diff {diff:.3g}; step ratio {_median_ms(m_times) / _median_ms(t_times):.2f}", n))
    work = workloads.get("mlp", quick=True)
    theirs, _, _ = train(counter, TorchDDP, work.build(), _batch(work), device, 3,
                         hook=(None, default_hooks.fp16_compress_hook))
    ours, _, n = train(counter, minidp.DDP, work.build(), _batch(work), device, 3,
                       hook=comm.compression_hook(comm.FP16()))
    rows.append(row("mlp FP16() vs torch's fp16_compress_hook", _max_diff(theirs, ours) == 0,
                    f"max weight diff {_max_diff(theirs, ours):.3g}", n))
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    batch = (torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen))
    theirs, _, _ = train(counter, TorchDDP, minidp.convert_sync_batchnorm(_bn_net()), batch, device, _gloo_steps(args),
                         hook=(None, default_hooks.fp16_compress_hook))
    ours, _, n = train(counter, minidp.DDP, minidp.convert_sync_batchnorm(_bn_net()), batch, device, _gloo_steps(args),
                       hook=comm.compression_hook(comm.FP16()))
    diff = _max_diff(theirs, ours)
    rows.append(row("SyncBatchNorm + compression_hook(FP16()) vs torch DDP + fp16_compress_hook",
                    diff == 0 and ranks_equal(ours), f"max weight diff {diff:.3g}; SyncBatchNorm's collectives "
                    "and the hook's (its own thread and group) in one backward", n))
    return rows


CHECKS = {  # name: (function, processes); backend: NCCL on cuda for one process, else gloo
    "engine": (check_engine_world_one, 1),
    "status": (check_status, 1),
    "cupy": (check_cupy, 1),
    "compressors": (check_compressors, 2),
    "world2": (check_world_two, 2),
}
