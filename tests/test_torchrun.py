"""minidp under the REAL torchrun (torch.distributed.run): its agent store, its environment, its errors.

torchrun's agent hosts a TCPStore on MASTER_PORT and tells the workers so
(TORCHELASTIC_USE_AGENT_STORE=True); minidp.init() must join it as a client, as torch's env://
rendezvous does, instead of starting a second server on the same port. Each launcher form runs once
(every torchrun start costs seconds on 2 cores):

  --rdzv-backend c10d --rdzv-endpoint, two "nodes"   here: tests/scripts/torchrun_check.py, world size 4
  --max-restarts, static rendezvous (--master-port)  test_restarts.py: a restarted run, a stuck rank, and a
                                                     rank that raises (named as the root cause, no worker
                                                     left behind)
  single node, its default port                      test_readme.py: the README's torchrun commands (the
                                                     minimal script, the torchvision example on torch DDP,
                                                     Accelerate, the README's diffs at world size 2)

The run here is registered at collection and runs in the background between other tests
(tests/scripts/background.py).
"""
import os
import pathlib
import re
import sys

import pytest

from minidp.launcher.spawn import free_port
from minidp.runtime.env import _agent_store_serves, resolve_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
sys.path.insert(0, SCRIPTS)

from background import folder, prelaunch  # noqa: E402
from processes import VENV_BIN, Command  # noqa: E402

TORCHRUN = [os.path.join(VENV_BIN, "torchrun")]  # the console script pip installs with torch
CHECK = os.path.join(SCRIPTS, "torchrun_check.py")
TIMEOUT_S = 240  # per command; a hung rendezvous or collective ends here, with its tree killed


def _two_nodes():
    """torchrun_check.py on two "nodes" (torchrun processes on this machine, started together), c10d rendezvous."""
    out_dir = _folder("nodes")
    endpoint = f"127.0.0.1:{free_port()}"
    return [Command([*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     endpoint, "--rdzv-id", "minidp-test", "--node-rank", str(n), CHECK, out_dir], ROOT,
                    timeout=TIMEOUT_S) for n in range(2)]


_FOLDERS: dict = {}  # launch -> its output folder, once started


def _folder(name):
    _FOLDERS[name] = folder(f"torchrun-{name}")
    return _FOLDERS[name]


# Registered at collection, run in the background between other tests (tests/scripts/background.py).
LAUNCHES = {"nodes": prelaunch("test_torchrun.py: two nodes", _two_nodes, module="test_torchrun.py")}


def _wait(name):
    return LAUNCHES[name].results(), pathlib.Path(_FOLDERS[name])


def _check_lines(output):
    """{rank: fields} from torchrun_check.py's `check:` lines."""
    found = {}
    for m in re.finditer(r"check: rank (\d+) local_rank (\d+) node (\d+) world (\d+) device (\w+) sum ([\d.]+)",
                         output):
        rank, local, node, world, device, total = m.groups()
        found[int(rank)] = dict(local=int(local), node=int(node), world=int(world), device=device, sum=float(total))
    return found


def test_two_nodes_with_c10d_rendezvous_pin_devices_and_go_local_rank_zero_first():
    results, out_dir = _wait("nodes")
    for r in results:
        assert r.returncode == 0, r
    ranks = _check_lines("".join(r.output for r in results))
    assert sorted(ranks) == [0, 1, 2, 3]
    assert all(v["world"] == 4 and v["sum"] == 1 + 2 + 3 + 4 for v in ranks.values())
    # Global rank = node rank * 2 + local rank, whichever agent the c10d rendezvous made node 0.
    assert {r: (v["node"], v["local"]) for r, v in ranks.items()} == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert {v["device"] for v in ranks.values()} == {"cuda" if _cuda() else "cpu"}
    events = open(out_dir / "events.log").read().splitlines()
    assert len(events) == 8, events
    zero_done = max(events.index("end node0 local0"), events.index("end node1 local0"))
    others_start = min(events.index("start node0 local1"), events.index("start node1 local1"))
    assert zero_done < others_start, events  # local rank 0 of *every* node first, then the others


def _cuda():
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("environ, explicit, expected", [
    ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, {}, True),
    ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, {}, False),  # e.g. torchrun with a restarted agent store
    ({}, {}, False),  # minidp.run, minidp.launch, SLURM: minidp hosts the store
    ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, {"master_port": 29999}, False),  # explicitly elsewhere
    ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, {"master_addr": "10.0.0.9"}, False),
])
def test_agent_store_is_used_only_where_torchrun_serves_it(environ, explicit, expected):
    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost",
               "MASTER_PORT": "29500", **environ}
    spec = resolve_env(environ, **explicit)
    assert _agent_store_serves(spec, environ) is expected
