"""The compression study's task and methods: a character-level MLP on the license texts in torch's wheel.

    import compression_task as task
    text = task.Text.load()                  # no download: examples/train_lm.py's finder, by import
    model = task.CharMLP(text.vocab)         # 16 characters of context -> the next one
    x, y = text.batch(step=0, seed=0, global_batch=128, rank=0, world_size=2)

Data: examples/train_lm.py's default_text() (the license files shipped in torch's wheel, about 300 KB,
else Python's LICENSE.txt), split 90/10 as its CharData does. A step's global batch is drawn from
(seed, step) alone and each rank takes its slice, so a run sees the same samples at any world size
(the validation at world size 4 keeps the global batch). The validation set is fixed (seed 0).
METHODS maps a study name to how it communicates (see attach()). Three methods bring their own optimizer
(optimizer()): DeMo and 1-bit Adam communicate inside their step (no DDP wrapper: no gradient all-reduce,
as their authors use them), and Adam is their exact baseline (DDP's all-reduce, torch.optim.Adam).
"""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))

import train_lm  # noqa: E402 - examples/ is not a package: its text finder and CharData, not copied

from minidp import comm  # noqa: E402

START_ITER = 10  # exact steps before any method starts (local SGD and DiLoCo: their warm-up)
LOCAL_PERIOD, DILOCO_PERIOD = 4, 8
# Adam-like methods: betas (0.9, 0.95) (a common LM setting) so that 1-bit Adam's variance, frozen after its
# warm-up of cfg["freeze_step"] steps, has settled (0.95 ** 40 = 13% of its start left; DeepSpeed's 0.999
# needs thousands of steps). DeMo: the authors' defaults (decay 0.999, top 32 of each 64 x 64 DCT block).
BETAS = (0.9, 0.95)
# 1-bit Adam's eps: 1e-6, not the paper's 1e-8. Embedding rows of characters not yet seen when the variance
# freezes (5 of 92 after 40 steps) keep v = 0, yet the compressed momentum gives every element +-scale: the
# update scale / eps. At 1e-8 that diverged (lr 0.003, seed 0: nan by step 220); 1e-6 and 1e-4 trained.
ONEBIT_EPS = 1e-6
STREAMING = dict(fragments=2, sync_delay=1, quantize_bits=4)  # CharMLP has 3 modules: F=2 divides period 8


def _diloco(model, period=DILOCO_PERIOD, start_iter=START_ITER, **streaming):
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)  # the paper's outer step
    if streaming:
        return comm.StreamingDiLoCo(model, outer, period=period, warmup_steps=start_iter, **streaming)
    return comm.DiLoCo(model, outer, period=period, warmup_steps=start_iter)


def optimizer(name: str, params, lr: float, freeze_step: int) -> torch.optim.Optimizer:
    """Method `name`'s optimizer at `lr`: SGD momentum 0.9 unless the method brings its own (OWN_OPTIMIZER)."""
    spec = METHODS.get(name)
    if spec == "adam":
        return torch.optim.Adam(params, lr=lr, betas=BETAS)
    if spec == "demo":
        return comm.DeMo(params, lr=lr)  # ranks meet here (its transport's group)
    if spec == "onebit":
        return comm.OneBitAdam(params, lr=lr, betas=BETAS, eps=ONEBIT_EPS, freeze_step=freeze_step)  # ranks meet here
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def method_start(name: str, cfg: dict) -> int:
    """Steps before the method's own communication starts: 1-bit Adam's freeze_step, DeMo's 0, else start_iter."""
    return {"onebit": cfg["freeze_step"], "demo": 0}.get(METHODS.get(name), cfg["start_iter"])


# name: (compressor factory, error feedback) for hooks; "local" / "diloco": parameter averaging; None: exact
METHODS = {
    "exact": None,
    "FP16": (comm.FP16, False), "BF16": (comm.BF16, False),
    "TopK 1%": (lambda: comm.TopK(0.01), False), "TopK 1%+EF": (lambda: comm.TopK(0.01), True),
    "RandomK 1%": (lambda: comm.RandomK(0.01), False), "RandomK 1%+EF": (lambda: comm.RandomK(0.01), True),
    "QSGD 16": (lambda: comm.QSGD(16), False), "QSGD 16+EF": (lambda: comm.QSGD(16), True),
    "Sign": (comm.Sign, False), "Sign+EF": (comm.Sign, True),
    "PowerSGD 1": (lambda: comm.PowerSGD(1), False), "PowerSGD 1+EF": (lambda: comm.PowerSGD(1), True),
    "PowerSGD 4+EF": (lambda: comm.PowerSGD(4), True),
    f"local SGD /{LOCAL_PERIOD}": "local",
    f"DiLoCo /{DILOCO_PERIOD}": "diloco",
    f"Streaming DiLoCo /{DILOCO_PERIOD}": "streaming",  # STREAMING: 2 fragments, sync_delay 1, 4 bits
    "Adam": "adam", "DeMo": "demo", "1-bit Adam": "onebit",
}
BUCKET_BYTES = (1_239_408, 11_776)  # CharMLP's two DDP buckets (exact's recorded all-reduces), bytes
OWN_OPTIMIZER = ("adam", "demo", "onebit")  # swept over --adam-lrs: sign and Adam steps want a smaller lr
NO_DDP = ("demo", "onebit")  # their step communicates; a plain module, no gradient all-reduce


