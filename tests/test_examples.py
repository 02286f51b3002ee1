"""The two training examples end to end in their --tiny mode (2 workers, 60 images of 16x16, 3 steps).

The torchvision example runs with minidp and with torch DDP on the same seed, with SyncBatchNorm and
LARS, and the two must end bitwise equal; the checkpoint is reloaded into a fresh model and must give
the accuracy the run reported. Both run through the example's main() in this process, its 2 workers
forked from it (tests/harness.py); the real command lines run in test_readme.py: the README's `python
examples/train_torchvision.py` (a worker spawned) and its `torchrun --nproc-per-node 2 ... --engine ddp
--sync-bn` (at 1 rank under torchrun). The DALI example's tests are in test_dali.py.
A few pure checks of the shared pieces need no process at all.
"""
import argparse
import io
import json
import os
import re
import sys
import threading

import pytest
import torch
import tqdm
from torch.utils.data import DataLoader

import minidp
from harness import workers_forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)
sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))

import demo  # noqa: E402
import train_torchvision  # noqa: E402
from processes import LAUNCH_VARS  # noqa: E402

import common  # noqa: E402 - examples/ is not a package

ACCURACY = re.compile(r"epoch 1/1  train loss [\d.]+  val loss [\d.]+  val accuracy ([\d.]+)% of 20 images")


def _in_process(engine, out, options, monkeypatch) -> dict:
    """The example's main() here, spawning (forking) its 2 workers itself; returns its JSON report."""
    for name in [*LAUNCH_VARS, *(k for k in os.environ if k.startswith(("TORCHELASTIC_", "SLURM_")))]:
        monkeypatch.delenv(name, raising=False)  # left by an in-process init(), the example would not launch
    with workers_forked():
        train_torchvision.main(["--tiny", *options, "--engine", engine, "--nproc-per-node", "2", "--checkpoint",
                                str(out / engine), "--report", str(out / f"{engine}.json")])
    with open(out / f"{engine}.json") as f:
        return json.load(f)


def test_torchvision_minidp_equals_torch_ddp(tmp_path, monkeypatch, capfd):
    # The same tiny run twice, on the same data and seed, with SyncBatchNorm, LARS and --amp (bfloat16 on CPU).
    same = ["--synthetic-dir", str(tmp_path / "data"), "--sync-bn", "--optimizer", "lars", "--amp"]
    ddp = _in_process("ddp", tmp_path, same, monkeypatch)
    accuracies = ACCURACY.findall(capfd.readouterr().out)
    assert len(accuracies) == 1, accuracies  # printed by rank 0 only
    assert float(accuracies[0]) == pytest.approx(100 * ddp["history"][0]["val_accuracy"], abs=0.01)
    out = _in_process("minidp", tmp_path, same, monkeypatch)
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
                                            ("lamb", minidp.optim.LAMB), ("novograd", minidp.optim.NovoGrad)])
def test_make_optimizer_warms_up_to_the_scaled_lr_then_decays(optimizer, cls):
    args = common.parse_args("test", ["--optimizer", optimizer, "--epochs", "2", "--warmup-epochs", "0.5"])
    opt, sched = common.make_optimizer(common.resnet18_cifar(10, width=4), args, steps_per_epoch=4, world_size=4)
    assert type(opt) is cls and [g["weight_decay"] for g in opt.param_groups][1] == 0.0  # biases, norms
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    peak = minidp.lr.scaled_lr(args.lr, 4, rule="sqrt" if optimizer in ("lamb", "novograd") else "linear")
    assert lrs[0] == pytest.approx(args.lr) and lrs[2] == pytest.approx(peak)  # 2 warm-up steps, then the peak
    assert lrs[2:] == pytest.approx([peak * common.cosine(s, 6) for s in range(6)])  # cosine over the 6 others
    assert sched.state_dict()["lr_lambdas"] == [{}, {}]  # nothing unpicklable goes into a checkpoint


def test_amp_is_bfloat16_autocast_on_cpu_without_loss_scaling():
    model = common.resnet18_cifar(10, width=4)
    for amp in (False, True):
        args = common.parse_args("test", ["--amp"] if amp else [])
        seen = []
        hook = model.conv1.register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.dtype))
        with common.autocast(args, torch.device("cpu")):
            loss = torch.nn.functional.cross_entropy(model(torch.zeros(2, 3, 8, 8)), torch.tensor([0, 1]))
        hook.remove()
        assert seen == [torch.bfloat16 if amp else torch.float32] and loss.dtype == torch.float32
        scaler = common.grad_scaler(args, torch.device("cpu"))
        assert not scaler.is_enabled() and scaler.scale(loss) is loss  # bfloat16 needs no loss scale
    assert model.fc.weight.dtype == torch.float32  # the parameters stay float32


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


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(monkeypatch):
    """Rank 0 shows where a long run is: plain lines with the rate and the time left when stdout is a file."""
    log = io.StringIO()
    monkeypatch.setattr(sys, "stdout", log)
    progress = common.Progress(20, "epoch 1/3", show=True, interval_s=0)  # every 2 steps: a tenth of 20
    for step in range(20):
        progress.step(**({"loss": f"{1 / (step + 1):.3f}"} if step % 10 == 0 else {}))
    progress.close()
    lines = log.getvalue().splitlines()
    assert [int(re.match(r"epoch 1/3: step (\d+)/20, [\d.]+ steps/s, ETA \d+ s, loss [\d.]+$", line).group(1))
            for line in lines] == list(range(2, 21, 2)), lines
    assert lines[-1].endswith("ETA 0 s, loss 0.091")  # the last loss given, kept until replaced
    assert common.rate_and_eta(0, 10, 0.0) == "0.00 steps/s, ETA ?" and common.duration(200) == "3.3 min"
    fast = common.Progress(20, "a fast loop", show=True)  # at most one line per 10 s (default): none here
    for _ in range(20):
        fast.step()
    assert "a fast loop" not in log.getvalue()

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    # No tqdm monitor thread: a thread left in this process would make the harness spawn later tests' ranks
    # instead of forking them (seconds each).
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)
    bar = common.Progress(5, "TernGrad training", show=True)
    for _ in range(5):
        bar.step()
    assert bar.bar.n == 5 and "\rTernGrad training:" in terminal.getvalue()  # tqdm's bar, redrawn in place
    bar.close()
    assert "step 1/5" not in terminal.getvalue()  # no plain lines beside the bar
    quiet = common.Progress(5, "rank 1", show=False)
    quiet.step()
    quiet.close()
    assert "rank 1" not in terminal.getvalue()  # the other ranks show nothing
    assert "tqdm_monitor" not in [t.name for t in threading.enumerate()]


def test_minimal_help_prints_its_text_and_trains_nothing():
    """`python examples/minimal.py --help` (a user's first try) prints the docstring and exits 0; it trained before.
    A misspelt option is one argparse line and exit 2, before minidp.init()."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    proc = subprocess.run([sys.executable, "examples/minimal.py", "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc
    assert proc.stdout.startswith("usage: minimal.py [-h]") and "one process: world size 1" in proc.stdout, proc.stdout
    assert "epoch 1:" not in proc.stdout and "rank(s), " not in proc.stdout, proc.stdout  # nothing trained
    import minimal
    with pytest.raises(SystemExit) as exit_info:
        minimal.main(["--epochs", "3"])  # no such option: refused before any process group
    assert exit_info.value.code == 2
