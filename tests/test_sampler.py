"""minidp.DistributedSampler against torch's, its properties, resume, exact mode and bad input."""
import math
import random
from collections import Counter

import pytest
import torch
import torch.utils.data as tud
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import run_ranks
from minidp.data.sampler import DistributedSampler
from minidp.train.metrics import all_reduce_sums

SETTINGS = settings(max_examples=150, deadline=None)


def _torch_indices(n, k, r, shuffle, seed, drop_last, epoch):
    s = tud.DistributedSampler(range(n), num_replicas=k, rank=r, shuffle=shuffle, seed=seed, drop_last=drop_last)
    s.set_epoch(epoch)
    return list(s)


def _mine(n, k, r, shuffle=True, seed=0, drop_last=False, epoch=0, **kw):
    s = DistributedSampler(range(n), num_replicas=k, rank=r, shuffle=shuffle, seed=seed, drop_last=drop_last, **kw)
    s.set_epoch(epoch)
    return s


def _random_configs(count, seed=0):
    rng = random.Random(seed)
    sizes = [0, 1, 2, 3, 7, 8, 9, 1000] + [rng.randint(0, 1000) for _ in range(count)]
    for n in sizes:
        k = rng.randint(1, 8)
        for shuffle in (False, True):
            for drop_last in (False, True):
                if drop_last and n == 0:
                    continue  # refused on purpose (tested below); torch yields nothing
                yield n, k, shuffle, drop_last, rng.choice([0, 1, 42, 2**31 - 1]), rng.choice([0, 1, 5, 99])


def test_index_parity_with_torch_many_configs():
    checked = 0
    for n, k, shuffle, drop_last, seed, epoch in _random_configs(60):
        for r in range(k):
            mine = _mine(n, k, r, shuffle, seed, drop_last, epoch)
            expected = _torch_indices(n, k, r, shuffle, seed, drop_last, epoch)
            assert list(mine) == expected, (n, k, r, shuffle, seed, drop_last, epoch)
            assert len(mine) == len(expected) and mine.indices() == expected
            checked += 1
    assert checked > 500


@SETTINGS
@given(n=st.integers(0, 1000), k=st.integers(1, 8), shuffle=st.booleans(), drop_last=st.booleans(),
       seed=st.integers(0, 2**32), epoch=st.integers(0, 1000))
def test_index_parity_with_torch_property(n, k, shuffle, drop_last, seed, epoch):
    if drop_last and n == 0:
        return
    for r in range(k):
        assert list(_mine(n, k, r, shuffle, seed, drop_last, epoch)) == _torch_indices(
            n, k, r, shuffle, seed, drop_last, epoch)


@SETTINGS
@given(n=st.integers(1, 300), k=st.integers(1, 8), shuffle=st.booleans(), drop_last=st.booleans(),
       seed=st.integers(0, 1000), epoch=st.integers(0, 50))
