"""minidp.DistributedDataParallel: the nn.Module wrapper. Construct, forward, no_sync, register_comm_hook.

A drop-in for torch's DistributedDataParallel (torch DDP): same constructor keywords, same `.module`,
same state_dict keys ("module." prefix). The gradient averaging itself is the reducer's (reducer.py).
What exists only because torch DDP has it (legacy helpers, attributes with torch's values, pickling)
is in compat.py; join() in join.py; the timeline and bucket_plan() in inspection.py.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

from . import debug as debug_mode
from .arguments import check_arguments, check_transport, group_of_mesh
from .collectives import broadcast_coalesced, check_same_across_ranks
from .compat import TorchCompat
from .devices import check_devices, check_sync_batchnorm, move_inputs
from .graph_split import ModuleRunner, forward_outside_dynamo
from .hook_checks import check_comm_hook
from .inspection import Inspection
from .join import CountedDivisor, JoinableDDP, broadcast_from_last_trainer, vote_to_sync
from .recovery import close_failed_step
from .reducer import Reducer
from .sparse import check_sparse, sparse_gradient_flags


class DistributedDataParallel(TorchCompat, Inspection, JoinableDDP, nn.Module):
    """Average gradients over ranks during backward, bucket by bucket, as torch DDP does.

    Args:
        module: the model, already on this rank's device.
        device_ids: None, or [the module's device] for a GPU module: forward moves the inputs there.
        output_device, dim, check_reduction: accepted for compatibility (ignored, as in torch DDP).
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) at construction and
            in every forward. Default True.
        init_sync: broadcast rank 0's parameters and buffers at construction. Default True.
        process_group: the group to average over. Default: the world.
        device_mesh: a 1-D torch DeviceMesh: average over its group instead (not with process_group).
        bucket_cap_mb: bucket size in MiB, or "auto" (autocap.py). Default None: 25 MiB, first bucket 1 MiB.
        find_unused_parameters: parameters that get no gradient are reduced as zeros. Default False.
        gradient_as_bucket_view: `.grad` tensors become views into the buckets. Default False.
        static_graph: every iteration uses the same parameters, as often (static_graph.py). Default False.
        debug: check every step that all ranks reduce the same thing (debug.py). Default None:
            on when the environment has MINIDP_DEBUG=1.
        transport: a minidp.comm transport that carries the default all-reduce instead of
            process_group (same arithmetic, other wires). Default None.
        forward_sync_buffers, batched_grad_copy: torch >= 2.14's keywords (see compat.py).

    Example:
        env = minidp.init()
        model = minidp.DDP(model.to(env.device))
        loss_fn(model(x), y).backward()      # gradients are averaged when this returns
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, debug: bool | None = None, transport=None,
                 forward_sync_buffers: bool | None = None, batched_grad_copy: bool = False, device_mesh=None,
                 **unsupported):
        super().__init__()  # nn.Module's, and Joinable's (join.py) on the way
        process_group = group_of_mesh(device_mesh, process_group)
        broadcast_buffers = True if broadcast_buffers is None else broadcast_buffers  # torch >= 2.14's default
        flags = dict(broadcast_buffers=broadcast_buffers, init_sync=init_sync, static_graph=static_graph, debug=debug,
                     find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=gradient_as_bucket_view,
                     forward_sync_buffers=forward_sync_buffers, batched_grad_copy=batched_grad_copy)
        check_arguments(module, bucket_cap_mb, process_group, flags, unsupported)
        self.parameters_to_ignore = self.ignored_names(module)  # neither broadcast nor averaged
        all_named = [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        named_buffers = {n: b for n, b in module.named_buffers() if n not in self.parameters_to_ignore}
        self.input_device = check_devices([p for _, p in all_named], device_ids)  # inputs go there (None: stay)
        if not dist.is_initialized():
            raise RuntimeError("minidp.DDP needs a process group: call minidp.init() first")
        self.module = module
        self.process_group = dist.group.WORLD if process_group is None else process_group
        self.device = all_named[0][1].device if all_named else None  # as DDP's: the module's device
        check_sync_batchnorm(module, self.device)
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.gradient_as_bucket_view, self.bucket_cap_mb = gradient_as_bucket_view, bucket_cap_mb
        # torch >= 2.14 splits broadcast_buffers into construction and forward_sync_buffers (forward only).
        self.broadcast_buffers = broadcast_buffers if forward_sync_buffers is None else forward_sync_buffers
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True  # whether the next forward broadcasts buffers
        self.debug = debug_mode.debug_from_env() if debug is None else debug
        self.has_buffers = bool(named_buffers)  # else skip the walk on every forward
        self.transport = check_transport(transport, module, self.process_group)
        self._comm_hook = None  # (state, hook) once registered
        self.set_torch_attributes(named_buffers, device_ids=self.input_device, output_device=output_device, dim=dim,
                                  forward_sync_buffers=forward_sync_buffers, batched_grad_copy=batched_grad_copy,
                                  device_mesh=device_mesh)
        named = [(n, p) for n, p in all_named if p.requires_grad]
        self._verify_across_ranks(named)
        if not named:
            raise RuntimeError("minidp.DDP: the module has no parameter that requires a gradient; "
                               "there is nothing to average (DDP is not needed)")
        if init_sync:
            states = [p for _, p in all_named]
            if broadcast_buffers or forward_sync_buffers is not None:  # with forward_sync_buffers: always
                states += list(named_buffers.values())
            broadcast_coalesced(states, self.process_group)  # ranks meet here: rank 0's weights win
        self._build_reducer(named)
        # The module; compiled, in bucket-sized pieces (cut at the default caps while "auto" is undecided).
        self._run_module = ModuleRunner(module, None if bucket_cap_mb == "auto" else bucket_cap_mb)

    def _build_reducer(self, named: list | None = None) -> None:
        """The reducer on this rank's parameters (at construction, and again after unpickling: compat.py)."""
        if named is None:
            named = [(n, p) for n, p in self.module.named_parameters()
                     if p.requires_grad and n not in self.parameters_to_ignore]
        params, names = [p for _, p in named], [n for n, _ in named]
        sparse = sparse_gradient_flags(self.module, params)
        check_sparse(params, names, sparse, dist.get_backend(self.process_group), self.transport)
        self.reducer = Reducer(
            params, names, sparse, process_group=self.process_group, bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters, gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph, debug=self.debug, transport=self.transport)

    def _verify_across_ranks(self, named) -> None:
        """Every rank must wrap the same parameters (and settings); say where they differ."""
        records = [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in named]
        records += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in self.module.named_buffers()
                    if n not in self.parameters_to_ignore]
        records.append(("settings", f"bucket_cap_mb={self.bucket_cap_mb}",
                        f"find_unused_parameters={self.find_unused_parameters}",
                        f"gradient_as_bucket_view={self.gradient_as_bucket_view}",
                        f"transport={type(self.transport).__name__ if self.transport is not None else None}"))
        # Ranks meet here. A differing setting (e.g. bucket_cap_mb) would give different buckets
        # from iteration 2 on, and sums of unrelated gradients: refuse before iteration 1.
        device = next((p.device for _, p in named), None)  # under NCCL the check runs on the module's GPU
        check_same_across_ranks("parameter/buffer/setting", records, self.process_group, device=device)

    def forward(self, *inputs, **kwargs):
        """Three steps: the collectives before the module, the module, then arm the reducer for backward."""
        if torch.compiler.is_compiling():
            # torch.compile(minidp.DDP(m)) traces this: run it as Python, the module compiled (graph_split.py).
            return torch.compiler.disable(forward_outside_dynamo, recursive=False)(self, inputs, kwargs)
        syncing = torch.is_grad_enabled() and self.require_backward_grad_sync
        divisor = self._pre_forward(syncing)
        if self.input_device is not None:
            inputs, kwargs = move_inputs(inputs, self.input_device), move_inputs(kwargs, self.input_device)
        output = self._run_module(*inputs, **kwargs)
        # As in DDP, whether the *next* forward broadcasts buffers depends on this one syncing.
        self.require_forward_param_sync = syncing
        if syncing:
            self.reducer.prepare_for_backward(divisor)
        return output

    def _pre_forward(self, syncing: bool):
        """Every collective that comes before the module, in DDP's order; returns join()'s divisor or None."""
        close_failed_step(self.reducer)  # ranks meet here only if this rank's last backward raised (recovery.py)
        count_work = Join.notify_join_context(self)  # ranks meet here under join(): who still trains?
        # After the join notice, where a joined rank's main_hook meets it. Under join() on every
        # forward: a joined rank cannot know whether this one syncs.
        if syncing or self._join_config.enable:
            debug_mode.check_step(self.reducer, debug_mode.FORWARD)  # ranks meet here in debug mode only
        self._sync_before_module(joined=False)
        if self._join_config.enable:
            vote_to_sync(self)  # ranks meet here: "do we sync gradients this iteration?"
        if count_work is not None and not self.divide_by_initial_world_size:
            return CountedDivisor(count_work)  # join(): divide by the ranks still training
        return None

    def _sync_before_module(self, joined: bool) -> None:
        """The rebuild and the buffers: the collectives a rank that has joined shadows too (join.py).

        Args:
            joined: True on a rank whose data has run out (called from join.DDPJoinHook.main_hook).
        """
        if joined or torch.is_grad_enabled():
            self.reducer.maybe_rebuild()  # ranks meet here, once, after the first synced iteration
        if self.require_forward_param_sync and self.broadcast_buffers and self.has_buffers:
            self.sync_buffers(joined)  # ranks meet here

    def sync_buffers(self, joined: bool) -> None:
        """Broadcast the buffers from rank 0 (under join(): from the highest rank still training)."""
        buffers = self.buffers_to_sync()  # all but those set to be ignored (compat.py)
        if not buffers:
            return
        if self._join_config.enable:  # ranks meet here, joined ones too
            broadcast_from_last_trainer(buffers, self.process_group, self.join_device, training=not joined)
        else:
            broadcast_coalesced(buffers, self.process_group)  # ranks meet here

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first synced backward after it averages the sum.

        Run the forward inside the context too, as with torch DDP.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state, hook: Callable) -> None:
        """Replace the all-reduce of each bucket by `hook(state, bucket) -> Future[Tensor]` (hooks.py).

        DDP's contract: the hook averages (gradients arrive unscaled), and the future's value is the
        reduced buffer. Register it once, before training.

        Args:
            state: passed to every call of the hook (e.g. a process group, a compressor's state).
            hook: `hook(state, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]`.
        """
        check_comm_hook(hook)  # TypeError / ValueError, as torch DDP's _check_comm_hook
        self.reducer.register_comm_hook(state, hook)  # RuntimeError if one is registered already
        self._comm_hook = (state, hook)  # re-registered when a pickled copy is loaded (compat.py)


DDP = DistributedDataParallel
