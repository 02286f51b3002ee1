"""The autograd functions behind SyncBatchNorm: batch norm over the samples of every rank.

  forward:  one collective of [sum(x), sum(x*x), count] per channel (counts may differ by rank);
  backward: one all-reduce of [sum(dy), sum(dy*xhat)] per channel, the two sums that the input
            gradient needs from every sample. Weight and bias gradients stay local, as in
            torch.nn.SyncBatchNorm: the data-parallel wrapper averages them with the others.

On CUDA (_FusedSyncBatchNormFn) it runs torch's own fused kernels in torch's order
(batch_norm_stats, an all-gather of [mean | invstd | count], batch_norm_gather_stats_with_counts,
batch_norm_elemt; backward_reduce, an all-reduce, backward_elemt), so it gives
torch.nn.SyncBatchNorm's results, but without its host sync (torch drops empty batches with a boolean
mask, whose size the host must read): empty batches are moved after the others on the device instead.

On CPU (_SyncBatchNormFn) it is plain tensor ops and one all-reduce; the variance is
E[x^2] - E[x]^2 of the global sums: in float32 it loses digits when a channel's mean is much larger
than its spread; half/bfloat16 inputs are accumulated in float32. Double backward is not supported.

Both take group=None to mean one process (no communication). The nn.Module is syncbn.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """(C,) -> (1, C, 1, ..., 1), to broadcast against a channels-first input of `ndim` dims."""
    return t.view(1, -1, *([1] * (ndim - 2)))


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    """Sum `t` over `group` in place; group=None means one process (no communication)."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)  # ranks meet here
    return t


def _update_running(running: Optional[torch.Tensor], value: torch.Tensor, factor: float) -> None:
    if running is not None:
        running.mul_(1.0 - factor).add_(value.to(running.dtype), alpha=factor)


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """(world, numel): every rank's `t`, in group-rank order; group=None: this rank's alone."""
    if group is None:
        return t.unsqueeze(0)
    world = dist.get_world_size(group)
    if dist.get_backend(group) == "gloo":  # gloo has no all_gather_into_tensor
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t, group=group)  # ranks meet here
        return torch.stack(parts)
    out = torch.empty(world, t.numel(), dtype=t.dtype, device=t.device)
    # torch 2.14 renamed all_gather_into_tensor to all_gather_single (the old name warns); older torch
    # only has the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)  # ranks meet here
    return out


def _channels_last_or_contiguous(t: torch.Tensor) -> torch.Tensor:
    """What torch's fused kernels take: channels-last as it is, anything else made contiguous."""
    if t.is_contiguous(memory_format=torch.channels_last) or t.is_contiguous(memory_format=torch.channels_last_3d):
        return t
    return t.contiguous()


