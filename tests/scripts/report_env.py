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
minidp.shutdown()
