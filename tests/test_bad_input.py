"""Bad input to the public helpers that have no test file of their own; each raises naming argument and value.

One rule for where a bad-input case lives: in the test file of the module that raises it
(test_sampler.py, test_lr.py, test_optim.py, test_launch.py, test_dali.py, test_env.py,
test_ddp_behaviour.py, test_checkpoint.py, test_syncbn.py, ...), next to that module's other tests.
This table holds the modules without one: minidp/runtime/ranks.py and minidp/train/metrics.py.

Everything here fails before any collective, so no process group is needed.
"""
import os
import sys

import pytest
import torch

import minidp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))  # examples/ is not a package

CASES = [
    # (id, call, exception, words that must appear in the message)
    # minidp/runtime/ranks.py
    ("barrier group", lambda: minidp.barrier(group="world"), TypeError, ["group='world'"]),
    ("local_rank_zero_first group", lambda: minidp.local_rank_zero_first(group=3).__enter__(), TypeError,
     ["group=3"]),
    ("get_logger name", lambda: minidp.get_logger(name=5), TypeError, ["name=5"]),
    # minidp/train/metrics.py
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



# ----------------------------------------------------------------------------- the examples' --data
@pytest.mark.parametrize("example, data, words", [
    ("train_torchvision", "no/such/dir", "--data 'no/such/dir' has no train/ folder"),
    ("train_dali", "no/such/dir", "--data 'no/such/dir' has no train/ folder"),
    ("train_lm", "no/such/file.txt", "--data='no/such/file.txt' is not a file"),
])
def test_an_example_refuses_a_bad_data_path_before_it_starts_a_worker(example, data, words, monkeypatch, capsys):
    """One line from argparse, exit status 2, and no worker started (a worker would fail later, in a traceback
    nested in the launcher's). In this process: the examples' main() is what `python examples/...` runs."""
    if example == "train_dali":
        pytest.importorskip("nvidia.dali")
    module = __import__(example)

    def no_launch(*args, **kwargs):
        raise AssertionError(f"{example} started its workers with --data {data!r}")
    monkeypatch.setattr(minidp, "launch", no_launch)
    for name in ("RANK", "LOCAL_RANK"):  # as a plain `python examples/...` command: the example would launch
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as info:
        module.main(["--data", data, "--tiny"])
    err = capsys.readouterr().err
    # argparse's usage, then the one line that says what is wrong; no traceback
    assert info.value.code == 2 and f"error: {words}" in err.strip().splitlines()[-1] and "Traceback" not in err, err


# ----------------------------------------------------------------------------- minidp.DDP's keywords
@pytest.mark.parametrize("keyword, suggestion", [("bucket_size_mb", "bucket_cap_mb"),
                                                 ("find_unused_params", "find_unused_parameters"),
                                                 ("no_such_option", None)])
def test_ddp_unknown_keyword_is_a_type_error_as_in_torch(keyword, suggestion):
    with pytest.raises(TypeError) as info:
        minidp.DDP(torch.nn.Linear(2, 2), **{keyword: 25})  # fails before it looks for a process group
    assert f"__init__() got an unexpected keyword argument '{keyword}'" in str(info.value)
    assert (f"did you mean '{suggestion}'?" in str(info.value)) if suggestion else "did you mean" not in str(info.value)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):  # torch DDP's words
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), **{keyword: 25})


MIXED = torch.nn.parallel.distributed._MixedPrecision(torch.bfloat16, torch.float32)


@pytest.mark.parametrize("kwargs, refused", [
    (dict(mixed_precision=MIXED, static_graph=True), "mixed_precision with static_graph=True"),
    (dict(mixed_precision=MIXED, gradient_as_bucket_view=True), "mixed_precision with gradient_as_bucket_view=True"),
    (dict(skip_all_reduce_unused_params=True, static_graph=True),
     "skip_all_reduce_unused_params=True with static_graph"),
])
def test_ddp_keyword_combination_minidp_lacks_is_refused_by_name(kwargs, refused):
    with pytest.raises(ValueError, match=f"minidp.DDP does not support {refused}"):
        minidp.DDP(torch.nn.Linear(2, 2), **kwargs)
