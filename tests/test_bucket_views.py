"""Bucket views keep the parameters' strides, as DDP's do: a channels_last model trains as under torch DDP.

A channels_last weight's gradient sits in its bucket in memory order, and its bucket view (so its
`.grad` under gradient_as_bucket_view) has the weight's strides: the optimizer's elementwise ops
see matching layouts, and the flat buffer holds the elements where DDP's does (which bitwise
equality at 3 ranks needs).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import run_ranks
from minidp.engine.bucket_kinds import ViewBucket
from minidp.engine.buckets import Bucket, Divisor
from training import bitwise_equal, shard_of, snapshot, train

STEPS, SHARD = 4, 2


def test_views_have_the_parameters_strides():
    conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    odd = nn.Parameter(torch.randn(6, 4)[:, ::2])  # not dense: a C-contiguous view, as DDP falls back to
    params = [conv.weight, conv.bias, odd]
    bucket = Bucket(0, [0, 1, 2], params)
    assert bucket.views[0].stride() == conv.weight.stride() != conv.weight.contiguous().stride()
    assert bucket.views[2].stride() == (2, 1) and bucket.views[2].shape == odd.shape
    assert [v.data_ptr() - bucket.buffer.data_ptr() for v in bucket.views] == [4 * o for o in bucket.offsets]


def test_a_gradient_made_outside_the_view_bucket_is_copied_at_once_not_held():
    """gradient_as_bucket_view: a small gradient autograd made (after zero_grad's set_to_none) is not
    held until its bucket's launch (copy_later) but copied in at its hook, so autograd's tensor is
    freed there, as torch DDP frees it (held, GPT-2's small gradients scattered the heap: more page
    faults a step, benchmarks/RESULTS.md); one that is the view already waits for the launch's division."""
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]
    bucket = ViewBucket(0, [0, 1], params)
    made = torch.full((3,), 2.0)
    assert not bucket.holds(0, made)
    params[0].grad = made
    bucket.copy_in(0, params[0], made, Divisor(2))
    assert params[0].grad.data_ptr() == bucket.view_ptrs[0]  # .grad is the view now
    assert torch.equal(params[0].grad, torch.ones(3))  # times 1/N while copied, as DDP
    assert bucket.holds(0, params[0].grad)
    assert Bucket(0, [0, 1], params).holds(0, made)  # without views: .grad keeps it alive anyway


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.head(h.mean((2, 3)))


def _train(engine, gradient_as_bucket_view):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ConvNet().to(memory_format=torch.channels_last)
    wrapped = engine(model, bucket_cap_mb=0.002, gradient_as_bucket_view=gradient_as_bucket_view)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    gen, strides_match = torch.Generator().manual_seed(5), []

    def batch():  # this rank's shard of a channels_last global batch
        x = torch.randn(world_size * SHARD, 3, 6, 6, generator=gen).to(memory_format=torch.channels_last)
        return shard_of((x, torch.randn(world_size * SHARD, 4, generator=gen)), rank, SHARD)
    train(wrapped, opt, [batch() for _ in range(STEPS)],
          per_step=lambda step: strides_match.append(all(p.grad.stride() == p.stride() for p in model.parameters())))
    return snapshot(model), strides_match


def _worker():
    out = {}
    for view in (False, True):
        (ours, ours_strides), (theirs, theirs_strides) = _train(minidp.DDP, view), _train(TorchDDP, view)
        out[view] = {"equal": bitwise_equal(ours, theirs),
                     "strides": ours_strides, "torch_strides": theirs_strides}
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_channels_last_grads_keep_strides_and_equal_torch_ddp(world_size):
    for rank, result in enumerate(run_ranks(_worker, world_size, timeout=200, collective_timeout=30)):
        for view, res in result.items():
            assert res["torch_strides"] == [True] * STEPS  # the reference behaviour
            assert res["strides"] == [True] * STEPS, f"rank {rank}, gradient_as_bucket_view={view}"
            assert res["equal"], f"rank {rank}, gradient_as_bucket_view={view}: not bitwise equal to torch DDP"
