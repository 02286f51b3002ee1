"""minidp.launch where __main__ is not a file: `python -` and a real Jupyter kernel (`python -c` is the kernel's case).

The walkthrough notebook (examples/walkthrough.ipynb) is run cell by cell in a real ipykernel: it
launches workers from a cell, which is the case that spawn-based launchers cannot handle.
"""
import functools
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import minidp
from minidp.launcher.spawn import start_method

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "examples", "walkthrough.ipynb")

# Run as `python -`: the parent uses torch's thread pool first (a forked child
# must not hang on it), registers an atexit handler (the children must not run it), holds 200,000
# objects (a child's garbage collector must not walk them: frozen), and launches twice: a good run,
# then one where rank 1 fails.
SCRIPT = """
import atexit, gc, os, sys, torch, minidp
log = sys.argv[1]
held = [[] for _ in range(200_000)]
atexit.register(lambda: open(log, "a").write(f"atexit {os.getpid()}\\n"))
torch.set_num_threads(2)
torch.tanh(torch.randn(4_000_000)) @ torch.ones(4_000_000)

def train(local_rank, log):
    env = minidp.init(timeout=30)
    t = torch.tanh(torch.full((1_000_000,), float(env.rank + 1))).sum().reshape(1)
    torch.distributed.all_reduce(t)
    open(log, "a").write(f"rank {env.rank} frozen {gc.get_freeze_count()} "
                         f"sum {t.item():.0f} threads {torch.get_num_threads()}\\n")
    minidp.shutdown()

def fail(local_rank):
    if local_rank == 1:
        raise ValueError("rank one says no")

minidp.launch(train, nprocs=2, args=(log,), timeout=60)
try:
    minidp.launch(fail, nprocs=2, timeout=60)
except minidp.WorkerFailed as e:
    open(log, "a").write(f"failed rank {e.rank} {'rank one says no' in str(e)}\\n")
"""


def test_launch_from_stdin(tmp_path):
    # `python -c` takes the same path as a notebook (no __main__.__file__): the kernel test runs it.
    log = str(tmp_path / "log.txt")
    proc = subprocess.run([sys.executable, "-", log], input=SCRIPT, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = open(log).read().splitlines()
    ranks = sorted(line.rsplit(" threads", 1)[0] for line in lines if line.startswith("rank"))
    assert len(ranks) == 2 and ranks[0].startswith("rank 0 frozen ") and ranks[1].startswith("rank 1 frozen ")
    assert all(int(line.split()[3]) >= 200_000 for line in ranks), ranks  # the parent's objects, frozen
    assert ranks[0].split()[-1] == ranks[1].split()[-1]  # the all-reduce happened
    assert all(line.endswith("threads 1") for line in lines if line.startswith("rank"))
    assert "failed rank 1 True" in lines
    atexits = [line for line in lines if line.startswith("atexit")]
    assert len(atexits) == 1, f"the children ran the parent's atexit handlers: {lines}"


def test_start_method_choice_and_refusal_with_cuda_initialised(monkeypatch):
    def fn(local_rank):
        return None

    script_main = types.ModuleType("__main__")  # as under `python script.py`: a real file to import again
    script_main.__file__ = __file__
    monkeypatch.setitem(sys.modules, "__main__", script_main)
    assert start_method(fn) == "spawn"
    notebook_main = types.ModuleType("__main__")  # as in Jupyter: no __file__, no __spec__
    monkeypatch.setitem(sys.modules, "__main__", notebook_main)
    assert start_method(fn) == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert start_method(json.dumps) == "spawn"  # importable from its module
    fn.__module__ = "__main__"
    with pytest.raises(RuntimeError, match="CUDA is already initialised.*restart the kernel"):
        minidp.launch(fn, nprocs=2)
    # An explicit start method: the argument, else MINIDP_START_METHOD; each refused where it cannot work.
    with pytest.raises(RuntimeError, match="start_method='fork': CUDA is already initialised in this process"):
        minidp.launch(json.dumps, nprocs=2, start_method="fork")
    monkeypatch.setenv("MINIDP_START_METHOD", "fork")
    with pytest.raises(RuntimeError, match="MINIDP_START_METHOD='fork': CUDA is already initialised"):
        minidp.launch(json.dumps, nprocs=2)
    with pytest.raises(ValueError, match=r"start_method='spawn': 'test_start_method_choice_and_refusal_with_cuda_"
                                         r"initialised.<locals>.fn' is defined in a __main__ that is not a file"):
        minidp.launch(fn, nprocs=2, start_method="spawn")  # the argument wins over the environment
    monkeypatch.delenv("MINIDP_START_METHOD")
    notebook_main.__file__ = "<stdin>"  # python -: spawn cannot work, whatever fn is
    with pytest.raises(RuntimeError, match=r"__main__ is not a file \(<stdin>\)"):
        minidp.launch(json.dumps, nprocs=2)


def _keep_output(texts: list, msg: dict) -> None:
    """Collect what a cell shows: printed text, the MIME types of displays, tracebacks."""
    content = msg["content"]
    if msg["msg_type"] == "stream":
        texts.append(content["text"])
    elif msg["msg_type"] in ("display_data", "execute_result"):
        texts.append(" ".join(content["data"]))  # e.g. "image/png text/plain"
    elif msg["msg_type"] == "error":
        texts.append("\n".join(content["traceback"]))


def _run_notebook(path: str) -> list:
    """Execute every code cell of `path` in a fresh ipykernel; return the text each cell printed or displayed."""
    from jupyter_client.manager import start_new_kernel

    cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
    km, kc = start_new_kernel(kernel_name="python3", cwd=os.path.dirname(path))
    outputs = []
    try:
        for cell in cells:
            texts = []
            reply = kc.execute_interactive("".join(cell["source"]), timeout=180,
                                           output_hook=functools.partial(_keep_output, texts))
            assert reply["content"]["status"] == "ok", "".join(cell["source"])[:200] + "\n" + "".join(texts)
            outputs.append("".join(texts))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return outputs


def test_walkthrough_notebook_runs_in_a_real_kernel():
    outputs = "\n".join(_run_notebook(NOTEBOOK))
    assert "both ranks finished: ['rank0.pt', 'rank1.pt']" in outputs  # launched from a cell
    assert "same buckets as torch DDP at construction: True" in outputs
    assert "same buckets as torch DDP after the rebuild: True" in outputs
    assert "hook: net.6.bias" in outputs and "all-reduce started for bucket 0" in outputs
    assert "image/png" in outputs
    assert outputs.count("(bitwise equal: True)") == 2
