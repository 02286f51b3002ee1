"""Run torch's own FSDP2 (fully_shard) test files against minidp.fully_shard (CPU: gloo, threaded PG).

The sibling of torch_suites.py (DDP and ZeRO), for test/distributed/_composable/fsdp/ of pytorch.
torch's test files are not installed with torch, and this script fetches nothing: it reads them
from --src (default /tmp/fsdp_suites/src), one file per name, copied byte-exact from pytorch/pytorch
at the commits below (SOURCES; the installed torch is 2.14.1+cu130, git 5c48869; each file's
imports resolve against it: its torch/testing/_internal/common_fsdp.py is installed):
  test/distributed/_composable/fsdp/test_fully_shard_state.py  2c50e08aa5ae6e22b41460edfa5f0ccbea8859f4
  test/distributed/_composable/fsdp/test_fully_shard_init.py   009e587ca22c4eafd1583ff821a98bdde6d8c1ac
  test/distributed/_composable/fsdp/test_fully_shard_training.py 001df7b5cd514f6b4fb6ffbaad6ea31e7a2ada72
  test/distributed/_composable/fsdp/test_fully_shard_comm.py     01d5c2cc8ac53ec6f45d10e2b90f7387df1f1ac4
(SOURCES below; a file in --src not named there is run and reported with commit "unknown".) In
test_fully_shard_comm.py only TestFullyShardUnshardMultiThread (threaded PG, 2 ranks),
TestFullyShardReduceOpWorldSize1 (1 rank, gloo) and TestFullyShardChunkCatMixedDtype (no fully_shard;
its op torch.ops.fsdp.chunk_cat_mixed_dtype is newer than torch 2.14.1) run on CPU. The other files
of that folder are GPU-only on the versions read (skip_if_lt_x_gpu without allow_cpu=True, cuda
memory stats or sleeps, instantiate_device_type_tests(except_for=["cpu"])) and were not copied:
test_fully_shard_frozen.py (04fb872, 7023af4), _autograd.py (0bc3de0, 2347785), _clip_grad_norm_.py
(f20bd3a, 0f31e61), _ignore_params.py (f3b61b4, 05a963f), _mixed_precision.py (42e4033, 003a6c0),
_extensions.py (005fb83), _memory.py (0334530), _overlap.py (068717b), _logging.py (01f9ef3; a
class-level skip_if_lt_x_gpu(2)), _block_shard.py (3e153a9); _compile.py was not considered.
Everything else they import is installed with torch (torch/testing/_internal/), except `expecttest`,
which torch's common_utils imports: put it in a folder of its own, off .venv,
  pip install --target /tmp/fsdp_suites/pydeps expecttest
and pass that folder as --deps (the default; it goes on PYTHONPATH). pytest-timeout is in .venv.

  python benchmarks/shared/fsdp_suites.py --engine both            # torch's fully_shard, then minidp's
  python benchmarks/shared/fsdp_suites.py --engine minidp --files test_fully_shard_state.py
  python benchmarks/shared/fsdp_suites.py --engine both -- -k Lazy  # more pytest arguments after --
  python benchmarks/shared/fsdp_suites.py --files test_fully_shard_training.py --cpu-multiprocess \
      --merge -- -k SharedParams     # add a -k selection's tests to the file's earlier ones

For each engine the test files are copied to WORK/<engine>/ (default /tmp/fsdp_suites/work); for
--engine minidp a first line `import _minidp_swap` is put at the top of each copy. That module puts
minidp.fully_shard (and minidp.FSDPModule, register_fsdp_forward_method, share_comm_ctx where minidp
has them) in the place of torch's before the test file imports them: torch.distributed.fsdp,
torch.distributed.fsdp._fully_shard, torch.distributed.fsdp._fully_shard._fully_shard, the old path
torch.distributed._composable.fsdp (and its fully_shard module), and torch.testing._internal.common_fsdp
(which imports fully_shard at its top, and whose FSDP2 helpers call it). torch's MultiProcessTestCase
spawns ranks that import the test module again, so the swap holds in every rank; FSDPTestMultiThread
runs its ranks as threads of one process. Each process that swaps appends a line to
WORK/<engine>/swapped.log.

The installed torch's FSDPTest and FSDPTestContinuous (multi-process ranks) skip every test on a machine
with no accelerator: FSDPTest._run and FSDPTestContinuous._init_pg exit with the multi-gpu-N skip code when
torch.accelerator.device_count() < world_size, although newer test files mark those tests
skip_if_lt_x_gpu(N, allow_cpu=True) or leave them undecorated. --cpu-multiprocess (both engines)
puts a line `import _cpu_multiprocess` in each copy, which makes that one check pass on CPU (see
CPU_MULTIPROCESS); without it those tests are reported as skipped. The JSON records which runs used it.
The lines put at the top shift the copies' line numbers (test lines in "where") by one or two.

Files run one at a time under `nice`, pytest -v with --timeout per test (pytest-timeout) and a wall
limit per file; outcomes come from pytest's junit XML, or, for a file cut off by the wall limit,
from pytest's -v lines (what it printed before). The outcome of every test under each engine, with
the cause of each minidp failure (the exception line and the last minidp/ frame of its traceback),
goes to --json (default benchmarks/results/fsdp_suites.json; a run of one engine or some files
updates the entries it ran and keeps the rest). The script prints a table (file, test, torch,
minidp) and the tests that pass with torch and fail with minidp.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# file in --src: the pytorch/pytorch commit it was copied from (path test/distributed/_composable/fsdp/)
SOURCES = {
    "test_fully_shard_state.py": "2c50e08aa5ae6e22b41460edfa5f0ccbea8859f4",
    "test_fully_shard_init.py": "009e587ca22c4eafd1583ff821a98bdde6d8c1ac",
    "test_fully_shard_training.py": "001df7b5cd514f6b4fb6ffbaad6ea31e7a2ada72",
    "test_fully_shard_comm.py": "01d5c2cc8ac53ec6f45d10e2b90f7387df1f1ac4",
}

SWAP = '''"""Put minidp's fully_shard in the place of torch's (written by benchmarks/shared/fsdp_suites.py)."""
import importlib
import os
import sys
import threading

import minidp

_fully_shard = minidp.fully_shard
_fsdp_module = getattr(minidp, "FSDPModule", None)
# more public names of torch.distributed.fsdp, swapped where minidp has them (torch's would act on its own state)
_more = {_n: getattr(minidp, _n) for _n in ("register_fsdp_forward_method", "share_comm_ctx") if hasattr(minidp, _n)}
_places = []
for _name in ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
              "torch.distributed.fsdp._fully_shard._fully_shard",
              "torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard",
              "torch.testing._internal.common_fsdp"):
    try:
        importlib.import_module(_name)
    except ImportError as e:
        _places.append(f"{_name}: not imported ({e})")
        continue
    _mod = sys.modules[_name]  # the module itself, also where the package attribute is the function
    _mod.fully_shard = _fully_shard
    if _fsdp_module is not None and hasattr(_mod, "FSDPModule"):
        _mod.FSDPModule = _fsdp_module
    for _n, _v in _more.items():
        if hasattr(_mod, _n):
            setattr(_mod, _n, _v)
    _places.append(_name)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "swapped.log"), "a") as _f:
    _swapped = 'swapped: ' + _fsdp_module.__module__ if _fsdp_module is not None else 'not swapped (minidp has none)'
    _f.write(f"pid {os.getpid()} thread {threading.get_ident()}: minidp at {os.path.dirname(minidp.__file__)}; "
             f"fully_shard {_fully_shard.__module__}.{_fully_shard.__qualname__}; FSDPModule "
             f"{_swapped}; "
             f"also {', '.join(sorted(_more)) or 'nothing else'}; "
             f"in {', '.join(_places)}\\n")
'''

CPU_MULTIPROCESS = '''"""Let torch's FSDPTest run its ranks with no accelerator (by fsdp_suites.py --cpu-multiprocess).

