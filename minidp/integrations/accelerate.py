"""minidp inside Hugging Face Accelerate: `from minidp.accelerate import Accelerator`, nothing else changed.

A subclass of accelerate.Accelerator whose prepare() wraps the model in minidp.DDP wherever Accelerate
would use torch's DistributedDataParallel (several GPUs or other devices, or several CPU processes),
with the DistributedDataParallelKwargs handler's keywords and its comm hook. The rest is Accelerate's:
device placement, autocast, data loaders, optimizers, accumulate(), no_sync() (it calls the wrapper's),
gather(), save_state()/load_state() (they hold the user's module, as with torch DDP, so a state saved
under either wrapper loads under the other).

What the subclass overrides, and why (each is a place where Accelerate tests for torch's class):
- prepare_model: Accelerate's, with the wrapping left out (its evaluation_mode), then minidp.DDP;
- unwrap_model (and so get_state_dict, save_model, HF Trainer's unwrapping): see through minidp.DDP;
- trigger_sync_in_backward: arm minidp's reducer as Accelerate arms torch's.
No Accelerate module global is patched. Code that calls `accelerate.utils.extract_model_from_parallel`
itself (not through the accelerator) sees minidp.DDP as a plain module: `.module` is the model.

Example (launch with `accelerate launch` or torchrun, as before):
    from minidp.accelerate import Accelerator   # was: from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from torch import nn

try:
    import accelerate
    from accelerate.utils import DistributedType, is_compiled_module
except ImportError as exc:  # the extra is optional: say which one to install
    raise ImportError("minidp.accelerate needs Hugging Face Accelerate: pip install accelerate "
                      "(from the clone: pip install -e '.[accelerate]') "
                      f"(importing accelerate failed: {exc})") from exc

from ..engine.ddp import DistributedDataParallel

__all__ = ["Accelerator"]


class Accelerator(accelerate.Accelerator):
    """accelerate.Accelerator that wraps models in minidp.DDP where Accelerate would use torch DDP.

    Args: accelerate.Accelerator's, unchanged. `kwargs_handlers=[DistributedDataParallelKwargs(...)]`
        gives minidp.DDP its keywords (find_unused_parameters, bucket_cap_mb, static_graph,
        gradient_as_bucket_view, broadcast_buffers; minidp's bucket_cap_mb="auto" passes through too)
        and its comm hook (comm_hook=DDPCommunicationHookType.FP16, ..., comm_wrapper, comm_state_option).

    The class adds no state of its own (only methods), so an accelerate.Accelerator made elsewhere can
    be switched to it: `accelerator.__class__ = minidp.accelerate.Accelerator` (README: HF Trainer).
    """

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        """Accelerate's prepare_model, with minidp.DDP where it would wrap in torch DDP."""
        if evaluation_mode or not self._wraps_in_ddp(model):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        # Everything Accelerate does but the wrapping (device placement, autocast, its model list, compile).
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        compiled = prepared if is_compiled_module(prepared) else None
        inner = compiled._orig_mod if compiled is not None else prepared
        # Accelerate marks the wrapper, not the user's module (a second prepare(model) must wrap again).
        for module in (prepared, inner):
            module.__dict__.pop("_is_accelerate_prepared", None)
        wrapped = DistributedDataParallel(inner, **self._ddp_arguments())  # ranks meet here
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(wrapped)  # Accelerate's hooks, by their DDP contract
        if compiled is not None:  # Accelerate compiles after wrapping: compile the wrapper instead of the module
            wrapped = torch.compile(wrapped, **self.state.dynamo_plugin.to_kwargs())
        wrapped._is_accelerate_prepared = True
        return wrapped

    def _wraps_in_ddp(self, model: nn.Module) -> bool:
        """Whether accelerate.Accelerator.prepare_model would wrap `model` in torch DDP (its own conditions)."""
        if getattr(model, "_is_accelerate_prepared", False):
            return False  # Accelerate returns it as it is
        config = getattr(self, "parallelism_config", None)
        if self.multi_device and not (config is not None and config.tp_enabled):
            try:
                from accelerate.utils.other import model_has_dtensor
            except ImportError:  # older Accelerate: no DTensor check
                return any(p.requires_grad for p in model.parameters())
            # A DTensor model: Accelerate raises its own error; leave that to it.
            return not model_has_dtensor(model) and any(p.requires_grad for p in model.parameters())
        return self.distributed_type == DistributedType.MULTI_CPU

    def _ddp_arguments(self) -> dict:
        """minidp.DDP's keywords, as Accelerate builds torch DDP's: the handler's, and device_ids on accelerators."""
        kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        if self.distributed_type == DistributedType.MULTI_CPU:
            return kwargs
        if os.environ.get("ACCELERATE_BYPASS_DEVICE_MAP", "false").lower() == "true":
            return kwargs  # a model spread over devices by device_map: no device_ids (Accelerate's rule)
        index = self.device.index if self.device.type == "hpu" else self.local_process_index
        return {"device_ids": [index], "output_device": index, **kwargs}

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """Accelerate's unwrap_model, seeing through minidp.DDP too: returns the user's module."""
        compiled = model if is_compiled_module(model) else None
        inner = compiled._orig_mod if compiled is not None else model
        if not isinstance(inner, DistributedDataParallel):
            return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        user = super().unwrap_model(inner.module, keep_fp32_wrapper, keep_torch_compile=False)
        if compiled is not None and keep_torch_compile:
            compiled._orig_mod = user  # what Accelerate does with a compiled torch DDP: the compiled shell kept
            return compiled
        return user

    @staticmethod
    @contextmanager
    def trigger_sync_in_backward(model: nn.Module):
        """Make the next backward average gradients even after forwards under no_sync() (Accelerate's contract)."""
        if not isinstance(model, DistributedDataParallel):
            with accelerate.Accelerator.trigger_sync_in_backward(model):
                yield
            return
        old = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward()  # arm the hooks, as Accelerate arms torch's reducer here
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = old
