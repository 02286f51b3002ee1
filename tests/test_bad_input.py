"""Bad input to the public helpers that have no test file of their own; each raises naming argument and value.

One rule for where a bad-input case lives: in the test file of the module that raises it
(test_sampler.py, test_lr.py, test_optim.py, test_launch.py, test_dali.py, test_env.py, ...), next
to that module's other tests. This table holds the modules without one: minidp/ranks.py and
minidp/metrics.py, and, until they move to their module's file, the cases of init(), the DDP
constructor and the checkpoint functions that no other file has.

Everything here fails before any collective, so no process group is needed.
"""
import pytest
import torch
from torch import nn

import minidp


def _model():
    return nn.Linear(2, 2)


CASES = [
    # (id, call, exception, words that must appear in the message)
    # minidp/ranks.py
    ("barrier group", lambda: minidp.barrier(group="world"), TypeError, ["group='world'"]),
    ("local_rank_zero_first group", lambda: minidp.local_rank_zero_first(group=3).__enter__(), TypeError,
     ["group=3"]),
    ("get_logger name", lambda: minidp.get_logger(name=5), TypeError, ["name=5"]),
    # minidp/metrics.py
    ("all_reduce_sums values", lambda: minidp.all_reduce_sums([1, 2]), TypeError, ["values=[1, 2]", "mapping"]),
    ("all_reduce_sums tensor", lambda: minidp.all_reduce_sums({"x": torch.ones(2)}), ValueError,
     ["x is a tensor of shape (2,)"]),
    ("all_reduce_sums str", lambda: minidp.all_reduce_sums({"x": "1"}), TypeError, ["x='1' must be an int, a float"]),
    ("all_reduce_sums bool", lambda: minidp.all_reduce_sums({"ok": True}), TypeError, ["ok=True"]),
    # minidp/env.py: init() (test_env.py tests resolve_env() only)
    ("init rank float", lambda: minidp.init(rank=1.5, world_size=2), TypeError, ["rank=1.5"]),
    ("init backend", lambda: minidp.init(backend="carrier-pigeon"), ValueError, ["backend='carrier-pigeon'"]),
    ("init timeout", lambda: minidp.init(timeout=-3), ValueError, ["timeout=", "positive"]),
    ("init nccl without cuda", lambda: minidp.init(backend="nccl"), ValueError, ["backend='nccl'", "CUDA"]),
    # minidp/engine/ddp.py: the constructor checks not in test_ddp_behaviour.py's errors-on-every-rank table
    ("DDP bucket_cap_mb type", lambda: minidp.DDP(_model(), bucket_cap_mb="25"), ValueError, ["bucket_cap_mb='25'"]),
    ("DDP flag type", lambda: minidp.DDP(_model(), find_unused_parameters="yes"), TypeError,
     ["find_unused_parameters='yes'"]),
    ("DDP process_group type", lambda: minidp.DDP(_model(), process_group="world"), TypeError,
     ["process_group='world'"]),
    # minidp/checkpoint.py (test_checkpoint.py tests corrupt files and resumption)
    ("save_checkpoint path", lambda: minidp.save_checkpoint(3.5, _model()), TypeError, ["path=3.5"]),
    ("save_checkpoint model", lambda: minidp.save_checkpoint("x.pt", "model"), TypeError, ["model=str"]),
    ("save_checkpoint step", lambda: minidp.save_checkpoint("x.pt", _model(), step=-1), ValueError, ["step=-1"]),
    ("load_checkpoint missing", lambda: minidp.load_checkpoint("/nonexistent/x.pt", _model()), FileNotFoundError,
     ["/nonexistent/x.pt"]),
]


@pytest.mark.parametrize("call, error, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_named(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"  # not a subclass
    for word in words:
        assert word in str(info.value), str(info.value)


def test_comm_hook_must_be_callable():
    from minidp.engine.ddp import DistributedDataParallel

    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # the check comes before any state is used
    with pytest.raises(TypeError, match="hook=42"):
        DistributedDataParallel.register_comm_hook(ddp, None, 42)