class Text:
    """The character data: train tokens, a fixed validation set, batches by (seed, step)."""

    def __init__(self, text: str, source: str, context: int = 16, val_windows: int = 4096):
        self.source, self.context = source, context
        self.data = train_lm.CharData(text, seed=0)
        self.vocab = len(self.data.chars)
        x, y = self.data.batch("val", val_windows, context, -1)  # fixed: seed 0, "step" -1
        self.val = (x, y[:, -1])

    @classmethod
    def load(cls, **kwargs) -> "Text":
        text, source = train_lm.default_text()
        return cls(text, source, **kwargs)

    def batch(self, step: int, seed: int, global_batch: int, rank: int, world_size: int):
        """This rank's slice of the step's global batch: (context characters, the next character)."""
        if global_batch % world_size:
            raise ValueError(f"global_batch={global_batch} must be a multiple of world_size={world_size}")
        x, y = self.data.batch("train", global_batch, self.context, seed, step)
        per = global_batch // world_size
        return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per, -1]


class CharMLP(nn.Module):
    """Bengio et al. 2003's model: embed each of `context` characters, a GELU hidden layer, logits."""

    def __init__(self, vocab: int, context: int = 16, embed: int = 32, hidden: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.hidden = nn.Linear(context * embed, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.hidden(self.embed(x).flatten(1))))


@torch.no_grad()
def val_loss(module: nn.Module, text: Text) -> float:
    """Cross-entropy (nats per character) of `module` on the fixed validation set."""
    x, y = text.val
    return torch.nn.functional.cross_entropy(module(x), y).item()


class RecordingDist(comm.TorchDist):
    """TorchDist that notes every collective it is handed: (op, bytes of this rank's input)."""

    def __init__(self):
        super().__init__()  # ranks meet here (a new group)
        self.calls: list = []

    def all_reduce(self, tensor):
        self.calls.append(("all_reduce", tensor.numel() * tensor.element_size()))
        return super().all_reduce(tensor)

    def all_gather(self, output, input):
        self.calls.append(("all_gather", input.numel() * input.element_size()))
        return super().all_gather(output, input)

    def all_to_all(self, output, input):
        self.calls.append(("all_to_all", input.numel() * input.element_size()))
        return super().all_to_all(output, input)

    @classmethod
    def wrapping(cls, transport: comm.TorchDist) -> "RecordingDist":
        """A RecordingDist on `transport`'s own group (no new group): for an optimizer's Channel."""
        recording = cls.__new__(cls)
        recording.__dict__.update(vars(transport), calls=[])
        return recording


def attach(model, name: str, start_iter: int = START_ITER, opt=None):
    """Register method `name`'s communication on the minidp.DDP `model`: (what steps after opt.step(), counter).

    The counter has stats() (bytes sent); a RecordingDist (as counter.transport) lists a hook's or an
    optimizer's (DeMo, 1-bit Adam: `opt`, on a plain module) collectives.
    """
    spec = METHODS[name]
    if spec in NO_DDP:
        opt.channel.transport = RecordingDist.wrapping(opt.channel.transport)
        return None, opt
    if spec in (None, "adam"):
        return None, None
    if spec == "local":
        averager = comm.PeriodicAverager(model, period=LOCAL_PERIOD, warmup_steps=start_iter)
        return averager, averager
    if spec in ("diloco", "streaming"):
        diloco = _diloco(model, start_iter=start_iter, **(STREAMING if spec == "streaming" else {}))
        return diloco, diloco
    make, ef = spec
    state, hook = comm.compression_hook(make(), memory=comm.ErrorFeedback() if ef else None,
                                        transport=RecordingDist(), start_iter=start_iter)
    model.register_comm_hook(state, hook)
    return None, state


