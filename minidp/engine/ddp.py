"""minidp.DistributedDataParallel: the nn.Module wrapper (verify, broadcast, buffers, no_sync, hooks).

A drop-in for torch's DistributedDataParallel (torch DDP): same constructor keywords, same
`.module`, same state_dict keys ("module." prefix), `no_sync()`, `register_comm_hook()`.
The gradient averaging itself lives in reducer.py.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from . import debug as debug_mode
from .arguments import check_arguments, check_transport, group_of_mesh
from .collectives import broadcast_coalesced, check_same_across_ranks
from .devices import check_devices, check_sync_batchnorm, move_inputs
from .graph_split import ModuleRunner, forward_outside_dynamo
from .hooks import check_comm_hook
from .join import JoinableDDP, broadcast_from_last_trainer, vote_to_sync
from .reducer import Reducer
from .timeline import Timeline


class DistributedDataParallel(nn.Module, JoinableDDP):
    """Average gradients over ranks during backward, bucket by bucket, as torch DDP does.

    Args:
        module: the model, already on this rank's device.
        device_ids: None, or [the module's device] (an index or a torch.device) for a GPU module:
            forward moves the inputs there, as DDP does (see move_inputs). Default None.
        output_device: accepted for compatibility; outputs stay where the module puts them.
        dim: accepted for compatibility (minidp never scatters inputs).
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) at construction and
            forward. Default True.
        init_sync: broadcast rank 0's parameters and buffers at construction. Default True.
        process_group: the group to average over. Default: the world (`self.process_group` is then
            the default group, as DDP's).
        device_mesh: a 1-D torch DeviceMesh: average over its group instead (not with process_group).
        bucket_cap_mb: bucket size in MiB, or "auto": time a few caps in the first iterations and keep
            the fastest, rank 0's choice on every rank (planning.AutoCap; see `auto_bucket_cap`).
            Default None: 25 MiB, first bucket 1 MiB (DDP's).
        find_unused_parameters: parameters that get no gradient are reduced as zeros. Default False.
        check_reduction: ignored (deprecated in torch too).
        gradient_as_bucket_view: `.grad` tensors become views into the buckets. Default False.
        static_graph: the same parameters are used, as often, every iteration: some may be unused and a
            hook may fire several times (activation checkpointing), as in DDP (static_graph.py). Default False.
        debug: check every step that all ranks reduce the same thing (see debug.py).
            Default None: on when the environment has MINIDP_DEBUG=1.
        transport: a minidp.comm transport (e.g. comm.CupyNccl(), comm.TorchDist(group)) that carries
            the default all-reduce instead of process_group; same arithmetic, other wires. Default
            None: process_group. (A registered comm hook replaces the default path, transport too.)

    At world size 1 on the default path (no comm hook, no transport) nothing is communicated or
    copied: no broadcast, no buffers, no status exchange; gradients stay where autograd put them
    (the average over one rank is the gradient itself, bitwise what torch DDP computes). A comm hook
    registered at world size 1 still gets every bucket.

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
        super().__init__()
        JoinableDDP.__init__(self)
        process_group = group_of_mesh(device_mesh, process_group)
        broadcast_buffers = True if broadcast_buffers is None else broadcast_buffers  # torch >= 2.14's default
        flags = dict(broadcast_buffers=broadcast_buffers, init_sync=init_sync, static_graph=static_graph, debug=debug,
                     find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=gradient_as_bucket_view,
                     forward_sync_buffers=forward_sync_buffers, batched_grad_copy=batched_grad_copy)
        check_arguments(module, bucket_cap_mb, process_group, flags, unsupported)
        # DDP._set_params_and_buffers_to_ignore_for_model(module, names): neither broadcast nor averaged.
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        # Walked once: on a model of hundreds of tensors each walk of the module tree costs ~1 ms.
        all_named = [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        named_buffers = {n: b for n, b in module.named_buffers() if n not in self.parameters_to_ignore}
        buffers = list(named_buffers.values())
        self.input_device = check_devices([p for _, p in all_named], device_ids)  # inputs go there (None: stay)
        self.device_ids = None if self.input_device is None else [self.input_device.index]  # as DDP's
        if not dist.is_initialized():
            raise RuntimeError("minidp.DDP needs a process group: call minidp.init() first")
        self.module, self.dim = module, dim
        # As DDP's attribute: the group itself, the default one when none was given.
        self.process_group = dist.group.WORLD if process_group is None else process_group
        self.device_mesh = device_mesh
        self.output_device = output_device
        # Buffers: torch >= 2.14 splits broadcast_buffers (at construction and in forward) into
        # forward_sync_buffers (in forward only; with it, buffers are always synced at construction).
        sync_at_init = broadcast_buffers if forward_sync_buffers is None else True
        self.broadcast_buffers = broadcast_buffers if forward_sync_buffers is None else forward_sync_buffers
        self.forward_sync_buffers = self.broadcast_buffers  # torch >= 2.14's name for it
        self.batched_grad_copy = batched_grad_copy  # accepted: small gradients are copied in batches anyway
        self.device = all_named[0][1].device if all_named else None  # as DDP's: the module's device
        self.device_type = self.device.type if self.device is not None else None
        check_sync_batchnorm(module, self.device)
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.gradient_as_bucket_view, self.bucket_cap_mb = gradient_as_bucket_view, bucket_cap_mb
        self._comm_hook = None  # (state, hook) once registered: kept when pickled, re-registered on load
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True  # whether the next forward broadcasts buffers
        self.divide_by_initial_world_size = True  # set by join_hook(), under join()
        self.debug = debug_mode.debug_from_env() if debug is None else debug
        self.has_buffers = bool(buffers)  # else skip the walk on every forward
        self._ignored_buffers = len(buffers) != sum(1 for _ in module.buffers())  # then sync_buffers filters
        # torch DDP's other public attributes, with its values, for scripts that read them.
        self.named_module_buffers, self.modules_buffers = named_buffers, buffers
        self.mixed_precision, self.is_multi_device_module, self.skip_all_reduce_unused_params = None, False, False
        self.bucket_bytes_cap_default = bucket_cap_mb is None
        self.use_side_stream_for_tensor_copies = False  # inputs are copied on the current stream (move_inputs)
        self.transport = check_transport(transport, module, self.process_group)
        named = [(n, p) for n, p in all_named if p.requires_grad]
        self._verify_across_ranks(named, bucket_cap_mb)
        if not named:
            raise RuntimeError("minidp.DDP: the module has no parameter that requires a gradient; "
                               "there is nothing to average (DDP is not needed)")
        if init_sync:
            states = [p for _, p in all_named] + (buffers if sync_at_init else [])
            broadcast_coalesced(states, self.process_group)  # ranks meet here: rank 0's weights win
        self._build_reducer(named)
        # The module; compiled, in bucket-sized pieces (cut at the default caps while "auto" is undecided).
        self._run_module = ModuleRunner(module, None if bucket_cap_mb == "auto" else bucket_cap_mb)

    def _build_reducer(self, named: list | None = None) -> None:
        """The reducer, on this rank's parameters: at construction, and again after unpickling.

        Args:
            named: the (name, parameter) pairs that require a gradient. Default None: read from the module.
        """
        if named is None:
            named = [(n, p) for n, p in self.module.named_parameters()
                     if p.requires_grad and n not in self.parameters_to_ignore]
        self.reducer = Reducer(
            [p for _, p in named], [n for n, _ in named], process_group=self.process_group,
            bucket_cap_mb=self.bucket_cap_mb, find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view, static_graph=self.static_graph, debug=self.debug,
            expect_sparse_gradient=Reducer.sparse_gradient_flags(self.module, [p for _, p in named]),
            transport=self.transport)

    def __getstate__(self) -> dict:
        """Pickle (torch.save(model), copy.deepcopy) without the process group and reducer, as DDP does.

        They hold live communication state (futures, hooks on this process's parameters); a loaded
        copy rebuilds them on the default process group (`__setstate__`), with no collective.
        """
        if self.process_group != dist.group.WORLD:
            raise RuntimeError("minidp.DDP can be pickled only on the default process group (as torch DDP): "
                               f"this one was built with process_group={self.process_group!r}")
        if self.transport is not None:
            raise RuntimeError(f"a minidp.DDP built with transport={self.transport!r} cannot be pickled: the "
                               "transport holds live communicators. Save model.module.state_dict() instead.")
        state = dict(self.__dict__)
        del state["process_group"], state["reducer"]
        return state

    def __setstate__(self, state: dict) -> None:
        if not dist.is_initialized():
            raise RuntimeError("loading a pickled minidp.DDP needs the default process group: call "
                               "minidp.init() first (its reducer is rebuilt on that group)")
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        self._build_reducer()  # fresh, as DDP's: the first iteration uses the initial bucket layout
        if self._comm_hook is not None:  # unlike torch DDP, which drops it from the rebuilt reducer
            self.reducer.register_comm_hook(*self._comm_hook)

    def _verify_across_ranks(self, named, bucket_cap_mb) -> None:
        """Every rank must wrap the same parameters (and settings); say where they differ."""
        records = [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in named]
        records += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in self.module.named_buffers()
                    if n not in self.parameters_to_ignore]
        records.append(("settings", f"bucket_cap_mb={bucket_cap_mb}",
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
        divisor_work = self._pre_forward(syncing)
        if self.input_device is not None:
            inputs, kwargs = move_inputs(inputs, self.input_device), move_inputs(kwargs, self.input_device)
        output = self._run_module(*inputs, **kwargs)
        # As in DDP, whether the *next* forward broadcasts buffers depends on this one syncing.
        self.require_forward_param_sync = syncing
        if syncing:
            self.reducer.prepare_for_backward(divisor_work)
        return output

    def _pre_forward(self, syncing: bool):
        """Every collective that comes before the module, in DDP's order.

        Returns:
            under join(divide_by_initial_world_size=False), the async count of ranks still training
            (the gradients' divisor); else None.
        """
        self.reducer.prepare_for_forward()  # ranks meet here only if this rank's last backward raised
        count_work = Join.notify_join_context(self)  # ranks meet here under join(): who still trains?
        # After the join notice, where a joined rank's main_hook meets it (debug.check_joined). Under
        # join() on every forward: a joined rank cannot know whether this one syncs.
        if syncing or self._join_config.enable:
            self.reducer.check_consistency(debug_mode.FORWARD)  # ranks meet here in debug mode only
        self.sync_before_module(joined=False)
        return count_work if count_work is not None and not self.divide_by_initial_world_size else None

    def sync_before_module(self, joined: bool) -> bool | None:
        """The collectives a rank that has joined shadows too (join.py), so the two sides share this code.

        Args:
            joined: True on a rank whose data has run out (called from DDPJoinHook.main_hook).
        Returns:
            on a joined rank, whether the ranks still training sync this iteration; else None.
        """
        if joined or torch.is_grad_enabled():
            self.reducer.maybe_rebuild()  # ranks meet here, once, after the first synced iteration
        if self.require_forward_param_sync and self.broadcast_buffers and self.has_buffers:
            self.sync_buffers(joined)  # ranks meet here
        if self._join_config.enable:
            return vote_to_sync(self, joined)  # ranks meet here: "do we sync gradients this iteration?"
        return None

    def sync_buffers(self, joined: bool) -> None:
        """Broadcast the buffers from rank 0 (under join(): from the highest rank still training)."""
        buffers = self.buffers_to_sync()
        if not buffers:
            return
        if self._join_config.enable:  # ranks meet here, joined ones too
            broadcast_from_last_trainer(buffers, self.process_group, self.join_device, training=not joined)
        else:
            broadcast_coalesced(buffers, self.process_group)  # ranks meet here

    def buffers_to_sync(self) -> list[torch.Tensor]:
        """The module's buffers but those set to be ignored (_set_params_and_buffers_to_ignore_for_model)."""
        if not self._ignored_buffers:
            return list(self.module.buffers())
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers (DDP's method of that name)."""
        return self.require_forward_param_sync and self.broadcast_buffers and self.has_buffers

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket cap in bytes, as DDP's attribute (25 MiB by default; under "auto" the cap in use)."""
        cap = self.reducer.layout.cap
        return int((25 if cap is None else cap) * 1024 * 1024)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore) -> None:
        """Mark parameters and buffers (by qualified name) that DDP neither broadcasts nor averages.

        torch DDP's static method of this name, which libraries call before wrapping a model; call it
        before minidp.DDP(module). Each rank keeps its own value of those tensors.
        """
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if name in params_and_buffers_to_ignore:
                tensor._ddp_ignored = True

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
        """Replace the all-reduce of each bucket by `hook(state, bucket) -> Future[Tensor]`.

        DDP's contract (checked as DDP checks it, see hooks.py): the hook averages (gradients arrive
        unscaled), and the future's value is the reduced buffer. Register it once, before training.

        Args:
            state: passed to every call of the hook (e.g. a process group, a compressor's state).
            hook: `hook(state, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]`.
        """
        check_comm_hook(hook)  # TypeError / ValueError, as torch DDP's _check_comm_hook
        self.reducer.register_comm_hook(state, hook)  # RuntimeError if one is registered already
        self._comm_hook = (state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch DDP's built-in hooks by type (dist.BuiltinCommHookType): ALLREDUCE, FP16_COMPRESS.

        torch runs them in C++; here they are torch's Python hooks that do the same arithmetic
        (divide by the world size, in fp16 for FP16_COMPRESS, then sum), so results stay bitwise DDP's.
        """
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # here: few scripts need it
        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        if comm_hook_type not in hooks:
            raise TypeError(f"comm_hook_type={comm_hook_type!r} must be a torch.distributed.BuiltinCommHookType "
                            "(ALLREDUCE or FP16_COMPRESS)")
        self.register_comm_hook(None if self.process_group == dist.group.WORLD else self.process_group,
                                hooks[comm_hook_type])

    def _set_static_graph(self) -> None:
        """static_graph=True after construction, before the first iteration (torch DDP's private API)."""
        if not self.static_graph:  # torch only warns when it is set already
            self.reducer.set_static_graph()
            self.static_graph = True

    def enable_timeline(self) -> Timeline:
        """Start recording gradient-ready, launch and completion events; returns the Timeline."""
        self.reducer.timeline = Timeline()
        return self.reducer.timeline

    def disable_timeline(self) -> None:
        self.reducer.timeline = None

    def bucket_plan(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return self.reducer.layout.by_name()

    @property
    def auto_bucket_cap(self):
        """With bucket_cap_mb="auto", the tuner (planning.AutoCap: `.chosen`, `.medians()`); else None."""
        return self.reducer.layout.tuner

    @property
    def join_device(self) -> torch.device:
        """Where join()'s votes run: the module's device (there may be no bucket at world size 1)."""
        return self.reducer.device


    # torch DDP's input/output helpers, kept for scripts that call them (minidp's forward needs none).
    def to_kwargs(self, inputs, kwargs, device_id):
        """`inputs` and `kwargs` moved to device `device_id` of the module's type, as DDP's: ((inputs,), (kwargs,))."""
        if not inputs and not kwargs:
            return (), ()
        device = torch.device(self.device_type, device_id)
        return ((move_inputs(inputs, device) if inputs else (),),
                (move_inputs(kwargs, device) if kwargs else {},))

    def scatter(self, inputs, kwargs, device_ids):
        """torch.nn.parallel.scatter_kwargs along `self.dim`, as DDP's."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs, output_device):
        """torch.nn.parallel.gather along `self.dim`, as DDP's."""
        return gather(outputs, output_device, dim=self.dim)


DDP = DistributedDataParallel
