"""Shared pieces of the two training examples: options, data root, model, optimizer, precision, evaluation.

train_torchvision.py and train_dali.py differ only in how images reach the model; everything else
(command line, the ResNet-18, engine, optimizer and warm-up, mixed precision, exact evaluation,
checkpoints, the JSON report) lives here, the synthetic image set in synthetic.py, and the progress
line every long-running example shows in progress.py (common.Progress too).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from synthetic import draw_image, ensure_synthetic, write_synthetic  # noqa: F401 - examples/synthetic.py, also as common.*
from torch import nn

import minidp
from minidp.data.dali import IMAGENET_MEAN, IMAGENET_STD
from progress import Progress, duration, rate_and_eta  # noqa: F401 - examples/progress.py, also as common.*

MEAN, STD = IMAGENET_MEAN, IMAGENET_STD  # torchvision's Normalize values, the DALI loader's defaults
DEFAULT_LR = {"sgd": 0.05, "lars": 0.05, "lamb": 2e-3, "novograd": 5e-3}  # base lr for one worker, before scaling
DEFAULT_WD = {"sgd": 5e-4, "lars": 5e-4, "lamb": 0.01, "novograd": 1e-3}
# A small, fast preset for tests: 60 + 20 images of 16x16, a narrow net, a few steps.
TINY = dict(train_per_class=6, val_per_class=2, image_size=16, width=8, batch_size=4, epochs=1, max_steps=3)


def positive(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def parse_args(description: str, argv=None) -> argparse.Namespace:
    """The options both examples share (see the README); --tiny changes the defaults only."""
    p = argparse.ArgumentParser(description=description)
    launch = p.add_argument_group("launch (ignored under torchrun / python -m minidp.run)")
    launch.add_argument("--nproc-per-node", type=positive, default=torch.cuda.device_count() or 2,
                        help="worker processes on this node (default: one per GPU, else 2)")
    launch.add_argument("--nnodes", type=positive, default=1)
    launch.add_argument("--node-rank", type=int, default=0)
    launch.add_argument("--master-addr", default="127.0.0.1", help="address of node 0")
    launch.add_argument("--master-port", type=int, default=None, help="default: a free port (one node only)")
    p.add_argument("--epochs", type=positive, default=3)
    p.add_argument("--batch-size", type=positive, default=32, help="images per worker per step")
    p.add_argument("--lr", type=float, default=None, help=f"base lr for one worker, default {DEFAULT_LR}; "
                   "scaled by the world size (sqrt for lamb and novograd) after a linear warm-up")
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--optimizer", choices=("sgd", "lars", "lamb", "novograd"), default="sgd")
    p.add_argument("--amp", action="store_true", help="mixed precision: float16 autocast and a GradScaler "
                   "on CUDA, bfloat16 autocast on CPU")
    p.add_argument("--engine", choices=("minidp", "ddp"), default="minidp", help="ddp = torch's DDP")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over all workers")
    p.add_argument("--data", default=None, help="ImageFolder root with train/ and val/ sub-folders; "
                   "default: a synthetic 10-class set written once per node under --synthetic-dir")
    p.add_argument("--synthetic-dir", default=None, help="where the synthetic set goes "
                   "(default: the system temp dir), in minidp-synthetic-<size>px-<train>x<val>-seed<seed>/")
    p.add_argument("--train-per-class", type=positive, default=300, help="synthetic training images per class")
    p.add_argument("--val-per-class", type=positive, default=60, help="synthetic validation images per class")
    p.add_argument("--image-size", type=positive, default=32, help="side of the synthetic images and of the crop")
    p.add_argument("--width", type=positive, default=64, help="ResNet-18 base width (64 is the standard net)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=positive, default=None, help="stop each epoch after this many steps")
    p.add_argument("--checkpoint", default=None, help="folder for epoch<e>.pt, written by rank 0")
    p.add_argument("--report", default=None, help="JSON summary written by rank 0 (used by the demo)")
    p.add_argument("--tiny", action="store_true", help=f"test preset: {TINY}")
    if "--tiny" in (argv if argv is not None else sys.argv[1:]):
        p.set_defaults(**TINY)
    args = p.parse_args(argv)
    check_data_dir(p, args)
    args.lr = DEFAULT_LR[args.optimizer] if args.lr is None else args.lr
    return args


def run(worker: Callable, args: argparse.Namespace) -> None:
    """Under torchrun / minidp.run (RANK and LOCAL_RANK set) be the worker; else spawn the workers."""
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        worker(int(os.environ["LOCAL_RANK"]), args)
    else:
        minidp.launch(worker, nprocs=args.nproc_per_node, args=(args,), nnodes=args.nnodes,
                      node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port)


def check_data_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a --data that is not an image folder root now, in one line, before any worker starts."""
    for split in ("train", "val") if args.data else ():
        if not os.path.isdir(os.path.join(args.data, split)):
            parser.error(f"--data {args.data!r} has no {split}/ folder: expected an ImageFolder root with "
                         "train/<class>/<image> and val/<class>/<image>")