class _FusedSyncBatchNormFn(torch.autograd.Function):
    """CUDA: torch.nn.SyncBatchNorm's fused kernels, without a host sync. group=None: local batch."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        x, channels = _channels_last_or_contiguous(x), x.shape[1]
        weight = weight.contiguous() if weight is not None else None
        if x.numel() > 0:
            mean, invstd = torch.batch_norm_stats(x, eps)
            count = torch.full((1,), x.numel() // channels, dtype=mean.dtype, device=x.device)
        else:  # an empty batch still joins the collective; invstd 1 keeps the kernel's 0 * (1/invstd)^2 finite
            mean = torch.zeros(channels, dtype=_stat_dtype(x.dtype), device=x.device)
            invstd, count = torch.ones_like(mean), mean.new_zeros(1)
        gathered = _all_gather(torch.cat([mean, invstd, count]), group)  # (world, 2C + 1)
        # The kernel merges ranks in order, dividing by the count so far: an empty batch first would
        # give 0/0. Stable-sort the empty ones last, on the device (rank order otherwise kept).
        gathered = gathered.index_select(0, torch.argsort((gathered[:, -1] == 0).to(torch.int32), stable=True))
        mean_all, invstd_all, count_all = gathered.split(channels, dim=1)
        counts = count_all.reshape(-1)
        if running_mean is not None and counts.dtype != running_mean.dtype:
            counts = counts.to(running_mean.dtype)
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts)
        ctx.save_for_backward(x, weight, mean, invstd, count_all.to(torch.int32))
        ctx.group = group
        if x.numel() == 0:
            return torch.empty_like(x)
        return torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, invstd, counts = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if x.numel() == 0:  # the peers wait for this rank's sums; zero gradients keep DDP's hooks firing
            if need_x:
                _all_reduce(mean.new_zeros(2 * x.shape[1]), ctx.group)
            zeros = [torch.zeros_like(t) if t is not None and need else None
                     for t, need in ((x, need_x), (weight, need_w), (weight, need_b))]
            return (*zeros, None, None, None, None, None)
        dy = _channels_last_or_contiguous(dy)
        sum_dy, sum_dy_xmu, grad_w, grad_b = torch.batch_norm_backward_reduce(
            dy, x, mean, invstd, weight, need_x, need_w, need_b)
        if need_x:
            both = _all_reduce(torch.cat([sum_dy, sum_dy_xmu]), ctx.group)  # one collective
            sum_dy, sum_dy_xmu = both.split(x.shape[1])
            w = weight.to(mean.dtype) if weight is not None and weight.dtype != mean.dtype else weight
            grad_x = torch.batch_norm_backward_elemt(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, counts)
        # Weight and bias gradients stay local: the data-parallel wrapper averages them.
        return (grad_x, grad_w if weight is not None and need_w else None,
                grad_b if weight is not None and need_b else None, None, None, None, None, None)


class _SyncBatchNormFn(torch.autograd.Function):
    """Batch norm over the global batch, in plain tensor ops (CPU). group=None: the local batch only."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        channels, dims = x.shape[1], [d for d in range(x.dim()) if d != 1]
        xs = x.to(_stat_dtype(x.dtype))
        count = torch.full((1,), x.numel() // max(channels, 1), dtype=xs.dtype, device=x.device)
        # One tensor, one collective: [sum | sum of squares | count], so ranks with different
        # batch sizes (even empty ones) weigh in by their number of samples.
        stats = _all_reduce(torch.cat([xs.sum(dims), (xs * xs).sum(dims), count]), group)
        total = stats[-1].item()  # CPU only (CUDA has its own function): a memory read, not a device sync
        if total <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel when training, "
                             f"got {int(total)} over all ranks (input shape {tuple(x.shape)})")
        mean = stats[:channels] / total
        var = (stats[channels:2 * channels] / total - mean * mean).clamp_min(0)  # biased, as normalised
        invstd = torch.rsqrt(var + eps)
        with torch.no_grad():
            _update_running(running_mean, mean, momentum)
            _update_running(running_var, var * (total / (total - 1)), momentum)  # unbiased, as torch
        xhat = (xs - _channel_view(mean, x.dim())) * _channel_view(invstd, x.dim())
        y = xhat
        if weight is not None:
            y = y * _channel_view(weight.to(xs.dtype), x.dim())
        if bias is not None:
            y = y + _channel_view(bias.to(xs.dtype), x.dim())
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.group, ctx.total = group, total
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        channels, dims, ndim = x.shape[1], [d for d in range(x.dim()) if d != 1], x.dim()
        dys = dy.to(_stat_dtype(dy.dtype))
        xhat = (x.to(dys.dtype) - _channel_view(mean, ndim)) * _channel_view(invstd, ndim)
        sum_dy, sum_dy_xhat = dys.sum(dims), (dys * xhat).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # y depends on every rank's samples through mean and invstd; these two sums carry
            # that dependence back. One tensor, one collective.
            both = _all_reduce(torch.cat([sum_dy, sum_dy_xhat]), ctx.group)
            g_dy, g_dy_xhat = both[:channels] / ctx.total, both[channels:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(dys.dtype)
            grad_x = (dys - _channel_view(g_dy, ndim) - xhat * _channel_view(g_dy_xhat, ndim))
            grad_x = (grad_x * _channel_view(scale, ndim)).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat.to(weight.dtype)  # local: DDP averages it like any other gradient
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None
