"""Bad input to the public helpers that have no test file of their own; each raises naming argument and value.

One rule for where a bad-input case lives: in the test file of the module that raises it
(test_sampler.py, test_lr.py, test_optim.py, test_launch.py, test_dali.py, test_env.py,
test_ddp_behaviour.py, test_checkpoint.py, test_syncbn.py, ...), next to that module's other tests.
This table holds the modules without one: minidp/ranks.py and minidp/metrics.py.

Everything here fails before any collective, so no process group is needed.
"""
import pytest
import torch

import minidp

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
]


@pytest.mark.parametrize("call, error, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_named(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"  # not a subclass
    for word in words:
        assert word in str(info.value), str(info.value)

