"""static_graph=True as torch DDP's: unused parameters, hooks that fire twice, the late rebuild, errors.

Side by side with torch DDP in the same processes, at 2 and 3 ranks (at 3, gloo's ring sums in an order
that depends on the bucket layout, so bitwise equality also checks that the buckets are rebuilt after
the second iteration, as torch does, with the unused parameters last). Under join(): test_join.py.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import error_of, run_ranks
from models import WithUnused
from training import mean_square, train

ENGINES = {"minidp": minidp.DDP, "torch": TorchDDP}
STEPS = 5


def _train(engine, case: dict):
    torch.manual_seed(0)
    net = WithUnused(case.get("twice", False), case.get("skip_on_rank"))
    kwargs = {k: v for k, v in case.items() if k not in ("twice", "skip_on_rank", "set_later")}
    if not case.get("set_later"):
        kwargs["static_graph"] = True
    model = engine(net, bucket_cap_mb=0.0008, **kwargs)  # several buckets once rebuilt
    if case.get("set_later"):
        model._set_static_graph()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [torch.randn(4, 6, generator=gen, requires_grad=case.get("twice", False)) for _ in range(STEPS)]
    unused_grads = []
    train(model, opt, batches, mean_square,
          per_step=lambda step: unused_grads.append(net.unused.weight.grad is None))
    return torch.cat([p.detach().flatten() for p in net.parameters()]), unused_grads


CASES = {
    "unused": {},
    "checkpoint_twice": {"twice": True},
    "checkpoint_twice_bucket_views": {"twice": True, "gradient_as_bucket_view": True},
    "unused_on_rank_1_only": {"skip_on_rank": 1},
    "set_later_with_find_unused": {"set_later": True, "find_unused_parameters": True},
}


class _Changing(nn.Module):
    """Uses `late` only from the second iteration on: not a static graph."""

    def __init__(self):
        super().__init__()
        self.a, self.late, self.calls = nn.Linear(3, 3), nn.Linear(3, 3), 0

    def forward(self, x):
        self.calls += 1
        return self.a(x) if self.calls == 1 else self.late(self.a(x))


def _changing_graph(engine):
    model = engine(_Changing(), static_graph=True)
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()


def _worker():
    out = {}
    for name, case in CASES.items():
        ours, theirs = _train(minidp.DDP, case), _train(TorchDDP, case)
        out[name] = (torch.equal(ours[0], theirs[0]), ours[1] == theirs[1], ours[1])
    out["changed"] = {label: error_of(lambda e=engine: _changing_graph(e)) for label, engine in ENGINES.items()}
    out["set_too_late"] = {label: error_of(lambda e=engine: _set_after_a_step(e)) for label, engine in ENGINES.items()}
    return out


def _set_after_a_step(engine):
    model = engine(nn.Linear(2, 2))
    model(torch.randn(1, 2)).sum().backward()
    model._set_static_graph()  # after the training loop started: refused


@pytest.mark.parametrize("world_size", [2, 3])
def test_static_graph_bitwise_as_torch_ddp(world_size):
    for rank, out in enumerate(run_ranks(_worker, world_size, timeout=300)):
        for name in CASES:
            equal, same_unused_grads, unused_grads = out[name]
            assert equal and same_unused_grads, (name, rank, out[name])
            assert unused_grads == [True] * STEPS, (name, rank)  # no rank used it: .grad stays None
        changed = out["changed"]
        assert changed["torch"] is not None and changed["torch"][0] == "RuntimeError", changed
        assert changed["minidp"][0] == "RuntimeError" and "graph changed" in changed["minidp"][1], changed
        late = out["set_too_late"]
        assert late["minidp"] == late["torch"] and late["torch"][0] == "RuntimeError", late
