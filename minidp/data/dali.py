"""A DALI image pipeline sharded by rank: each rank reads, decodes and augments its own shard.

NVIDIA DALI is optional: it is imported only when a loader is built, so minidp works without it.

Sharding, as DALI's fn.readers.file does it (checked in tests/test_dali.py):
  * The N files are cut into world_size contiguous shards: shard s holds files
    [N * s // world_size, N * (s + 1) // world_size) of the (optionally pre-shuffled) file list, so
    shard sizes differ by at most one. Each epoch the ranks' shards are disjoint and together cover
    the folder: nothing is padded across ranks, unlike DistributedSampler.
  * With shuffle "shard" or "none", a rank reads shard `rank` in epoch 0 and, unless
    stick_to_shard=True, moves to the next shard every epoch: in epoch e it reads shard
    (rank + e) % world_size. So over world_size epochs every rank sees every file; with
    stick_to_shard=True a rank only ever sees its own shard (less to cache, but its data never
    changes). With shuffle "global" a rank keeps shard index `rank` (DALI sticks to it by itself)
    and the shard's content changes every epoch instead; `loader.shard` says which applies.
  * The reader always pads each shard (pad_last_batch=True): without it DALI fills a short last
    batch with the next files and epochs drift off the shard boundaries.
  * Every rank yields the same number of batches per epoch (DDP needs ranks in lockstep); the last
    one depends on `last_batch`:
      "partial" (default): ceil(ceil(N / world_size) / batch_size) batches; the last holds what is
          left of the shard, possibly nothing at all (a batch of 0 images on the smaller shards):
          every file once, no duplicates. Fit for evaluation with summed metrics; for training
          prefer "drop" or "fill" (a mean loss over 0 images is NaN).
      "fill": as many batches, all full; the last is padded by repeating the shard's last file.
      "drop": (N // world_size) // batch_size full batches; the rest of the shard is skipped this
          epoch. (Done here over DALI's PARTIAL policy: DALI's own DROP lets the padded remainder
          leak into the next epoch.)
  * Shuffling: "global" (default) reshuffles the whole file list every epoch with the same seed on
    every rank (DALI's shuffle_after_epoch), then cuts it into shards, as DistributedSampler does;
    shard sizes stay with the ranks, and stick_to_shard=True is refused as meaningless. "shard"
    shuffles the list once (DALI's fixed seed, the same on every rank), then shuffles within each
    shard through a buffer (random_shuffle); "none" keeps the sorted order.

Labels follow torchvision's ImageFolder: class sub-folders sorted by name get labels 0..C-1 (an
empty sub-folder still takes its label). Unlike ImageFolder, DALI reads only the files directly in
each class folder, with an image extension (case-insensitive), not nested folders.
"""
from __future__ import annotations

import fnmatch
import os
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..runtime.ranks import get_local_rank, get_rank, get_world_size
from ..validate import check_bool, check_choice, check_int

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # torchvision's Normalize constants, for images in [0, 1]
IMAGENET_STD = (0.229, 0.224, 0.225)
LAST_BATCH = ("partial", "fill", "drop")
SHUFFLE = ("global", "shard", "none")
# fn.readers.file's default file_filters, less the audio formats.
IMAGE_PATTERNS = ("*.jpg", "*.jpeg", "*.png", "*.bmp", "*.tif", "*.tiff", "*.pnm", "*.ppm", "*.pgm", "*.pbm",
                  "*.jp2", "*.webp")


def _import_dali():
    try:
        import nvidia.dali  # noqa: F401
        from nvidia.dali.plugin import pytorch  # noqa: F401
    except ImportError as exc:
        raise ImportError("minidp.data.dali needs NVIDIA DALI: pip install nvidia-dali-cuda120 "
                          "(or from the clone: pip install -e '.[dali]')") from exc
    return nvidia.dali, pytorch


def list_image_folder(root: str) -> Tuple[List[str], List[Tuple[str, int]]]:
    """Classes (sorted sub-folder names) and (path, label) pairs in the order DALI reads them."""
    if not os.path.isdir(root):
        raise ValueError(f"root={root!r} is not a directory")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise ValueError(f"root={root!r} has no class sub-folders (expected root/<class>/<image>)")
    files = []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        for f in sorted(os.listdir(folder)):
            path = os.path.join(folder, f)
            if os.path.isfile(path) and any(fnmatch.fnmatch(f.lower(), p) for p in IMAGE_PATTERNS):
                files.append((path, label))
    return classes, files


