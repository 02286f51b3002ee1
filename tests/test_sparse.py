"""Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True), as torch DDP reduces them on gloo.

Each sparse parameter has a bucket of its own; its gradient is divided in place by the world size
(no hook) and all-reduced with gloo's sparse all-reduce, then written back into `.grad`, as in DDP.
Checked bitwise against torch DDP at world sizes 2 and 3, with and without a comm hook (the one of
torch's own test_ddp_comm_hook_sparse_gradients), with gradient_as_bucket_view and under no_sync.
"""
import copy
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import error_of, run_ranks, sizes_and_keys
from minidp.engine.planning import MIB, UNBOUNDED, assign_buckets, plan_rebuilt
from training import shard_of, snapshot, train

# ---- planning: a sparse parameter gets a bucket of its own, where torch puts it -----------------


@pytest.mark.parametrize("seed", range(20))
def test_assignment_with_sparse_equals_torch(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 20)
    tensors = [torch.empty(rng.choice([1, 100, 5000, 70000])) for _ in range(n)]
    sparse = [rng.random() < 0.3 for _ in range(n)]
    limits = rng.choice([[UNBOUNDED], [MIB, 25 * MIB], [4096], [1000, 50000]])
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, limits, sparse)
    assert assign_buckets(*sizes_and_keys(tensors), limits, sparse=sparse) == expected
    order = list(range(n))
    rng.shuffle(order)
    expected, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], limits, sparse, order)
    assert plan_rebuilt(*sizes_and_keys(tensors), limits, order, sparse) == expected


# ---- training: parity with torch DDP ---------------------------------------------------------------

STEPS, SHARD = 5, 4


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(40, 8, sparse=True)
        self.emb = nn.Embedding(40, 8, sparse=True)
        self.mid, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, idx):
        h = torch.cat([self.bag(idx), self.emb(idx).mean(1)], dim=1)
        return self.head(torch.tanh(self.mid(h)))


def _torch_test_hook(state, bucket):
    """torch's test_ddp_comm_hook_sparse_gradients hook: all-reduce, then divide by the world size."""
    state.append([id(p) for p in bucket.parameters()])
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / dist.get_world_size())


SCENARIOS = {
    "default": {},
    "bucket_view_small_buckets": {"ddp": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005}},
    "comm_hook": {"hook": True, "ddp": {"bucket_cap_mb": 0.0005}},
    "no_sync_2_micro_steps": {"micro": 2},
}


def _batches(world_size, rank, micro):
    """STEPS * micro batches: this rank's shard of the same global batches on every rank."""
    gen = torch.Generator().manual_seed(7)
    return [shard_of((torch.randint(0, 40, (world_size * SHARD, 3), generator=gen),
                      torch.randn(world_size * SHARD, 4, generator=gen)), rank, SHARD) for _ in range(STEPS * micro)]


def _train(engine, cfg, model):
    """Parameters, the last step's gradients, and the buckets the hook saw, after STEPS steps of `micro` batches."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    wrapped = engine(model, **cfg.get("ddp", {}))
    names, log = {id(p): n for n, p in model.named_parameters()}, []
    if cfg.get("hook"):
        wrapped.register_comm_hook(log, _torch_test_hook)
    grads = []

    def record_grads(step):
        grads[:] = [p.grad.coalesce() if p.grad.is_sparse else p.grad.clone() for p in model.parameters()]
    micro = cfg.get("micro", 1)
    train(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.5), _batches(world_size, rank, micro),
          accumulate=micro, per_step=record_grads)
    return snapshot(model), grads, [[names[i] for i in bucket] for bucket in log]


def _equal(x, y):
    if x.is_sparse != y.is_sparse:
        return False
    return torch.equal(x.indices(), y.indices()) and torch.equal(x.values(), y.values()) if x.is_sparse \
        else torch.equal(x, y)


def _same(a, b):
    return all(_equal(x, y) for x, y in zip(a, b))


def _one_step_against_one_process():
    """torch's _run_and_verify_sparse_gradients: one step on shards = one process on the whole batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1337)
    vanilla = SparseNet()
    ddp = minidp.DDP(copy.deepcopy(vanilla))
    idx, y = torch.randint(0, 40, (2 * world_size, 3)), torch.randn(2 * world_size, 4)
    nn.functional.mse_loss(vanilla(idx), y).backward()
    nn.functional.mse_loss(ddp(idx.split(2)[rank]), y.split(2)[rank]).backward()
    return all(torch.allclose(a.grad.to_dense(), b.grad.to_dense(), atol=1e-7)
               for a, b in zip(vanilla.parameters(), ddp.parameters()))


def _worker():
    out = {}
    for name, cfg in SCENARIOS.items():
        torch.manual_seed(0)
        model = SparseNet()
        ours = _train(minidp.DDP, cfg, copy.deepcopy(model))
        theirs = _train(TorchDDP, cfg, copy.deepcopy(model))
        out[name] = {"params": _same(ours[0], theirs[0]), "grads": _same(ours[1], theirs[1]),
                     "sparse": [g.is_sparse for g in ours[1]], "layouts": (ours[2], theirs[2])}
    out["one_process"] = _one_step_against_one_process()
    out["dense_grad_for_sparse"] = error_of(_dense_grad_where_sparse_expected)
    return out


def _dense_grad_where_sparse_expected():
    model = minidp.DDP(nn.Embedding(10, 3, sparse=True))
    model(torch.tensor([1, 2]))  # arms the reducer; then a dense gradient arrives for the embedding
    model.module.weight.grad = None
    (model.module.weight * 2).sum().backward()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout=240, collective_timeout=30)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sparse_parity_with_torch_ddp(results, scenario):
    world_size, per_rank = results
    for rank, result in enumerate(per_rank):
        res = result[scenario]
        assert res["params"], f"{scenario}, world size {world_size}, rank {rank}: parameters differ from torch DDP"
        assert res["grads"], f"{scenario}, world size {world_size}, rank {rank}: last gradients differ"
        assert res["sparse"] == [True, True, False, False, False, False]
        ours, theirs = res["layouts"]
        assert ours == theirs  # the buckets a hook sees: the same, in the same order


def test_one_step_equals_one_process_on_the_whole_batch(results):
    _, per_rank = results
    assert all(result["one_process"] for result in per_rank)


def test_dense_gradient_where_sparse_expected_is_a_clear_error(results):
    _, per_rank = results
    kind, message = per_rank[0]["dense_grad_for_sparse"]
    assert kind == "RuntimeError" and "'weight' has a dense gradient" in message and "sparse=True" in message


# ---- NCCL: no sparse all-reduce --------------------------------------------------------------------


def _nccl_worker():
    minidp.init(backend="nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    ours = error_of(lambda: minidp.DDP(SparseNet().to(device), device_ids=[device.index]))
    theirs = TorchDDP(SparseNet().to(device), device_ids=[device.index])
    torch_error = error_of(lambda: theirs(torch.randint(0, 40, (4, 3), device=device)).sum().backward())
    return ours, torch_error


@pytest.mark.gpu
def test_nccl_refuses_sparse_gradients_at_construction():
    ours, torch_error = run_ranks(_nccl_worker, 1, init=False)[0]
    assert ours[0] == "ValueError" and "'bag.weight'" in ours[1] and "'nccl'" in ours[1] and "gloo" in ours[1]
    assert torch_error is not None  # torch DDP constructs, then fails in backward