def test_ranks_are_disjoint_up_to_padding_and_cover(n, k, shuffle, drop_last, seed, epoch):
    per_rank = [list(_mine(n, k, r, shuffle, seed, drop_last, epoch)) for r in range(k)]
    lengths = {len(ix) for ix in per_rank}
    assert len(lengths) == 1  # every rank the same count: DDP steps stay in lockstep
    counts = Counter(i for ix in per_rank for i in ix)
    if drop_last:
        assert len(counts) == k * (n // k) and set(counts.values()) <= {1}  # disjoint, tail trimmed
    else:
        assert set(counts) == set(range(n))  # covers the data set
        padding = k * -(-n // k) - n
        assert sum(counts.values()) - n == padding  # the only duplicates are the padding
        if padding <= n:
            assert max(counts.values()) <= 2


@SETTINGS
@given(n=st.integers(0, 300), k=st.integers(1, 8), shuffle=st.booleans(), seed=st.integers(0, 1000),
       epoch=st.integers(0, 50))
def test_exact_mode_has_each_sample_exactly_once(n, k, shuffle, seed, epoch):
    per_rank = [list(_mine(n, k, r, shuffle, seed, epoch=epoch, pad=False)) for r in range(k)]
    assert sorted(i for ix in per_rank for i in ix) == list(range(n))
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1
    for r, ix in enumerate(per_rank):
        # The exact order is the padded (torch) order with the padding cut off.
        padded = _torch_indices(n, k, r, shuffle, seed, False, epoch)
        assert ix == padded[:len(ix)] and len(_mine(n, k, r, shuffle, seed, pad=False)) == len(ix)


@SETTINGS
@given(n=st.integers(10, 300), seed=st.integers(0, 1000), epoch=st.integers(0, 50))
def test_set_epoch_changes_the_order_and_seed_epoch_fix_it(n, seed, epoch):
    s = _mine(n, 1, 0, seed=seed, epoch=epoch)
    first = list(s)
    assert list(s) == first  # same epoch: same order
    assert list(_mine(n, 1, 0, seed=seed, epoch=epoch)) == first  # a fresh sampler agrees
    s.set_epoch(epoch + 1)
    assert list(s) != first and sorted(s) == sorted(first)


def test_same_seed_and_epoch_give_one_permutation_across_ranks():
    n, k = 103, 4
    per_rank = [list(_mine(n, k, r, seed=9, epoch=3)) for r in range(k)]
    interleaved = [per_rank[i % k][i // k] for i in range(k * len(per_rank[0]))]
    g = torch.Generator()
    g.manual_seed(9 + 3)
    perm = torch.randperm(n, generator=g).tolist()
    assert interleaved == perm + perm[:len(interleaved) - n]


# ---- resume -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n, k, rank, shuffle, drop_last, pad", [
    (101, 3, 1, True, False, True), (64, 4, 3, True, True, True), (37, 2, 0, False, False, True),
    (37, 5, 4, True, False, False), (5, 8, 6, True, False, True),
])
def test_resume_yields_exactly_the_rest_of_the_epoch(n, k, rank, shuffle, drop_last, pad):
    kw = dict(num_replicas=k, rank=rank, shuffle=shuffle, seed=3, drop_last=drop_last, pad=pad)
    full = DistributedSampler(range(n), **kw).indices(epoch=2)
    for consumed in range(len(full) + 1):
        s = DistributedSampler(range(n), **kw)
        s.set_epoch(2)
        it = iter(s)
        taken = [next(it) for _ in range(consumed)]
        assert s.consumed == consumed
        state = s.state_dict()
        fresh = DistributedSampler(range(n), **kw)
        fresh.load_state_dict(state)
        fresh.set_epoch(2)  # the usual loop calls set_epoch(epoch) on the resumed epoch: the point is kept
        rest = list(fresh)
        assert taken + rest == full, consumed
        assert fresh.consumed == len(full)
        fresh.set_epoch(3)  # the next epoch is whole again
        assert list(fresh) == fresh.indices(3) and len(fresh.indices(3)) == len(full)


def test_resume_with_explicit_consumed_and_from_another_rank():
    s0 = DistributedSampler(range(50), num_replicas=2, rank=0, seed=1)
    loader = tud.DataLoader(range(50), batch_size=4, sampler=s0)
    batches = []
    for step, batch in enumerate(loader):
        batches.append(batch)
        if step == 2:
            break
    state = s0.state_dict(consumed=3 * 4)  # what was trained on, not what was read ahead
    s1 = DistributedSampler(range(50), num_replicas=2, rank=1, seed=1)
    s1.load_state_dict(state)  # rank 0 saved the checkpoint; every rank loads it
    assert list(s1) == s1.indices(0)[12:]
    s0.consumed = 5
    assert s0.state_dict()["consumed"] == 5


def test_loading_into_another_rank_resumes_in_lockstep():
    states = [DistributedSampler(range(30), 3, r, seed=2).state_dict(consumed=4) for r in range(3)]
    for r in range(3):
        s = DistributedSampler(range(30), 3, r, seed=2)
        s.load_state_dict(states[0])
        assert list(s) == s.indices()[4:]


@pytest.mark.parametrize("change, match", [
    (dict(dataset=range(99)), r"dataset_len: saved 100, this sampler 99"),
    (dict(num_replicas=4), r"num_replicas: saved 2, this sampler 4"),
    (dict(shuffle=False), r"shuffle: saved True, this sampler False"),
    (dict(drop_last=True), r"drop_last: saved False, this sampler True"),
    (dict(seed=8), r"seed: saved 7, this sampler 8"),
    (dict(pad=False), r"pad: saved True, this sampler False"),
])
def test_load_state_dict_refuses_other_settings(change, match):
    state = DistributedSampler(range(100), 2, 0, seed=7).state_dict()
    kw = dict(dataset=range(100), num_replicas=2, rank=1, seed=7)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        DistributedSampler(**kw).load_state_dict(state)


def test_bad_positions_and_states():
    s = DistributedSampler(range(10), 2, 0)
    with pytest.raises(ValueError, match=r"consumed=6 must be in \[0, 5\]"):
        s.state_dict(consumed=6)
    with pytest.raises(ValueError, match=r"consumed=-1 must be in \[0, 5\]"):
        s.consumed = -1
    with pytest.raises(ValueError, match=r"lacks \['consumed'"):
        s.load_state_dict({"epoch": 0})
    state = s.state_dict()
    state["consumed"] = 9
    with pytest.raises(ValueError, match=r"consumed=9 must be in \[0, 5\]"):
        s.load_state_dict(state)


def test_an_abandoned_pass_does_not_move_the_count():
    s = DistributedSampler(range(20), 1, 0)
    old = iter(s)
    next(old)
    new = iter(s)
    assert s.consumed == 0
    next(old), next(old)
    assert s.consumed == 0
    next(new)
    assert s.consumed == 1


# ---- forgotten set_epoch ----------------------------------------------------------------------

def test_epoch_mode_auto_advances_every_pass():
    s = DistributedSampler(range(40), 2, 1, seed=5, epoch_mode="auto")
    assert [list(s) for _ in range(3)] == [s.indices(e) for e in range(3)]
    assert s.epoch == 2
    s.set_epoch(10)  # still jumps explicitly
    assert list(s) == s.indices(10) and list(s) == s.indices(11)
    # A DataLoader calls iter(sampler) once per `for batch in loader`: one pass, one epoch.
    s = DistributedSampler(range(40), 2, 1, seed=5, epoch_mode="auto")
    loader = tud.DataLoader(range(40), batch_size=3, sampler=s)
    assert [torch.cat(list(loader)).tolist() for _ in range(3)] == [s.indices(e) for e in range(3)]


def test_epoch_mode_auto_resumes_a_finished_epoch_at_the_next():
    s = DistributedSampler(range(40), 2, 1, seed=5, epoch_mode="auto")
    list(s)
    fresh = DistributedSampler(range(40), 2, 1, seed=5, epoch_mode="auto")
    fresh.load_state_dict(s.state_dict())  # saved after the last index of epoch 0
    assert list(fresh) == s.indices(1)
    half = DistributedSampler(range(40), 2, 1, seed=5, epoch_mode="auto")
    half.load_state_dict(s.state_dict(consumed=7))
    assert list(half) == s.indices(0)[7:] and list(half) == s.indices(1)


def test_epoch_mode_strict_raises_on_a_forgotten_set_epoch():
    s = DistributedSampler(range(40), 2, 0, epoch_mode="strict")
    list(s)
    with pytest.raises(RuntimeError, match=r"second pass over epoch 0 without set_epoch\(\)"):
        iter(s)
    s.set_epoch(1)
    assert list(s) == s.indices(1)


def test_manual_mode_repeats_like_torch():
    s = DistributedSampler(range(40), 2, 0)
    assert list(s) == list(s) == _torch_indices(40, 2, 0, True, 0, False, 0)


# ---- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_replicas=0, rank=0), ValueError, r"num_replicas=0 must be >= 1"),
    (dict(num_replicas=-2, rank=0), ValueError, r"num_replicas=-2 must be >= 1"),
    (dict(num_replicas=2.0, rank=0), TypeError, r"num_replicas=2.0 must be an int"),
    (dict(num_replicas=2, rank=2), ValueError, r"rank=2 must be in \[0, num_replicas=2\)"),
    (dict(num_replicas=2, rank=-1), ValueError, r"rank=-1 must be in \[0, num_replicas=2\)"),
    (dict(num_replicas=2, rank=True), TypeError, r"rank=True must be an int"),
    (dict(num_replicas=2, rank=0, seed=1.5), TypeError, r"seed=1.5 must be an int"),
    (dict(num_replicas=2, rank=0, seed="0"), TypeError, r"seed='0' must be an int"),
    (dict(num_replicas=2, rank=0, seed=None), TypeError, r"seed=None must be an int"),
    (dict(num_replicas=2, rank=0, shuffle="yes"), TypeError, r"shuffle='yes' must be True or False"),
    (dict(num_replicas=2, rank=0, pad=1), TypeError, r"pad=1 must be True or False"),
    (dict(num_replicas=2, rank=0, drop_last=True, pad=False), ValueError, r"drop_last=True .* pad=False"),
    (dict(num_replicas=2, rank=0, epoch_mode="sometimes"), ValueError, r"epoch_mode='sometimes' must be one of"),
    (dict(dataset=[], num_replicas=2, rank=0, drop_last=True), ValueError,
     r"drop_last=True with an empty data set \(len\(dataset\)=0\)"),
    (dict(dataset=iter([1, 2]), num_replicas=2, rank=0), TypeError, r"has no len\(\)"),
])
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedSampler(**{"dataset": range(10), **kwargs})


