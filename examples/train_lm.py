"""Train a small character-level transformer, nanoGPT-style, with minidp or torch DDP.

    python examples/train_lm.py                                # 2 workers, a text found on this machine
    python examples/train_lm.py --data input.txt --engine ddp --grad-accum 4 --bf16 --compile
    torchrun --nproc-per-node 4 examples/train_lm.py --data input.txt      # or python -m minidp.run
    python examples/train_lm.py --out-dir ckpt --max-steps 200; python examples/train_lm.py --out-dir ckpt \\
        --max-steps 400 --resume                               # continues exactly where it stopped

Without --data it trains on the license texts shipped in torch's wheel (about 300 KB, found at run
time), else on Python's own LICENSE.txt. Gradient accumulation is DDP's idiom from nanoGPT: only the
last micro-step sets `model.require_backward_grad_sync = True`, so the all-reduce runs once per step.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from progress import rate_and_eta  # examples/progress.py, shared with the other examples


# ----------------------------------------------------------------------------- the model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, blocks, final norm, a head tied to the token embedding."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, reduced once
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, new_tokens: int, generator: torch.Generator):
        for _ in range(new_tokens):
            logits, _ = self(idx[:, -self.block_size:])
            probs = torch.softmax(logits[:, -1].float(), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


# ----------------------------------------------------------------------------- the data
def default_text() -> tuple[str, str]:
    """(text, where it came from): the license texts in torch's wheel, else Python's LICENSE.txt."""
    try:
        files = sorted((f for f in importlib.metadata.distribution("torch").files or () if "/licenses/" in str(f)),
                       key=str)
        text = "".join(f.locate().read_text(errors="replace") for f in files if os.path.isfile(f.locate()))
        if len(text) > 10_000:
            return text, f"{len(files)} license files of torch's wheel"
    except importlib.metadata.PackageNotFoundError:
        pass
    path = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    if not os.path.isfile(path):
        raise SystemExit("train_lm: no text found on this machine; pass --data FILE")
    return open(path, errors="replace").read(), path


class CharData:
    """Characters as tokens; 90% train / 10% val; batches drawn from (seed, rank, step), so resumable."""

    def __init__(self, text: str, seed: int):
        self.chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        tokens = torch.tensor([lookup[c] for c in text], dtype=torch.int64)
        cut = int(0.9 * len(tokens))
        self.splits, self.seed = {"train": tokens[:cut], "val": tokens[cut:]}, seed

    def batch(self, split: str, batch_size: int, block_size: int, *where: int):
        """One (x, y) batch; `where` (rank, step, micro-step) picks it, nothing else does."""
        data = self.splits[split]
        key = hashlib.sha256(repr((self.seed, split, *where)).encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key[:7], "little"))
        starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
        x = torch.stack([data[s:s + block_size] for s in starts])
        y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts])
        return x, y

    def decode(self, idx) -> str:
        return "".join(self.chars[i] for i in idx.tolist())


# ----------------------------------------------------------------------------- training
def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to lr/10 at --lr-decay-steps (nanoGPT's schedule)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.lr_decay_steps - args.warmup_steps))
    return args.lr / 10 + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.lr / 10)


def build(args, vocab_size: int, device: torch.device):
    """(raw model, the model to call: compiled and wrapped by the chosen engine, optimizer)."""
    torch.manual_seed(args.seed)
    raw = GPT(vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd).to(device)
    model = torch.compile(raw) if args.compile else raw
    engine = minidp.DDP if args.engine == "minidp" else TorchDDP
    model = engine(model, device_ids=[device] if device.type == "cuda" else None)
    decay = [p for p in raw.parameters() if p.dim() >= 2]  # weights decay; biases and norms do not
    rest = [p for p in raw.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    return raw, model, opt


@torch.no_grad()
def val_loss(raw: GPT, data: CharData, args, rank: int, ctx) -> float:
    """Mean loss over --eval-batches batches per rank, counted over all ranks (one all-reduce)."""
    total = 0.0
    for i in range(args.eval_batches):
        x, y = data.batch("val", args.batch_size, args.block_size, rank, -1, i)
        with ctx:
            total += raw(x.to(args.device), y.to(args.device))[1].item()
    sums = minidp.all_reduce_sums({"loss": total, "count": args.eval_batches})  # ranks meet here
    return sums["loss"] / sums["count"]


def train(args) -> dict:
    """Train on this rank (the process group may exist already, e.g. in a test); returns a summary."""
    own_group = not dist.is_initialized()
    env = minidp.init() if own_group else None
    rank = dist.get_rank()
    args.device = env.device if env else torch.device("cpu")
    text, source = (open(args.data, errors="replace").read(), args.data) if args.data else default_text()
    data = CharData(text, args.seed)
    raw, model, opt = build(args, len(data.chars), args.device)
    minidp.print0(f"{args.engine}: {sum(p.numel() for p in raw.parameters()):,} parameters, "
                  f"{len(text):,} characters from {source}, world size {dist.get_world_size()}")
    ckpt = os.path.join(args.out_dir, "ckpt.pt") if args.out_dir else None
    start = minidp.load_checkpoint(ckpt, raw, opt)["step"] if args.resume and ckpt else 0
    ctx = torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.bf16)
    losses, began = [], time.perf_counter()
    for step in range(start, args.max_steps):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        for micro in range(args.grad_accum):
            # DDP's accumulation idiom: only the last micro-step's backward all-reduces.
            model.require_backward_grad_sync = micro == args.grad_accum - 1
            x, y = data.batch("train", args.batch_size, args.block_size, rank, step, micro)
            with ctx:
                _, loss = model(x.to(args.device), y.to(args.device))
            (loss / args.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.max_steps - 1:
            done, now = step + 1 - start, time.perf_counter()
            minidp.print0(f"step {step}: loss {losses[-1]:.4f}, {1e3 * (now - t0):.0f} ms, "
                          f"{rate_and_eta(done, args.max_steps - start, now - began)}")
    if ckpt:
        os.makedirs(args.out_dir, exist_ok=True)
        minidp.save_checkpoint(ckpt, raw, opt, step=args.max_steps)  # every rank calls it: ranks meet here
    summary = {"losses": losses, "val_loss": val_loss(raw, data, args, rank, ctx), "start": start,
               "state": {k: v.detach().cpu().clone() for k, v in raw.state_dict().items()}}
    minidp.print0(f"val loss {summary['val_loss']:.4f}")
    if args.sample and rank == 0:
        out = raw.generate(torch.zeros(1, 1, dtype=torch.int64, device=args.device), args.sample,
                           torch.Generator(args.device).manual_seed(args.seed))
        print(data.decode(out[0]))
    if args.report and rank == 0:
        write_report(args.report, summary, source)
    if own_group:
        minidp.shutdown()
    return summary


def write_report(path: str, summary: dict, source: str) -> None:
    """JSON: losses, validation loss, the text's origin, a SHA-256 of the final weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(summary["state"].items()):
        digest.update(name.encode() + tensor.float().numpy().tobytes())
    with open(path, "w") as f:
        json.dump({"losses": summary["losses"], "val_loss": summary["val_loss"], "data": source,
                   "weights_sha256": digest.hexdigest()}, f)


