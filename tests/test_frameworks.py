"""minidp inside PyTorch Lightning and Hugging Face Accelerate, each against the framework's own torch-DDP path.

Two real launches (world size 2, gloo, CPU), registered at collection and run in the background
between other tests (tests/scripts/background.py); the module fixture waits for them: Lightning's own
launcher (tests/scripts/frameworks_lightning.py: strategy "ddp" and "minidp"), and `accelerate launch`
(tests/scripts/frameworks_accelerate.py: accelerate.Accelerator and minidp.accelerate.Accelerator). Each
script trains both paths in the same processes, with and without gradient accumulation, resumes each
path's checkpoint under the other, and writes what it saw; the tests here compare the minidp path with
the torch-DDP path, bitwise. Under torchrun, the README's own command runs Accelerate
(examples/accelerate_minidp.py: both engines in turn, with and without accumulation; test_readme.py
checks they end bitwise equal), so no third launch runs here: each costs ~25 s of CPU on 2 cores.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

from minidp.launcher.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
sys.path.insert(0, SCRIPTS)
from background import folder, prelaunch  # noqa: E402
from processes import VENV_BIN, Command, clean_env  # noqa: E402

# Looked up, not imported: importing Lightning here would cost this process seconds of CPU for nothing.
for _framework in ("lightning", "accelerate"):
    if importlib.util.find_spec(_framework) is None:
        pytest.skip(f"needs {_framework}: pip install -e '.[{_framework}]' (make test installs it)",
                    allow_module_level=True)

TIMEOUT_S = 240


def _launch(out: str, name: str) -> Command:
    """One of the two launches, started now."""
    # No user config, cache or token: HF_HOME (Accelerate's config dir is under it) and caches in the temp folder.
    env = clean_env(HF_HOME=os.path.join(out, "hf"), XDG_CACHE_HOME=os.path.join(out, "cache"),
                    CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    commands = {
        # Lightning's launcher re-runs the script for rank 1; it reads the port from MASTER_PORT.
        "lightning": [sys.executable, os.path.join(SCRIPTS, "frameworks_lightning.py"), out],
        # Without a GPU, --multi_gpu is Accelerate's torchrun-based launcher; the script asks for cpu=True.
        "accelerate": [os.path.join(VENV_BIN, "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                       "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                       "--main_process_port", str(free_port()), os.path.join(SCRIPTS, "frameworks_accelerate.py"),
                       out, "accelerate"],
    }
    return Command(commands[name], cwd=out, env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
                   if name == "lightning" else env, timeout=TIMEOUT_S)


OUT: list = []  # the launches' shared folder, made when the first starts


def _start(name: str) -> list:
    if not OUT:
        OUT.append(folder("frameworks"))
    return [_launch(OUT[0], name)]


LAUNCHES = {name: prelaunch(f"test_frameworks.py: {name}", lambda name=name: _start(name), module="test_frameworks.py")
            for name in ("lightning", "accelerate")}


class Runs:
    """The launches' results, once all have ended; runs[name] is [rank 0's results, rank 1's]."""

    def __init__(self):
        self.ended = {name: group.results()[0] for name, group in LAUNCHES.items()}
        self.out, self.loaded = OUT[0], {}

    def __getitem__(self, name: str) -> list:
        result = self.ended[name]  # a failed launch fails its own tests only
        assert result.returncode == 0, str(result)
        if name not in self.loaded:
            self.loaded[name] = [torch.load(os.path.join(self.out, f"{name}-{rank}.pt"), weights_only=False)
                                 for rank in (0, 1)]
        return self.loaded[name]


@pytest.fixture(scope="module")
def runs():
    return Runs()


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resumed_like(reference, ranks, directions):
    """The runs resumed from a checkpoint, by direction (ranks[direction, 3]): each ran under the engine its
    direction names and ended with the uninterrupted run's weights, bitwise."""
    resumed = {}
    for direction, wrapper in directions:
        run = resumed[direction] = ranks[direction, 3]
        assert run["wrapper"] == f"{wrapper}.DistributedDataParallel", direction
        assert _equal(run["weights"], reference["weights"]), direction
    return resumed


def test_lightning_minidp_equals_ddp_bitwise(runs):
    """Trainer(strategy="minidp") ends with torch DDP's weights, with and without accumulate_grad_batches."""
    for ranks in runs["lightning"]:
        assert ranks["world_size"] == 2
        assert ranks["registered"] == ["minidp", "minidp_fork", "minidp_notebook", "minidp_spawn"]
        for accumulate in (1, 3):
            ddp, mini = ranks["ddp", accumulate], ranks["minidp", accumulate]
            assert ddp["wrapper"] == "torch.DistributedDataParallel"
            assert mini["wrapper"] == "minidp.DistributedDataParallel"
            assert mini["strategy"] == "minidp.integrations.lightning.DDPStrategy"  # public: minidp.lightning
            assert mini["lightning_module_is_model"] and ddp["lightning_module_is_model"]
            assert mini["steps"] == ddp["steps"]
            assert _equal(mini["weights"], ddp["weights"]), f"accumulate_grad_batches={accumulate}"
            # Accumulation went through minidp's no_sync(): one averaging backward per optimizer step.
            assert mini["synced"] == ddp["steps"]
        assert not _equal(ranks["ddp", 1]["weights"], ranks["ddp", 3]["weights"])  # accumulation changes the run
    assert _equal(runs["lightning"][0]["minidp", 3]["weights"], runs["lightning"][1]["minidp", 3]["weights"])