def test_empty_data_set_and_bad_epoch():
    assert list(DistributedSampler([], 2, 1)) == [] and list(DistributedSampler([], 2, 1, pad=False)) == []
    with pytest.raises(TypeError, match=r"epoch='x' must be an int"):
        DistributedSampler([], 2, 1).set_epoch("x")
    with pytest.raises(TypeError, match=r"epoch=1.0 must be an int"):
        DistributedSampler([], 2, 1).indices(1.0)


def test_defaults_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    s = DistributedSampler(range(10))
    assert (s.rank, s.num_replicas) == (2, 3)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    s = DistributedSampler(range(10))
    assert (s.rank, s.num_replicas) == (0, 1)


def test_all_reduce_sums_without_a_process_group():
    out = all_reduce_sums({"correct": torch.tensor(3), "count": 4, "loss": torch.tensor([1.5])})
    assert out == {"correct": 3, "count": 4, "loss": 1.5} and isinstance(out["correct"], int)
    assert math.isnan(all_reduce_sums({"loss": float("nan")})["loss"])  # NaN is data here: summed, not refused


# ---- exact mode over 2 real processes ---------------------------------------------------------

N_EVAL = 101  # odd: the padded sampler would count one sample twice


def _eval_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_EVAL, 5, generator=g)
    y = torch.randint(0, 3, (N_EVAL,), generator=g)
    model = torch.nn.Linear(5, 3)
    with torch.no_grad():
        model.weight.copy_(torch.randn(3, 5, generator=g))
        model.bias.zero_()
    return tud.TensorDataset(x, y), model


