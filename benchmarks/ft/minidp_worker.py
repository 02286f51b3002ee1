"""One replica of minidp.ft on the benchmark's workload: `python -m minidp.run --ft` starts one per replica.

    python -m minidp.run --ft --nproc-per-node 3 --max-restarts 1000 benchmarks/ft/minidp_worker.py \\
        --log-dir LOGS --schedule SCHEDULE.json --run-start T0 --deadline T1 [--record DIR]

Replica r meets the schedule's events for r mid-step (workload.Injector, between forward and
backward): an exception is caught by the round (every participant discards the step, no process
restarts), a kill ends the process (the launcher restarts it alone; it heals from a live peer), a
hang outlives the collective timeout (the others discard the step and go on without it; it heals
when it wakes). Each replica stops at its first round past the deadline and leaves.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from event_log import EventLog, add_run_arguments  # noqa: E402 - before torch's import: "start" is the process's start

BATCH = 64


def build(width: int = 1024):
    """(model, policy, stream) as every replica (and the replay) builds them."""
    import torch
    from workload import make_model

    from minidp import ft
    model = make_model(0, width)
    policy = ft.AverageGradients(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return model, policy, ft.SampleStream(8192, BATCH, seed=0)


def body(model, policy, stream, rank, count, poll=lambda: None):
    """One round: this participant's forward and backward on its cut of the step's samples."""
    import torch
    x, y = _data()
    idx = stream.indices(rank, count)
    loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
    poll()  # mid-step: a due failure fires here
    loss.backward()


_DATA = []


def _data():
    if not _DATA:
        from workload import make_data
        _DATA.append(make_data())
    return _DATA[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(p)
    p.add_argument("--timeout", type=float, default=3.0, help="collectives and transfers between replicas, s")
    p.add_argument("--record", default=None, help="record the rounds for a replay (slower: a digest a commit)")
    p.add_argument("--width", type=int, default=1024, help="the MLP's width (default 1024: 1.3 M parameters)")
    a = p.parse_args(argv)
    replica_id = int(os.environ["MINIDP_FT_REPLICA_ID"])
    log = EventLog(a.log_dir, replica_id)
    if time.time() >= a.deadline:
        return  # restarted after the run's end

    import torch
    from workload import Injector

    from minidp import ft
    torch.set_num_threads(1)
    injector = Injector(a.schedule, replica_id, a.run_start, hang_s=a.hang_s)
    model, policy, stream = build(a.width)
    replica = ft.Replica(model, policy, stream, timeout=a.timeout, record=a.record)
    while time.time() < a.deadline:
        with replica.step() as r:
            body(model, policy, stream, r.rank, len(r.participants), lambda: log.poll(injector))
        if r.committed:
            log.commit(r.step)
    replica.close()
    log.close()


if __name__ == "__main__":
    main()
