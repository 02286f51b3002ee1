"""One command for a machine with one NVIDIA GPU and no network: minidp's GPU paths, checked and timed.

    PYTHONPATH=. python benchmarks/gpu_check.py                  # about 3-5 minutes on one GPU
    PYTHONPATH=. python benchmarks/gpu_check.py --quick          # smaller models, fewer steps
    PYTHONPATH=. python benchmarks/gpu_check.py --device cpu --quick --results-md ''   # dry run without a GPU

Checks, each in fresh processes:
  1. NCCL at world size 1: minidp.DDP against torch DDP on the MLP and ResNet-18 (parity of the
     weights after training, bitwise expected; step-time ratio minidp / DDP).
  2. the CuPy transport at world size 1: CupyNccl's all-reduce bitwise equal to torch's NCCL
     all-reduce (4 dtypes, 3 sizes), all-gather and all-to-all, and DDP averaging over it.
  3. the compressors on CUDA tensors (world size 1, over TorchDist and CupyNccl, with error
     feedback): finite results, bytes measured = bytes analytical, step time.
  4. two processes sharing the GPU over gloo: minidp.DDP against torch DDP, bitwise, and FP16().
Prints a table and writes it into --results-md between markers. Needs torch, and CuPy for check 2
and half of 3 (reported as skipped without it); torchvision for ResNet-18 (skipped without it).
Exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import minidp  # noqa: E402
import workloads  # noqa: E402 - benchmarks/ is not a package
from minidp import comm  # noqa: E402

COMPRESSORS = {"FP16": comm.FP16, "BF16": comm.BF16, "TopK 1%": lambda: comm.TopK(0.01),
               "RandomK 1%": lambda: comm.RandomK(0.01), "QSGD 16": lambda: comm.QSGD(16), "Sign": comm.Sign,
               "PowerSGD 1": lambda: comm.PowerSGD(1)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run on gloo "
                   "(no GPU needed; the CuPy rows are skipped)")
    p.add_argument("--quick", action="store_true", help="small models, few steps")
    p.add_argument("--steps", type=int, default=None, help="timed steps per engine (default 30, quick 4)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per check before it is killed")
    p.add_argument("--results-md", default=os.path.join(HERE, "RESULTS.md"), help="'' to skip writing")
    p.add_argument("--checks", default="nccl,cupy,compressors,gloo", help="comma-separated subset (default: all)")
    args = p.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    if not args.checks or any(c not in CHECKS for c in args.checks):
        p.error(f"--checks {','.join(args.checks)!r}: choose from {','.join(CHECKS)}")
    if args.steps is None:
        args.steps = 4 if args.quick else 30
    if args.steps < 1:
        p.error(f"--steps {args.steps} must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                "use --device cpu for a dry run")
    return args


def row(check: str, ok: bool | None, detail: str) -> dict:
    """One line of the table; ok=None means skipped."""
    return {"check": check, "result": "skipped" if ok is None else ("ok" if ok else "FAIL"), "detail": detail}


def _device(args) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def _deterministic() -> None:
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def _models(args) -> list:
    names = ["mlp", "resnet18"]
    out = []
    for name in names:
        work = workloads.get(name, quick=args.quick)
        try:
            work.build()
        except ImportError as exc:  # torchvision missing: ResNet-18 is skipped, not failed
            out.append((name, None, str(exc)))
            continue
        out.append((name, work, ""))
    return out


def _train(engine, work, device, steps: int, hook=None, **kwargs) -> tuple[list, list]:
    """(weights, per-step seconds) after `steps` steps of `work` under `engine`."""
    module = work.build().to(device)
    ids = [device.index] if device.type == "cuda" else None
    model = engine(module, device_ids=ids, **kwargs)
    if hook is not None:
        model.register_comm_hook(*hook)
    opt = workloads.make_optimizer(model)
    x, y = work.batch_for(dist.get_rank(), device)
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        workloads.train_step(model, opt, x, y)
        _sync(device)
        times.append(time.perf_counter() - start)
    return [p.detach().cpu() for p in module.parameters()], times


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_diff(a: list, b: list) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def _median_ms(times: list) -> float:
    return statistics.median(times[3:] if len(times) > 4 else times) * 1e3


def _parity_rows(args, prefix: str, hook_cases=()) -> list:
    """minidp.DDP against torch DDP on each model: weights (bitwise expected) and the step-time ratio."""
    device, rows = _device(args), []
    _deterministic()
    for name, work, why in _models(args):
        if work is None:
            rows.append(row(f"{prefix}: {name} parity", None, why))
            continue
        theirs, t_times = _train(TorchDDP, work, device, args.steps + 3)
        ours, m_times = _train(minidp.DDP, work, device, args.steps + 3)
        diff = _max_diff(theirs, ours)
        ratio = _median_ms(m_times) / _median_ms(t_times)
        rows.append(row(f"{prefix}: {name} minidp vs torch DDP", diff == 0.0,
                        f"max weight diff {diff:.3g}; step {_median_ms(m_times):.2f} ms vs {_median_ms(t_times):.2f} "
                        f"ms (ratio {ratio:.2f})"))
        for label, make_hook in hook_cases:
            reference, _ = _train(TorchDDP, work, device, 3, hook=make_hook(True))
            mine, _ = _train(minidp.DDP, work, device, 3, hook=make_hook(False))
            diff = _max_diff(reference, mine)
            rows.append(row(f"{prefix}: {name} {label}", diff == 0.0, f"max weight diff {diff:.3g}"))
    return rows


# ----------------------------------------------------------------------------- checks (in workers)
def check_nccl_world_one(args) -> list:
    return _parity_rows(args, f"{dist.get_backend()} world 1")


def check_cupy(args) -> list:
    try:
        transport = comm.CupyNccl()
    except RuntimeError as exc:
        return [row("CupyNccl world 1", None, str(exc))]
    device, bad = _device(args), []
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for size in (1, 4099, 1 << 20):
            x = torch.randn(size, device=device).to(dtype)
            ours, theirs = x.clone(), x.clone()
            transport.all_reduce(ours).wait()
            dist.all_reduce(theirs)  # torch's NCCL
            if not torch.equal(ours, theirs):
                bad.append(f"{dtype} x {size}")
    rows = [row("CupyNccl all-reduce = torch NCCL all-reduce", not bad, "bitwise, 4 dtypes x 3 sizes"
                if not bad else f"differs: {bad}")]
    x = torch.arange(256, device=device, dtype=torch.uint8)
    gathered, exchanged = torch.empty_like(x), torch.empty_like(x)
    transport.all_gather(gathered, x).wait()
    transport.all_to_all(exchanged, x).wait()
    rows.append(row("CupyNccl all-gather, all-to-all", torch.equal(gathered, x) and torch.equal(exchanged, x),
                    "world size 1: identity"))
    work = workloads.get("mlp", quick=args.quick)
    reference, t_times = _train(TorchDDP, work, device, args.steps + 3)
    mine, m_times = _train(minidp.DDP, work, device, args.steps + 3, hook=(transport, comm.allreduce_hook))
    rows.append(row("minidp.DDP + allreduce_hook over CupyNccl vs torch DDP (mlp)", _max_diff(reference, mine) == 0,
                    f"max weight diff {_max_diff(reference, mine):.3g}; step ratio "
                    f"{_median_ms(m_times) / _median_ms(t_times):.2f}"))
    return rows


def check_compressors(args) -> list:
    device, rows = _device(args), []
    transports = {"TorchDist": comm.TorchDist()}
    try:
        transports["CupyNccl"] = comm.CupyNccl()
    except RuntimeError as exc:
        rows.append(row("compressors over CupyNccl", None, str(exc)))
    work = workloads.get("mlp", quick=args.quick)
    _, exact = _train(minidp.DDP, work, device, args.steps + 3)
    for (tname, transport), (cname, make) in ((t, c) for t in transports.items() for c in COMPRESSORS.items()):
        state, hook = comm.compression_hook(make(), memory=comm.ErrorFeedback(), transport=transport, start_iter=1)
        weights, times = _train(minidp.DDP, work, device, args.steps + 3, hook=(state, hook))
        stats = state.stats()
        ok = all(torch.isfinite(w).all() for w in weights) and stats["bytes_sent"] == state.bytes_analytical
        rows.append(row(f"{cname}+EF on {args.device} over {tname}", ok,
                        f"bytes {stats['bytes_sent']:,} (ratio {stats['ratio']:.3f}); step "
                        f"{_median_ms(times) / _median_ms(exact):.2f}x exact"))
    return rows


def check_gloo_two_ranks(args) -> list:
    def fp16_hook(torch_side):
        if torch_side:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            return None, default_hooks.fp16_compress_hook
        return comm.compression_hook(comm.FP16())
    return _parity_rows(args, f"gloo world {dist.get_world_size()} on {args.device}",
                        hook_cases=[("FP16() vs torch's fp16_compress_hook", fp16_hook)])


CHECKS = {  # name: (function, processes); backend: NCCL on cuda for one process, else gloo
    "nccl": (check_nccl_world_one, 1),
    "cupy": (check_cupy, 1),
    "compressors": (check_compressors, 1),
    "gloo": (check_gloo_two_ranks, 2),
}


def _worker(local_rank: int, name: str, args, path: str) -> None:
    fn, procs = CHECKS[name]
    minidp.init(backend="nccl" if args.device == "cuda" and procs == 1 else "gloo", timeout=120)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    rows = fn(args)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(rows, f)
    minidp.shutdown()


def run_check(name: str, args) -> list:
    """Run one check in fresh processes; a crash or timeout becomes a FAIL row, not a stop."""
    _, procs = CHECKS[name]
    with tempfile.TemporaryDirectory(prefix="minidp-gpu-check-") as folder:
        path = os.path.join(folder, "rows.json")
        try:
            minidp.launch(_worker, procs, args=(name, args, path), timeout=args.timeout)
            with open(path) as f:
                return json.load(f)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            return [row(name, False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}")]


def write_section(path: str, tag: str, text: str) -> None:
    """Put `text` between `tag`'s markers in `path`, keeping the rest of the file.

    compression.py imports it from here (not the other way: that script imports torchvision, which
    this one must run without)."""
    begin, end = f"<!-- BEGIN {tag} -->", f"<!-- END {tag} -->"
    old = open(path).read() if os.path.exists(path) else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    block = f"{begin}\n{text}\n{end}"
    new = pattern.sub(lambda _: block, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)


def table(rows: list, header: str) -> str:
    lines = [header, "", "| check | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {r['check']} | {r['result']} | {r['detail']} |" for r in rows]
    return "\n".join(lines)


def environment() -> str:
    parts = [f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name(0))
    try:
        import cupy
        parts.append(f"cupy {cupy.__version__}")
    except ImportError:
        parts.append("no cupy")
    return ", ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    start, rows = time.time(), []
    for name in args.checks:
        try:
            rows += run_check(name, args)
        except Exception:  # noqa: BLE001 - never lose the rows gathered so far
            rows.append(row(name, False, traceback.format_exc().strip().splitlines()[-1]))
    text = table(rows, f"GPU check ({environment()}; {time.time() - start:.0f} s; "
                       f"{'quick' if args.quick else 'full'}, {args.steps} timed steps)")
    print(text)
    if args.results_md:
        write_section(args.results_md, f"gpu_check {args.device}", text)
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
