"""One rank of the restart path: minidp.DDP, a checkpoint every M steps, resume after a restart.

    python -m minidp.run --nproc-per-node 3 --max-restarts 100 benchmarks/ft/restart_worker.py \\
        --log-dir LOGS --ckpt-dir CKPT --schedule SCHEDULE.json --run-start T0 --deadline T1

restart_side.py starts it so. Rank r is replica r of the schedule: its Injector fires r's events
between forward and backward. Any failure makes `minidp.run` stop every rank and start them all
again (TORCHELASTIC_RESTART_COUNT > 0); they load the last checkpoint and redo the steps after it.
A `hang` sleeps hang_s mid-step: the other ranks' gloo all-reduce waits `--hang-timeout` seconds,
raises, and the launcher restarts everyone (with --hang-timeout >= hang_s the hang only stalls the
step). The ranks stop together at the first 10-step boundary past the deadline and exit 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from event_log import EventLog, add_run_arguments  # noqa: E402 - before torch's import: "start" is the process's start

STOP_EVERY = 10  # steps between the ranks' stop votes (one tiny all-reduce): a past-deadline overshoot is harmless


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(p)
    p.add_argument("--ckpt-dir", required=True, help="where the checkpoint goes (a fresh folder per run)")
    p.add_argument("--every", type=int, default=20, help="steps between checkpoints (default 20)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step (default 64)")
    p.add_argument("--hang-timeout", type=float, default=3.0, help="gloo's collective timeout, s (default 3)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    rank = int(os.environ["RANK"])
    log = EventLog(a.log_dir, rank)
    if time.time() >= a.deadline:
        return  # restarted after the run's end: nothing to do

    import torch
    import torch.distributed as dist
    from workload import Injector, make_data, make_model

    import minidp

    torch.set_num_threads(1)
    injector = Injector(a.schedule, rank, a.run_start, hang_s=a.hang_s)
    minidp.init(backend="gloo", timeout=a.hang_timeout)
    world = dist.get_world_size()
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(a.ckpt_dir, "ckpt.pt")
    step = 0
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and os.path.exists(path):
        step = minidp.load_checkpoint(path, model, opt)["step"]
    ddp = minidp.DDP(model)
    x, y = make_data()
    loss_fn = torch.nn.CrossEntropyLoss()
    while True:
        first = ((step * world + rank) * a.batch) % len(x)  # this rank's slice of global step `step`
        idx = torch.arange(first, first + a.batch) % len(x)
        opt.zero_grad()
        loss = loss_fn(ddp(x[idx]), y[idx])
        log.poll(injector)  # mid-step: log a due failure, then raise, SIGKILL, or sleep
        loss.backward()  # the ranks meet here: gradient all-reduce
        opt.step()
        log.commit(step)
        step += 1
        if step % a.every == 0:
            minidp.save_checkpoint(path, ddp, opt, step=step)  # ranks meet: RNG gather, closing barrier
        if step % STOP_EVERY == 0:
            stop = torch.tensor([float(time.time() >= a.deadline)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # ranks meet: everyone stops at the same step
            if stop.item():
                break
    log.close()


if __name__ == "__main__":
    main()
