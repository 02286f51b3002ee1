"""minidp.DistributedDataParallel: the nn.Module wrapper. Construct, forward, no_sync, comm hooks.

A drop-in for torch DDP: same keywords, `.module`, state_dict keys. The averaging is the Reducer's.
The other methods are its two base classes', second read: what torch DDP has (_set_static_graph,
_register_builtin_comm_hook, pickling, to_kwargs, ...) in compat.py; join() and the Join protocol
in join.py. The constructor and forward call none of them: only second-read modules' functions,
one line each. Last here, minidp's own windows into the engine: enable_timeline(), bucket_plan().
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from . import compat, join
from .arguments import (
    Mode,
    check_arguments,
    check_devices,
    check_sync_batchnorm,
    check_transport,
    choose,
    group_of_mesh,
    ignored_names,
    move_inputs,
)
from .collectives import FORWARD, broadcast_coalesced, check_same_model, debug_from_env
from .compat import TorchCompat
from .graph_split import ModuleRunner, forward_outside_dynamo, is_compiled
from .hooks import hook_name
from .join import JoinableDDP
from .reducer import Reducer
from .timeline import ReducerRecorder, Timeline


class DistributedDataParallel(TorchCompat, JoinableDDP, nn.Module):
    """Average gradients over ranks during backward, bucket by bucket, as torch DDP does.

    Args: torch DDP's keywords, with its defaults and meanings: module (on this rank's device),
        device_ids, broadcast_buffers, init_sync, process_group or device_mesh, bucket_cap_mb
        (25 MiB, the first bucket 1 MiB), find_unused_parameters, gradient_as_bucket_view,
        static_graph (output_device, dim, check_reduction ignored, as in torch); minidp's own:
        bucket_cap_mb="auto": time a few caps in the first steps, keep the fastest (layout.py);
        debug: check every step that all ranks reduce the same thing (collectives.py). Default:
        MINIDP_DEBUG=1; transport: a minidp.comm transport for the default all-reduce. Default None.

    Example:
        model = minidp.DDP(model.to(minidp.init().device))
        loss_fn(model(x), y).backward()      # gradients are averaged when this returns
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, debug: bool | None = None, transport=None,
                 forward_sync_buffers: bool | None = None, batched_grad_copy: bool = False,
                 device_mesh=None, **torch_later):
        super().__init__()  # nn.Module's, and Joinable's (join.py) on the way
        process_group = group_of_mesh(device_mesh, process_group)
        flags = dict(broadcast_buffers=broadcast_buffers, init_sync=init_sync,
                     static_graph=static_graph, debug=debug,
                     find_unused_parameters=find_unused_parameters,
                     gradient_as_bucket_view=gradient_as_bucket_view,
                     forward_sync_buffers=forward_sync_buffers, batched_grad_copy=batched_grad_copy)
        self.torch_keywords = check_arguments(module, bucket_cap_mb, process_group, flags,
                                              torch_later, constructor=type(self).__init__)
        ignored = ignored_names(module, self.torch_keywords)  # not broadcast nor averaged
        self.parameters_to_ignore = ignored
        all_named = [(n, p) for n, p in module.named_parameters() if n not in ignored]
        named_buffers = {n: b for n, b in module.named_buffers() if n not in ignored}
        self.input_device = check_devices([p for _, p in all_named], device_ids)  # inputs go there
        if not dist.is_initialized():
            raise RuntimeError("minidp.DDP needs a process group: call minidp.init() first")
        self.module = module
        self._comm_hook = None  # (state, hook) once registered
        self.timeline = None  # the Timeline while enable_timeline() records
        self.process_group = dist.group.WORLD if process_group is None else process_group
        self.device = all_named[0][1].device if all_named else None  # as DDP's: the module's
        check_sync_batchnorm(module, self.device)
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_cap_mb = bucket_cap_mb
        # torch >= 2.14 splits broadcast_buffers in two: (at construction, in every forward).
        at_init, in_forward = compat.buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.broadcast_buffers = in_forward
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True  # whether the next forward broadcasts buffers
        self.debug = debug_from_env() if debug is None else debug
        self.has_buffers = bool(named_buffers)  # else skip the walk on every forward
        self.transport = check_transport(transport, module, self.process_group)
        compat.set_torch_attributes(self, output_device, dim, batched_grad_copy, device_mesh)
        named = [(n, p) for n, p in all_named if p.requires_grad]
        settings = [f"bucket_cap_mb={bucket_cap_mb}", f"keywords={self.torch_keywords}",
                    f"find_unused_parameters={find_unused_parameters}",
                    f"gradient_as_bucket_view={gradient_as_bucket_view}",
                    f"transport={None if transport is None else type(transport).__name__}"]
        buffers = list(named_buffers.items())
        check_same_model(named, buffers, settings, self.process_group)  # ranks meet here
        if not named:
            raise RuntimeError("minidp.DDP: the module has no parameter that requires a gradient; "
                               "there is nothing to average (DDP is not needed)")
        if init_sync:
            states = [p for _, p in all_named]
            states += list(named_buffers.values()) if at_init else []
            broadcast_coalesced(states, self.process_group)  # ranks meet here: rank 0's weights win
        mode = self._build_reducer(named)
        self._run_module = ModuleRunner(module, mode.compile_cap)  # compiled in bucket-sized pieces
        self._module_is_compiled = is_compiled(module)  # minidp.DDP(torch.compile(m))

    def _build_reducer(self, named: list) -> Mode:
        """Build the reducer on (name, parameter) pairs (again when unpickled); returns its mode."""
        params = [p for _, p in named]
        names = [n for n, _ in named]
        mode = choose(self, params, names)  # the readiness policy, the bucket kinds, the cap
        self.reducer = Reducer(params, names, mode, process_group=self.process_group,
                               debug=self.debug, transport=self.transport)
        return mode

    def forward(self, *inputs, **kwargs):
        """Three steps: the collectives before the module, the module, then arm the reducer."""
        if torch.compiler.is_compiling():
            # torch.compile(minidp.DDP(m)) traces this: run it as Python, the module compiled.
            outside_dynamo = torch.compiler.disable(forward_outside_dynamo, recursive=False)
            return outside_dynamo(self, inputs, kwargs)
        # graph_split.py's runner compiles the module in bucket-sized pieces, if it is compiled.
        run = self._run_module if self._module_is_compiled else self.module
        return self._forward(run, inputs, kwargs)

    def _forward(self, run, inputs: tuple, kwargs: dict):
        """The forward outside any compile; `run` calls the module."""
        syncing = torch.is_grad_enabled() and self.require_backward_grad_sync
        divisor = self._pre_forward(syncing)
        if self.input_device is not None:
            inputs = move_inputs(inputs, self.input_device)
            kwargs = move_inputs(kwargs, self.input_device)
        output = run(*inputs, **kwargs)
        # As in DDP, whether the *next* forward broadcasts buffers depends on this one syncing.
        self.require_forward_param_sync = syncing
        if syncing:
            self.reducer.prepare_for_backward(divisor)
        return output

    def _pre_forward(self, syncing: bool):
        """Every collective before the module, in DDP's order; returns join()'s divisor or None."""
        self.reducer.before_forward()  # ranks meet there only if this rank's last backward raised
        under_join = self._join_config.enable  # `with model.join():` (uneven inputs, join.py)
        # Under join(), ranks meet there: who still trains? (None: divide by the world size)
        divisor = join.notify_joined_ranks(self) if under_join else None
        if syncing or under_join:  # under join(): always (joined ranks can't know)
            self.reducer.check_consistency(FORWARD)  # ranks meet there in debug mode
        self._sync_before_module(joined=False)
        if under_join:
            join.vote_to_sync(self)  # ranks meet there: do we sync gradients this time?
        return divisor

    def _sync_before_module(self, joined: bool) -> None:
        """The rebuild and the buffers: collectives a rank out of data (`joined`) shadows too."""
        if joined or torch.is_grad_enabled():  # ranks meet there, once, after the first step
            self.reducer.replan()
        if self.require_forward_param_sync and self.broadcast_buffers and self.has_buffers:
            self.sync_buffers(joined)  # ranks meet here

    def sync_buffers(self, joined: bool) -> None:
        """Broadcast the buffers from rank 0 (under join(): the highest rank still training)."""
        buffers = self._buffers_to_sync()
        if not buffers:
            return
        group = self.process_group
        if self._join_config.enable:  # ranks meet here, joined ones too
            join.broadcast_from_last_trainer(buffers, group, self.device, not joined)
        else:
            broadcast_coalesced(buffers, group)  # ranks meet here

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        """The module's buffers but those set to be ignored (compat.py: torch DDP's private API)."""
        if not self._ignored_buffers:
            return list(self.module.buffers())
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, gradients accumulate locally; the next synced backward averages their sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state, hook: Callable) -> None:
        """Replace each bucket's all-reduce by `hook(state, bucket) -> Future[Tensor]`, once.

        DDP's contract (hooks.py): the hook gets the plain sum of this rank's gradients and
        averages; its future's value is the reduced buffer. `state` is passed to every call.
        Register it before training.
        """
        self._check_comm_hook(hook)  # TypeError / ValueError, logged as torch DDP's (compat.py)
        if self._comm_hook is not None:
            compat.refuse_as_reducer(self, "register_comm_hook or register_builtin_comm_hook can "
                                     "only be called once. minidp: a communication hook is "
                                     f"registered already ({hook_name(self._comm_hook[1])})")
        self.reducer.use_comm_hook(hook, state)
        self._comm_hook = (state, hook)  # re-registered when a pickled copy is loaded (compat.py)

    # minidp's own windows into the engine; none of them changes what is computed.

    def enable_timeline(self) -> Timeline:
        """Start recording gradient-ready, launch and completion events; returns the Timeline."""
        self.timeline = Timeline()
        self.reducer.record_to(ReducerRecorder(self.timeline, self.device))
        return self.timeline

    def disable_timeline(self) -> None:
        self.timeline = None
        self.reducer.record_to(None)

    def bucket_plan(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        known = self.reducer.describe()
        return [[known["names"][i] for i in indices] for indices in known["plan"]]

    @property
    def auto_bucket_cap(self):
        """With bucket_cap_mb="auto", the tuner (layout.AutoCap), else None."""
        return self.reducer.describe()["tuner"]


DDP = DistributedDataParallel
