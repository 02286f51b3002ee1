"""Run by the CLI failure test: rank 1 raises, rank 0 waits in a collective that never completes."""
import os
import sys
import time

import torch
import torch.distributed as dist

import minidp

torch.set_num_threads(1)
env = minidp.init(timeout=120)
with open(os.path.join(sys.argv[1], f"{env.rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
dist.barrier()
if env.rank == 1:
    time.sleep(0.5)
    raise ValueError("rank one is broken on purpose")
dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that has died
time.sleep(120)
