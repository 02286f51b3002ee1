"""Context: what a compressor knows about the bucket in hand; RandomStream: the hook's private generator.

The hook makes one Context per bucket and step and hands it to compress and decompress (single-round
compressors) or, inside the Job, to reduce (multi-round methods), so that no method reaches for
globals such as dist.get_rank() or the global RNG. Its generator belongs to the hook's state: saved
in state.state_dict(), one stream per state that follows the buckets to their device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Context:
    """Who, when and what: the bucket a compressor works on, and a private random generator.

    As autograd's ctx, compress may keep on it what decompress needs (RandomK keeps its positions:
    `ctx.indices = ...`). A non-summable compressor's decompress also receives the other ranks'
    payloads: what it reads from ctx must then be the same on every rank (numel, dtype, ...).

    Args:
        rank: this rank in the transport's group.
        world_size: ranks in the transport's group.
        step: the iteration, from 0 (the exact ones before start_iter count too).
        shapes: the bucket's parameter shapes, in buffer order (`numel` is their total).
        dtype: the flat bucket's dtype (what decompress returns).
        device: the flat bucket's device.
        generator: a torch.Generator on `device`, never the global RNG. In the hook it is seeded with
            `compressor.seed + rank` (each rank draws its own numbers) or, if
            `compressor.shared_seed`, with `compressor.seed` (every rank draws the same numbers),
            and saved with the hook's state_dict().
    """

    rank: int
    world_size: int
    step: int
    shapes: list
    dtype: torch.dtype
    device: torch.device
    generator: torch.Generator | None = None
    numel: int = field(init=False)

    def __post_init__(self):
        self.numel = sum(math.prod(shape) for shape in self.shapes)

    @classmethod
    def for_tensor(cls, tensor: torch.Tensor, world_size: int = 1, rank: int = 0, step: int = 0,
                   seed: int = 0) -> "Context":
        """A context for trying a compressor on one flat tensor outside a hook (a test, a notebook).

        Args:
            tensor: the flat "bucket".
            world_size, rank, step: what the compressor is told. Defaults 1, 0, 0.
            seed: the seed of a fresh generator on the tensor's device. Default 0.
        """
        generator = torch.Generator(device=tensor.device).manual_seed(seed)
        return cls(rank, world_size, step, [tensor.shape], tensor.dtype, tensor.device, generator)


class RandomStream:
    """One torch.Generator that follows the buckets to their device, and its checkpointable state.

    Not keyed by device: a rank that resumes on another GPU index, or whose state_dict was saved on
    one device and loaded on another, goes on with the same stream. (CPU and CUDA generators keep
    different kinds of state: moving a stream between them raises.)

    Args:
        seed: the generator's seed.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self.generator: torch.Generator | None = None
        self._loaded: tuple | None = None  # (device type, state) from load_state_dict, until first use

    def on(self, device: torch.device) -> torch.Generator:
        """The generator, on `device` (made there at first use, or moved there with its state)."""
        device = torch.device(device)
        if self.generator is not None and self.generator.device == device:
            return self.generator
        carried = self._loaded
        if self.generator is not None:
            carried = (self.generator.device.type, self.generator.get_state())
        generator = torch.Generator(device=device).manual_seed(self.seed)
        if carried is not None:
            kind, state = carried
            if kind != device.type:
                raise RuntimeError(f"the hook's random generator was saved on a {kind} device and cannot go on "
                                   f"on {device}: resume on a {kind} device, or start the hook afresh")
            generator.set_state(state)
        self.generator, self._loaded = generator, None
        return generator

    def state_dict(self) -> dict:
        """The seed, and the generator's device type and state (none before the first bucket)."""
        if self.generator is not None:
            return {"seed": self.seed, "device_type": self.generator.device.type,
                    "state": self.generator.get_state()}
        if self._loaded is not None:
            return {"seed": self.seed, "device_type": self._loaded[0], "state": self._loaded[1].clone()}
        return {"seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"state_dict: the random generator's seed is {state['seed']}, this hook's {self.seed} "
                             "(seeds differ per rank unless the compressor's shared_seed is set): load the state "
                             "this rank saved, into a compressor made with the same seed")
        self.generator = None
        self._loaded = (state["device_type"], state["state"].clone()) if "state" in state else None