# ----------------------------------------------------------------------------- data
def data_root(args: argparse.Namespace) -> str:
    """--data if given, else the synthetic set, generated by local rank 0 while the others wait."""
    if args.data:
        root = args.data
    else:
        with minidp.local_rank_zero_first():  # ranks meet here (barriers): one writer per node
            root = ensure_synthetic(args)
    for split in ("train", "val"):
        if not os.path.isdir(os.path.join(root, split)):
            raise ValueError(f"--data {root!r} has no {split}/ folder: expected an ImageFolder root "
                             "with train/<class>/<image> and val/<class>/<image>")
    return root


@dataclass
class Loaders:
    """What the training loop needs from a data path (torchvision's or DALI's)."""

    train: Iterable  # yields (images, labels); one pass = one epoch
    val: Iterable  # this rank's share of the validation set, each image on exactly one rank
    steps_per_epoch: int  # the same on every rank
    num_classes: int
    set_epoch: Callable[[int], None]
    state: Callable[[int], dict]  # state(steps_done) -> what a checkpoint records about the data


# ----------------------------------------------------------------------------- model and engine
def resnet18_cifar(num_classes: int = 10, width: int = 64) -> nn.Module:
    """torchvision's ResNet-18 with the CIFAR stem (3x3 conv, stride 1, no max-pool), base `width`."""
    # Imported here, not at the top: torchvision pulls in torch._dynamo (a second on 2 cores, in every
    # worker), which the DALI example and the tests of the other helpers do not need.
    import torchvision
    from torchvision.models.resnet import BasicBlock

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()  # 32x32 inputs are too small to downsample 4x in the stem
    if width != 64:  # torchvision hard-codes 64..512: rebuild the stages with its own blocks
        model.bn1, model.inplanes = nn.BatchNorm2d(width), width
        for i, mult in enumerate((1, 2, 4, 8), start=1):
            setattr(model, f"layer{i}", model._make_layer(BasicBlock, width * mult, 2, stride=1 if i == 1 else 2))
        model.fc = nn.Linear(8 * width, num_classes)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):  # torchvision's ResNet initialisation
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return model


def wrap(model: nn.Module, args: argparse.Namespace, env: minidp.DistEnv) -> nn.Module:
    """SyncBatchNorm if asked, move to the device, wrap in minidp's or torch's DDP."""
    if args.sync_bn:
        # torch.nn.SyncBatchNorm runs on CUDA only: on CPU both engines use minidp's.
        cuda_torch = args.engine == "ddp" and env.device.type == "cuda"
        convert = nn.SyncBatchNorm.convert_sync_batchnorm if cuda_torch else minidp.convert_sync_batchnorm
        model = convert(model)
    model = model.to(env.device)
    ids = [env.device.index] if env.device.type == "cuda" else None
    engine = minidp.DDP if args.engine == "minidp" else nn.parallel.DistributedDataParallel
    return engine(model, device_ids=ids)  # ranks meet here: rank 0's weights are broadcast


def cosine(step: int, total: int) -> float:
    """Cosine decay from 1 to 0 over `total` steps (after warm-up)."""
    return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def lr_rule(args: argparse.Namespace) -> str:
    """How the lr grows with the world size: linearly for SGD/LARS, by its square root for LAMB and NovoGrad.

    LAMB's Adam moments and NovoGrad's per-layer gradient norms make the step's size independent of the
    gradient's scale, as Adam's is: the square-root rule is the one for such adaptive methods.
    """
    return "sqrt" if args.optimizer in ("lamb", "novograd") else "linear"


def make_optimizer(model: nn.Module, args: argparse.Namespace, steps_per_epoch: int, world_size: int):
    """Optimizer at the base lr, and a scheduler: linear warm-up to lr * world_size, then cosine."""
    groups = minidp.optim.exclude_bias_and_norm(model)  # no weight decay on biases and norm weights
    wd = DEFAULT_WD[args.optimizer]
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=args.lr, momentum=0.9, weight_decay=wd)
    elif args.optimizer == "lars":
        opt = minidp.optim.LARS(groups, lr=args.lr, momentum=0.9, weight_decay=wd, trust_coefficient=0.02)
    elif args.optimizer == "lamb":
        opt = minidp.optim.LAMB(groups, lr=args.lr, weight_decay=wd)
    else:
        opt = minidp.optim.NovoGrad(groups, lr=args.lr, weight_decay=wd)
    total = args.epochs * steps_per_epoch
    warmup = min(total, round(args.warmup_epochs * steps_per_epoch))
    sched = minidp.lr.warmup_scheduler(opt, warmup_steps=warmup, world_size=world_size,
                                       rule=lr_rule(args), decay=functools.partial(cosine, total=total - warmup))
    return opt, sched


