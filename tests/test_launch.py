"""minidp.launch and `python -m minidp.run`: real processes, real gloo, on CPU."""
import json
import os
import runpy
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from processes import fresh_interpreter_report

import minidp
from harness import assert_dead, run_ranks, write_pid
from minidp.launcher.spawn import free_port

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)  # ranks meet here
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "local_rank": int(os.environ["LOCAL_RANK"]), "pid": os.getpid()}


@pytest.mark.parametrize("world_size", [1, 3])  # 2 ranks: nearly every other test
def test_launch_all_reduce(world_size):
    results = run_ranks(_all_reduce_rank, world_size)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world"] == world_size for r in results)
    assert all(r["sum"] == sum(range(world_size)) for r in results)
    assert [r["local_rank"] for r in results] == list(range(world_size))


def _node_worker(local_rank, out_dir, log_path):
    torch.set_num_threads(1)
    env = minidp.init(timeout=60)
    with minidp.local_rank_zero_first():
        _append(log_path, f"start {env.rank}")
        if env.local_rank == 0:
            time.sleep(1.0)  # long enough that a missing barrier would let the others start first
        _append(log_path, f"end {env.rank}")
    t = torch.tensor([float(env.rank)])
    dist.all_reduce(t)  # ranks meet here, across both "nodes"
    with open(os.path.join(out_dir, f"{env.rank}.json"), "w") as f:
        json.dump({"local_rank": env.local_rank, "node_rank": env.node_rank, "sum": t.item(),
                   "world": env.world_size}, f)
    minidp.shutdown()


def _append(path, line):
    with open(path, "a") as f:  # O_APPEND: each short write lands whole, in the order made
        f.write(line + "\n")


def _node(port, out_dir, log_path):
    """One "node": its own launcher process (as on its own machine), starting 2 local ranks of 4."""
    minidp.launch(_node_worker, nprocs=2, args=(out_dir, log_path), nnodes=2, node_rank=int(os.environ["RANK"]),
                  master_addr="127.0.0.1", master_port=port, timeout=120)


