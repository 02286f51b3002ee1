"""What gloo itself holds for a collective, outside every tensor Python can see (the RSS gap of issue 41).

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/memory/gloo_buffers.py   # world sizes 2 and 4 (seconds)

Each rank runs a 16 MiB (fp32) reduce-scatter (reduce_scatter_tensor) and all-gather
(all_gather_into_tensor), synchronous and async_op=True, twice each, and reads its RSS (VmRSS) before,
after the call returns (async: after it was started), after wait(), and after the Work object is
dropped, and the peak in between (VmHWM, reset before each call by writing 5 to /proc/self/clear_refs).
The tensors (input, output) exist before the first reading: any growth is the backend's own memory.
With glibc's mmap threshold fixed (as above), a freed buffer of 128 KiB or more goes back to the OS at
once, so RSS follows what is alive. Rank 0 prints its readings (MiB over the reading before the call).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(os.path.dirname(HERE), "shared")
if SHARED not in sys.path:
    sys.path.insert(0, SHARED)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rank_memory import launch_json  # noqa: E402

import minidp  # noqa: E402


def status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rank(local_rank, numel, repeats, out_path):
    torch.set_num_threads(1)
    minidp.init(backend="gloo")
    world = dist.get_world_size()
    full, shard, gathered = torch.randn(numel), torch.zeros(numel // world), torch.zeros(numel)  # pages touched
    rows = []
    for repeat in range(repeats):
        for collective in ("reduce_scatter", "all_gather"):
            for mode in ("sync", "async"):
                dist.barrier()
                time.sleep(0.05)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # VmHWM := VmRSS
                before = status("VmRSS")
                if collective == "reduce_scatter":
                    work = dist.reduce_scatter_tensor(shard, full, async_op=mode == "async")
                else:
                    work = dist.all_gather_into_tensor(gathered, shard, async_op=mode == "async")
                started = status("VmRSS")
                if work is not None:
                    time.sleep(0.1)  # the caller computes while it runs
                    work.wait()
                waited, peak = status("VmRSS"), status("VmHWM")
                del work
                dropped = status("VmRSS")
                rows.append({"repeat": repeat, "collective": collective, "mode": mode,
                             "returned_or_started": started - before, "after_wait": waited - before,
                             "after_work_dropped": dropped - before, "peak": peak - before})
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    minidp.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mib", type=int, default=16, help="the full tensor's size (default 16 MiB, one unit)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="also write every reading here")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, gloo, MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_')}; "
          f"a {args.mib} MiB fp32 tensor; rank 0's RSS, MiB over the reading before the call")
    print(f"{'N':>2} {'collective':<15}{'mode':<6}{'returned':>9}{'waited':>8}{'dropped':>8}{'peak':>7}")
    result = {}
    for n in args.world_sizes:
        rows = launch_json(_rank, n, (args.mib * 2**20 // 4, args.repeats))
        result[n] = rows
        for r in rows:
            print(f"{n:>2} {r['collective']:<15}{r['mode']:<6}{r['returned_or_started']:9.1f}{r['after_wait']:8.1f}"
                  f"{r['after_work_dropped']:8.1f}{r['peak']:7.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "malloc": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
                       "torch": torch.__version__, "rows": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