def autocast(args: argparse.Namespace, device: torch.device):
    """The forward's mixed-precision context: float16 on CUDA, bfloat16 on CPU; a no-op without --amp.

    Only the forward and the loss run in it: parameters, gradients and optimizer state stay float32.

    Args:
        args: the parsed options (args.amp).
        device: the rank's device; its type picks the autocast device and the dtype.
    """
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=args.amp)


def grad_scaler(args: argparse.Namespace, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler for float16 (--amp on CUDA); disabled otherwise, where its calls pass straight through.

    bfloat16 has float32's exponent range, so CPU autocast needs no loss scaling. Every rank makes the same
    skip decision without any extra collective: the engines average the gradients during backward, before
    scaler.step() unscales them, so an inf or NaN on one rank reaches every rank's averaged gradients
    (tests/test_amp.py checks it with an inf on one rank only).

    Args:
        args: the parsed options (args.amp).
        device: the rank's device; the scaler is enabled on CUDA only.
    """
    return torch.amp.GradScaler(device.type, enabled=args.amp and device.type == "cuda")


# ----------------------------------------------------------------------------- evaluation, checkpoints
def sync_buffers(module: nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank.

    The engines broadcast them before each training forward, so after the last step each rank
    holds statistics updated with its own batch; evaluating with rank 0's makes the result equal
    to what rank 0's checkpoint gives.
    """
    for b in module.buffers():
        torch.distributed.broadcast(b, src=0)  # ranks meet here


@torch.no_grad()
def evaluate(module: nn.Module, batches: Iterable, device: torch.device) -> dict:
    """Correct predictions, image count and summed loss over every rank's share, summed exactly.

    Uses the unwrapped module: the wrapper's forward may hold collectives, and ranks may have
    different numbers of validation batches (even an empty one with DALI).
    """
    module.eval()
    correct, count, loss_sum = 0, 0, 0.0
    for images, labels in batches:
        if labels.numel() == 0:
            continue
        images, labels = images.to(device), labels.to(device)
        logits = module(images)
        correct += int((logits.argmax(1) == labels).sum())
        count += labels.numel()
        loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
    module.train()
    return minidp.all_reduce_sums({"correct": correct, "count": count, "loss_sum": loss_sum})  # ranks meet


def save_checkpoint(folder: str, epoch: int, model, opt, sched, extra: dict) -> str:
    """Every rank calls it (minidp.save_checkpoint gathers RNG states); rank 0 writes folder/epoch<epoch>.pt.

    minidp.save_checkpoint writes atomically (temp file, fsync, rename) with a SHA-256 the loader checks;
    read it back with minidp.load_checkpoint(path, model, ...).
    """
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"epoch{epoch}.pt")
    minidp.save_checkpoint(path, model, opt, sched, epoch=epoch, extra=extra)  # ranks meet here
    return path


def resume(args, model, opt, sched, scaler=None) -> tuple[int, list]:
    """(first epoch to train, history so far): from the newest --checkpoint file after a restart, else (0, []).

    A restart is what torchrun (--max-restarts) and `python -m minidp.run --max-restarts` start after a
    worker failed: TORCHELASTIC_RESTART_COUNT > 0. Only then is an existing checkpoint picked up, so a
    fresh run never continues an old one by surprise. Every rank loads (its own RNG state included):
    the resumed run goes on exactly as the interrupted one would have. `scaler` (--amp on CUDA) gets the
    loss scale the checkpoint's extra["grad_scaler"] recorded.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or not args.checkpoint or not os.path.isdir(args.checkpoint):
        return 0, []
    done = [int(m.group(1)) for m in map(re.compile(r"epoch(\d+)\.pt").fullmatch, os.listdir(args.checkpoint)) if m]
    if not done:
        return 0, []
    path = os.path.join(args.checkpoint, f"epoch{max(done)}.pt")
    payload = minidp.load_checkpoint(path, model, opt, sched)
    if scaler is not None and payload["extra"].get("grad_scaler"):
        scaler.load_state_dict(payload["extra"]["grad_scaler"])
    minidp.print0(f"restart {attempt}: resumed from {path} ({payload['epoch'] + 1} of {args.epochs} epochs done)")
    return payload["epoch"] + 1, list(payload["extra"].get("history", []))