torch 2.14.1's FSDPTest._run and FSDPTestContinuous._init_pg (torch/testing/_internal/common_fsdp.py) exit
with the multi-gpu-N skip code when torch.accelerator.device_count() < world_size, so on a CPU-only machine
every multi-process FSDP test is skipped, even those the test files mark skip_if_lt_x_gpu(N, allow_cpu=True)
or leave undecorated. With no accelerator, that call, made from those two methods, answers 2**30; every
other caller gets torch's answer.
"""
import sys

import torch

if not torch.accelerator.is_available():
    _device_count = torch.accelerator.device_count

    def _device_count_for_fsdptest_run(*args, **kwargs):
        caller = sys._getframe(1).f_code
        if caller.co_name in ("_run", "_init_pg") and caller.co_filename.endswith("common_fsdp.py"):
            return 1 << 30
        return _device_count(*args, **kwargs)

    torch.accelerator.device_count = _device_count_for_fsdptest_run
'''

PASS, FAIL = {"passed"}, {"failed", "error", "timeout", "missing"}


def prepare(src, work, engine, name, cpu_multiprocess=False):
    os.makedirs(work, exist_ok=True)
    path = os.path.join(src, name)
    if not os.path.exists(path):
        sys.exit(f"missing {path}: copy torch's test files there first (see this file's docstring)")
    first = ""
    if engine == "minidp":
        first = "import _minidp_swap  # noqa: F401  (fsdp_suites.py)\n"
        with open(os.path.join(work, "_minidp_swap.py"), "w") as f:
            f.write(SWAP)
    if cpu_multiprocess:
        first += "import _cpu_multiprocess  # noqa: F401  (fsdp_suites.py --cpu-multiprocess)\n"
        with open(os.path.join(work, "_cpu_multiprocess.py"), "w") as f:
            f.write(CPU_MULTIPROCESS)
    with open(path, newline="") as f:
        text = f.read()
    with open(os.path.join(work, name), "w", newline="") as f:
        f.write(first + text)


EXC = re.compile(r"^\s*(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failed|Timeout)\b.*)$")
FRAME = re.compile(r'File "([^"]+)", line (\d+)')
# torch's private FSDP2 names a test may read (it then tests torch's internals, not the behaviour)
PRIVATE = ("fully_shard.state", "_get_fsdp_state", "_get_module_fsdp_state", "_fsdp_param_group",
           "fsdp_param_group", "FSDPParamGroup", "fsdp_params", "_fsdp_param", "FSDPParam",
           "ParamModuleInfo", "_get_param_module_infos", "_get_managed_modules", "_get_managed_states",
           "_lazy_init", "_is_root", "_state_ctx", "_training_state", "TrainingState",
           "_fsdp_collectives", "foreach_all_gather", "foreach_reduce", "_fsdp_state", "_fsdp_common",
           "_fully_shard._", "patch_all_gather", "patch_reduce_scatter", "patch_all_reduce",
           "patch_unshard", "patch_reshard", "patch_post_backward", "patch_foreach_",
           "patch_register_post_backward_hook_backward", "_comm_ctx", "_all_gather_result",
           "_sharded_param_data", "_unsharded_param", "sharded_state_dict", "_mp_policy",
           "_reshard_after_forward", "_post_forward_mesh_info")


def cause(text, package):
    """(the exception line, the last frame in minidp's package) of a failure's text (maybe several
    tracebacks)."""
    exc = ""
    for line in reversed(text.splitlines()):
        m = EXC.match(line)
        if m and not m.group(1).startswith(("Traceback", "torch.testing._internal")):
            exc = m.group(1).strip()
            break
    if not exc and "Timeout" in text:
        exc = "Timeout (pytest-timeout)"
    where = test_line = ""
    for path, line in FRAME.findall(text):
        if os.path.realpath(path).startswith(package):
            where = f"minidp/{os.path.relpath(os.path.realpath(path), package)}:{line}"
        elif os.path.basename(path).startswith("test_"):
            test_line = f"{os.path.basename(path)}:{line}"
    return exc[:300], where or (f"(no minidp frame; test at {test_line})" if test_line else "")


def private_reads(source, test_id):
    """The private FSDP2 names that a test method (and the self._ helpers it calls) reads."""
    import ast

    cls_name, _, test = test_id.partition("::")
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
            seen, todo, text = set(), [test], ""
            while todo:
                name = todo.pop()
                if name in seen or name not in methods:
                    continue
                seen.add(name)
                body = ast.get_source_segment(source, methods[name]) or ""
                text += body
                todo += re.findall(r"self\.(_\w+)", body)
            return sorted({p for p in PRIVATE if p in text})
    return []


def outcomes(junit, package):
    """{test id: {outcome, message, cause, where}} from pytest's junit XML."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        bad = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(
            bad[0].tag if bad else "", "passed")
        message = bad[0].get("message", "") if bad else ""
        text = "\n".join((child.get("message", "") + "\n" + (child.text or "")) for child in bad)
        if outcome in ("failed", "error") and re.search(r"Timeout|timed out", message):
            outcome = "timeout"
        entry = {"outcome": outcome, "message": message[:300]}
        if outcome not in ("passed", "skipped"):
            entry["cause"], entry["where"] = cause(text, package)
        result.setdefault(test_id, entry)  # a teardown error after a pass: keep the first
        if outcome == "error" and result[test_id]["outcome"] == "passed":
            result[test_id] = entry
    return result


