"""The hooks fully_shard puts on a module, and the root that closes each backward.

Each fully_shard call gives its module a ModuleState (FSDP2's FSDPState) and two forward hooks:
the pre-hook runs the unit's pre_forward (gather), the post-hook its post_forward (free) and puts a
gradient hook on the outputs that is the unit's pre_backward (gather again). The first module whose
forward runs is the root: it finds the states below it and shares one Root with them, which holds
what they share: the order of this step's forwards (prefetch.ForwardOrder: backward's prefetch
targets) and the reduce-scatters in flight (collectives.ReducesInFlight). At the first pre_backward
of a backward, the Root queues a callback at the end of the autograd run (the engine's
queue_callback, as minidp.DDP's reducer does), where units whose inputs needed no gradient (the
first block, fed with data; the root) run their post_backward, and every state goes IDLE.

fully_shard([a, b]) (one unit for several modules, e.g. chunked loss: [norm, head]) gathers at the
first of its modules to run and frees after the last; a forward that skips one of them (head is
called later, chunk by chunk) is completed by the root's post-forward, and a later call of the
skipped module gathers again and arms its own reduce-scatter (FSDP2 2.14's rule).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from minidp.runtime import watchdog

from .collectives import ReducesInFlight
from .prefetch import ForwardOrder
from .unit import Phase, Unit

STATE_ATTRIBUTE = "_minidp_fully_shard"  # where a module keeps its ModuleState


def state_of(module: nn.Module) -> ModuleState | None:
    """The ModuleState fully_shard gave `module`, or None."""
    return module.__dict__.get(STATE_ATTRIBUTE)


def cast_floats(tree, dtype: torch.dtype | None):
    """`tree` (nested tuples, lists, dicts) with its floating-point tensors cast to `dtype`."""
    if dtype is None:
        return tree
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                    and x.dtype != dtype else x, tree)


class Root:
    """What a root shares with the states below it (FSDP2's FSDPStateContext and FSDPCommContext):
    who they are, this step's forward order and reduce-scatters in flight, and its progress.

    Args:
        states: the root's ModuleState first, then the others in named_modules() order.
    """

    def __init__(self, states: list):
        self.states = states
        self.units: list[Unit] = [state.unit for state in states if state.unit is not None]
        self.forward_order = ForwardOrder()  # backward's prefetch targets
        # every unit's reduce-scatter joins it (share_comm_ctx: one for several roots)
        self.reduces = states[0].shared_reduces or ReducesInFlight()
        self.reduces.max_in_flight = max(s.max_reduces_in_flight for s in states)
        self.forward_root: ModuleState | None = None  # the outermost forward now running
        self.iteration = 0  # forwards of the root so far: what the watchdog says a rank is at
        self.end_queued = False  # end_backward waits at the end of this backward's autograd run
        self.is_last_backward = states[0].is_last_backward  # set_is_last_backward
        self.post_optim_event = None  # set_post_optim_event (the CPU has one stream: no wait)

    def start_forward(self, state: ModuleState) -> None:
        """A state's forward begins: the outermost one (the root's) counts an iteration."""
        if self.forward_root is None:
            self.forward_root = state
            self.iteration += 1
            self.post_optim_event = None  # waited for (a GPU's streams) and dropped, as FSDP2
            self.record("forward")

    def end_forward(self, state: ModuleState, output):
        """A state's forward ends: the outermost one completes the lists whose forward skipped a
        module (their unit frees and its backward is armed, on this output)."""
        if self.forward_root is not state:
            return output
        for other in reversed(self.states):
            if other is not state and other.to_run:
                output = other.complete_forward(output)
        self.forward_root = None
        return output

    def start_backward(self) -> None:
        """At the first pre_backward of a backward: queue end_backward at the end of autograd's
        run (once)."""
        if not self.end_queued:
            self.end_queued = self.reduces.waited_at_end = True
            Variable._execution_engine.queue_callback(self.end_backward)
            self.record("backward")

    def end_backward(self) -> None:
        """At the end of autograd's run: post_backward where autograd did not call it, wait for
        every reduce-scatter (the DTensors' gradients are set then), reset."""
        self.forward_root = None
        for state in self.states:
            state.to_run.clear()
            if state.unit is not None and state.unit.phase != Phase.POST_BACKWARD:
                state.unit.post_backward(self.reduces)  # ranks meet here (its reduce-scatter)
        self.reduces.wait()
        self.record("after backward")
        for unit in self.units:
            unit.phase = Phase.IDLE
        for state in self.states:
            state.phase = Phase.IDLE
        if self.is_last_backward:  # else the next backward still prefetches by this forward,
            self.forward_order.clear()  # and a prefetched gather waits for the next unshard
            for unit in self.units:
                unit.drop_prefetch()
        self.end_queued = self.reduces.waited_at_end = False

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: finish the collectives in flight, keep nothing of
        the failed step (gradients in flight, kept sums), reshard every unit, clear the trackers."""
        self.reduces.discard()
        self.forward_order.clear()
        for state in self.states:
            state.to_run.clear()
            state.phase = Phase.IDLE
            if state.unit is not None:
                state.unit.discard_step()
        self.forward_root = None
        self.end_queued = self.reduces.waited_at_end = False

    def record(self, phase: str) -> None:
        """Tell minidp's watchdog (if minidp.init started one) where this rank is: a failed
        collective's error then names the ranks behind it, and where they are."""
        if watchdog.current() is not None:
            watchdog.current().progress.update(self.iteration, phase)


class ModuleState:
    """One fully_shard call: its module(s), its unit (None when it manages no parameters), hooks.

    Args:
        modules: the module fully_shard was applied to, or the modules of a list (one unit for
            them all: it gathers before the first of them runs, frees after the last).
        unit: its parameters, or None.
        auto_reshard: reshard_after_forward was None: True, except for the root (FSDP2's rule: the
            root's parameters would be gathered again at once for backward).
        mp_policy: torch's MixedPrecisionPolicy: the casts of the floating inputs and outputs.
    """

    def __init__(self, modules: tuple, unit: Unit | None, auto_reshard: bool, mp_policy):
        self.modules, self.unit, self.auto_reshard = modules, unit, auto_reshard
        self.to_run: set = set()  # a list's modules whose forward has not run yet in this pass
        cast_inputs = mp_policy.cast_forward_inputs and mp_policy.param_dtype is not None
        self.input_dtype = mp_policy.param_dtype if cast_inputs else None
        self.output_dtype = mp_policy.output_dtype
        self.forward_prefetch: list[Unit] = []  # set_modules_to_forward_prefetch
        self.backward_prefetch: list[Unit] | None = None  # set_modules_to_backward_prefetch
        self.max_reduces_in_flight = 1  # set_reduce_scatter_max_input_buffers
        self.is_last_backward = True  # set_is_last_backward before the first forward
        self.shared_reduces: ReducesInFlight | None = None  # share_comm_ctx
        self.is_root: bool | None = None  # decided at the first forward
        self.root: Root | None = None  # what the states under one root share, from then on
        self.phase = Phase.IDLE
        for module in modules:
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.post_forward, always_call=len(modules) > 1)

    def _lazy_init(self) -> None:
        """At the first forward through this module: become the root of the states below it."""
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {self.modules}")
        self.is_root = True
        states = []
        for name, module in self.modules[0].named_modules():
            state = state_of(module)
            if state is None or state in states:  # a list's state sits on each of its modules
                continue
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError(f"FSDP state has already been lazily initialized for "
                                       f"{name}\nFSDP requires running forward through the "
                                       "root module first")
                state.is_root = False
            states.append(state)
        if self.auto_reshard and self.unit is not None:
            self.unit.reshard_after_forward = False
        _check_no_shared_params(self.modules[0], states)
        root = Root(states)
        for state in states:
            state.root = root
            if state.unit is not None:  # parameters replaced since fully_shard (FSDP2 does this)
                state.unit.reset()
                state.unit.check_offload()

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.phase == Phase.PRE_BACKWARD:  # activation checkpointing: forward again in backward
            if self.unit is not None:
                self.unit.unshard()
            return cast_floats((args, kwargs), self.input_dtype)
        if len(self.modules) > 1 and not self.to_run:  # the first of a list's modules to run
            self.to_run.update(self.modules)
        first_in_pass = self.phase != Phase.FORWARD
        self.phase = Phase.FORWARD
        if first_in_pass:
            self._lazy_init()
            self.root.start_forward(self)
        args, kwargs = cast_floats((args, kwargs), self.input_dtype)
        if self.unit is not None:  # ranks meet here (all-gather)
            args, kwargs = self.unit.pre_forward(args, kwargs, self.root.reduces)
        if first_in_pass:
            for unit in self.forward_prefetch:
                unit.prefetch(Phase.FORWARD)  # ranks meet here (started)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, output):
        if self.phase == Phase.PRE_BACKWARD:
            return cast_floats(output, self.output_dtype)
        if len(self.modules) > 1:  # a list: only the module that completes it frees the unit
            if module not in self.to_run:
                return cast_floats(output, self.output_dtype)
            self.to_run.discard(module)
            if self.to_run:
                return cast_floats(output, self.output_dtype)
        output = self.complete_forward(output)
        return self.root.end_forward(self, output)

    def complete_forward(self, output):
        """The unit's forward is over: free (or keep) its parameters, arm its backward on the
        outputs that need a gradient."""
        self.to_run.clear()
        if self.unit is not None:
            self.unit.post_forward()
        if torch.is_grad_enabled():  # a backward will follow: record the order, hook the outputs
            if self.unit is not None:
                self.root.forward_order.record(self.unit)
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self.pre_backward)
        self.phase = Phase.IDLE
        return cast_floats(output, self.output_dtype)

    def pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        """Gradient hook on the outputs: the unit's backward is about to run."""
        self.phase = Phase.PRE_BACKWARD
        self.root.start_backward()
        if self.unit is not None:
            # ranks meet here (all-gathers)
            self.unit.pre_backward(self.root.forward_order, self.backward_prefetch)
        elif self.backward_prefetch:
            for unit in self.backward_prefetch:
                unit.prefetch(Phase.PRE_BACKWARD)
        return grad


def _check_no_shared_params(root_module: nn.Module, states: list) -> None:
    """A parameter tied across two fully_shard calls would be two shards of one weight, updated
    apart: FSDP2 refuses it at the first forward, naming the second place it meets it."""
    names = {param: name for name, param in root_module.named_parameters()}
    seen = set()
    for state in states:
        for p in state.unit.params if state.unit is not None else ():
            if p.uid in seen:
                raise ValueError(
                    f"Parameter '{names.get(p.sharded)}' is shared with a parameter already "
                    "managed by another FSDP group. For shared/tied parameters, use "
                    "fully_shard([module_a, module_b]) to place them in the same FSDP group.")
            seen.add(p.uid)
