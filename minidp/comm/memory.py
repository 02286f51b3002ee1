"""Per-parameter state that survives bucket rebuilds, and error feedback (the Memory of GRACE's split).

DDP rebuilds its buckets once, after iteration 1: a bucket index then names other parameters.
State keyed by bucket index (as torch's PowerSGD keeps it) would be added to the wrong gradients,
so minidp keys it by parameter. For speed, the parameters of one bucket keep their state as
views of one flat tensor laid out like the bucket: one add per bucket per step. When a bucket's
layout changes, a new flat tensor is built from the per-parameter pieces, so no value is lost.
"""
from __future__ import annotations

import itertools

import torch


class ParamStore:
    """Tensors kept per parameter key, served as one flat tensor per bucket layout.

    Keys are small ints the hook gives parameters in the order they first reach it (the same in
    every run of the same model and DDP settings), so a state_dict can be loaded in a new process.
    """

    def __init__(self):
        self.pieces: dict[int, torch.Tensor] = {}     # key -> 1-D view (into a flat below) or loaded tensor
        self.flats: dict[tuple, torch.Tensor] = {}    # bucket layout (tuple of keys) -> flat tensor

    def flat(self, keys: list[int], numels: list[int], like: torch.Tensor) -> tuple[torch.Tensor, bool, bool]:
        """The flat tensor for this layout: (flat, missing, moved).

        missing: some key had no state yet (its part starts at zero). moved: the layout is new and
        some key brought state from an earlier layout or a loaded state_dict.
        """
        layout = tuple(keys)
        if layout in self.flats:
            flat = self.flats[layout]
            if flat.device != like.device or flat.dtype != like.dtype:  # loaded with map_location="cpu"
                flat = self.flats[layout] = flat.to(like.device, like.dtype)
                offsets = [0, *itertools.accumulate(numels)]
                for key, start, end in zip(keys, offsets, offsets[1:]):
                    self.pieces[key] = flat[start:end]
            return flat, False, False
        flat = torch.zeros(sum(numels), dtype=like.dtype, device=like.device)
        missing, moved, offset = False, False, 0
        for key, numel in zip(keys, numels):
            old = self.pieces.get(key)
            if old is None:
                missing = True
            elif old.numel() != numel:
                raise ValueError(f"state for parameter #{key} holds {old.numel()} elements but the parameter "
                                 f"has {numel}: the state_dict comes from another model or DDP setup")
            else:
                flat[offset:offset + numel].copy_(old)
                moved = True
            self.pieces[key] = flat[offset:offset + numel]
            offset += numel
        taken = set(layout)  # layouts that lost a parameter to this one are stale: free them
        for stale in [lay for lay in self.flats if taken.intersection(lay)]:
            del self.flats[stale]
        self.flats[layout] = flat
        return flat, missing, moved

    def state_dict(self) -> dict:
        """Pieces by key, and the layouts they sit in (so a reload rebuilds the same flat tensors)."""
        return {"pieces": {key: piece.detach().clone() for key, piece in self.pieces.items()},
                "layouts": [list(layout) for layout in self.flats]}

    def load_state_dict(self, state: dict) -> None:
        self.pieces = {int(key): value.detach().clone().reshape(-1) for key, value in state["pieces"].items()}
        self.flats = {}
        for layout in state["layouts"]:
            like = self.pieces[layout[0]]
            self.flat(layout, [self.pieces[key].numel() for key in layout], like)


class Memory:
    """What a memory does: add what was held back to the gradient, then hold back what was not sent.

    Subclass it for another scheme (e.g. a decayed residual); the hook calls, per bucket and step,
    `compensate` before compressing and `update` after.
    """

    def compensate(self, tensor: torch.Tensor, keys: list[int], numels: list[int]) -> None:
        raise NotImplementedError

    def update(self, residual: torch.Tensor, keys: list[int], numels: list[int]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ErrorFeedback(Memory):
    """Error feedback: residual = what was meant minus what was sent, added back the next step.

    The residual is kept per parameter (see ParamStore), in the gradient's dtype and device.
    Example:
        state, hook = comm.compression_hook(comm.TopK(0.01), memory=comm.ErrorFeedback())
    """

    def __init__(self):
        self.store = ParamStore()

    def compensate(self, tensor: torch.Tensor, keys: list[int], numels: list[int]) -> None:
        """tensor += the residual of the same parameters (zeros the first time)."""
        residual, _, _ = self.store.flat(keys, numels, tensor)
        tensor.add_(residual)

    def update(self, residual: torch.Tensor, keys: list[int], numels: list[int]) -> None:
        flat, _, _ = self.store.flat(keys, numels, residual)
        flat.copy_(residual)

    def state_dict(self) -> dict:
        return {"residuals": self.store.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state["residuals"])

    def __repr__(self) -> str:
        return "ErrorFeedback()"
