"""minidp.data.dali: a DALI pipeline sharded by rank, over a tiny generated image folder (CPU; GPU marked).

First, the DALI example (examples/train_dali.py) trained with minidp and with torch DDP in the same two
ranks, one after the other, with --amp (bfloat16 on CPU) and NovoGrad: the two must end bitwise equal, and
the exact validation must count each of its 17 images once though rank 0's second batch is empty. (The
README's DALI command runs under `python -m minidp.run` in test_readme.py.)
Then the loader itself: every image is one solid colour whose red channel encodes the file's id
(10 * id), so a batch can be traced back to its files without any side channel: sharding, padding and
shard moves are checked on the pixels the pipeline actually produced.
"""
import os
import re
import sys

import pytest
import torch

pytest.importorskip("nvidia.dali")
from PIL import Image  # noqa: E402
from processes import fresh_interpreter_report  # noqa: E402 - tests/scripts/

import minidp  # noqa: E402
from harness import run_ranks  # noqa: E402
from minidp.data.dali import image_folder_loader, list_image_folder  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import demo  # noqa: E402
import train_dali  # noqa: E402
import train_torchvision  # noqa: E402

import common  # noqa: E402 - examples/ is not a package

COUNTS = {"ant": 9, "bee": 8, "cat": 8}  # 25 files: shards of 12 and 13 at world size 2
N = sum(COUNTS.values())
BS, CROP = 4, 8
RAW = dict(mean=(0.0, 0.0, 0.0), std=(1 / 255,) * 3)  # normalize to raw pixel values


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    file_id = 0
    for label, (name, count) in enumerate(COUNTS.items()):
        os.makedirs(root / name)
        for i in range(count):
            # Varied sizes exercise resize and crop; PNG and JPEG both decode.
            image = Image.new("RGB", (12 + 2 * i, 10 + i), (10 * file_id, 80 * label, 128))
            ext = "png" if i % 2 else "jpg"
            image.save(root / name / f"{name}{i:02d}.{ext}", quality=95)
            file_id += 1
    (root / "bee" / "notes.txt").write_text("not an image")
    return str(root)


class _Dtypes:
    """A training loader that records the dtype of every image batch it yields."""

    def __init__(self, loader, seen: set):
        self.loader, self.seen = loader, seen

    def __iter__(self):
        for images, labels in self.loader:
            self.seen.add(str(images.dtype))
            yield images, labels


def _both_engines_worker(folder: str) -> dict:
    """Train the DALI example's tiny run with minidp, then with torch DDP, in this one process group."""
    env = minidp.init()
    out = {"dtypes": set()}
    for engine in ("minidp", "ddp"):
        args = common.parse_args("test", ["--tiny", "--data", os.path.join(folder, "images"), "--optimizer",
                                          "novograd", "--amp", "--engine", engine, "--checkpoint",
                                          os.path.join(folder, engine)])
        loaders = train_dali.build_loaders(args, env)  # fresh pipelines: the same batches for both engines
        loaders.train = _Dtypes(loaders.train, out["dtypes"])
        out[engine] = train_torchvision.fit(args, env, loaders)
    return out


def test_dali_example_with_amp_and_novograd_minidp_equals_torch_ddp(tmp_path):
    # 17 validation images: shards of 8 and 9 in batches of 8, so rank 0's second batch is empty.
    common.write_synthetic(str(tmp_path / "images"), common.TINY["train_per_class"], 2, size=16, seed=0)
    for name in ("class9/00000.png", "class9/00001.png", "class8/00001.png"):
        os.remove(tmp_path / "images" / "val" / name)
    # One launch of two ranks (the README's command runs the example under a launcher), both engines in turn.
    results = run_ranks(_both_engines_worker, 2, str(tmp_path), init=False, timeout=240)
    mine, ddp = results[0]["minidp"], results[0]["ddp"]
    assert mine["steps"] == ddp["steps"] == common.TINY["max_steps"] and mine["world_size"] == 2
    # The pipeline still gives float32 images: autocast casts them inside the model's bfloat16 ops.
    assert all(r["dtypes"] == {"torch.float32"} for r in results)
    assert demo.max_difference(mine["checkpoint"], ddp["checkpoint"])[0] == 0.0
    assert mine["history"] == ddp["history"] and mine["history"][0]["val_count"] == 17
    assert mine["history"][0]["train_loss"] > 0
    assert results[1]["minidp"]["history"] == mine["history"]  # the sums over ranks, the same on both