def _evaluate(dataset, model, sampler):
    correct, count = torch.zeros((), dtype=torch.long), 0
    with torch.no_grad():
        for x, y in tud.DataLoader(dataset, batch_size=8, sampler=sampler):
            correct += (model(x).argmax(1) == y).sum()
            count += len(y)
    return correct, count


def _distributed_accuracy():
    dataset, model = _eval_data()
    results = {}
    for pad in (False, True):
        sampler = DistributedSampler(dataset, shuffle=True, seed=4, pad=pad)  # rank, size from the group
        correct, count = _evaluate(dataset, model, sampler)
        results[pad] = all_reduce_sums({"correct": correct, "count": count})
    return {"rank": sampler.rank, "world": sampler.num_replicas, "exact": results[False], "padded": results[True],
            "indices": DistributedSampler(dataset, seed=4, pad=False).indices()}


def test_exact_mode_accuracy_over_two_processes_equals_single_process():
    dataset, model = _eval_data()
    correct, count = _evaluate(dataset, model, None)
    expected = correct.item() / count
    results = run_ranks(_distributed_accuracy, 2)
    assert [(r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2)]
    for r in results:
        assert r["exact"]["count"] == N_EVAL
        assert r["exact"]["correct"] / r["exact"]["count"] == expected
        assert r["padded"]["count"] == N_EVAL + 1  # why evaluation needs the exact mode
    assert sorted(results[0]["indices"] + results[1]["indices"]) == list(range(N_EVAL))
