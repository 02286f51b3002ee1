"""Run under the real torchrun by tests/test_torchrun.py: init, device, local_rank_zero_first, a sum.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d ... tests/scripts/torchrun_check.py OUT_DIR

Every rank prints one `check:` line with who it is and the all-reduced sum of (rank + 1); the
events of the `local_rank_zero_first` block go to OUT_DIR/events.log (shared by all ranks and
"nodes" on this machine), each rank's pid to OUT_DIR/<rank>.pid (so a test can clean up).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

import minidp

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
args = parser.parse_args()
torch.set_num_threads(1)

env = minidp.init(timeout=60)
with open(os.path.join(args.out_dir, f"{env.rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
# The device is pinned by LOCAL_RANK (modulo the GPUs there are: gloo ranks may share one).
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
expected = torch.device("cuda", env.local_rank % gpus) if gpus else torch.device("cpu")
if env.device != expected or env.local_rank != int(os.environ["LOCAL_RANK"]):
    raise RuntimeError(f"device {env.device} / local rank {env.local_rank}: expected {expected} / LOCAL_RANK")
if gpus and torch.cuda.current_device() != expected.index:
    raise RuntimeError(f"current CUDA device {torch.cuda.current_device()}, expected {expected.index}")


def log(event: str) -> None:
    with open(os.path.join(args.out_dir, "events.log"), "a") as f:  # O_APPEND: whole lines, in order
        f.write(f"{event} node{env.node_rank} local{env.local_rank}\n")


with minidp.local_rank_zero_first():  # ranks meet here (barriers)
    log("start")
    if env.local_rank == 0:
        time.sleep(0.5)  # long enough that a missing barrier would let another rank start first
    log("end")

total = torch.tensor([float(env.rank + 1)], device=env.device)
dist.all_reduce(total)  # ranks meet here
print(f"check: rank {env.rank} local_rank {env.local_rank} node {env.node_rank} world {env.world_size} "
      f"device {env.device.type} sum {total.item():g}", flush=True)
dist.barrier()  # ranks meet here
minidp.shutdown()