def _loader(folder, rank, world_size=2, **kw):
    kw = {"shuffle": "none", "num_threads": 1, "crop": CROP, **RAW, **kw}
    return image_folder_loader(folder, BS, rank=rank, world_size=world_size, **kw)


def _epochs(loader, n):
    """Per epoch, per batch: the file ids; checks shapes, dtypes and labels on the way."""
    out = []
    for _ in range(n):
        batches = []
        for images, labels in loader:
            assert images.dtype == torch.float32 and images.shape[1:] == (3, CROP, CROP)
            assert labels.dtype == torch.int64 and labels.shape == (images.shape[0],)
            assert images.device == loader.device and labels.device == loader.device
            red = images[:, 0].flatten(1)
            assert torch.all(red.max(1).values - red.min(1).values <= 2)  # one solid colour per image
            ids = [round(v / 10) for v in red.mean(1).tolist()]
            assert labels.tolist() == [_label_of(i) for i in ids]
            batches.append(ids)
        out.append(batches)
    return out


def _label_of(file_id):
    bounds = [sum(list(COUNTS.values())[:k + 1]) for k in range(len(COUNTS))]
    return next(k for k, b in enumerate(bounds) if file_id < b)


def _shard(s, world_size=2):
    return list(range(N * s // world_size, N * (s + 1) // world_size))


def _flat(batches):
    return [i for b in batches for i in b]


def test_classes_and_files_follow_image_folder(folder):
    torchvision = pytest.importorskip("torchvision")
    reference = torchvision.datasets.ImageFolder(folder)
    classes, files = list_image_folder(folder)
    assert classes == reference.classes == sorted(COUNTS)
    assert files == reference.samples and len(files) == N


def test_two_ranks_partial_disjoint_cover_and_move_shards(folder):
    loaders = [_loader(folder, r) for r in (0, 1)]
    epochs = [_epochs(loader, 3) for loader in loaders]
    assert [len(loader) for loader in loaders] == [4, 4]  # ceil(13 / 4) on every rank: lockstep
    # Epoch 0: rank r reads shard r, in file order; the smaller shard ends with an empty batch.
    assert [len(b) for b in epochs[0][0]] == [4, 4, 4, 0]
    assert [len(b) for b in epochs[1][0]] == [4, 4, 4, 1]
    for e in range(3):
        got = [_flat(epochs[r][e]) for r in (0, 1)]
        assert not set(got[0]) & set(got[1]) and sorted(got[0] + got[1]) == list(range(N))
        for r in (0, 1):
            assert got[r] == _shard((r + e) % 2)  # next shard every epoch (stick_to_shard=False)
    assert [loader.epoch for loader in loaders] == [3, 3] and loaders[0].shard == 1


def test_stick_to_shard_keeps_each_rank_on_its_shard(folder):
    loaders = [_loader(folder, r, stick_to_shard=True) for r in (0, 1)]
    for r, loader in enumerate(loaders):
        assert [_flat(b) for b in _epochs(loader, 2)] == [_shard(r), _shard(r)]
        assert loader.shard == r
    got = [[_flat(b) for b in _epochs(_loader(folder, r, shuffle="shard", stick_to_shard=True), 2)] for r in (0, 1)]
    for r in (0, 1):  # shuffled within the shard, the same files every epoch
        assert sorted(got[r][0]) == sorted(got[r][1]) and len(got[r][0]) == len(_shard(r))
    assert sorted(got[0][0] + got[1][0]) == list(range(N))


def test_shard_shuffle_is_disjoint_and_covers(folder):
    got = [[_flat(b) for b in _epochs(_loader(folder, r, shuffle="shard", seed=5), 2)] for r in (0, 1)]
    for e in range(2):
        assert sorted(got[0][e] + got[1][e]) == list(range(N))
        assert len(got[0][e]) == len(_shard(e % 2))  # the shard moves, its size with it


def test_global_shuffle_reshuffles_every_epoch_across_ranks(folder):
    loaders = [_loader(folder, r, shuffle="global", seed=7) for r in (0, 1)]
    got = [[_flat(b) for b in _epochs(loader, 3)] for loader in loaders]
    assert [loader.shard for loader in loaders] == [0, 1]  # DALI keeps the shard index, reshuffles its content
    for e in range(3):
        assert sorted(got[0][e] + got[1][e]) == list(range(N))  # the same permutation on both ranks
        assert [len(got[0][e]), len(got[1][e])] == [12, 13]  # shard sizes stay with the rank
    assert got[0][0] != got[0][1] and got[0][0] != _shard(0)


def test_fill_pads_the_last_batch_with_the_shards_last_file(folder):
    for r, last in ((0, [11] * 4), (1, [24] * 4)):
        loader = _loader(folder, r, last_batch="fill")
        batches = _epochs(loader, 1)[0]
        assert len(loader) == 4 and [len(b) for b in batches] == [4, 4, 4, 4]
        assert _flat(batches[:3]) == _shard(r)[:12] and batches[3] == last


def test_drop_yields_only_full_batches_and_stays_aligned(folder):
    loader = _loader(folder, 1, last_batch="drop")
    epochs = _epochs(loader, 3)
    assert len(loader) == 3  # (25 // 2) // 4 on every rank
    for e, batches in enumerate(epochs):
        assert [len(b) for b in batches] == [4, 4, 4]
        assert _flat(batches) == _shard((1 + e) % 2)[:12]  # no padding leaks into the next epoch


def test_an_epoch_left_part_way_is_finished_before_the_next(folder):
    loader = _loader(folder, 0)
    for _, _ in loader:
        break
    assert _flat(_epochs(loader, 1)[0]) == _shard(1)  # epoch 1 starts on its shard boundary


def test_default_normalization_matches_torchvision(folder):
    loader = image_folder_loader(folder, BS, crop=CROP, shuffle="none", rank=0, world_size=1, num_threads=1)
    images, labels = next(iter(loader))
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    expected = (torch.tensor([10.0, 0.0, 128.0]) / 255 - mean) / std  # file 1: red 10, label 0, blue 128
    assert torch.allclose(images[1].mean((1, 2)), expected, atol=0.05)
    assert labels.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(rank=2, world_size=2), ValueError, r"rank=2 must be in \[0, world_size=2\)"),
    (dict(rank=0, world_size=0), ValueError, r"world_size=0 must be >= 1"),
    (dict(rank=0, world_size=1, last_batch="pad"), ValueError, r"last_batch='pad' must be one of"),
    (dict(rank=0, world_size=1, shuffle="yes"), ValueError, r"shuffle='yes' must be one of"),
    (dict(rank=0, world_size=1, resize=4), ValueError, r"resize=4 must be >= crop=8"),
    (dict(rank=0, world_size=1, stick_to_shard=True), ValueError, r"stick_to_shard=True with shuffle='global'"),
    (dict(rank=0, world_size=26), ValueError, r"holds 25 image file\(s\), fewer than world_size=26"),
    (dict(rank=0, world_size=1, batch_size="4"), TypeError, r"batch_size='4' must be an int"),
    (dict(rank=0, world_size=1, batch_size=0), ValueError, r"batch_size=0 must be >= 1"),
    (dict(rank=0, world_size=1, flip="yes"), TypeError, r"flip='yes' must be True or False"),
    (dict(rank=0, world_size=1, num_threads=0), ValueError, r"num_threads=0 must be >= 1"),
])
def test_bad_input(folder, kwargs, error, match):
    kwargs = {"batch_size": BS, "crop": CROP, **kwargs}
    with pytest.raises(error, match=match):
        image_folder_loader(folder, **kwargs)


def test_bad_folders(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"root={str(tmp_path / 'missing')!r} is not a directory")):
        image_folder_loader(str(tmp_path / "missing"), 2, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"has no class sub-folders"):
        image_folder_loader(str(tmp_path), 2, rank=0, world_size=1)
    (tmp_path / "empty_class").mkdir()
    with pytest.raises(ValueError, match=r"has no image files in its class sub-folders \['empty_class'\]"):
        image_folder_loader(str(tmp_path), 2, rank=0, world_size=1)


def test_minidp_imports_without_dali():
    """Where DALI is not installed, minidp and minidp.data import, and the DALI loader says what to install."""
    assert fresh_interpreter_report()["dali_error"] == (
        "minidp.data.dali needs NVIDIA DALI: pip install nvidia-dali-cuda120 "
        "(or from the clone: pip install -e '.[dali]')")


@pytest.mark.gpu
def test_gpu_decoding_gives_the_cpu_result_on_the_ranks_device(folder):
    gpu = [_loader(folder, r, device="cuda") for r in (0, 1)]
    cpu = [_loader(folder, r, device="cpu") for r in (0, 1)]
    for g, c in zip(gpu, cpu):
        assert g.device.type == "cuda"
        assert _epochs(g, 2) == _epochs(c, 2)
