"""Count the runs that abort at exit after a gloo collective, with and without minidp.shutdown().

    python benchmarks/faults/exit_aborts.py --runs 40 --concurrent 4                      # plain python
    python benchmarks/faults/exit_aborts.py --torchrun --runs 40 --plain-runs 20 --concurrent 5

Why: torch's gloo frees a finished work on its worker thread; a script that ends right after a
collective sometimes has that happen after Python began finalizing, and the process aborts
("terminate called without an active exception", exit -6), about 1 run in 5 when runs overlap.
Each run is a plain `python SCRIPT` (minidp.init() makes a world of one on gloo, with the same gloo
worker threads), as a user starts it by hand; not under `python -m minidp.run`, whose workers leave
with os._exit (worker.exit_now) and so skip the finalization where the abort happens.
The script trains a few steps with minidp.DDP, then all-reduces twice and ends: variant "plain"
ends there, variant "shutdown" calls minidp.shutdown() last. Runs of both variants are interleaved,
`--concurrent` at a time, a new one started as soon as one ends, so runs start while others end.
With --torchrun each run is `torchrun --standalone --nproc-per-node 1 SCRIPT`, the form the abort was seen in
(commit 7febf1e): twice the processes, so more overlap; --nproc 2 makes it a world of two (gloo over
TCP, as tests/test_readme.py runs the README's train.py).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

PROGRESS_S = 20.0  # seconds between progress lines
SCRIPT = """
import sys
import torch
import torch.distributed as dist
import minidp
torch.set_num_threads(1)
env = minidp.init()
model = minidp.DDP(torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
low, high = flat.clone(), flat.clone()
dist.all_reduce(low, op=dist.ReduceOp.MIN)   # the works are released right after their wait
dist.all_reduce(high, op=dist.ReduceOp.MAX)
if sys.argv[1] == "shutdown":
    minidp.shutdown()
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=40, help="runs of the shutdown variant")
    p.add_argument("--plain-runs", type=int, default=None, help="runs of the plain variant (default: --runs)")
    p.add_argument("--torchrun", action="store_true", help="start each run with torchrun --standalone")
    p.add_argument("--nproc", type=int, default=1, help="torchrun's --nproc-per-node (default 1)")
    p.add_argument("--concurrent", type=int, default=6, help="runs at a time")
    a = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "end_after_collective.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        plain = a.runs if a.plain_runs is None else a.plain_runs
        todo = [v for i in range(max(a.runs, plain)) for v, n in (("plain", plain), ("shutdown", a.runs)) if i < n]
        launcher = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
                    "--nproc-per-node", str(a.nproc)] if a.torchrun else [sys.executable]
        running, results, start = [], collections.defaultdict(list), time.time()
        total, said = len(todo), time.time()
        print(f"{total} runs, {a.concurrent} at a time; a line every {PROGRESS_S:.0f} s and one per abort", flush=True)
        while todo or running:
            if time.time() - said >= PROGRESS_S:  # a run takes seconds: a silent minute would look like a hang
                said = time.time()
                done = sum(len(r) for r in results.values())
                print(f"  {done} of {total} runs done, {sum(map(sum, results.values()))} aborted, "
                      f"{said - start:.0f} s", flush=True)
            while todo and len(running) < a.concurrent:
                variant = todo.pop(0)
                proc = subprocess.Popen([*launcher, script, variant], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
                running.append((variant, proc))
            time.sleep(0.02)
            for variant, proc in [r for r in running if r[1].poll() is not None]:
                running.remove((variant, proc))
                output = proc.stdout.read()
                aborted = proc.returncode != 0
                results[variant].append(aborted)
                if aborted:  # the lines that say why: torchrun's summary names the worker's signal
                    why = [ln.strip() for ln in output.splitlines()
                           if re.search(r"exitcode|terminate called|Signal \d+|Error:", ln)][:4]
                    print(f"{variant}: exit {proc.returncode}: {why}", flush=True)
    print(f"{f'torchrun --nproc-per-node {a.nproc}' if a.torchrun else 'python'}, {a.concurrent} at a time, "
          f"{time.time() - start:.0f} s")
    for variant in ("plain", "shutdown"):
        print(f"{variant:9s} aborts at exit: {sum(results[variant])} of {len(results[variant])}")


if __name__ == "__main__":
    main()
