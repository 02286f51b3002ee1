"""SyncBatchNorm on minidp's own collectives: batch statistics over the samples of every rank.

With small per-rank batches, plain BatchNorm normalises with noisy statistics. SyncBatchNorm
computes the mean and variance over the whole global batch instead: one collective of per-channel
sums in forward, one in backward (how, on CPU and on CUDA: syncbn_autograd.py). Weight and bias
gradients stay local, as in torch.nn.SyncBatchNorm: the data-parallel wrapper averages them.

Numerics follow torch.nn.SyncBatchNorm: the running variance gets the unbiased global variance
(count / (count - 1)), momentum=None means a cumulative average over num_batches_tracked, eval
mode normalises with the running statistics and does not communicate. Unlike torch's, which needs
a GPU, this one also runs on CPU (gloo). Double backward is not supported. With momentum=None the
averaging factor is read from num_batches_tracked, one host read per layer, as in torch.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..validate import check_int, check_number

# forward() looks the CPU function up here, by name, at each call: tests swap in the fused one.
from .syncbn_autograd import _FusedSyncBatchNormFn, _SyncBatchNormFn

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span every rank of a process group.

    A drop-in for torch.nn.SyncBatchNorm (same arguments, same state_dict keys) that also runs on
    CPU/gloo. Takes channels-first input of any rank >= 2: (N, C), (N, C, L), (N, C, H, W), ...
    Without an initialised process group, in a group of one, or in eval mode, it is plain BatchNorm
    and makes no collective call. In training, every rank of the group must call forward (and
    backward) the same number of times; a rank may bring an empty batch.

    Args:
        num_features: number of channels C.
        eps: added to the variance for stability. Default 1e-5.
        momentum: weight of the new batch in the running statistics; None for a cumulative
            average. Default 0.1.
        affine: learnable per-channel weight and bias. Default True.
        track_running_stats: keep running_mean/running_var for eval mode. Default True.
        process_group: group whose ranks share statistics. Default None: the world.
        device, dtype: of the parameters and buffers. Default: torch's defaults.
        bias: with affine, whether there is a learnable bias. Default True.

    Example:
        model = minidp.convert_sync_batchnorm(model)   # or minidp.SyncBatchNorm(64) by hand
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None, *, bias: bool = True) -> None:
        check_int("num_features", num_features, 1)
        check_number("eps", eps, positive=True)
        if momentum is not None:  # None: a cumulative average, as torch allows
            check_number("momentum", momentum, low=0, high=1)
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, bias=bias)
        self.process_group = process_group

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """torch's spelling of minidp.convert_sync_batchnorm(module, process_group)."""
        return convert_sync_batchnorm(module, process_group)

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input of at least 2 dims (N, C, ...), got shape {tuple(x.shape)}")
        if x.size(1) != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got input with {x.size(1)} channels "
                             f"(shape {tuple(x.shape)})")

    def _group(self):
        """The process group to synchronise over, or None when there is nobody to talk to."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _average_factor(self) -> float:
        """Weight of this batch in the running statistics; counts the batch (as torch does)."""
        if not (self.training and self.track_running_stats):
            return 0.0 if self.momentum is None else self.momentum
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        factor = self._average_factor()
        # Batch statistics in training, and in eval when there are no running statistics.
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        # Eval mode never communicates: each rank may run inference on its own.
        group = self._group() if self.training else None
        if group is None:
            return F.batch_norm(x, running_mean, running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        fn = _FusedSyncBatchNormFn if x.is_cuda else _SyncBatchNormFn
        return fn.apply(x, self.weight, self.bias, running_mean, running_var, self.eps, factor, group)


def _convert(module: nn.Module, process_group) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, bias=module.bias is not None)
        # The same Parameter and buffer objects, as torch's convert does: an optimizer built
        # before the conversion still updates the right tensors, and requires_grad carries over.
        if module.affine:
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _convert(child, process_group))
    return out


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every BatchNorm layer (1d/2d/3d, torch's SyncBatchNorm) in `module` by minidp's.

    The new layers share the old ones' parameters and buffers (weight, bias, running_mean,
    running_var, num_batches_tracked), so requires_grad, values and optimizer references carry
    over; the training flag is copied. Call it before wrapping the model in DDP.

    Args:
        module: a BatchNorm layer or a module that contains at least one.
        process_group: group to synchronise over. Default None: the world.

    Returns:
        `module` with its BatchNorm layers replaced, or a new SyncBatchNorm if `module` is one.

    Raises:
        TypeError: `module` is not an nn.Module.
        ValueError: `module` contains no BatchNorm layer (most likely the wrong object was passed).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_sync_batchnorm() expects an nn.Module, got {type(module).__name__}")
    if not any(isinstance(m, _BatchNorm) for m in module.modules()):
        raise ValueError(f"convert_sync_batchnorm(): {type(module).__name__} is not a BatchNorm layer and "
                         "contains none; pass the model (or layer) that has the BatchNorm layers")
    return _convert(module, process_group)
