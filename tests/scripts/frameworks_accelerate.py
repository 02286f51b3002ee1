"""Accelerate with accelerate.Accelerator (torch DDP) and minidp.accelerate.Accelerator, in the same processes.

Run under `accelerate launch` or torchrun at world size 2 on CPU: `... frameworks_accelerate.py OUT_DIR TAG`.
For gradient_accumulation_steps 1 and 3, each Accelerator trains 2 epochs (SGD with momentum, a shuffled
loader, accumulate()) and save_state()s after epoch 0; then each saved state resumes under the other
Accelerator (load_state()). Each rank writes OUT_DIR/<TAG>-<rank>.pt: final weights, the wrapper's type,
whether unwrap_model() is the user's module, get_state_dict() keys, gather()ed losses, the synced backward
count (minidp), the gradients after no_sync() and trigger_sync_in_backward(), and a run with an FP16 comm
hook from DistributedDataParallelKwargs. tests/test_frameworks.py compares them.
"""
import os
import sys
import warnings

import accelerate
import torch
import torch.distributed as dist
from accelerate.utils import DataLoaderConfiguration, DDPCommunicationHookType, DistributedDataParallelKwargs
from torch.utils.data import DataLoader, TensorDataset

import minidp
import minidp.accelerate

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
OUT, TAG = sys.argv[1], sys.argv[2]
KINDS = {"torch": accelerate.Accelerator, "minidp": minidp.accelerate.Accelerator}
ACCUMULATIONS = (1, 3)  # 3 of 8 batches per rank and epoch: the epoch's last step has 2 (synced at its end)


def make(kind, accumulate, handlers=()):
    """An Accelerator of `kind`, and a fresh model, optimizer and shuffled loader prepared by it."""
    # A seedable sampler: each epoch's shuffle depends on (seed, epoch) only, so a resumed run sees the same batches.
    acc = KINDS[kind](cpu=not torch.cuda.is_available(), gradient_accumulation_steps=accumulate,
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0),
                      kwargs_handlers=list(handlers))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(256, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    wrapped, optimizer, loader = acc.prepare(model, optimizer, loader)
    return acc, model, wrapped, optimizer, loader


def train_epoch(acc, wrapped, optimizer, loader, epoch):
    """One epoch; returns the last loss of every rank (gather()) and how many steps Accelerate synced."""
    loader.set_epoch(epoch)
    synced_steps = 0
    for x, y in loader:
        with acc.accumulate(wrapped):
            loss = torch.nn.functional.mse_loss(wrapped(x), y)
            acc.backward(loss)
            synced_steps += acc.sync_gradients
            optimizer.step()  # Accelerate's optimizer steps only when gradients were synced
            optimizer.zero_grad()
    return acc.gather(loss.detach()[None]), synced_steps  # ranks meet here


def result(acc, model, wrapped, epoch_results):
    losses, synced_steps = epoch_results
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "wrapper": f"{type(wrapped).__module__.split('.')[0]}.{type(wrapped).__name__}",
            "unwrapped_is_model": acc.unwrap_model(wrapped) is model,
            "state_dict_keys": sorted(acc.get_state_dict(wrapped)),
            "synced": wrapped.reducer.iteration if isinstance(wrapped, minidp.DDP) else None,
            "synced_steps": synced_steps, "losses": losses, "distributed_type": str(acc.distributed_type),
            "world_size": acc.num_processes}


def full_run(kind, accumulate):
    acc, model, wrapped, optimizer, loader = make(kind, accumulate)
    _, first = train_epoch(acc, wrapped, optimizer, loader, 0)
    acc.save_state(os.path.join(OUT, f"{TAG}-{kind}-{accumulate}"))  # ranks meet here
    losses, second = train_epoch(acc, wrapped, optimizer, loader, 1)
    out = result(acc, model, wrapped, (losses, first + second))
    acc.free_memory()
    return out


def resumed_run(saved, kind, accumulate):
    acc, model, wrapped, optimizer, loader = make(kind, accumulate)
    acc.load_state(os.path.join(OUT, f"{TAG}-{saved}-{accumulate}"))
    out = result(acc, model, wrapped, train_epoch(acc, wrapped, optimizer, loader, 1))
    acc.free_memory()
    return out


def hooked_run(kind):
    """One epoch with DistributedDataParallelKwargs: Accelerate's FP16 comm hook, gradients as bucket views."""
    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16, gradient_as_bucket_view=True)
    acc, model, wrapped, optimizer, loader = make(kind, 1, [handler])
    train_epoch(acc, wrapped, optimizer, loader, 0)
    hook = wrapped._comm_hook[1] if isinstance(wrapped, minidp.DDP) else wrapped._comm_hooks[0][0]
    out = {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "hook": hook.__qualname__,
           "gradient_as_bucket_view": wrapped.gradient_as_bucket_view}
    acc.free_memory()
    return out


def sync_switches(kind):
    """Gradients after a backward under no_sync(), and after trigger_sync_in_backward(): each rank's own data."""
    acc, model, wrapped, _, _ = make(kind, 1)
    x = torch.full((4, 8), float(acc.process_index + 1))  # different data on each rank: different gradients
    with acc.no_sync(wrapped):
        acc.backward(wrapped(x).sum())
    local = model[0].weight.grad.clone()
    model.zero_grad()
    with acc.no_sync(wrapped):
        out = wrapped(x).sum()
    with acc.trigger_sync_in_backward(wrapped):
        acc.backward(out)
    averaged = model[0].weight.grad.clone()
    acc.free_memory()
    return {"local": local, "averaged": averaged}


results = {}
for accumulate in ACCUMULATIONS:
    for kind in KINDS:
        results[kind, accumulate] = full_run(kind, accumulate)
accumulate = ACCUMULATIONS[-1]
for saved, resumed in (("torch", "minidp"), ("minidp", "torch")):
    results[f"{saved}->{resumed}", accumulate] = resumed_run(saved, resumed, accumulate)
for kind in KINDS:
    results["sync_switches", kind] = sync_switches(kind)
    results["comm_hook", kind] = hooked_run(kind)
torch.save(results, os.path.join(OUT, f"{TAG}-{dist.get_rank()}.pt"))
dist.barrier()  # ranks meet here: both files written before either process ends
dist.destroy_process_group()
