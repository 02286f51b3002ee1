"""Failure behaviour: a rank that dies mid-training. Real processes, gloo, CPU.

The other failures have a home with their behaviour: desync diagnosis in test_debug.py, uneven inputs
in test_join.py, a backward that raises in test_recovery.py, a rank that raises in test_launch.py.
"""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import minidp
from harness import assert_dead, workers_forked, write_pid
from models import build

# ---- dead ranks ---------------------------------------------------------------------------------
# One trial: rank 1 is SIGKILLed mid-training, so it leaves no traceback and rank 0 is blocked in the
# engine's all-reduce. (A rank that raises is tested once, in test_launch.py.)

def _train_then_die(local_rank, pid_dir):
    torch.set_num_threads(1)
    minidp.init(timeout=20)  # the collective timeout: a peer that stays silent errors within 20 s
    write_pid(pid_dir, dist.get_rank())
    model = minidp.DDP(build("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1000):
        if step == 5 and dist.get_rank() == 1:
            with open(os.path.join(pid_dir, "killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_rank_killed_mid_training_stops_everyone_quickly(tmp_path):
    # The real launcher, its workers forked as the harness forks them (a spawn costs ~15 s here, importing torch).
    with pytest.raises(minidp.WorkerFailed) as info, workers_forked():
        minidp.launch(_train_then_die, 2, args=(str(tmp_path),), timeout=120)
    after_kill = time.time() - float((tmp_path / "killed_at").read_text())
    assert info.value.rank == 1 and "killed by signal SIGKILL" in str(info.value), str(info.value)
    assert_dead(str(tmp_path), 2)
    # Well under the 20 s collective timeout: the launcher saw the death, it did not wait for rank 0 to time out.
    assert after_kill < 15, f"{after_kill:.1f} s from the kill to the launcher's error"
