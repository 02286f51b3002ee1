"""delay_all_reduce_named_params with param_to_hook_all_reduce: some parameters outside the buckets,
all-reduced together, in one flat buffer, when one chosen parameter's gradient is computed.

What it changes in the core: nothing; the named parameters are ignored by the reducer (as if set
by _set_params_and_buffers_to_ignore_for_model) and averaged here instead. As torch DDP's
`_register_delay_all_reduce_hook`, `_delayed_all_reduce_hook` and `_clear_grad_buffer`:
  * at construction rank 0's values of the named parameters are broadcast (also with
    init_sync=False), and one zeroed flat buffer of torch's default dtype holds their gradients
    (on the CPU unless device_ids names a device), one view per parameter in the order given;
  * after every forward of the wrapper, a named parameter whose `.grad` is None gets its view as
    `.grad` (zeroed; the whole buffer at once when every one was None), so autograd accumulates
    into the buffer;
  * a hook on param_to_hook_all_reduce's gradient (a tensor hook: before that gradient is
    accumulated) divides the buffer by the world size and all-reduces it (SUM), in every backward
    that computes that gradient, no_sync() included. torch never waits for that all-reduce;
    minidp waits for it at the end of that backward (the values are the same; the optimizer then
    never reads a buffer still being reduced). Choose a parameter whose gradient comes after the
    named ones' (e.g. the first layer's weight), as with torch DDP.
minidp refuses what torch does not do through this path: delaying every parameter (torch then has
no reducer at all), a name that is not the module's parameter, and pickling such a wrapper.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Variable

from .collectives import broadcast_coalesced


def check_delayed(module, named_params, hook_param, ignored: set) -> tuple[list | None, str | None]:
    """(the delayed names, the hooked parameter's name), or (None, None) when neither is given."""
    if (named_params is None) != (hook_param is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set "
                         "at the same time.")  # torch DDP's words
    if named_params is None:
        return None, None
    params = dict(module.named_parameters())
    names = []
    for pair in named_params:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(f"delay_all_reduce_named_params: {pair!r} must be a (name, parameter) "
                            "pair, as module.named_parameters() gives")
        if params.get(pair[0]) is not pair[1]:
            raise ValueError(f"delay_all_reduce_named_params: {pair[0]!r} is not the name of that "
                             "parameter in the module")
        names.append(pair[0])
    hook_names = [n for n, p in params.items() if p is hook_param]
    if not hook_names:
        raise ValueError("param_to_hook_all_reduce must be a parameter of the module (minidp: "
                         f"got {type(hook_param).__name__})")
    if all(n in names or n in ignored for n, p in params.items() if p.requires_grad):
        raise ValueError("minidp.DDP does not support delay_all_reduce_named_params naming every "
                         "parameter that requires a gradient (torch DDP then builds no reducer)")
    return names, hook_names[0]


class DelayedAllReduce:
    """The flat gradient buffer of the named parameters, and the hooks that fill and reduce it.

    Args:
        ddp: the wrapper (its module, process_group, device_ids), before its reducer is built.
        names, hook_name: check_delayed's answer.
    """

    def __init__(self, ddp, names: list[str], hook_name: str):
        params = dict(ddp.module.named_parameters())
        self.params = [params[n] for n in names]
        self.group = ddp.process_group
        device = torch.device("cpu") if ddp.device_ids is None else ddp.input_device
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), device=device)
        offsets = [0]
        for p in self.params:
            offsets.append(offsets[-1] + p.numel())
        self.views = [self.buffer[a:b].view(p.shape)
                      for a, b, p in zip(offsets, offsets[1:], self.params)]
        broadcast_coalesced([p.detach() for p in self.params], self.group)  # ranks meet here
        params[hook_name].register_hook(self.reduce)
        ddp.register_forward_hook(self.clear_grads)

    def clear_grads(self, module, inputs, output) -> None:
        """After each forward: a parameter without `.grad` gets its (zeroed) view of the buffer."""
        all_none = all(p.grad is None for p in self.params)
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    view.zero_()
        if all_none:
            self.buffer.zero_()

    def reduce(self, grad: torch.Tensor) -> torch.Tensor:
        """The hooked gradient is computed: average the buffer over the ranks (waited for at the end
        of this backward); the gradient passes unchanged."""
        self.buffer.div_(dist.get_world_size(self.group))
        work = dist.all_reduce(self.buffer, group=self.group, async_op=True)  # ranks meet here
        Variable._execution_engine.queue_callback(work.wait)
        return grad
