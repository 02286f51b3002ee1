"""One table of bad input across the public API: each raises TypeError/ValueError naming argument and value.

Everything here fails before any collective, so no process group is needed.
"""
import pytest
import torch
from torch import nn

import minidp
from minidp.env import resolve_env


def _model():
    return nn.Linear(2, 2)


def _opt_params():
    return [nn.Parameter(torch.zeros(2))]


CASES = [
    # (id, call, exception, words that must appear in the message)
    ("init rank float", lambda: minidp.init(rank=1.5, world_size=2), TypeError, ["rank=1.5"]),
    ("init backend", lambda: minidp.init(backend="carrier-pigeon"), ValueError, ["backend='carrier-pigeon'"]),
    ("init timeout", lambda: minidp.init(timeout=-3), ValueError, ["timeout=", "positive"]),
    ("init nccl without cuda", lambda: minidp.init(backend="nccl"), ValueError, ["backend='nccl'", "CUDA"]),
    ("env RANK >= WORLD_SIZE", lambda: resolve_env({"RANK": "4", "WORLD_SIZE": "4"}), ValueError, ["RANK=4"]),
    ("launch nprocs", lambda: minidp.launch(print, 0), ValueError, ["nprocs=0"]),
    ("launch fn", lambda: minidp.launch("train.py", 2), TypeError, ["fn='train.py'"]),
    ("launch args", lambda: minidp.launch(print, 2, args=5), TypeError, ["args=5"]),
    ("launch timeout", lambda: minidp.launch(print, 2, timeout=0), ValueError, ["timeout=0"]),
    ("launch port", lambda: minidp.launch(print, 2, master_port=70000), ValueError, ["master_port=70000"]),
    ("launch node_rank", lambda: minidp.launch(print, 2, nnodes=2, node_rank=5, master_port=1), ValueError,
     ["node_rank=5"]),
    ("barrier group", lambda: minidp.barrier(group="world"), TypeError, ["group='world'"]),
    ("local_rank_zero_first group", lambda: minidp.local_rank_zero_first(group=3).__enter__(), TypeError,
     ["group=3"]),
    ("get_logger name", lambda: minidp.get_logger(name=5), TypeError, ["name=5"]),
    ("DDP module", lambda: minidp.DDP("model"), TypeError, ["module=str"]),
    ("DDP bucket_cap_mb", lambda: minidp.DDP(_model(), bucket_cap_mb=0), ValueError, ["bucket_cap_mb=0"]),
    ("DDP bucket_cap_mb type", lambda: minidp.DDP(_model(), bucket_cap_mb="25"), ValueError, ["bucket_cap_mb='25'"]),
    ("DDP flag type", lambda: minidp.DDP(_model(), find_unused_parameters="yes"), TypeError,
     ["find_unused_parameters='yes'"]),
    ("DDP process_group type", lambda: minidp.DDP(_model(), process_group="world"), TypeError,
     ["process_group='world'"]),
    ("DDP device_ids", lambda: minidp.DDP(_model(), device_ids=[0, 1]), ValueError, ["device_ids=[0, 1]"]),
    ("sampler num_replicas", lambda: minidp.DistributedSampler(range(10), num_replicas=0, rank=0), ValueError,
     ["num_replicas=0"]),
    ("sampler rank", lambda: minidp.DistributedSampler(range(10), num_replicas=2, rank=2), ValueError, ["rank=2"]),
    ("sampler seed", lambda: minidp.DistributedSampler(range(10), 2, 0, seed="7"), ValueError, ["seed='7'"]),
    ("sampler empty drop_last", lambda: minidp.DistributedSampler([], 2, 0, drop_last=True), ValueError,
     ["drop_last"]),
    ("all_reduce_sums values", lambda: minidp.all_reduce_sums([1, 2]), TypeError, ["values"]),
    ("save_checkpoint path", lambda: minidp.save_checkpoint(3.5, _model()), TypeError, ["path=3.5"]),
    ("save_checkpoint model", lambda: minidp.save_checkpoint("x.pt", "model"), TypeError, ["model=str"]),
    ("save_checkpoint step", lambda: minidp.save_checkpoint("x.pt", _model(), step=-1), ValueError, ["step=-1"]),
    ("load_checkpoint missing", lambda: minidp.load_checkpoint("/nonexistent/x.pt", _model()), FileNotFoundError,
     ["/nonexistent/x.pt"]),
    ("SyncBatchNorm eps", lambda: minidp.SyncBatchNorm(4, eps=0), ValueError, ["eps=0"]),
    ("convert non-BN", lambda: minidp.convert_sync_batchnorm(_model()), ValueError, ["Linear"]),
    ("LARS lr", lambda: minidp.optim.LARS(_opt_params(), lr=-1), ValueError, ["lr=-1"]),
    ("LARS momentum", lambda: minidp.optim.LARS(_opt_params(), momentum=1.0), ValueError, ["momentum=1.0"]),
    ("LAMB eps", lambda: minidp.optim.LAMB(_opt_params(), eps=0), ValueError, ["eps=0"]),
    ("LAMB betas", lambda: minidp.optim.LAMB(_opt_params(), betas=(0.9, 1.5)), ValueError, ["1.5"]),
    ("lr world_size", lambda: minidp.lr.scaled_lr(0.1, world_size=0), ValueError, ["world_size=0"]),
    ("lr base", lambda: minidp.lr.scaled_lr(-0.1, world_size=2), ValueError, ["-0.1"]),
    ("dali root", lambda: minidp.data.image_folder_loader("/nonexistent/folder", 4, rank=0, world_size=1),
     ValueError, ["/nonexistent/folder"]),
    ("dali batch_size", lambda: minidp.data.image_folder_loader(".", 0, rank=0, world_size=1), ValueError,
     ["batch_size=0"]),
]


@pytest.mark.parametrize("call, error, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_named(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), str(info.value)


def test_comm_hook_must_be_callable():
    from minidp.engine.ddp import DistributedDataParallel

    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # the check comes before any state is used
    with pytest.raises(TypeError, match="hook=42"):
        DistributedDataParallel.register_comm_hook(ddp, None, 42)
