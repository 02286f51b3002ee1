"""Run by the CLI test: checks torchrun's variables, all-reduces, prints once, logs per rank."""
import json
import os
import sys

import torch
import torch.distributed as dist

import minidp

torch.set_num_threads(1)
out_dir = sys.argv[1]
env = minidp.init(timeout=60)
total = torch.tensor([float(env.rank + 1)])
dist.all_reduce(total)  # ranks meet here
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
with open(os.path.join(out_dir, f"{env.rank}.json"), "w") as f:
    json.dump({"env": {n: os.environ[n] for n in names}, "sum": total.item(), "argv": sys.argv[1:],
               "name": __name__}, f)
minidp.print0("printed once by rank 0")
minidp.get_logger().info("hello from the logger")
minidp.shutdown()
