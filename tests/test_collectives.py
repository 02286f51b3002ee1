"""engine/collectives.py: agreement checks and object gathers on real gloo ranks, device choice without any."""
import pytest
import torch
import torch.distributed as dist

from harness import error_of, run_ranks
from minidp.engine.collectives import all_gather_objects, check_same_across_ranks, collective_device


def _records(rank, world_size, case):
    base = [("parameter", "a.weight", (4, 3), "torch.float32"), ("parameter", "a.bias", (4,), "torch.float32"),
            ("settings", "bucket_cap_mb=25")]
    odd = rank == world_size - 1  # the last rank is the odd one out
    if case == "shape" and odd:
        base[1] = ("parameter", "a.bias", (5,), "torch.float32")
    if case == "extra entry" and odd:
        base.append(("buffer", "bn.running_mean", (4,), "torch.float32"))
    if case == "pickled differently":
        # Equal records, unequal bytes: pickle writes a repeated object once, by identity.
        name = "".join(["layer"] * 8)
        same = name if rank == 0 else "".join(["layer"] * 8)
        base = [("parameter", name), ("parameter", same)]
    return base


def _worker():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for case in ("equal", "shape", "extra entry", "pickled differently"):
        out[case] = error_of(check_same_across_ranks, "parameter/buffer/setting", _records(rank, world_size, case),
                             device="cpu")
    out["gathered"] = all_gather_objects({"rank": rank, "state": torch.arange(rank + 2)})
    if world_size == 3:
        group = dist.new_group([1, 2])  # ranks meet here (every rank creates every group)
        if rank > 0:  # group ranks 0 and 1 are global ranks 1 and 2
            out["subgroup"] = error_of(check_same_across_ranks, "entry", [("x", rank)], group=group)
        # ranks meet here: rank 0 hosts the store ranks 1 and 2 built their group through; if it
        # exited first (a loaded machine: it had nothing to do) their gloo setup lost the store
        dist.barrier()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_agreement_checks_and_object_gather(world_size):
    odd = world_size - 1
    for rank, out in enumerate(run_ranks(_worker, world_size)):
        assert out["equal"] is None and out["pickled differently"] is None
        assert {out[case][0] for case in ("shape", "extra entry")} == {"RuntimeError"}, out
        shape, extra = out["shape"][1], out["extra entry"][1]
        assert f"ranks [{odd}] differ from rank 0 at parameter/buffer/setting #1" in shape, shape
        assert "rank 0: ('parameter', 'a.bias', (4,), 'torch.float32')" in shape
        assert f"rank {odd}: ('parameter', 'a.bias', (5,), 'torch.float32')" in shape
        assert f"ranks [{odd}] differ from rank 0 at parameter/buffer/setting #3" in extra, extra
        assert "entry counts seen: [3, 4]" in extra and "rank 0: (none: fewer entries)" in extra
        assert [g["rank"] for g in out["gathered"]] == list(range(world_size))
        assert all(torch.equal(g["state"], torch.arange(r + 2)) for r, g in enumerate(out["gathered"]))
        if world_size == 3 and rank > 0:  # ranks are named by their rank in the group
            kind, subgroup = out["subgroup"]
            assert kind == "RuntimeError" and "ranks [1] differ from rank 0 at entry #0" in subgroup
            assert "rank 0: ('x', 1)" in subgroup and "rank 1: ('x', 2)" in subgroup


def test_collective_device_follows_the_module_under_nccl_only(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device(None, torch.device("cuda", 1)) == torch.device("cuda", 1)  # not the current one
    assert collective_device(None, "cuda:2") == torch.device("cuda", 2)
    for unpinned in (None, "cpu", "cuda"):  # nothing better to go on: the current device, as torch does
        assert collective_device(None, unpinned) == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collective_device(None, "cuda:1") == torch.device("cpu")  # gloo: CPU tensors, no copies



def test_metrics_sum_on_the_device_the_caller_names(monkeypatch):
    from minidp.train import metrics

    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(metrics, "collective_device", lambda group, device: seen.append(device) or torch.device("cpu"))
    monkeypatch.setattr(dist, "all_reduce", lambda buf, op=None, group=None: buf.mul_(2))  # two ranks alike
    assert metrics.all_reduce_sums({"n": 3, "loss": 0.5}, device=torch.device("cuda", 1)) == {"loss": 1.0, "n": 6}
    assert metrics.all_reduce_sums({"n": torch.tensor(2)}) == {"n": 4}
    assert seen == [torch.device("cuda", 1), None]  # no CUDA value, no device: collective_device decides
