"""Surviving what clusters do, with the real launchers: restarts after a lost worker, a stuck rank named.

Every launcher run of this file is registered at collection and runs in the background between other
tests (tests/scripts/background.py; each in its own session, with its own port and a hard timeout that
kills its process tree); each test waits for its own:

  reference   restart_train.py's build and train_step, uninterrupted, in 2 ranks forked from this process
            (no launcher: it is the answer, not what is tested)
  torchrun    torchrun --max-restarts 1: rank 1 SIGKILLs itself at step 20 of 40, attempt 0 only
  run         python -m minidp.run --max-restarts 1, the same
  stuck_*     tests/scripts/stuck_rank.py: rank 1 sleeps at step 5 under minidp.run and torchrun
              (init(timeout=15)), and under minidp.launch (timeout=5, ranks forked)
  gives_up    python -m minidp.run --max-restarts 1 with a rank that fails every attempt
"""
import os
import pathlib
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist

from minidp.launcher.spawn import free_port
from minidp.runtime import watchdog
from minidp.runtime.env import resolve_env, settle_threads
from minidp.runtime.rendezvous import attempt_prefix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
sys.path.insert(0, SCRIPTS)
import restart_train  # noqa: E402
from background import folder, prelaunch  # noqa: E402
from processes import VENV_BIN, Command, clean_env  # noqa: E402

from harness import run_ranks  # noqa: E402

TORCHRUN = os.path.join(VENV_BIN, "torchrun")
RUN = [sys.executable, "-m", "minidp.run", "--nproc-per-node", "2"]
TRAIN, STUCK = os.path.join(SCRIPTS, "restart_train.py"), os.path.join(SCRIPTS, "stuck_rank.py")
TIMEOUT_S = 150  # per command: a hang ends here, its tree killed
STUCK_TIMEOUT = 15  # init(timeout=15): the others must stop, naming the stuck rank, within it (plus SLACK_S)
# "Within the timeout plus a few seconds": a few on an idle machine (benchmarks/RESULTS.md), more when loaded.
SLACK_S = 20
STEPS = 40  # the restarted runs' length; rank 1 is killed halfway


def _command(name, out):
    """The command line of one scenario, writing into the folder `out`."""
    kill = [TRAIN, out, "--steps", str(STEPS), "--kill-at", str(STEPS // 2)]
    stuck = [STUCK, out, "--timeout", str(STUCK_TIMEOUT)]
    torchrun = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port())]
    if name == "torchrun":
        return [*torchrun, "--max-restarts", "1", *kill]
    if name == "run":
        return [*RUN, "--max-restarts", "1", *kill]
    if name == "stuck_run":
        return [*RUN, *stuck]
    if name == "stuck_torchrun":
        return [*torchrun, *stuck]
    if name == "stuck_launch":
        return [sys.executable, STUCK, out, "--timeout", "5", "--launch"]
    return [*RUN, "--max-restarts", "1", _failing_script(out)]  # gives_up


def _failing_script(folder):
    script = os.path.join(folder, "fails.py")  # imports no torch itself: a cheap run
    with open(script, "w") as f:
        f.write("import os, sys\nattempt = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
                "if os.environ['RANK'] == '1':\n    sys.exit(f'rank 1 fails in attempt {attempt}')\n")
    return script


SCENARIOS = ("torchrun", "run", "stuck_run", "stuck_torchrun", "stuck_launch", "gives_up")
_FOLDERS: dict = {}  # scenario -> its output folder, once started


def _start(name):
    out = _FOLDERS[name] = pathlib.Path(folder(f"restarts-{name}"))
    cmd = _command(name, str(out))
    env = clean_env(CUDA_VISIBLE_DEVICES="")  # CPU and gloo, as tests/conftest.py has it
    if name == "stuck_launch":  # minidp.launch's ranks fork (their watchdog is tested; spawn: test_readme, test_launch)
        env["MINIDP_START_METHOD"] = "fork"
    # The launcher's exit time, written when it exits (the launch runs in the background, waited for later).
    wrapped = ["/bin/bash", "-c", '"$@"; code=$?; date +%s.%N > "$0"; exit $code', str(out / "ended"), *cmd]
    return [Command(wrapped, ROOT, env, timeout=TIMEOUT_S)]


