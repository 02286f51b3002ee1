"""Train a ResNet-18 data-parallel with minidp (or torch DDP), images read by torchvision.

    python examples/train_torchvision.py --nproc-per-node 2 --epochs 3        # spawns 2 workers
    python -m minidp.run --nproc-per-node 2 examples/train_torchvision.py     # or torchrun, unchanged
    python examples/train_torchvision.py --engine ddp --sync-bn --optimizer lars --data ~/imagefolder

Without --data, a synthetic 10-class set (shapes and colours plus noise) is written once per node.
Each worker reads its share through minidp.DistributedSampler; rank 0 shows its progress (a bar on a
terminal, else a line every few steps with the rate and the time left), prints per-epoch loss and exact
validation accuracy, and writes a checkpoint per epoch (--checkpoint).
Restarted by torchrun --max-restarts or `python -m minidp.run --max-restarts`, it resumes from the
newest checkpoint there (common.resume).
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

import common
import minidp

WARM_STEPS = 5  # first steps left out of the median step time (bucket rebuild, allocator warm-up)


def image_folders(root: str, image_size: int):
    """(train, val) ImageFolders: shorter side resized, centre crop, flips for training, normalized."""
    resize = [transforms.Resize(image_size), transforms.CenterCrop(image_size)]
    tail = [transforms.ToTensor(), transforms.Normalize(common.MEAN, common.STD)]
    train_set = datasets.ImageFolder(os.path.join(root, "train"),
                                     transforms.Compose([*resize, transforms.RandomHorizontalFlip(), *tail]))
    return train_set, datasets.ImageFolder(os.path.join(root, "val"), transforms.Compose([*resize, *tail]))


def build_loaders(args, env: minidp.DistEnv) -> common.Loaders:
    """ImageFolder train/val sets; training sharded with padding, validation exact (pad=False)."""
    train_set, val_set = image_folders(common.data_root(args), args.image_size)
    sampler = minidp.DistributedSampler(train_set, seed=args.seed)
    val_sampler = minidp.DistributedSampler(val_set, shuffle=False, pad=False)  # each image on one rank
    pin = env.device.type == "cuda"
    # num_workers=0: deterministic, and on a 2-core machine extra loader processes only compete.
    # drop_last: every step has a full batch (the padded sampler gives every rank the same count).
    train = DataLoader(train_set, args.batch_size, sampler=sampler, drop_last=True, pin_memory=pin)
    val = DataLoader(val_set, 2 * args.batch_size, sampler=val_sampler, pin_memory=pin)
    if len(train) == 0:
        raise ValueError(f"{len(sampler)} training images per rank make no batch of --batch-size {args.batch_size}")
    steps = min(len(train), args.max_steps or len(train))
    return common.Loaders(train, val, steps, len(train_set.classes), sampler.set_epoch,
                          lambda done: {"sampler": sampler.state_dict(consumed=done * args.batch_size)})


def train_one_epoch(model, opt, sched, loaders: common.Loaders, env, epoch: int, args, step_times: list,
                    scaler=None) -> dict:
    """One pass over this rank's shard (at most loaders.steps_per_epoch steps); loss summed over ranks.

    With --amp the forward runs under common.autocast, and `scaler` (common.grad_scaler: active for float16
    on CUDA, a pass-through otherwise) scales the loss and skips a step whose gradients hold an inf or NaN.
    """
    scaler = common.grad_scaler(args, env.device) if scaler is None else scaler
    cuda = env.device.type == "cuda"
    loss_sum, count = torch.zeros((), device=env.device), 0
    progress = common.Progress(loaders.steps_per_epoch, f"epoch {epoch + 1}/{args.epochs}")  # rank 0 shows it
    for step, (images, labels) in enumerate(loaders.train):
        if step == loaders.steps_per_epoch:
            break
        images, labels = images.to(env.device, non_blocking=True), labels.to(env.device, non_blocking=True)
        if cuda:
            torch.cuda.synchronize()  # time the step, not the copy
        start = time.perf_counter()
        with common.autocast(args, env.device):
            loss = F.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # the engine averages the gradients over the ranks here
        scaler.step(opt)  # unscales the averaged gradients: every rank finds the same inf, skips the same step
        scaler.update()
        sched.step()
        if cuda:
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - start)
        loss_sum += loss.detach() * labels.numel()
        count += labels.numel()
        if step % 10 == 0:  # .item() waits for the device: not every step
            progress.step(loss=f"{loss.item():.3f}", lr=f"{sched.get_last_lr()[0]:.4f}")
        else:
            progress.step()
    progress.close()
    return minidp.all_reduce_sums({"loss_sum": loss_sum, "count": count})  # ranks meet here


def fit(args, env: minidp.DistEnv, loaders: common.Loaders) -> dict:
    """Build model, engine and optimizer; train and evaluate every epoch; checkpoint on rank 0."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank, and for both engines
    model = common.wrap(common.resnet18_cifar(loaders.num_classes, args.width), args, env)
    opt, sched = common.make_optimizer(model.module, args, loaders.steps_per_epoch, env.world_size)
    torch.manual_seed(args.seed + 1 + env.rank)  # augmentation: its own stream per rank, same for both engines
    minidp.print0(f"{args.engine}: {env.world_size} workers x {args.batch_size} images, {loaders.steps_per_epoch} "
                  f"steps/epoch, {args.optimizer} lr {args.lr} warmed up to "
                  f"{minidp.lr.scaled_lr(args.lr, env.world_size, rule=common.lr_rule(args)):g} "
                  f"(sync-bn {args.sync_bn}, amp {args.amp}), ResNet-18 width {args.width}, device {env.device}")
    scaler = common.grad_scaler(args, env.device)
    first, history = common.resume(args, model, opt, sched, scaler)  # after a restart: the newest checkpoint's epoch
    step_times, path = [], None
    for epoch in range(first, args.epochs):
        loaders.set_epoch(epoch)
        train = train_one_epoch(model, opt, sched, loaders, env, epoch, args, step_times, scaler)
        common.sync_buffers(model.module)  # ranks meet here
        val = common.evaluate(model.module, loaders.val, env.device)
        history.append(dict(epoch=epoch, train_loss=train["loss_sum"] / train["count"],
                            val_loss=val["loss_sum"] / val["count"], val_accuracy=val["correct"] / val["count"],
                            val_count=val["count"], lr=sched.get_last_lr()[0]))
        minidp.print0("epoch {}/{}  train loss {:.4f}  val loss {:.4f}  val accuracy {:.2%} of {} images".format(
            epoch + 1, args.epochs, history[-1]["train_loss"], history[-1]["val_loss"],
            history[-1]["val_accuracy"], val["count"]))
        if args.checkpoint:
            path = common.save_checkpoint(args.checkpoint, epoch, model, opt, sched, {
                **loaders.state(loaders.steps_per_epoch), "args": vars(args), "metrics": history[-1],
                "history": history, "grad_scaler": scaler.state_dict()})
    timed = step_times[WARM_STEPS:] if len(step_times) > 2 * WARM_STEPS else step_times
    return dict(engine=args.engine, world_size=env.world_size, steps=len(step_times), history=history,
                median_step_s=statistics.median(timed) if timed else None, step_times=step_times, checkpoint=path)


def write_report(args, summary: dict) -> None:
    """Rank 0 writes the run's summary as JSON to --report (read by examples/demo.py)."""
    if args.report and minidp.is_main():
        with open(args.report, "w") as f:
            json.dump(summary, f, indent=1)


def worker(local_rank: int, args, build=None) -> None:
    """One rank: join the process group, build the data (`build`, default torchvision's), train, report."""
    env = minidp.init()
    # One compute thread per core: workers on a node share its cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    summary = fit(args, env, (build or build_loaders)(args, env))
    write_report(args, summary)
    minidp.shutdown()


def main(argv=None) -> None:
    common.run(worker, common.parse_args(__doc__.split("\n")[0], argv))


if __name__ == "__main__":
    main()
