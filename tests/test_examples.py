"""The two training examples end to end in their --tiny mode (2 workers, 60 images of 16x16, 3 steps).

Each run is a real command line in a subprocess: spawned by the example itself (minidp.launch) or
under `python -m minidp.run`. The torchvision example runs with minidp and with torch DDP on the same
seed, and the two must end bitwise equal; the checkpoint is reloaded into a fresh model and must
give the accuracy the run reported. A few pure checks of the shared pieces need no process at all.
"""
import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import minidp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import demo  # noqa: E402
import train_torchvision  # noqa: E402

import common  # noqa: E402 - examples/ is not a package

# A variable left by an in-process minidp.init() elsewhere in the session would make the example
# believe it runs under torchrun: the children get a clean launch environment.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT")


def run_example(tmp_path, script, *options, under_minidp_run=False, name="report") -> dict:
    """Run examples/<script> in tiny mode with 2 workers; return its JSON report."""
    report = tmp_path / f"{name}.json"
    cmd = [os.path.join(EXAMPLES, script), "--tiny", "--report", str(report), *options]
    cmd = [sys.executable, "-m", "minidp.run", "--nproc-per-node", "2", *cmd] if under_minidp_run else \
        [sys.executable, *cmd, "--nproc-per-node", "2"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    assert "val accuracy" in proc.stdout and proc.stdout.count("epoch 1/1  train loss") == 1  # rank 0 only
    with open(report) as f:
        return json.load(f)


def test_torchvision_minidp_spawned_equals_torch_ddp_under_minidp_run(tmp_path):
    # The same tiny run twice, on the same data and seed, with SyncBatchNorm and LARS: minidp's engine
    # spawned by the example itself, then torch's DDP under `python -m minidp.run`.
    same = ["--synthetic-dir", str(tmp_path / "data"), "--sync-bn", "--optimizer", "lars"]
    out = run_example(tmp_path, "train_torchvision.py", *same, "--checkpoint", str(tmp_path / "minidp"),
                      name="minidp")
    ddp = run_example(tmp_path, "train_torchvision.py", *same, "--engine", "ddp", "--checkpoint",
                      str(tmp_path / "ddp"), under_minidp_run=True, name="ddp")
    assert out["engine"] == "minidp" and out["world_size"] == 2 and out["steps"] == common.TINY["max_steps"]
    assert ddp["engine"] == "ddp" and ddp["world_size"] == 2 and ddp["steps"] == out["steps"]
    # At 2 ranks minidp is bitwise torch DDP: the same weights, BatchNorm statistics, losses and accuracy.
    assert demo.max_difference(out["checkpoint"], ddp["checkpoint"])[0] == 0.0
    assert out["history"] == ddp["history"]
    (record,) = out["history"]
    assert record["val_count"] == 20 and torch.isfinite(torch.tensor(record["train_loss"]))

    model = common.resnet18_cifar(10, width=common.TINY["width"])  # SyncBatchNorm keeps BatchNorm's keys
    ckpt = minidp.load_checkpoint(out["checkpoint"], model)  # verified, weights_only, strict
    assert out["checkpoint"] == str(tmp_path / "minidp" / "epoch0.pt") and ckpt["epoch"] == 0
    assert {"sampler", "args", "metrics"} <= set(ckpt["extra"]) and ckpt["optimizer"] is not None
    assert ckpt["extra"]["sampler"]["consumed"] == 3 * 4 and ckpt["scheduler"]["last_epoch"] == 3
    # Rank 0's weights and statistics, evaluated in one process, give the accuracy the 2 ranks reported.
    (root,) = [e.path for e in os.scandir(tmp_path / "data") if e.name.startswith("minidp-synthetic-")]
    _, val_set = train_torchvision.image_folders(root, common.TINY["image_size"])
    sums = common.evaluate(model, DataLoader(val_set, batch_size=7), torch.device("cpu"))
    assert sums["count"] == 20 and abs(sums["correct"] - round(20 * record["val_accuracy"])) <= 1
    assert sums["loss_sum"] / 20 == pytest.approx(record["val_loss"], rel=1e-4)


@pytest.mark.parametrize("optimizer, cls", [("sgd", torch.optim.SGD), ("lars", minidp.optim.LARS),
                                            ("lamb", minidp.optim.LAMB)])
def test_make_optimizer_warms_up_to_the_scaled_lr_then_decays(optimizer, cls):
    args = common.parse_args("test", ["--optimizer", optimizer, "--epochs", "2", "--warmup-epochs", "0.5"])
    opt, sched = common.make_optimizer(common.resnet18_cifar(10, width=4), args, steps_per_epoch=4, world_size=4)
    assert type(opt) is cls and [g["weight_decay"] for g in opt.param_groups][1] == 0.0  # biases, norms
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    peak = minidp.lr.scaled_lr(args.lr, 4, rule="sqrt" if optimizer == "lamb" else "linear")
    assert lrs[0] == pytest.approx(args.lr) and lrs[2] == pytest.approx(peak)  # 2 warm-up steps, then the peak
    assert lrs[2:] == pytest.approx([peak * common.cosine(s, 6) for s in range(6)])  # cosine over the 6 others
    assert sched.state_dict()["lr_lambdas"] == [{}, {}]  # nothing unpicklable goes into a checkpoint


def test_dali_spawned_exact_validation_with_an_empty_batch(tmp_path):
    pytest.importorskip("nvidia.dali")
    root = tmp_path / "images"
    common.write_synthetic(str(root), 6, 2, size=16, seed=0)
    for name in ("class9/00000.png", "class9/00001.png", "class8/00001.png"):
        os.remove(root / "val" / name)
    # 17 validation images: shards of 8 and 9 in batches of 8, so rank 0's second batch is empty.
    out = run_example(tmp_path, "train_dali.py", "--data", str(root), "--optimizer", "lamb",
                      "--checkpoint", str(tmp_path / "ckpt"))
    assert out["steps"] == 3 and out["history"][0]["val_count"] == 17
    minidp.load_checkpoint(out["checkpoint"], common.resnet18_cifar(10, width=common.TINY["width"]))


def _args(tmp_path, **kw):
    return argparse.Namespace(**{"train_per_class": 2, "val_per_class": 1, "image_size": 8, "seed": 3,
                                 "synthetic_dir": str(tmp_path), "data": None, **kw})


def test_synthetic_set_is_deterministic_and_half_written_sets_are_replaced(tmp_path):
    root = common.ensure_synthetic(_args(tmp_path / "a"))
    files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    assert len(files) == 10 * 3 + 1 and "COMPLETE" in files
    again = common.ensure_synthetic(_args(tmp_path / "b"))
    assert all(open(os.path.join(root, f), "rb").read() == open(os.path.join(again, f), "rb").read() for f in files)
    os.remove(os.path.join(again, "COMPLETE"))  # as if a writer had crashed
    os.remove(os.path.join(again, "train", "class0", "00000.png"))
    assert common.ensure_synthetic(_args(tmp_path / "b")) == again
    assert os.path.exists(os.path.join(again, "COMPLETE")) and os.path.exists(os.path.join(again, files[1]))
    assert not [e for e in os.listdir(tmp_path / "b") if ".partial-" in e]


def test_data_without_train_and_val_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no train/ folder"):
        common.data_root(_args(tmp_path, data=str(tmp_path)))


def test_resnet18_keeps_torchvision_names_and_width():
    names = set(common.resnet18_cifar(10).state_dict())
    import torchvision

    assert names == set(torchvision.models.resnet18(num_classes=10).state_dict())
    narrow = common.resnet18_cifar(10, width=8)
    assert narrow.fc.in_features == 64 and narrow(torch.zeros(2, 3, 16, 16)).shape == (2, 10)


def test_demo_compares_checkpoints_written_by_minidp(tmp_path):
    model = common.resnet18_cifar(10, width=4)
    minidp.save_checkpoint(tmp_path / "a.pt", model)
    minidp.save_checkpoint(tmp_path / "b.pt", model)
    assert demo.max_difference(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))[0] == 0.0
    with torch.no_grad():
        next(model.parameters()).add_(0.5)
    minidp.save_checkpoint(tmp_path / "b.pt", model)
    assert demo.max_difference(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))[0] == pytest.approx(0.5)