def test_lightning_manual_optimization(runs):
    """Manual optimization (backward inside training_step, accumulation by toggle_model): torch DDP's weights."""
    for ranks in runs["lightning"]:
        ddp, mini = ranks["manual", "ddp"], ranks["manual", "minidp"]
        assert mini["wrapper"] == "minidp.DistributedDataParallel"
        assert _equal(mini["weights"], ddp["weights"])
        assert mini["synced"] == ddp["steps"] < 16  # one averaging backward per optimizer step, of 16 batches
        assert not _equal(ddp["weights"], ranks["ddp", 1]["weights"])  # the accumulation happened


def test_lightning_strategy_keywords_reach_minidp(runs):
    """DDPStrategy(ddp_comm_hook=fp16_compress_hook, bucket_cap_mb=1): both reach minidp.DDP, on CPU too."""
    for ranks in runs["lightning"]:
        hooked, plain = ranks["comm_hook", 1], ranks["minidp", 1]
        assert (hooked["hook"], hooked["bucket_cap_mb"]) == ("fp16_compress_hook", 1)
        assert (plain["hook"], plain["bucket_cap_mb"]) == (None, None)
        assert not _equal(hooked["weights"], plain["weights"])  # the hook rounded the averaged gradients
        gap = max((weight - plain["weights"][name]).abs().max().item() for name, weight in hooked["weights"].items())
        assert gap < 1e-2  # ... to about fp16's precision


def test_lightning_checkpoints_resume_across_strategies(runs):
    """An epoch-0 checkpoint of "ddp" resumes under "minidp" and back, to the uninterrupted run's weights."""
    for ranks in runs["lightning"]:
        reference = ranks["ddp", 3]
        resumed = _resumed_like(reference, ranks, (("ddp->minidp", "minidp"), ("minidp->ddp", "torch")))
        for run in resumed.values():
            assert run["steps"] == reference["steps"]
            assert run["ckpt_keys"] == sorted(reference["weights"])  # the LightningModule's keys, no "module."
        assert resumed["ddp->minidp"]["synced"] == reference["steps"] // 2  # the resumed epoch's steps only


def test_accelerate_minidp_equals_torch_ddp_bitwise(runs):
    """minidp.accelerate.Accelerator ends with accelerate.Accelerator's weights; unwrap_model() is the model."""
    for ranks in runs["accelerate"]:
        for accumulate in (1, 3):
            torch_ddp, mini = ranks["torch", accumulate], ranks["minidp", accumulate]
            assert torch_ddp["distributed_type"] == mini["distributed_type"] == "DistributedType.MULTI_CPU"
            assert torch_ddp["world_size"] == mini["world_size"] == 2
            assert torch_ddp["wrapper"] == "torch.DistributedDataParallel"
            assert mini["wrapper"] == "minidp.DistributedDataParallel"
            assert mini["unwrapped_is_model"] and torch_ddp["unwrapped_is_model"]
            assert mini["state_dict_keys"] == torch_ddp["state_dict_keys"] == sorted(torch_ddp["weights"])
            assert _equal(mini["weights"], torch_ddp["weights"]), f"gradient_accumulation_steps={accumulate}"
            assert torch.equal(mini["losses"], torch_ddp["losses"]) and mini["losses"].shape == (2,)  # gather()
            # accumulate() went through minidp's no_sync(): it averaged exactly on the steps Accelerate synced.
            assert mini["synced"] == torch_ddp["synced_steps"] == mini["synced_steps"]
        assert not _equal(ranks["torch", 1]["weights"], ranks["torch", 3]["weights"])
    assert _equal(runs["accelerate"][0]["minidp", 3]["weights"], runs["accelerate"][1]["minidp", 3]["weights"])


def test_accelerate_state_resumes_across_accelerators(runs):
    """save_state() under one Accelerator, load_state() under the other: the uninterrupted run's weights."""
    for ranks in runs["accelerate"]:
        reference = ranks["torch", 3]
        for run in _resumed_like(reference, ranks, (("torch->minidp", "minidp"), ("minidp->torch", "torch"))).values():
            assert torch.equal(run["losses"], reference["losses"])


def test_accelerate_no_sync_and_trigger_sync(runs):
    """no_sync() keeps each rank's gradient; trigger_sync_in_backward() averages it: as with torch DDP."""
    ranks = runs["accelerate"]
    for rank in ranks:
        for name in ("local", "averaged"):
            assert torch.equal(rank["sync_switches", "minidp"][name], rank["sync_switches", "torch"][name]), name
    mini = [rank["sync_switches", "minidp"] for rank in ranks]
    assert not torch.equal(mini[0]["local"], mini[1]["local"])
    assert torch.equal(mini[0]["averaged"], mini[1]["averaged"])


def test_accelerate_ddp_kwargs_and_comm_hook(runs):
    """DistributedDataParallelKwargs(comm_hook=FP16, gradient_as_bucket_view=True) reaches minidp.DDP."""
    for ranks in runs["accelerate"]:
        torch_ddp, mini = ranks["comm_hook", "torch"], ranks["comm_hook", "minidp"]
        assert mini["hook"] == torch_ddp["hook"] == "fp16_compress_hook"
        assert mini["gradient_as_bucket_view"] and torch_ddp["gradient_as_bucket_view"]
        assert _equal(mini["weights"], torch_ddp["weights"])


@pytest.mark.parametrize("module, extra, framework", [("minidp.lightning", "lightning", "lightning"),
                                                      ("minidp.accelerate", "accelerate", "accelerate")])
def test_missing_framework_names_the_extra(monkeypatch, module, extra, framework):
    """Without the framework, importing the integration says which extra to install."""
    for name in [name for name in sys.modules if name == framework or name.startswith(framework + ".")] or [framework]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: importing it fails
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.delitem(sys.modules, f"minidp.integrations.{extra}", raising=False)  # the public name's code
    with pytest.raises(ImportError, match=rf"pip install -e '\.\[{extra}\]'"):
        importlib.import_module(module)