def test_two_nodes_on_localhost_and_local_rank_zero_first(tmp_path):
    log = str(tmp_path / "events.log")
    run_ranks(_node, 2, free_port(), str(tmp_path), log, init=False)  # the two launchers, no process group
    results = {r: json.load(open(tmp_path / f"{r}.json")) for r in range(4)}
    assert {r: (v["node_rank"], v["local_rank"]) for r, v in results.items()} == {
        0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert all(v["sum"] == 0 + 1 + 2 + 3 and v["world"] == 4 for v in results.values())
    events = open(log).read().split()
    events = [" ".join(events[i:i + 2]) for i in range(0, len(events), 2)]
    last_local_zero_end = max(events.index("end 0"), events.index("end 2"))
    first_other_start = min(events.index("start 1"), events.index("start 3"))
    assert last_local_zero_end < first_other_start, events


def _raise_on_rank1(pid_dir):
    write_pid(pid_dir, dist.get_rank())
    dist.barrier()  # ranks meet here: both pids are written
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here on a dead peer
    time.sleep(120)


def _seconds_since_pids_written(pid_dir):
    # The workers write their pid right after init (and their other files before the failure), so start-up
    # time (long on a busy machine) is not counted.
    return time.time() - max(os.path.getmtime(os.path.join(pid_dir, f)) for f in os.listdir(pid_dir))


def test_launch_failure_names_rank_and_leaves_no_process(tmp_path):
    with pytest.raises(minidp.WorkerFailed) as info:
        run_ranks(_raise_on_rank1, 2, str(tmp_path), collective_timeout=120)
    assert _seconds_since_pids_written(str(tmp_path)) < 60  # rank 0 did not wait out its 120 s collective timeout
    assert info.value.rank == 1
    assert "worker rank 1 failed first" in str(info.value)
    assert "rank one is broken on purpose" in str(info.value)
    assert_dead(str(tmp_path), 2)


def _cli(args, **kw):
    return subprocess.run([sys.executable, "-m", "minidp.run", *args], capture_output=True, text=True,
                          timeout=120, **kw)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One `python -m minidp.run` run of 2 ranks that report their environment, then rank 1 fails."""
    out = tmp_path_factory.mktemp("cli")
    proc = _cli(["--nproc-per-node", "2", os.path.join(SCRIPTS, "report_env.py"), str(out), "--flag",
                 "--fail-rank", "1"])
    return proc, out, _seconds_since_pids_written(str(out))


def test_cli_sets_torchrun_environment(cli_run):
    proc, out, _ = cli_run  # its exit status: test_cli_failure_exits_nonzero_naming_rank (0: test_readme's runs)
    reports = [json.load(open(out / f"{r}.json")) for r in range(2)]
    for rank, rep in enumerate(reports):
        assert rep["env"]["RANK"] == rep["env"]["LOCAL_RANK"] == str(rank)
        assert rep["env"]["WORLD_SIZE"] == rep["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert rep["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert rep["sum"] == 3.0 and rep["argv"] == [str(out), "--flag", "--fail-rank", "1"]
        assert rep["name"] == "__main__"
    assert reports[0]["env"]["MASTER_PORT"] == reports[1]["env"]["MASTER_PORT"]
    assert reports[0]["listen"] == ["127.0.0.1"]  # the rendezvous is not exposed on other interfaces
    assert proc.stdout.count("printed once by rank 0") == 1
    assert "[rank 0] hello from the logger" in proc.stderr
    assert "[rank 1] hello from the logger" in proc.stderr


def test_cli_failure_exits_nonzero_naming_rank(cli_run):
    proc, out, seconds = cli_run
    assert seconds < 60  # rank 0 did not wait out its 120 s collective timeout
    assert proc.returncode != 0
    assert "worker rank 1 failed first" in proc.stderr
    assert proc.stderr.count("ValueError: rank 1 is broken on purpose") == 1  # traceback printed once
    assert_dead(str(out), 2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(nprocs=0), ValueError, r"nprocs=0 must be >= 1"),
    (dict(nprocs=2, nnodes=2, node_rank=2, master_port=1234), ValueError, r"node_rank=2 must be in \[0, nnodes=2\)"),
    (dict(nprocs=2, nnodes=2, node_rank=0, master_addr=None, master_port=1234), ValueError,
     r"master_addr=None with nnodes=2"),
    (dict(nprocs=2, nnodes=2, node_rank=0), ValueError, r"master_port=None with nnodes=2"),
    (dict(nprocs="2"), TypeError, r"nprocs='2' must be an int"),
    (dict(nprocs=2, nnodes=0), ValueError, r"nnodes=0 must be >= 1"),
    (dict(fn="train.py", nprocs=2), TypeError, r"fn='train.py' must be a callable"),
    (dict(nprocs=2, args=5), TypeError, r"args=5 must be a tuple"),
    (dict(nprocs=2, timeout=0), ValueError, r"timeout=0 must be > 0"),
    (dict(nprocs=2, timeout="10"), TypeError, r"timeout='10' must be a number"),
    (dict(nprocs=2, master_port=70000), ValueError, r"master_port=70000 must be <= 65535"),
    (dict(nprocs=2, master_port="29500"), TypeError, r"master_port='29500' must be an int"),
    (dict(nprocs=2, start_method="frok"), ValueError, r"start_method='frok' must be one of spawn, fork, forkserver"),
])
def test_launch_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        minidp.launch(**{"fn": print, **kwargs})


_SET_AT_RUN_TIME = {"value": "as imported"}


def _report_what_the_worker_sees(local_rank, path):
    with open(path, "w") as f:
        f.write(_SET_AT_RUN_TIME["value"])


def test_start_method_from_the_environment_is_used_and_checked(tmp_path, monkeypatch):
    # A forked worker sees what this process changed after importing the module; a spawned one imports it again.
    monkeypatch.setitem(_SET_AT_RUN_TIME, "value", "changed in the parent")
    monkeypatch.setenv("MINIDP_START_METHOD", "fork")
    minidp.launch(_report_what_the_worker_sees, 1, args=(str(tmp_path / "seen"),))
    assert (tmp_path / "seen").read_text() == "changed in the parent"
    monkeypatch.setenv("MINIDP_START_METHOD", "threads")
    with pytest.raises(ValueError, match=r"MINIDP_START_METHOD='threads' must be one of spawn, fork, forkserver"):
        minidp.launch(_report_what_the_worker_sees, 1, args=(str(tmp_path / "seen"),))


@pytest.mark.filterwarnings("ignore:'minidp.run' found in sys.modules")
def test_cli_bad_input(monkeypatch, capsys):
    # minidp.run's __main__ block, run here (runpy) rather than in a new interpreter: no torch import
    monkeypatch.setattr(sys, "argv", ["minidp.run", "--nproc-per-node", "0", "x.py"])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("minidp.run", run_name="__main__")
    assert info.value.code == 2 and "nprocs=0 must be >= 1" in capsys.readouterr().err


def _init_shutdown_twice_init_again():
    """After init: shutdown destroys the group, a second shutdown is a no-op, and init works again."""
    states = [dist.is_initialized()]
    minidp.shutdown()
    states.append(dist.is_initialized())
    minidp.shutdown()  # nothing left to destroy: must neither raise nor touch anything
    states.append(dist.is_initialized())
    env = minidp.init(timeout=60)  # refused ("exists already") had the first shutdown left the group
    t = torch.ones(1)
    dist.all_reduce(t)  # ranks meet here: the new group works
    return states, env.world_size, t.item()


def test_shutdown_destroys_the_group_and_is_safe_twice():
    assert not dist.is_initialized()
    minidp.shutdown()  # without init(): a no-op, twice
    minidp.shutdown()
    assert not dist.is_initialized()
    for states, world, total in run_ranks(_init_shutdown_twice_init_again, 2):
        assert states == [True, False, False]
        assert world == 2 and total == 2.0


def test_the_launcher_and_simulate_start_without_torch():
    """`import minidp` loads its names on first use: the launcher and the simulator import no torch (seconds of
    CPU a process), while minidp.DDP still works as an attribute (a fresh interpreter: processes.py)."""
    report = fresh_interpreter_report()
    assert report["torch_imported_by_the_launcher"] is False
    assert report["launch_module"] == "minidp.launcher.spawn" and report["ddp_name"] == "DistributedDataParallel"
    assert report["hooks_names_are_the_engines"] is True