# A preset for smoke tests (as the other examples' --tiny): a 2-layer, 32-wide model, 3 steps.
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8, max_steps=3, eval_batches=1, log_every=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", help="a text file (default: license texts found on this machine)")
    p.add_argument("--engine", choices=("minidp", "ddp"), default="minidp", help="ddp = torch's DDP")
    p.add_argument("--nproc-per-node", type=int, default=torch.cuda.device_count() or 2,
                   help="workers to start when not under torchrun / minidp.run (default: one per GPU, else 2)")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--lr-decay-steps", type=int, default=None, help="end of the cosine (default: --max-steps)")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per worker per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward")
    p.add_argument("--compile", action="store_true", help="torch.compile the model before wrapping it")
    p.add_argument("--out-dir", help="write OUT_DIR/ckpt.pt at the end (model, optimizer, step, RNG)")
    p.add_argument("--resume", action="store_true", help="start from OUT_DIR/ckpt.pt")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--sample", type=int, default=0, help="characters to generate at the end (rank 0)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--report", help="JSON summary written by rank 0")
    p.add_argument("--tiny", action="store_true", help=f"test preset (changes the defaults only): {TINY}")
    if "--tiny" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**TINY)
    args = p.parse_args(argv)
    for name in ("nproc_per_node", "max_steps", "batch_size", "grad_accum", "block_size", "n_layer", "n_head",
                 "n_embd", "eval_batches", "log_every", "warmup_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd={args.n_embd} must be a multiple of --n-head={args.n_head}")
    if args.resume and not args.out_dir:
        p.error("--resume needs --out-dir")
    if args.data and not os.path.isfile(args.data):
        p.error(f"--data={args.data!r} is not a file")
    args.lr_decay_steps = args.lr_decay_steps or args.max_steps
    return args


def worker(local_rank: int, args) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    train(args)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:  # under torchrun or python -m minidp.run
        worker(int(os.environ["LOCAL_RANK"]), args)
    else:
        minidp.launch(worker, nprocs=args.nproc_per_node, args=(args,))


if __name__ == "__main__":
    main()
