r"""minidp inside Hugging Face Accelerate: `from minidp.accelerate import Accelerator`, nothing else changed.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no --main_process_port 0 examples/accelerate_minidp.py    # Accelerate's launcher
    torchrun --nproc-per-node 2 examples/accelerate_minidp.py                    # or torchrun
    torchrun --nproc-per-node 2 examples/accelerate_minidp.py --engine ddp       # accelerate's own (torch DDP)

Without GPUs the script asks Accelerate for CPU processes (cpu=True): `--multi_gpu` is then just
Accelerate's torchrun-based launcher (`--cpu` would start one process); `--main_process_port 0` picks a
free port. A small regression MLP trains for 2 epochs (SGD with momentum, a shuffled loader that
Accelerate shards, accumulate() over 2 batches: Accelerate calls minidp's no_sync()). Rank 0 prints the
gathered losses and a fingerprint of the weights' bytes: both engines print the same (bitwise equal
weights). Needs `pip install 'minidp[accelerate]'`. A few seconds on a CPU.
"""
import argparse
import hashlib

import accelerate
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

import minidp.accelerate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="minidp", choices=["minidp", "ddp"],
                        help="minidp.accelerate.Accelerator (default) or accelerate.Accelerator (torch DDP)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share this machine's cores
    Accelerator = minidp.accelerate.Accelerator if args.engine == "minidp" else accelerate.Accelerator
    # A seedable sampler: each epoch's shuffle depends on (seed, epoch) only, the same for both engines.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0))
    torch.manual_seed(0)  # the same data and initial weights on every rank and with both engines
    x = torch.randn(512, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    wrapped, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # minidp.DDP(model) with minidp
    for epoch in range(2):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            with accelerator.accumulate(wrapped):  # no_sync() on all but every 2nd batch
                loss = torch.nn.functional.mse_loss(wrapped(xb), yb)
                accelerator.backward(loss)  # ranks meet here when Accelerate syncs this step
                optimizer.step()
                optimizer.zero_grad()
    losses = accelerator.gather(loss.detach()[None])  # ranks meet here: every rank's last loss
    unwrapped = accelerator.unwrap_model(wrapped) is model  # the user's module, not the wrapper
    if accelerator.is_main_process:
        weights = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
        print(f"accelerate_minidp.py: engine={args.engine}, {type(wrapped).__module__.split('.')[0]}."
              f"{type(wrapped).__name__} on {accelerator.num_processes} processes, unwrap_model() is the model: "
              f"{unwrapped}, last losses "
              f"{[round(v, 5) for v in losses.tolist()]}, weights {hashlib.sha256(weights).hexdigest()[:16]}",
              flush=True)
    accelerator.end_training()  # ranks meet here: the process group is destroyed


if __name__ == "__main__":
    main()
