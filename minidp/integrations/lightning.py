"""minidp inside PyTorch Lightning: `import minidp.lightning`, then `Trainer(strategy="minidp")`.

A subclass of Lightning's DDPStrategy that wraps the LightningModule in minidp.DDP instead of torch's
DistributedDataParallel. Everything else is Lightning's: the launchers (popen, spawn, fork), the
process group, the distributed samplers, checkpointing (a checkpoint holds the LightningModule's own
state_dict, so one saved under "ddp" resumes under "minidp" and back), gradient accumulation (Lightning
calls the wrapper's no_sync(), minidp's here).

What differs from Lightning's own DDP strategy, and why:
- the places where Lightning checks `isinstance(model, torch DistributedDataParallel)` (comm hooks,
  teardown's unwrapping) are overridden to recognise minidp.DDP;
- `ddp_comm_hook=` is registered on every device: minidp's hooks run on gloo too, where Lightning
  registers torch's only on CUDA (a limit of torch DDP's hooks in torch 1.8 that Lightning kept);
- manual optimization: training_step runs backward inside the wrapper's forward, before minidp would arm
  its reducer (after the module): the forward arms nothing and pre_backward arms each backward that
  syncs, which is what Lightning does with torch's reducer (`opt.toggle_model(sync_grad=False)` works).

Example:
    import lightning as L
    import minidp.lightning  # registers the strategy name "minidp"

    trainer = L.Trainer(strategy="minidp", accelerator="cpu", devices=2, max_epochs=2)
    trainer.fit(model, loader)
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.nn import Module

try:
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
except ImportError as exc:  # the extra is optional: say which one to install
    raise ImportError("minidp.lightning needs PyTorch Lightning 2.x: pip install lightning "
                      "(from the clone: pip install -e '.[lightning]') "
                      f"(importing lightning failed: {exc})") from exc

from ..engine.ddp import DistributedDataParallel

__all__ = ["DDPStrategy", "MinidpStrategy"]

# (registered name, Lightning's start_method): the same launchers as Lightning's "ddp", "ddp_spawn", ...
_NAMES = (("minidp", "popen"), ("minidp_spawn", "spawn"), ("minidp_fork", "fork"), ("minidp_notebook", "fork"))


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's DDP strategy with minidp.DDP as the wrapper; same keywords as lightning's DDPStrategy.

    Args: those of `lightning.pytorch.strategies.DDPStrategy` (accelerator, parallel_devices,
        cluster_environment, checkpoint_io, precision_plugin, ddp_comm_state, ddp_comm_hook,
        ddp_comm_wrapper, model_averaging_period, process_group_backend, timeout, start_method="popen");
        any other keyword goes to minidp.DDP (find_unused_parameters, bucket_cap_mb, static_graph,
        gradient_as_bucket_view, ... and minidp's own: debug, transport).

    Example:
        Trainer(strategy=minidp.lightning.DDPStrategy(bucket_cap_mb=5), accelerator="cpu", devices=2)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forward_redirection = _ForwardRedirection()

    def _setup_model(self, model: Module) -> DistributedDataParallel:
        """Wrap the LightningModule in minidp.DDP (Lightning's own wraps it in torch's DDP)."""
        device_ids = self.determine_ddp_device_ids()
        # As Lightning does for torch DDP: build on a side stream on CUDA (torch's CUDA notes, "stream semantics").
        ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with ctx:
            return DistributedDataParallel(module=model, device_ids=device_ids, **self._ddp_kwargs)  # ranks meet here

    def _register_ddp_hooks(self) -> None:
        """Register `ddp_comm_hook` (wrapped by `ddp_comm_wrapper`) on minidp.DDP, on any device."""
        if isinstance(self.model, DistributedDataParallel):
            _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                    ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Manual optimization: arm minidp's reducer if this backward syncs (as Lightning's prepare_for_backward)."""
        model, module = self.model, self.lightning_module
        if not isinstance(model, DistributedDataParallel):
            return super().pre_backward(closure_loss)
        if module is None or module.automatic_optimization:
            return None  # the forward armed it
        if torch.is_grad_enabled() and model.require_backward_grad_sync:  # False in opt.toggle_model(sync_grad=False)
            model.require_forward_param_sync = True
            model.reducer.prepare_for_backward()
        else:
            model.require_forward_param_sync = False
        return None

    def teardown(self) -> None:
        """Unwrap minidp.DDP back to the LightningModule, then Lightning's teardown."""
        if isinstance(self.model, DistributedDataParallel):
            # Lightning's teardown only unwraps torch's DDP; without this, self.model would stay the wrapper.
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Register "minidp", "minidp_spawn", "minidp_fork", "minidp_notebook" (not Lightning's "ddp" names)."""
        for name, start_method in _NAMES:
            if name not in strategy_registry:  # importing twice (or a reload) must not raise
                strategy_registry.register(name, cls, description=f"minidp.DDP with start_method={start_method!r}",
                                           start_method=start_method)


class _ForwardRedirection(_DDPForwardRedirection):
    """Lightning's redirection of training_step through the wrapper's forward; with minidp, manual optimization.

    In manual optimization training_step calls backward itself, inside minidp.DDP's forward, whose arming
    comes after the module: too late. So the forward runs as under no_sync() (it arms nothing), training_step
    sees require_backward_grad_sync as the user left it, and DDPStrategy.pre_backward arms each synced backward.
    """

    def __call__(self, wrapper_module: Module, original_module: Module, method_name: str, *args: Any, **kwargs: Any):
        if not isinstance(wrapper_module, DistributedDataParallel) or original_module.automatic_optimization:
            return super().__call__(wrapper_module, original_module, method_name, *args, **kwargs)
        wanted, original_forward = wrapper_module.require_backward_grad_sync, original_module.forward

        def inner(*inner_args: Any, **inner_kwargs: Any) -> Any:
            original_module.forward = original_forward  # the method may call the real forward
            wrapper_module.require_backward_grad_sync = wanted
            try:
                return getattr(original_module, method_name)(*inner_args, **inner_kwargs)
            finally:
                wrapper_module.require_backward_grad_sync = False  # as Lightning's on_after_inner_forward

        original_module.forward = inner
        wrapper_module.require_backward_grad_sync = False  # read by the forward before the module: no arming
        try:
            return wrapper_module(*args, **kwargs)
        finally:
            wrapper_module.require_backward_grad_sync = wanted
            if original_module.forward is inner:  # the wrapper raised before calling it
                original_module.forward = original_forward


MinidpStrategy = DDPStrategy  # a name that does not shadow Lightning's when both are imported

DDPStrategy.register_strategies(StrategyRegistry)