def collectives(name: str, calls: list, param_bytes: int, world_size: int, stepper=None) -> list:
    """The collectives of one compressed step as the simulator reads them.

    Each: op, bytes (this rank's input at `world_size`), per_step (how often per step), and scale:
    "fixed" (the same input at any world size) or "chunk" (input = bytes * world_size / N: Sign's
    server stage sends only its 1/N chunk of the signs); Streaming DiLoCo's also overlap_steps (the
    inner steps its sync runs beside). Streaming DiLoCo's (the `stepper`), per fragment every period
    steps: the all-gathers of its 4-bit codes (two to a byte) and of its float32 scales, one per tensor.
    """
    spec = METHODS[name]
    if spec == "streaming":
        out = []
        for fragment in stepper.fragments:
            numel = sum(stepper.params[i].numel() for i in fragment)
            for nbytes in (-(-numel // 2), 4 * len(fragment)):
                out.append({"op": "all_gather", "bytes": nbytes, "per_step": 1 / stepper.period, "scale": "fixed",
                            "overlap_steps": stepper.sync_delay})
        return out
    if spec in ("local", "diloco"):
        period = LOCAL_PERIOD if spec == "local" else DILOCO_PERIOD
        return [{"op": "all_reduce", "bytes": param_bytes, "per_step": 1 / period, "scale": "fixed"}]
    a2a = [b for op, b in calls if op == "all_to_all"]
    out = []
    for op, nbytes in calls:
        chunk = op == "all_gather" and any(nbytes * world_size == b for b in a2a)
        out.append({"op": op, "bytes": nbytes, "per_step": 1, "scale": "chunk" if chunk else "fixed"})
    return out


def payload_cost(name: str, bucket_numels, repeats: int = 30) -> float:
    """Seconds one more rank's payload adds to a step: what the aggregate of a method that all-gathers
    (a single-round compressor that is not summable: TopK, QSGD) spends on each rank's payload, decompress
    and add, over the step's buckets of `bucket_numels` elements. 0 for the other methods (an all-reduce
    sums in the collective; Sign's server stage decodes 1/N of the signs from each of N ranks; DeMo
    concatenates the coefficients and decodes once).

    Measured as (aggregate of 5 payloads - aggregate of 1) / 4, the medians of `repeats` runs: the cost
    phase at world size 1 aggregates one payload, so N ranks add N - 1 of these.
    """
    import statistics
    import time

    spec = METHODS.get(name)
    if not isinstance(spec, tuple):
        return 0.0
    compressor = spec[0]()
    if not isinstance(compressor, comm.Compressor) or compressor.summable:
        return 0.0
    total = 0.0
    for numel in bucket_numels:
        tensor = torch.randn(numel)
        ctx = comm.Context.for_tensor(tensor)
        payload = compressor.compress(tensor.clone(), ctx)
        times = {}
        for count in (1, 5):
            runs = []
            for _ in range(repeats):
                began = time.perf_counter()
                compressor.aggregate([payload] * count, ctx)
                runs.append(time.perf_counter() - began)
            times[count] = statistics.median(runs)
        total += max(0.0, (times[5] - times[1]) / 4)
    return total


def onebit_compression_cost(shapes, repeats: int = 30) -> float:
    """Seconds 1-bit Adam's compressed step adds: comm.Sign's worker and server stages, with both errors,
    over the flat momentum of `shapes` (what OneBitAdam runs after its warm-up), on a group of one rank,
    where OneBitAdam itself compresses nothing (DeepSpeed's rule). Needs an initialized process group."""
    import math
    import statistics
    import time

    from minidp.comm.exchange import Channel, Job

    channel, sign = Channel(comm.TorchDist()), comm.Sign()  # ranks meet here (TorchDist: a new group)
    numels = [math.prod(shape) for shape in shapes]
    momentum, times = torch.randn(sum(numels)), []
    for step in range(repeats + 3):  # three warm-ups
        began = time.perf_counter()
        job = Job(momentum.clone(), list(range(len(numels))), numels, True,
                  comm.Context(0, 1, step, list(shapes), momentum.dtype, momentum.device))
        sign.reduce(job, channel)  # ranks meet here (one)
        times.append(time.perf_counter() - began)
    return statistics.median(times[3:])


def gradient_energy(text: Text, lr: float = 0.1, steps=(10, 100, 200, 300), seed: int = 0) -> dict:
    """How much of a gradient TopK 1% and a rank-1/rank-4 approximation keep, along exact SGD's run (one process).

    Per probed step: the share of the gradient's squared norm in its 1% largest entries (TopK 1%'s best
    case) and, per matrix, in its best rank-1 and rank-4 approximation (singular values; PowerSGD's one
    warm-started power iteration keeps at most that). What a compressor leaves out, error feedback carries
    into later steps.
    """
    torch.manual_seed(seed)
    model = CharMLP(text.vocab, text.context)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    out = {}
    for step in range(max(steps) + 1):
        x, y = text.batch(step, seed, 128, 0, 1)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / START_ITER)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if step in steps:
            grads = {name: p.grad for name, p in model.named_parameters()}
            flat = torch.cat([g.flatten() for g in grads.values()])
            row = {"topk_1%": ((flat.abs().topk(len(flat) // 100).values ** 2).sum() / (flat ** 2).sum()).item()}
            for name, g in grads.items():
                if g.dim() == 2:
                    energy = torch.linalg.svdvals(g) ** 2
                    row[f"{name} {tuple(g.shape)} rank 1"] = (energy[:1].sum() / energy.sum()).item()
                    row[f"{name} {tuple(g.shape)} rank 4"] = (energy[:4].sum() / energy.sum()).item()
            out[step] = row
        opt.step()
    return out