def _resolve_device(device) -> torch.device:
    if device is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())  # as minidp.init() pins
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} needs CUDA, and torch.cuda.is_available() is False")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device.type != "cpu":
        raise ValueError(f"device={str(device)!r} must be 'cpu' or a CUDA device")
    return device


class DaliImageLoader:
    """Iterate over one rank's shard: each `for images, labels in loader` is one epoch.

    images: float32 (B, 3, crop, crop), normalized; labels: int64 (B,); both on `device`. Built by
    image_folder_loader(); `iterator` is the underlying DALIGenericIterator, `pipeline` its pipeline.
    """

    def __init__(self, iterator, pipeline, classes: List[str], num_files: int, batch_size: int,
                 last_batch: str, stick_to_shard: bool, rank: int, world_size: int, device: torch.device):
        self.iterator, self.pipeline, self.classes = iterator, pipeline, classes
        self.num_files, self.batch_size, self.last_batch = num_files, batch_size, last_batch
        self.stick_to_shard, self.rank, self.world_size, self.device = stick_to_shard, rank, world_size, device
        self.epoch = 0  # epochs finished
        if last_batch == "drop":
            self._batches = (num_files // world_size) // batch_size
        else:
            largest_shard = -(-num_files // world_size)  # ceil: shard sizes differ by at most one
            self._batches = -(-largest_shard // batch_size)
        self._current = None  # generator of the latest epoch
        self._in_epoch = False  # DALI's iterator is part-way through an epoch

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank."""
        return self._batches

    @property
    def shard(self) -> int:
        """The shard the current (or next) epoch reads: (rank + epoch) % world_size, or rank if stuck."""
        return self.rank if self.stick_to_shard else (self.rank + self.epoch) % self.world_size

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        if self._current is not None:
            self._current.close()
        if self._in_epoch:
            # An epoch left part-way (a `break`): read it to its end, so the next one starts at a
            # shard boundary as DALI requires; the rest of that epoch is skipped.
            for _ in self.iterator:
                pass
            self._end_epoch()
        self._current = self._one_epoch()
        return self._current

    def _one_epoch(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        self._in_epoch = True
        for i, out in enumerate(self.iterator):  # auto_reset: DALI rewinds when the epoch ends
            if i < self._batches:  # with "drop", the batches past the count are read and skipped
                batch = out[0]
                yield batch["images"], batch["labels"].reshape(-1).long()
        self._end_epoch()

    def _end_epoch(self) -> None:
        self._in_epoch = False
        self.epoch += 1


def image_folder_loader(
    root: str,
    batch_size: int,
    *,
    crop: int = 224,
    resize: Optional[int] = None,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    flip: bool = False,
    shuffle: Union[bool, str] = "global",
    stick_to_shard: bool = False,
    last_batch: str = "partial",
    seed: int = 0,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    device: Union[str, torch.device, None] = None,
    num_threads: int = 2,
) -> DaliImageLoader:
    """Build a DALI pipeline over this rank's shard of an ImageFolder-style tree; see the module doc.

    Read (fn.readers.file, shard_id=rank, num_shards=world_size) -> decode -> resize the shorter
    side to `resize` -> center crop `crop` x `crop` (random horizontal flip if `flip`) -> normalize
    -> float32 CHW. Decoding runs on the GPU (DALI "mixed") when `device` is CUDA, else on the CPU.

    Args:
        root: folder with one sub-folder of images per class.
        batch_size: images per batch on this rank.
        crop: side of the square output. Default 224.
        resize: shorter side after resizing, >= crop. Default: crop.
        mean, std: per channel, for pixels in [0, 1]. Default: ImageNet's (torchvision's values).
        flip: random horizontal flip (training). Default False.
        shuffle: "global", "shard" or "none" (True means "global", False "none"). Default "global".
        stick_to_shard: keep reading shard `rank` every epoch. Default False. Not with "global".
        last_batch: "partial", "fill" or "drop". Default "partial".
        seed: shuffling seed, the same on every rank (flips use seed + rank). Default 0.
        rank, world_size: this rank and the number of shards. Default: the process group's, else
            RANK / WORLD_SIZE from the environment, else 0 / 1.
        device: "cpu" or a CUDA device. Default: cuda:<LOCAL_RANK % device count> when CUDA is
            available (the device minidp.init() pins), else "cpu" (a CPU-only pipeline).
        num_threads: DALI CPU worker threads. Default 2.

    Example:
        loader = image_folder_loader("imagenet/train", 256, flip=True, last_batch="drop")
        for epoch in range(epochs):
            for images, labels in loader:
                ...
    """
    _import_dali()  # fail first, and clearly, where DALI is not installed
    check_int("batch_size", batch_size, 1)
    check_int("crop", crop, 1)
    resize = crop if resize is None else check_int("resize", resize, 1)
    if resize < crop:
        raise ValueError(f"resize={resize} must be >= crop={crop}")
    if isinstance(shuffle, bool):
        shuffle = "global" if shuffle else "none"
    check_choice("shuffle", shuffle, SHUFFLE)
    check_choice("last_batch", last_batch, LAST_BATCH)
    check_bool("flip", flip)
    check_bool("stick_to_shard", stick_to_shard)
    check_int("num_threads", num_threads, 1)
    if shuffle == "global" and stick_to_shard:
        raise ValueError("stick_to_shard=True with shuffle='global': a global reshuffle changes every shard; "
                         "use shuffle='shard' or 'none' to stick to a shard")
    world_size = check_int("world_size", get_world_size() if world_size is None else world_size, 1)
    rank = check_int("rank", get_rank() if rank is None else rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    check_int("seed", seed, 0)
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"mean={tuple(mean)} and std={tuple(std)} need one value per RGB channel")
    classes, files = list_image_folder(root)
    if not files:
        raise ValueError(f"root={root!r} has no image files in its class sub-folders {classes} "
                         f"(looked for {', '.join(IMAGE_PATTERNS)})")
    if len(files) < world_size:
        raise ValueError(f"root={root!r} holds {len(files)} image file(s), fewer than world_size={world_size} shards")
    device = _resolve_device(device)
    pipe = _build_pipeline(root, batch_size, crop, resize, mean, std, flip, shuffle, stick_to_shard, seed,
                           rank, world_size, device, num_threads)
    _, plugin = _import_dali()
    iterator = plugin.DALIGenericIterator(
        pipe, ["images", "labels"], reader_name="Reader", auto_reset=True,
        last_batch_policy=plugin.LastBatchPolicy.FILL if last_batch == "fill" else plugin.LastBatchPolicy.PARTIAL)
    # With shuffle="global" DALI sticks to the shard on its own (the shard's content changes instead).
    stuck = bool(pipe.reader_meta("Reader")["stick_to_shard"])
    return DaliImageLoader(iterator, pipe, classes, len(files), batch_size, last_batch, stuck,
                           rank, world_size, device)


def _build_pipeline(root, batch_size, crop, resize, mean, std, flip, shuffle, stick_to_shard, seed,
                    rank, world_size, device, num_threads):
    dali, _ = _import_dali()
    fn, types = dali.fn, dali.types
    gpu = device.type == "cuda"
    pipe = dali.Pipeline(batch_size=batch_size, num_threads=num_threads, seed=seed + rank,
                         device_id=device.index if gpu else None)  # None: a CPU-only pipeline
    shuffling = dict(shuffle_after_epoch=True, shuffle_after_epoch_seed=seed) if shuffle == "global" else dict(
        random_shuffle=shuffle == "shard", stick_to_shard=stick_to_shard)
    with pipe:
        encoded, labels = fn.readers.file(file_root=root, shard_id=rank, num_shards=world_size,
                                          pad_last_batch=True, name="Reader", **shuffling)
        images = fn.decoders.image(encoded, device="mixed" if gpu else "cpu", output_type=types.RGB)
        images = fn.resize(images, resize_shorter=resize)
        images = fn.crop_mirror_normalize(
            images, crop=(crop, crop), dtype=types.FLOAT, output_layout="CHW",
            mean=[255 * m for m in mean], std=[255 * s for s in std],
            mirror=fn.random.coin_flip() if flip else 0)
        pipe.set_outputs(images, labels.gpu() if gpu else labels)
    pipe.build()
    return pipe
