"""minidp inside PyTorch Lightning: `import minidp.lightning`, then `Trainer(strategy="minidp")`.

    python examples/lightning_minidp.py                # 2 processes on CPU, started by Lightning's own launcher
    python examples/lightning_minidp.py --engine ddp   # the same with Lightning's torch DDP (strategy="ddp")

A small regression MLP trains for 2 epochs (SGD with momentum, a shuffled loader that Lightning shards
with its DistributedSampler, 2 batches accumulated per optimizer step: Lightning calls minidp's no_sync()).
Rank 0 prints the final loss and a fingerprint of the weights' bytes: both engines print the same
(bitwise equal weights). Needs Lightning (`make` installs it; elsewhere `pip install -e '.[lightning]'` from the
clone). A few seconds on a CPU.
"""
import argparse
import hashlib

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import minidp.lightning  # noqa: F401  registers strategy="minidp" (and "minidp_spawn", "minidp_fork")


class Regression(L.LightningModule):
    """An MLP fitting y = sin(sum(x)), trained with SGD and momentum."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # averaged over the ranks (Lightning's all-reduce)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="minidp", choices=["minidp", "ddp"],
                        help='the strategy: "minidp" (default) or Lightning\'s "ddp" (torch DDP)')
    parser.add_argument("--accelerator", default="cpu", help='"cpu" (default) or "gpu"')
    parser.add_argument("--devices", type=int, default=2, help="processes on this machine (default 2)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share this machine's cores
    L.seed_everything(0, verbose=False)  # the same data and initial weights on every rank and with both engines
    x = torch.randn(512, 8)
    data = TensorDataset(x, x.sum(1, keepdim=True).sin())
    model = Regression()
    trainer = L.Trainer(strategy=args.engine, accelerator=args.accelerator, devices=args.devices, max_epochs=2,
                        accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=16, shuffle=True))
    if trainer.is_global_zero:
        weights = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
        print(f"lightning_minidp.py: strategy={args.engine}, {trainer.world_size} processes, "
              f"{trainer.global_step} steps, loss {trainer.callback_metrics['loss']:.5f}, "
              f"weights {hashlib.sha256(weights).hexdigest()[:16]}", flush=True)


if __name__ == "__main__":
    main()
