r"""minidp inside Hugging Face Accelerate: `from minidp.accelerate import Accelerator`, nothing else changed.

    torchrun --nproc-per-node 2 examples/accelerate_minidp.py                    # both engines, compared
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no --main_process_port 0 examples/accelerate_minidp.py    # Accelerate's launcher
    torchrun --nproc-per-node 2 examples/accelerate_minidp.py --engine minidp    # one engine only

Without GPUs the script asks Accelerate for CPU processes (cpu=True): `--multi_gpu` is then just
Accelerate's torchrun-based launcher (`--cpu` would start one process); `--main_process_port 0` picks a
free port. A small regression MLP trains for 2 epochs (SGD with momentum, a shuffled loader that
Accelerate shards), once without gradient accumulation and once with accumulate() over 2 batches
(Accelerate then calls minidp's no_sync()), under each engine in turn in the same processes:
accelerate.Accelerator (torch DDP) and minidp.accelerate.Accelerator. Rank 0 prints, per run, the
gathered losses and a fingerprint of the weights' bytes, then whether the two engines' weights are
bitwise equal. Needs Accelerate (`make` installs it; elsewhere `pip install -e '.[accelerate]'` from the clone).
A few seconds on a CPU.
"""
import argparse
import hashlib

import accelerate
import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

import minidp.accelerate

ENGINES = {"ddp": accelerate.Accelerator, "minidp": minidp.accelerate.Accelerator}


def train(engine: str, accumulation: int) -> str:
    """2 epochs under ENGINES[engine]; rank 0 prints what it saw. Returns the weights' fingerprint."""
    # A seedable sampler: each epoch's shuffle depends on (seed, epoch) only, the same for both engines.
    accelerator = ENGINES[engine](cpu=not torch.cuda.is_available(), gradient_accumulation_steps=accumulation,
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
            with accelerator.accumulate(wrapped):  # no_sync() on all but every `accumulation`-th batch
                loss = torch.nn.functional.mse_loss(wrapped(xb), yb)
                accelerator.backward(loss)  # ranks meet here when Accelerate syncs this step
                optimizer.step()
                optimizer.zero_grad()
    losses = accelerator.gather(loss.detach()[None])  # ranks meet here: every rank's last loss
    unwrapped = accelerator.unwrap_model(wrapped) is model  # the user's module, not the wrapper
    weights = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
    fingerprint = hashlib.sha256(weights).hexdigest()[:16]
    if accelerator.is_main_process:
        print(f"accelerate_minidp.py: engine={engine}, {type(wrapped).__module__.split('.')[0]}."
              f"{type(wrapped).__name__} on {accelerator.num_processes} processes, gradient_accumulation_steps="
              f"{accumulation}, unwrap_model() is the model: {unwrapped}, last losses "
              f"{[round(v, 5) for v in losses.tolist()]}, weights {fingerprint}", flush=True)
    accelerator.free_memory()
    return fingerprint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["both", *ENGINES], default="both",
                        help='"minidp" (minidp.accelerate.Accelerator), "ddp" (accelerate.Accelerator: torch DDP) '
                             'or "both" (default): each in turn, then the comparison')
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share this machine's cores
    engines = list(ENGINES) if args.engine == "both" else [args.engine]
    for accumulation in (1, 2):
        fingerprints = {engine: train(engine, accumulation) for engine in engines}
        if len(fingerprints) == 2:
            minidp.print0(f"accelerate_minidp.py: gradient_accumulation_steps={accumulation}: minidp's weights "
                          f"are torch DDP's, bitwise: {fingerprints['minidp'] == fingerprints['ddp']}")
    accelerate.PartialState().destroy_process_group()  # ranks meet here: the process group is destroyed


if __name__ == "__main__":
    main()
