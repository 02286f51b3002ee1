"""Lightning with strategy="ddp" (torch DDP) and "minidp", in the same processes; results to a file.

Run as `python frameworks_lightning.py OUT_DIR`: the first Trainer.fit starts rank 1 with Lightning's
own launcher (it re-runs this script); every later Trainer in both processes finds the ranks made.
For accumulate_grad_batches 1 and 3, each strategy trains 2 epochs (SGD with momentum, a shuffled
loader) and saves a checkpoint after each epoch; then each epoch-0 checkpoint resumes under the other
strategy. Each rank writes OUT_DIR/lightning-<rank>.pt: final weights, steps, minidp's synced backward
count, the checkpoints' keys; and a minidp run with an FP16 comm hook and a bucket cap given to the
strategy; and both strategies under manual optimization. tests/test_frameworks.py compares them.
"""
import glob
import importlib
import os
import sys
import warnings

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.utils.data import DataLoader, TensorDataset

import minidp
import minidp.lightning  # noqa: F401  registers strategy="minidp"

importlib.reload(minidp.lightning)  # a second registration must not raise (a notebook re-running its imports)
torch.set_num_threads(1)
warnings.filterwarnings("ignore")  # Lightning's advice (num_workers, logging intervals) is noise here
OUT = sys.argv[1]
ACCUMULATIONS = (1, 3)  # 3 of 8 batches per epoch: the last step of each epoch has 2 (Lightning steps at the end)


class Net(L.LightningModule):
    """A tiny regression MLP, SGD with momentum."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class ManualNet(Net):
    """Manual optimization, 3 batches accumulated per step through opt.toggle_model(sync_grad=...)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, index):
        opt = self.optimizers()
        last = (index + 1) % 3 == 0 or index + 1 == self.trainer.num_training_batches
        with opt.toggle_model(sync_grad=last):  # no_sync() unless the step ends here
            x, y = batch
            self.manual_backward(torch.nn.functional.mse_loss(self.net(x), y) / 3)
        if last:
            opt.step()
            opt.zero_grad()


class Record(L.Callback):
    """What the wrapper was during fit (before teardown unwraps it), and minidp's synced backward count."""

    def on_train_end(self, trainer, module):
        wrapper = trainer.strategy.model
        self.wrapper = f"{type(wrapper).__module__.split('.')[0]}.{type(wrapper).__name__}"
        self.synced = wrapper.reducer.iteration if isinstance(wrapper, minidp.DDP) else None
        hook = wrapper.reducer.comm_hook if isinstance(wrapper, minidp.DDP) else None
        self.hook = hook.__qualname__ if hook is not None else None
        self.bucket_cap_mb = wrapper.bucket_cap_mb if isinstance(wrapper, minidp.DDP) else None


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(256, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)  # Lightning adds its DistributedSampler


def fit(strategy, accumulate, ckpt_dir=None, ckpt_path=None, module=Net):
    L.seed_everything(0, verbose=False)
    model, record = module(), Record()
    callbacks = [record]
    if ckpt_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2,
                        accumulate_grad_batches=accumulate, callbacks=callbacks, logger=False,
                        enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "steps": trainer.global_step, "wrapper": record.wrapper, "synced": record.synced,
            "strategy": type(trainer.strategy).__module__ + "." + type(trainer.strategy).__name__,
            "hook": record.hook, "bucket_cap_mb": record.bucket_cap_mb,
            "lightning_module_is_model": trainer.lightning_module is model}


results = {}
for accumulate in ACCUMULATIONS:
    for strategy in ("ddp", "minidp"):
        ckpt_dir = os.path.join(OUT, f"{strategy}-{accumulate}")
        results[strategy, accumulate] = fit(strategy, accumulate, ckpt_dir=ckpt_dir)
accumulate = ACCUMULATIONS[-1]
for saved, resumed in (("ddp", "minidp"), ("minidp", "ddp")):
    (ckpt,) = glob.glob(os.path.join(OUT, f"{saved}-{accumulate}", "epoch=0-*.ckpt"))
    results[f"{saved}->{resumed}", accumulate] = fit(resumed, accumulate, ckpt_path=ckpt)
    results[f"{saved}->{resumed}", accumulate]["ckpt_keys"] = sorted(torch.load(ckpt, weights_only=False)["state_dict"])
# Lightning's DDP keywords reach minidp.DDP: a comm hook (registered on CPU too) and a bucket cap.
strategy = minidp.lightning.DDPStrategy(ddp_comm_hook=fp16_compress_hook, bucket_cap_mb=1)
results["comm_hook", 1] = fit(strategy, 1)
for strategy in ("ddp", "minidp"):
    results["manual", strategy] = fit(strategy, 1, module=ManualNet)
results["world_size"] = dist.get_world_size()
results["registered"] = sorted(n for n in L.pytorch.strategies.StrategyRegistry if n.startswith("minidp"))
torch.save(results, os.path.join(OUT, f"lightning-{dist.get_rank()}.pt"))
dist.barrier()  # ranks meet here: rank 0 (the launcher) ends only after rank 1 wrote its file
dist.destroy_process_group()
