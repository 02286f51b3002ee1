"""Run torch's own DDP and ZeroRedundancyOptimizer test suites against minidp (CPU, gloo).

torch's test files are not installed with torch, and this script fetches nothing: put them in one
folder first (default /tmp/torch_suites/src), copied from a pytorch/pytorch checkout:
  test/distributed/test_c10d_gloo.py            -> SRC/test_c10d_gloo.py
  test/distributed/test_c10d_common.py          -> SRC/test_c10d_common.py   (test_c10d_gloo imports it)
  test/distributed/optim/test_zero_redundancy_optimizer.py -> SRC/test_zero_redundancy_optimizer.py
  test/distributed/test_distributed_spawn.py    -> SRC/test_distributed_spawn.py (--suite distributed only)
Everything else they import is installed with torch (torch/testing/_internal/), except the
`expecttest` package that torch's common_utils imports: put it in a folder of its own, off .venv,
  pip install --target /tmp/torch_suites/pydeps expecttest
and pass that folder as --deps (the default; it goes on PYTHONPATH).

  python benchmarks/shared/torch_suites.py --engine torch              # torch's own classes: the baseline
  python benchmarks/shared/torch_suites.py --engine minidp             # minidp.DDP / minidp's ZeRO in their place
  python benchmarks/shared/torch_suites.py --engine both               # both, then the tests whose outcome differs
  python benchmarks/shared/torch_suites.py --suite zero --unskip-gpu   # also the ZeRO tests torch skips without a GPU

For each engine the test files are copied to WORK/<engine>/ (default /tmp/torch_suites/work); for
--engine minidp a first line `import _minidp_swap` is put at the top of each copy. That module sets
torch.nn.parallel.DistributedDataParallel, torch.nn.parallel.distributed.DistributedDataParallel,
torch.distributed.optim.ZeroRedundancyOptimizer and
torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer to minidp's classes before
the test file imports them. torch's MultiProcessTestCase spawns its ranks, which import the test
module again, so the swap holds in every rank; each process that swaps appends a line to
WORK/<engine>/swapped.log and the summary prints how many did. pytest runs each suite with -q, no -x,
--timeout per test (pytest-timeout) and a wall limit on the whole run; the outcome of every test goes to
WORK/<engine>/<suite>.json, and --engine both prints the tests that pass under torch and not under
minidp. --unskip-gpu turns torch's `skip_if_no_gpu` into a no-op before the ZeRO file is imported:
with no GPU those tests then run on CPU with gloo (a variant torch's CI does not run; compare it
under both engines).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

SUITES = {  # name: (the test file, the files it imports)
    "c10d_gloo": ("test_c10d_gloo.py", ["test_c10d_common.py"]),
    "zero": ("test_zero_redundancy_optimizer.py", []),
    # not in "all": torch's big DistributedTest (installed distributed_test.py); hundreds of tests,
    # select with -k, e.g. -- -k "ddp or DistributedDataParallel"
    "distributed": ("test_distributed_spawn.py", []),
}

SWAP = '''"""Put minidp's classes in the place of torch's (written by benchmarks/shared/torch_suites.py)."""
import os

import torch.distributed.optim
import torch.distributed.optim.zero_redundancy_optimizer as _zro
import torch.nn.parallel
import torch.nn.parallel.distributed

import minidp

torch.nn.parallel.DistributedDataParallel = minidp.DDP
torch.nn.parallel.distributed.DistributedDataParallel = minidp.DDP
torch.distributed.optim.ZeroRedundancyOptimizer = minidp.ZeroRedundancyOptimizer
_zro.ZeroRedundancyOptimizer = minidp.ZeroRedundancyOptimizer
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "swapped.log"), "a") as f:
    f.write(f"{os.getpid()} {minidp.DDP.__module__} {minidp.ZeroRedundancyOptimizer.__module__}\\n")
'''

UNSKIP = '''"""Make torch's skip_if_no_gpu a no-op (written by benchmarks/shared/torch_suites.py --unskip-gpu)."""
import torch.testing._internal.common_distributed as _cd

