"""A rank that stops arriving: rank 1 sleeps (alive, stuck) or SIGKILLs itself at step 5 of 10.

    python -m minidp.run --nproc-per-node 2 tests/scripts/stuck_rank.py OUT_DIR --timeout 15
    torchrun --nproc-per-node 2 tests/scripts/stuck_rank.py OUT_DIR --timeout 15 [--die]
    python tests/scripts/stuck_rank.py OUT_DIR --timeout 5 --launch     # minidp.launch, 2 processes

Rank 1 writes the time of its fault to OUT_DIR/fault (seconds since the epoch) first, so a test can
tell how long the others took to stop; every rank writes its pid to OUT_DIR/<rank>.pid, so a test can
tell that the launcher left none behind (the sleeping one included). tests/test_restarts.py runs it.
"""
import argparse
import os
import signal
import time

import torch

import minidp

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--timeout", type=float, default=15)
parser.add_argument("--die", action="store_true", help="SIGKILL rank 1 instead of putting it to sleep")
parser.add_argument("--launch", action="store_true", help="start 2 ranks with minidp.launch")
args = parser.parse_args()


def train(local_rank=None):
    torch.set_num_threads(1)
    env = minidp.init(timeout=args.timeout)
    with open(os.path.join(args.out_dir, f"{env.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    model = minidp.DDP(torch.nn.Linear(4, 2))
    for step in range(10):
        if step == 5 and env.rank == 1:
            with open(os.path.join(args.out_dir, "fault"), "w") as f:
                f.write(repr(time.time()))
            if args.die:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(300)  # THE STUCK LINE: rank 1 is alive, and never arrives
        model.zero_grad()
        model(torch.randn(3, 4)).sum().backward()  # ranks meet here: the gradients are averaged
        with torch.no_grad():  # plain SGD by hand: torch.optim's first optimizer imports torch._dynamo (seconds
            for p in model.parameters():  # of CPU per rank), and the optimizer plays no part in what is tested
                p -= 0.1 * p.grad
    minidp.shutdown()


if __name__ == "__main__":
    if args.launch:
        minidp.launch(train, nprocs=2)
    else:
        train()