LAUNCHES = {name: prelaunch(f"test_restarts.py: {name}", lambda name=name: _start(name), module="test_restarts.py")
            for name in SCENARIOS}


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run's weights (rank 0's), from 2 ranks forked here."""
    return run_ranks(_uninterrupted, 2, STEPS)[0]


def _uninterrupted(steps):
    """The run the restarted ones must equal: every step once, no checkpoint, no launcher (rank 0's weights)."""
    model, opt = restart_train.build()
    for step in range(steps):
        restart_train.train_step(model, opt, step, dist.get_rank())
    return model.module.state_dict()


def _wait(name):
    """(Result, the launcher's exit time, its output folder) of a scenario, once it has ended."""
    (result,) = LAUNCHES[name].results()
    out = _FOLDERS[name]
    ended = float((out / "ended").read_text()) if (out / "ended").exists() else float("inf")
    return result, ended, out


def _final(folder):
    return torch.load(folder / "final.pt", weights_only=True)


def _assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("launcher", ["torchrun", "run"])
def test_a_killed_worker_is_restarted_and_the_resumed_run_ends_bitwise_equal(reference, launcher):
    result, _, folder = _wait(launcher)
    assert result.returncode == 0, result
    # Attempt 0 lost rank 1 at step 20; both workers of attempt 1 met (no stale gloo address) and resumed.
    assert "attempt 0 rank 1 done" not in result.output, result
    for rank in (0, 1):
        assert f"attempt 1 rank {rank} starts at step {STEPS // 2}" in result.output, result
        assert f"attempt 1 rank {rank} done" in result.output, result
    assert "connectFullMesh" not in result.output, result
    if launcher == "run":
        assert "worker rank 1 failed first (exit code -9)" in result.output, result
        assert "killed by signal SIGKILL" in result.output and "restart 1 of 1" in result.output, result
    _assert_bitwise_equal(_final(folder), reference)


@pytest.mark.parametrize("launcher, timeout", [("stuck_run", STUCK_TIMEOUT), ("stuck_torchrun", STUCK_TIMEOUT),
                                               ("stuck_launch", 5)])
def test_a_stuck_rank_is_named_with_the_line_it_is_stuck_on(launcher, timeout):
    result, ended, folder = _wait(launcher)
    assert result.returncode != 0, result
    fault = float(open(folder / "fault").read())
    assert ended - fault < timeout + SLACK_S, (ended - fault, result)
    assert re.search(r"rank 0 \(iteration 6, .*\) waited in vain in the all-reduce of bucket 0; ranks that did "
                     r"not arrive: \[1\]", result.output), result
    assert "rank 1 (pid " in result.output and "iteration 5, after its backward" in result.output, result
    line = next(i for i, text in enumerate(open(STUCK), 1) if "THE STUCK LINE" in text)
    assert f'stuck_rank.py", line {line}, in train' in result.output, result
    assert "time.sleep(300)  # THE STUCK LINE" in result.output, result
    if launcher == "stuck_torchrun":  # torchrun names the rank that raised (rank 0, above) as the root cause
        root_cause = result.output.partition("Root Cause (first observed failure):")[2]
        assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s+exitcode\s*: 1 ", root_cause), result
    for rank in (0, 1):  # the launcher left no rank behind, the sleeping one included
        with pytest.raises(ProcessLookupError):
            os.kill(int(open(folder / f"{rank}.pid").read()), 0)


def test_minidp_run_gives_up_after_max_restarts_with_the_first_failure():
    result, _, _ = _wait("gives_up")
    assert result.returncode == 1, result
    assert result.output.count("restarting all 2 worker(s) (restart 1 of 1)") == 1, result
    first = result.output.partition("giving up after 1 restart(s); the first failure was:")[2]
    assert "worker rank 1 failed first" in first and "rank 1 fails in attempt 0" in first, result
    assert "rank 1 fails in attempt 1" in result.output, result


def test_each_torchrun_attempt_meets_under_keys_of_its_own():
    store = dist.HashStore()
    spec = resolve_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    first = {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0"}
    seen = [attempt_prefix(store, spec, first) for _ in range(2)]  # two ranks of attempt 0
    seen += [attempt_prefix(store, spec, {**first, "TORCHELASTIC_RESTART_COUNT": "1"}) for _ in range(2)]
    seen += [attempt_prefix(store, spec, first) for _ in range(2)]  # a new round with the same count
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[4] == seen[5], seen
    assert len({seen[0], seen[2], seen[4]}) == 3, seen


def test_the_report_names_a_rank_whose_process_is_gone_and_one_that_is_behind():
    store = dist.HashStore()
    dog = watchdog.Watchdog(store, rank=0, world_size=3, interval=0.05)
    try:
        dog.progress.update(7, "finalize", 1)
        peers = dist.PrefixStore("minidp_watchdog/", store)
        gone = dict(iteration=7, phase="after backward", bucket=None, pid=2 ** 22 + 1, host=dog.host, beat=1,
                    time=time.time())
        peers.set("progress/1", __import__("json").dumps(gone))
        text = dog.report("the all-reduce of bucket 1")
    finally:
        dog.stop()
    assert "ranks that did not arrive: [1, 2]" in text, text
    assert "rank 1 (pid 4194305" in text and "its process is gone" in text, text
    assert "rank 2 (never seen): no progress published" in text, text


def test_settle_threads_returns_once_the_other_threads_sleep():
    assert settle_threads(limit_s=2.0) is True
