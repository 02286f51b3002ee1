"""Train a ResNet-18 data-parallel with minidp (or torch DDP), images read by a DALI pipeline.

    python examples/train_dali.py --nproc-per-node 2 --epochs 3              # spawns 2 workers
    python -m minidp.run --nproc-per-node 2 examples/train_dali.py           # or torchrun, unchanged

The same training as train_torchvision.py (same options, model, optimizer, evaluation and
checkpoints); only the data path differs: each rank's DALI pipeline (minidp.data.image_folder_loader)
reads its own shard of the image folder and decodes it, on the rank's GPU when CUDA is present
("mixed" decode), else on the CPU. Needs NVIDIA DALI (`make` installs it; elsewhere `pip install -e '.[dali]'`
from the clone: minidp is not on PyPI).

Differences from the torchvision path: DALI shards the files itself (shard sizes differ by at most
one; no DistributedSampler), training drops each shard's incomplete last batch, and validation
keeps every file once, so a rank's last validation batch may be short or empty. The checkpoint
records no sampler state (resuming mid-epoch is not supported here).

With --amp the pipelines still give float32 images, the dtype of the model's parameters: autocast casts
them inside the model's float16 (CUDA) or bfloat16 (CPU) ops, so the model runs with or without --amp.
"""
from __future__ import annotations

import os

import train_torchvision

import common
import minidp
from minidp.data import image_folder_loader


def build_loaders(args, env: minidp.DistEnv) -> common.Loaders:
    """Two DALI pipelines over this rank's shards: training (shuffled, flipped) and validation (exact)."""
    root = common.data_root(args)
    threads = max(1, (os.cpu_count() or 1) // env.local_world_size)
    shared = dict(crop=args.image_size, mean=common.MEAN, std=common.STD, seed=args.seed, device=env.device,
                  num_threads=threads)
    # "global": the whole file list is reshuffled every epoch, then cut into shards, as the sampler does;
    # "drop": every rank runs the same number of full batches (ranks must stay in lockstep).
    train = image_folder_loader(os.path.join(root, "train"), args.batch_size, flip=True, shuffle="global",
                                last_batch="drop", **shared)
    # "partial" with fixed shards: every validation image exactly once over the ranks.
    val = image_folder_loader(os.path.join(root, "val"), 2 * args.batch_size, shuffle="none",
                              stick_to_shard=True, last_batch="partial", **shared)
    if len(train) == 0:
        raise ValueError(f"{train.num_files} training images over {env.world_size} ranks make no batch of "
                         f"--batch-size {args.batch_size}")
    steps = min(len(train), args.max_steps or len(train))
    return common.Loaders(train, val, steps, len(train.classes), lambda epoch: None,
                          lambda done: {"dali": {"steps_in_epoch": done}})


def worker(local_rank: int, args) -> None:
    """One rank: the torchvision example's worker, with DALI pipelines for data."""
    train_torchvision.worker(local_rank, args, build=build_loaders)


def main(argv=None) -> None:
    common.run(worker, common.parse_args(__doc__.split("\n")[0], argv))


if __name__ == "__main__":
    main()