_cd.skip_if_no_gpu = lambda func: func
'''


def prepare(src, work, engine, suite, unskip_gpu):
    """Copy the suite's files into work/, each with the import lines that must run first."""
    os.makedirs(work, exist_ok=True)
    main, extra = SUITES[suite]
    first = []
    if engine == "minidp":
        first.append("import _minidp_swap  # noqa: F401  (torch_suites.py)")
        with open(os.path.join(work, "_minidp_swap.py"), "w") as f:
            f.write(SWAP)
    if unskip_gpu:
        first.append("import _unskip_gpu  # noqa: F401  (torch_suites.py)")
        with open(os.path.join(work, "_unskip_gpu.py"), "w") as f:
            f.write(UNSKIP)
    for name in [main] + extra:
        path = os.path.join(src, name)
        if not os.path.exists(path):
            sys.exit(f"missing {path}: copy torch's test files there first (see this file's docstring)")
        with open(path) as f:
            text = f.read()
        with open(os.path.join(work, name), "w") as f:
            f.write("".join(line + "\n" for line in first) + text)
    return main


def outcomes(junit):
    """{test id: outcome} from pytest's junit XML: passed / failed / error / skipped."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(
            kinds[0] if kinds else "", "passed")
        message = next((child.get("message", "") for child in case
                        if child.tag in ("failure", "error", "skipped")), "")
        result[test_id] = {"outcome": outcome, "message": message[:300]}
    return result


def run_suite(args, engine, suite):
    work = os.path.join(args.work, engine + ("-unskip" if args.unskip_gpu else ""))
    main = prepare(args.src, work, engine, suite, args.unskip_gpu)
    log = os.path.join(work, "swapped.log")
    if os.path.exists(log):
        os.remove(log)
    junit = os.path.join(work, suite + ".xml")
    path = os.pathsep.join([work] + ([args.deps] if os.path.isdir(args.deps) else []))
    env = dict(os.environ, BACKEND="gloo", WORLD_SIZE=str(args.world_size), PYTHONPATH=path,
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    if suite == "distributed":  # what torch's run_test.py sets up for test_distributed_spawn.py
        temp = os.path.join(work, "temp_dir")
        shutil.rmtree(temp, ignore_errors=True)
        for folder in ("barrier", "test_dir"):
            os.makedirs(os.path.join(temp, folder))
        # file:// as run_test.py: TestDistBackend.setUp sets a file:// INIT_METHOD, and the spawned ranks
        # look the test class up by a name that depends on it (no "NoInitFile" suffix then)
        env.update(TEMP_DIR=temp, INIT_METHOD="file://" + os.path.join(temp, "shared_init_file"))
    cmd = ["timeout", str(args.wall), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--rootdir", work, "-c", os.devnull, f"--timeout={args.timeout}", "-rfE",
           f"--junitxml={junit}", main] + args.pytest_args
    print(f"== {suite} under {engine}: {' '.join(cmd[3:])}", flush=True)
    proc = subprocess.run(cmd, cwd=work, env=env)
    result = outcomes(junit) if os.path.exists(junit) else {}
    swapped = sum(1 for _ in open(log)) if os.path.exists(log) else 0
    counts = {k: sum(1 for r in result.values() if r["outcome"] == k)
              for k in ("passed", "failed", "error", "skipped")}
    summary = {"engine": engine, "suite": suite, "returncode": proc.returncode, "counts": counts,
               "processes_swapped": swapped, "unskip_gpu": args.unskip_gpu, "tests": result}
    with open(os.path.join(work, suite + ".json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"== {suite} under {engine}: {counts}; processes that swapped in minidp: {swapped}", flush=True)
    return summary


def compare(torch_run, minidp_run):
    """Print the tests whose outcome differs between the two engines."""
    for test_id, ref in sorted(torch_run["tests"].items()):
        got = minidp_run["tests"].get(test_id, {"outcome": "missing", "message": ""})
        if got["outcome"] != ref["outcome"]:
            print(f"  {test_id}: torch {ref['outcome']}, minidp {got['outcome']}: {got['message'][:200]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--src", default="/tmp/torch_suites/src", help="folder with torch's test files")
    parser.add_argument("--work", default="/tmp/torch_suites/work", help="where the copies and results go")
    parser.add_argument("--deps", default="/tmp/torch_suites/pydeps", help="folder with expecttest")
    parser.add_argument("--engine", choices=["torch", "minidp", "both"], default="both")
    parser.add_argument("--suite", choices=sorted(SUITES) + ["all"], default="all")
    parser.add_argument("--unskip-gpu", action="store_true", help="run the ZeRO tests skipped without a GPU")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--wall", type=int, default=1800, help="seconds for one suite's whole run")
    parser.add_argument("--world-size", type=int, default=2, help="WORLD_SIZE in the environment")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -k state")
    args = parser.parse_args()
    engines = ["torch", "minidp"] if args.engine == "both" else [args.engine]
    suites = ["c10d_gloo", "zero"] if args.suite == "all" else [args.suite]
    for suite in suites:
        runs = {engine: run_suite(args, engine, suite) for engine in engines}
        if len(runs) == 2:
            print(f"== {suite}: tests whose outcome differs (torch -> minidp)")
            compare(runs["torch"], runs["minidp"])


if __name__ == "__main__":
    main()
