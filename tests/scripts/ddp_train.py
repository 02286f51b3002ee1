"""A small torch DDP training script, written for torchrun on GPUs (NCCL).

tests/test_readme.py applies the README's ```diff blocks to it (torch DDP -> minidp) and runs the
result under torchrun at world size 2 on CPU (gloo), which works only if the switch is complete.
Rank 0 prints the world size, the engine, the optimizer's class, the state_dict key prefix, and whether every rank ended
with the same weights.
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

local_rank = int(os.environ["LOCAL_RANK"])
torch.set_num_threads(1)
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = DDP(model.cuda(), device_ids=[local_rank])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
device = next(model.parameters()).device
torch.manual_seed(1 + dist.get_rank())  # each rank its own batches
for _ in range(3):
    x, y = torch.randn(4, 8, device=device), torch.randn(4, 1, device=device)
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # ranks meet here: gradients averaged
    opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
low, high = flat.clone(), flat.clone()
# The two works stay referenced until the interpreter exits. Released right after wait(), gloo's worker
# thread may be the one to free them, and if that happens after Python began finalizing (the script
# ends here), the thread cannot take the GIL to free their tensors and the process aborts: "terminate
# called without an active exception" (torch's gloo, with torch DDP as with minidp; about 1 run in 5
# when runs overlap on this machine, none in 24 with the works held).
works = [dist.all_reduce(low, op=dist.ReduceOp.MIN, async_op=True),  # ranks meet here
         dist.all_reduce(high, op=dist.ReduceOp.MAX, async_op=True)]
for work in works:
    work.wait()
if dist.get_rank() == 0:
    engine = f"{type(model).__module__.split('.')[0]}.{type(model).__name__}"
    prefixed = all(k.startswith("module.") for k in model.state_dict())
    print(f"train.py: {dist.get_world_size()} ranks, {engine}, {type(opt).__name__}, state_dict keys with "
          f"'module.': {prefixed}, same weights on every rank: {torch.equal(low, high)}", flush=True)
dist.destroy_process_group()
