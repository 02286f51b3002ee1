"""A new gradient compressor in about 20 lines, trained with: TernGrad (Wen et al. 2017).

    python examples/custom_hook.py                          # 2 CPU workers, 300 steps per run
    python examples/custom_hook.py --steps 50 --nproc-per-node 2
    python -m minidp.run --nproc-per-node 2 examples/custom_hook.py

It trains the same small classifier twice (exact all-reduce, then TernGrad through
minidp.comm.compression_hook), shows rank 0's progress, and prints each run's loss, accuracy and bytes
sent per step.
minidp.comm does the rest: overlap with backward, the exchange (all-gather, since every rank's
scale differs), averaging, byte counting, the same hook on minidp.DDP or torch DDP.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import minidp
from minidp import comm
from progress import Progress  # examples/progress.py: a bar on a terminal, else a line every few steps


# ----------------------------------------------------------------------------- the new compressor
class TernGrad(comm.Compressor):
    """Each element becomes -s, 0 or +s (s: the bucket's largest magnitude), kept with probability |x|/s.

    Unbiased; one int8 per element plus one scale. Each rank has its own s, so the payloads cannot
    be summed: summable stays False and minidp.comm all-gathers them and decompresses each one.
    """

    def compress(self, tensor, ctx):  # ctx.generator: the hook's own, a different stream on each rank
        scale = tensor.abs().max()
        keep = torch.rand(tensor.shape, generator=ctx.generator, device=tensor.device, dtype=tensor.dtype) * scale
        ternary = (tensor.sign() * (keep < tensor.abs())).to(torch.int8)
        return [ternary, scale.reshape(1)]

    def decompress(self, payload, ctx):
        ternary, scale = payload
        return ternary.to(scale.dtype) * scale

    def payload_bytes(self, ctx):  # optional: the hook checks it against the bytes it counts, per bucket
        return ctx.numel + ctx.dtype.itemsize


# ----------------------------------------------------------------------------- training with it
def train(env: minidp.DistEnv, compressor, steps: int, name: str) -> dict:
    """Train a small classifier on a teacher's labels; each rank draws its own batches."""
    torch.manual_seed(0)
    model = minidp.DDP(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10)).to(env.device))
    state = None
    if compressor is not None:
        state, hook = comm.compression_hook(compressor, start_iter=10)  # 10 exact steps first
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(123)).to(env.device)
    gen = torch.Generator().manual_seed(env.rank)
    progress = Progress(steps, f"{name} training", every=max(1, steps // 5))
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen).to(env.device)
        loss = F.cross_entropy(model(x), (x @ teacher).argmax(1))
        opt.zero_grad()
        loss.backward()  # minidp.comm compresses and averages each bucket here
        opt.step()
        progress.step()
    progress.close()
    x = torch.randn(2048, 32, generator=torch.Generator().manual_seed(999)).to(env.device)
    with torch.no_grad():
        accuracy = (model.module(x).argmax(1) == (x @ teacher).argmax(1)).float().mean().item()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sent = state.stats()["bytes_sent"] / steps if state else grad_bytes  # exact all-reduce sends the grads
    return {"loss": loss.item(), "accuracy": accuracy, "bytes_per_step": sent}


def worker(local_rank: int, args: argparse.Namespace) -> None:
    env = minidp.init()
    for name, compressor in (("exact all-reduce", None), ("TernGrad", TernGrad())):
        r = train(env, compressor, args.steps, name)
        minidp.print0(f"{name:>16}: loss {r['loss']:.3f}  accuracy {r['accuracy']:.3f}  "
                      f"bytes sent per step {r['bytes_per_step']:,.0f}")
    minidp.shutdown()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="steps per run (default 300; the first 10 exact)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="CPU workers (default 2)")
    args = p.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--nproc-per-node", args.nproc_per_node)):
        if value < 1:  # refused here, before any worker starts (else a traceback from the launcher)
            p.error(f"{flag}={value} must be >= 1")
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:  # under torchrun / python -m minidp.run
        worker(int(os.environ["LOCAL_RANK"]), args)
    else:
        minidp.launch(worker, nprocs=args.nproc_per_node, args=(args,))


if __name__ == "__main__":
    main()
