"""What sharing this machine's 2 cores among W ranks does to the parts of a step: the causes behind the
compression study's validation misses (RESULTS.md, "Time to target at scale", Validation).

    python benchmarks/compression/shared_cores.py                 # ~2 minutes on 2 idle cores
    python benchmarks/compression/shared_cores.py --out results/shared_cores.json

LAUNCHES rounds of one launch per world size W = 1, 2, 4; every rank one thread. Each part is timed
REPEATS times with the ranks in lockstep (an untimed barrier before each repetition), the median per
rank, then the median over ranks:
  compute b64 / b32   forward, backward and SGD of the study's CharMLP at a per-rank batch of 64 / 32
  compute free        the same at the study's per-rank batch (128 / W) back to back with no barrier: how
                      the validation's "noop" runs measure the compute
  cpu work            Sign + error feedback's kind of work (elementwise passes) over the 313 k gradients:
                      what a compressor's cost is made of
  and at W >= 2, after the barrier:
  all-reduce fp32 / fp16   1.2 MB of float32, then the same bytes of float16 (gloo sums fp16 on the CPU)
  2 buckets async / sync   the study's two DDP buckets (1.24 MB, 11.7 KB): launched together and waited
                           (as DDP does), then one after the other (as the simulator adds them)
  step + a-r 16 B / 4 KiB  the "compute free" step ending in one all-reduce of 16 bytes (minidp.DDP's
                           status at 4 ranks, after any comm hook until 3bb5da5), then of 4 KiB (the
                           validation's smallest probe), no barrier
  all-gather / all-reduce 312 KB   QSGD 16's payload all-gathered, and all-reduced (a ring all-gather
                           of P bytes should cost less than a ring all-reduce of P: (N-1)(a + P/b)
                           against 2(N-1) a + 2(N-1)/N P/b)
Printed: the median over launches (min-max); slowdowns against W = 1's parts, which run alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "shared")]

import minidp  # noqa: E402

REPEATS = 40
LAUNCHES = 5
GATHER_BYTES = 312_276  # QSGD 16's payload of the large bucket


def _median_over_repeats(fn, repeats: int, lockstep: bool = True) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(repeats + 3):  # three warm-ups
        if lockstep and dist.is_initialized():
            dist.barrier()  # ranks meet here, untimed: every rank starts the part together
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def _worker(local_rank: int, repeats: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import compression_task as task

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        minidp.init(backend="gloo")
    text = task.Text.load(val_windows=256)
    torch.manual_seed(0)
    model = task.CharMLP(text.vocab, text.context)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(batch):
        x, y = text.batch(0, 0, batch, 0, 1)

        def run():
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return run

    numel = sum(p.numel() for p in model.parameters())
    grad, error = torch.randn(numel), torch.zeros(numel)

    def cpu_work():  # Sign + EF: add the error, signs and a scale, the new error
        corrected = grad + error
        scale = corrected.abs().mean()
        signs = corrected.sign()
        error.copy_(corrected - signs * scale)

    parts = {"compute b64": _median_over_repeats(step(64), repeats),
             "compute b32": _median_over_repeats(step(32), repeats),
             "compute free": _median_over_repeats(step(128 // world), repeats, lockstep=False),
             "cpu work": _median_over_repeats(cpu_work, repeats)}
    if world > 1:
        large = task.BUCKET_BYTES[0]
        fp32, fp16 = torch.ones(large // 4), torch.ones(large // 2, dtype=torch.float16)
        buckets = [torch.ones(b // 4) for b in task.BUCKET_BYTES]

        def together():
            for work in [dist.all_reduce(b, async_op=True) for b in buckets]:  # ranks meet here (each)
                work.wait()

        def one_after_the_other():
            for b in buckets:
                dist.all_reduce(b)  # ranks meet here
        payload = torch.ones(GATHER_BYTES // 4)
        gathered = [torch.empty_like(payload) for _ in range(world)]
        same_bytes = torch.ones(GATHER_BYTES // 4)
        def step_and_all_reduce(tensor):  # a training step that ends in one blocking all-reduce, back to back
            run = step(128 // world)

            def both():
                run()
                dist.all_reduce(tensor)  # ranks meet here
            return both
        parts.update({"step + a-r 16 B": _median_over_repeats(step_and_all_reduce(torch.zeros(4)), repeats, False),
                      "step + a-r 4 KiB": _median_over_repeats(step_and_all_reduce(torch.zeros(1024)), repeats, False)})
        parts.update({"all-gather 312 KB": _median_over_repeats(lambda: dist.all_gather(gathered, payload), repeats),
                      "all-reduce 312 KB": _median_over_repeats(lambda: dist.all_reduce(same_bytes), repeats),
                      "all-reduce fp32": _median_over_repeats(lambda: dist.all_reduce(fp32), repeats),
                      "all-reduce fp16": _median_over_repeats(lambda: dist.all_reduce(fp16), repeats),
                      "2 buckets async": _median_over_repeats(together, repeats),
                      "2 buckets sync": _median_over_repeats(one_after_the_other, repeats)})
        gathered = [None] * world
        dist.all_gather_object(gathered, parts)  # ranks meet here: every rank's medians
        parts = {k: statistics.median(p[k] for p in gathered) for k in parts}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out_dir, f"{world}.json"), "w") as f:
            json.dump(parts, f)
    if world > 1:
        minidp.shutdown()


def measure(repeats: int = REPEATS, launches: int = LAUNCHES) -> dict:
    """{world: {part: [median seconds of each launch]}}: `launches` rounds of one launch per world size."""
    out = {"1": {}, "2": {}, "4": {}}
    with tempfile.TemporaryDirectory(prefix="minidp-shared-cores-") as tmp:
        for _ in range(launches):
            for world in (1, 2, 4):
                minidp.launch(_worker, nprocs=world, args=(repeats, tmp))
                with open(os.path.join(tmp, f"{world}.json")) as f:
                    for part, seconds in json.load(f).items():
                        out[str(world)].setdefault(part, []).append(seconds)
    return out


def table(result: dict) -> str:
    """Per part and world size: the median over launches (min-max), ms, and the median over W = 1's."""
    med = statistics.median
    alone = {part: med(v) for part, v in result["1"].items()}
    lines = [f"{'part':<18}" + "".join(f"{f'W={w} ms (min-max)':>24}{'x W=1':>7}" for w in result)]
    for part in result["4"]:
        cells = ""
        for parts in result.values():
            if part in parts:
                v = parts[part]
                ratio = f"{med(v) / alone[part]:.2f}" if part in alone else "-"
                cells += f"{f'{1e3 * med(v):.2f} ({1e3 * min(v):.2f}-{1e3 * max(v):.2f})':>24}{ratio:>7}"
            else:
                cells += f"{'-':>24}{'':>7}"
        lines.append(f"{part:<18}" + cells)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=REPEATS, help=f"repetitions per part (default {REPEATS})")
    p.add_argument("--launches", type=int, default=LAUNCHES, help=f"launches per world size, alternating "
                   f"(default {LAUNCHES})")
    p.add_argument("--out", default=None, help="JSON file for the medians (default: none)")
    args = p.parse_args(argv)
    for name in ("repeats", "launches"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be >= 1")
    result = measure(args.repeats, args.launches)
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
