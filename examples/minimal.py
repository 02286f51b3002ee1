"""The smallest complete minidp training script: a torch DDP script after the README's one-line switch.

    torchrun --nproc-per-node 2 examples/minimal.py
    python -m minidp.run --nproc-per-node 2 examples/minimal.py     # minidp's launcher, same environment
    python examples/minimal.py                                      # one process: world size 1

Every rank fits the same linear model to its share of a synthetic regression set (minidp.DistributedSampler);
backward averages the gradients over the ranks; rank 0 prints each epoch's loss over all ranks' samples and how
far the learned weights are from the true ones. A few seconds on a CPU. No options: --help prints this text.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import minidp


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    env = minidp.init()  # process group from torchrun's / minidp.run's variables; gloo on CPU, NCCL on GPUs
    torch.set_num_threads(1)  # the ranks of a node share its cores
    torch.manual_seed(0)  # the same data and the same initial weights on every rank
    true_w = torch.randn(8, 1)
    x = torch.randn(1024, 8)
    data = TensorDataset(x, x @ true_w + 0.01 * torch.randn(1024, 1))
    sampler = minidp.DistributedSampler(data, seed=0)  # each rank its own 1/world_size of the samples
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = minidp.DDP(torch.nn.Linear(8, 1, bias=False).to(env.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    minidp.print0(f"minimal.py: {env.world_size} rank(s), {len(loader)} steps per epoch on each")
    for epoch in range(3):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total, count = 0.0, 0
        for xb, yb in loader:
            loss = F.mse_loss(model(xb.to(env.device)), yb.to(env.device))
            opt.zero_grad()
            loss.backward()  # ranks meet here: the gradients are averaged over the ranks
            opt.step()
            total, count = total + loss.item() * len(yb), count + len(yb)
        sums = minidp.all_reduce_sums({"loss": total, "count": count})  # ranks meet here
        minidp.print0(f"epoch {epoch + 1}: loss {sums['loss'] / sums['count']:.5f} over {sums['count']} samples")
    error = (model.module.weight.detach().cpu().T - true_w).abs().max().item()
    minidp.print0(f"largest weight error: {error:.4f}")
    minidp.shutdown()


if __name__ == "__main__":
    main()