VLINE = re.compile(r"^(\S+\.py)::(\w+)::(\w+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def outcomes_from_log(log):
    """What pytest -v printed before it was cut off: {test id: {outcome}}."""
    result = {}
    with open(log, errors="replace") as f:
        for line in f:
            m = VLINE.match(line)
            if m:
                outcome = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error",
                           "SKIPPED": "skipped"}.get(m.group(4), m.group(4).lower())
                result.setdefault(f"{m.group(2)}::{m.group(3)}", {"outcome": outcome, "message": "",
                                                                  "cause": "(from the -v log)"})
    return result


def run_file(args, engine, name):
    work = os.path.join(args.work, engine)
    prepare(args.src, work, engine, name, args.cpu_multiprocess)
    log = os.path.join(work, "swapped.log")
    if os.path.exists(log):
        os.remove(log)
    stem = name[:-3]
    junit, out = os.path.join(work, stem + ".xml"), os.path.join(work, stem + ".log")
    for path in (junit, out):
        if os.path.exists(path):
            os.remove(path)
    path = os.pathsep.join([work, args.minidp] + ([args.deps] if os.path.isdir(args.deps) else []))
    env = dict(os.environ, BACKEND="gloo", PYTHONPATH=path, OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    cmd = ["timeout", "-k", "30", str(args.wall), "nice", "-n", str(args.nice), sys.executable, "-m",
           "pytest", "-v", "-p", "no:cacheprovider", "--rootdir", work, "-c", os.devnull,
           f"--timeout={args.timeout}", "-rfE", f"--junitxml={junit}", name] + args.pytest_args
    print(f"== {name} under {engine}: {' '.join(cmd[6:])}", flush=True)
    with open(out, "w") as f:
        proc = subprocess.run(cmd, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT)
    package = os.path.realpath(os.path.join(args.minidp, 'minidp')) + os.sep
    result = outcomes(junit, package) if os.path.exists(junit) else {}
    if not result and os.path.exists(out):  # cut off by the wall limit: what -v printed
        result = outcomes_from_log(out)
    swapped = [line.strip() for line in open(log)] if os.path.exists(log) else []
    counts = {k: sum(1 for r in result.values() if r["outcome"] == k)
              for k in ("passed", "failed", "error", "timeout", "skipped")}
    print(f"   {counts}; exit {proc.returncode}{' (wall limit)' if proc.returncode in (124, 137) else ''}"
          f"; processes that swapped in minidp: {len(swapped)}", flush=True)
    return {"returncode": proc.returncode, "wall_limited": proc.returncode in (124, 137),
            "counts": counts, "processes_swapped": len(swapped), "swap_lines": sorted(set(
                re.sub(r"^pid \d+ thread \d+: ", "", s) for s in swapped)),
            "log": out, "tests": result}


def table(data, names, src):
    rows, lost = [], []
    for name in names:
        source = open(os.path.join(src, name)).read() if os.path.exists(os.path.join(src, name)) else ""
        entry = data["files"].get(name, {})
        t, m = entry.get("torch", {}).get("tests", {}), entry.get("minidp", {}).get("tests", {})
        for test_id in sorted(set(t) | set(m)):
            a = t.get(test_id, {}).get("outcome", "-")
            b = m.get(test_id, {}).get("outcome", "-" if "minidp" not in entry else "missing")
            rows.append((name, test_id, a, b))
            if a in PASS and b in FAIL:
                got = m.get(test_id, {})
                lost.append({"file": name, "test": test_id, "minidp": b, "cause": got.get("cause", ""),
                             "where": got.get("where", ""), "private": private_reads(source, test_id)})
    return rows, lost


def main():
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--src", default="/tmp/fsdp_suites/src", help="folder with torch's test files")
    parser.add_argument("--work", default="/tmp/fsdp_suites/work", help="where the copies and logs go")
    parser.add_argument("--deps", default="/tmp/fsdp_suites/pydeps", help="folder with expecttest")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "fsdp_suites.json"))
    parser.add_argument("--engine", choices=["torch", "minidp", "both"], default="both")
    parser.add_argument("--files", nargs="*", help="test files in --src (default: every test_*.py there)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test (pytest-timeout)")
    parser.add_argument("--wall", type=int, default=1200, help="seconds for one file's whole run")
    parser.add_argument("--nice", type=int, default=10)
    parser.add_argument("--merge", action="store_true", help="add this run's tests to the file's entry from "
                        "earlier runs (e.g. another -k selection) instead of replacing it; counts cover both")
    parser.add_argument("--cpu-multiprocess", action="store_true", help="let torch's multi-process FSDPTest "
                        "run on CPU (its device-count gate skips them all there; see CPU_MULTIPROCESS)")
    parser.add_argument("--minidp", default=ROOT, help="folder that holds the minidp package (first on "
                        "PYTHONPATH), e.g. a `git archive HEAD minidp` of a commit, not the working tree")
    parser.add_argument("--minidp-label", default="working tree", help="what --minidp holds, for the JSON")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -k Lazy")
    args = parser.parse_args()
    names = args.files or sorted(n for n in os.listdir(args.src) if n.startswith("test_") and n.endswith(".py"))
    engines = ["torch", "minidp"] if args.engine == "both" else [args.engine]
    import torch

    data = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            data = json.load(f)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    data.update(minidp_from=args.minidp, repo_head=head, minidp_label=args.minidp_label,
                torch_version=torch.__version__, torch_git_version=torch.version.git_version,
                test_files_from="pytorch/pytorch test/distributed/_composable/fsdp/",
                updated=datetime.datetime.now().isoformat(timespec="seconds"))
    data.setdefault("files", {})
    print(f"torch {torch.__version__} (git {torch.version.git_version}); test files from pytorch/pytorch "
          "test/distributed/_composable/fsdp/ at:")
    for name in names:
        print(f"  {name}: {SOURCES.get(name, 'unknown commit')}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    for name in names:
        entry = data["files"].setdefault(name, {})
        entry["commit"] = SOURCES.get(name, "unknown")
        for engine in engines:
            old = entry.get(engine, {})
            entry[engine] = run_file(args, engine, name)
            if args.pytest_args:
                entry[engine]["pytest_args"] = args.pytest_args
            entry[engine]["cpu_multiprocess"] = args.cpu_multiprocess
            if args.merge and old.get("tests"):  # keep the earlier runs' other tests
                entry[engine]["tests"] = {**old["tests"], **entry[engine]["tests"]}
                entry[engine]["counts"] = {k: sum(1 for r in entry[engine]["tests"].values() if r["outcome"] == k)
                                           for k in entry[engine]["counts"]}
                entry[engine]["earlier_runs"] = old.get("earlier_runs", []) + [
                    {k: old.get(k) for k in ("pytest_args", "cpu_multiprocess", "counts", "returncode", "log")}]
            with open(args.json, "w") as f:  # after every run: an interrupted run keeps what it has
                json.dump(data, f, indent=1, sort_keys=True)
    rows, lost = table(data, names, args.src)
    width = max([len(r[1]) for r in rows] + [4])
    print(f"\n{'file':34} {'test':{width}} {'torch':8} minidp")
    for name, test_id, a, b in rows:
        print(f"{name:34} {test_id:{width}} {a:8} {b}")
    print("\ncounts (passed/failed+error/timeout/skipped):")
    for name in names:
        for engine in ("torch", "minidp"):
            c = data["files"][name].get(engine, {}).get("counts")
            if c:
                print(f"  {name:34} {engine:6} {c['passed']}/{c['failed'] + c['error']}/{c['timeout']}/{c['skipped']}")
    print(f"\npasses with torch, fails with minidp ({len(lost)}):")
    for item in lost:
        private = f" (reads torch private: {', '.join(item['private'])})" if item["private"] else ""
        print(f"  {item['file']}::{item['test']}: {item['minidp']}: {item['cause']} [{item['where']}]{private}")
    _, all_lost = table(data, sorted(data["files"]), args.src)
    data["passes_with_torch_fails_with_minidp"] = all_lost
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
