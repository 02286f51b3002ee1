"""Run by test_launch.py under `python -m minidp.run`: torchrun's variables, an all-reduce, print once, a failure.

    python -m minidp.run --nproc-per-node 2 tests/scripts/report_env.py OUT_DIR [ARGS...] [--fail-rank R]

Every rank writes OUT_DIR/<rank>.pid and OUT_DIR/<rank>.json (its launch variables, the all-reduced
sum of rank + 1, its argv, __name__, and where the rendezvous port listens), then prints once through
print0 and logs through the logger. With --fail-rank R (anywhere after OUT_DIR; kept in the argv it
reports), rank R then raises while the others wait in an all-reduce that never completes: the
launcher must stop them, name rank R, and print its traceback once.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import minidp

torch.set_num_threads(1)
out_dir = sys.argv[1]
fail_rank = int(sys.argv[sys.argv.index("--fail-rank") + 1]) if "--fail-rank" in sys.argv else None
env = minidp.init(timeout=120)
with open(os.path.join(out_dir, f"{env.rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
total = torch.tensor([float(env.rank + 1)])
dist.all_reduce(total)  # ranks meet here


def listen_addresses(port):
    """Local addresses with a socket listening on `port`, from /proc/net/tcp{,6} (state 0A)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.append("127.0.0.1" if addr == "0100007F" else addr)
    return found


names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
with open(os.path.join(out_dir, f"{env.rank}.json"), "w") as f:
    json.dump({"env": {n: os.environ[n] for n in names}, "sum": total.item(), "argv": sys.argv[1:],
               "name": __name__, "listen": listen_addresses(int(os.environ["MASTER_PORT"]))}, f)
minidp.print0("printed once by rank 0")
minidp.get_logger().info("hello from the logger")
if fail_rank is not None:
    dist.barrier()  # ranks meet here: every rank has reported before one fails
    if env.rank == fail_rank:
        time.sleep(0.5)  # the others are inside the all-reduce below by then
        raise ValueError(f"rank {fail_rank} is broken on purpose")
    dist.all_reduce(torch.ones(1))  # the other ranks wait here for a peer that has died
    time.sleep(120)
minidp.shutdown()
