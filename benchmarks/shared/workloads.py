"""The benchmark workloads: what model, what batch, and how one training step runs.

Three shapes that stress different parts of a data-parallel engine:
  * ``mlp``: ~25M parameters and a small batch, so all-reducing ~100 MB of gradients dominates;
  * ``resnet18``: torchvision's ResNet-18 on 32x32 images, where convolutions dominate;
  * ``deep300``: 300 small residual Linear layers (600 parameter tensors, ~1.2M parameters), where
    whatever an engine spends per parameter (hooks, copies, bookkeeping) shows.
``quick=True`` shrinks each one so that a smoke run takes seconds; the names stay the same (quick
``resnet18`` keeps ResNet-18's layers, 62 parameter tensors and BatchNorm buffers, at base width 8).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NAMES = ("mlp", "resnet18", "deep300")


class MLP(nn.Module):
    """A plain MLP: `depth` hidden Linear(width, width) layers between an input and a head."""

    def __init__(self, inputs: int = 1024, width: int = 2048, depth: int = 5, classes: int = 1000):
        super().__init__()
        layers = [nn.Linear(inputs, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class DeepNarrow(nn.Module):
    """`layers` residual blocks x + tanh(Linear(x)): many tiny parameters, little arithmetic each."""

    def __init__(self, width: int = 64, layers: int = 300, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.tanh(block(x))  # the residual keeps activations sane over 300 layers
        return self.head(x)


@dataclass(frozen=True)
class Workload:
    """One model with its batch: enough to build identical copies and run steps on any rank."""

    name: str
    batch: int          # per rank
    input_shape: tuple  # one sample
    classes: int
    quick: bool

    def build(self, seed: int = 0) -> nn.Module:
        """A fresh model; the same `seed` gives the same weights (both engines start equal)."""
        torch.manual_seed(seed)
        if self.name == "mlp":
            return MLP(*((64, 128, 2, 10) if self.quick else (1024, 2048, 5, 1000)))
        if self.name == "resnet18":
            import torchvision  # imported here: only this workload needs it
            model = torchvision.models.resnet18(num_classes=self.classes)
            return narrow_resnet(model, width=8) if self.quick else model
        if self.name == "deep300":
            return DeepNarrow(*((16, 30, 10) if self.quick else (64, 300, 10)))
        raise ValueError(f"workload={self.name!r} must be one of {NAMES}")

    def batch_for(self, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed random batch per rank (data loading is not what is measured)."""
        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(self.batch, *self.input_shape, generator=gen)
        y = torch.randint(0, self.classes, (self.batch,), generator=gen)
        return x.to(device), y.to(device)


def narrow_resnet(model: nn.Module, width: int) -> nn.Module:
    """torchvision's ResNet-18 rebuilt at base `width` (64 is the standard net): the same layers, smaller.

    torchvision hard-codes the widths 64..512, so the stem and the four stages are rebuilt with its own
    blocks (the quick smoke run's 11M parameters cost seconds per step on 2 cores).
    """
    from torchvision.models.resnet import BasicBlock

    model.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
    model.bn1, model.inplanes = nn.BatchNorm2d(width), width
    for i, mult in enumerate((1, 2, 4, 8), start=1):
        setattr(model, f"layer{i}", model._make_layer(BasicBlock, width * mult, 2, stride=1 if i == 1 else 2))
    model.fc = nn.Linear(8 * width, model.fc.out_features)
    return model


def get(name: str, quick: bool = False) -> Workload:
    """The workload called `name` (one of NAMES), full-size or quick."""
    if name == "mlp":
        return Workload(name, 8 if quick else 16, (64,) if quick else (1024,), 10 if quick else 1000, quick)
    if name == "resnet18":
        return Workload(name, 2 if quick else 32, (3, 16, 16) if quick else (3, 32, 32), 10, quick)
    if name == "deep300":
        return Workload(name, 8 if quick else 32, (16,) if quick else (64,), 10, quick)
    raise ValueError(f"workload={name!r} must be one of {NAMES}")


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step as a training loop writes it: zero_grad (set_to_none), forward, backward, step."""
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: the same cost for both engines, with realistic state."""
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def clone(model: nn.Module) -> nn.Module:
    """An independent copy with equal weights (each engine wraps its own copy)."""
    return copy.deepcopy(model)


def grad_numel(model: nn.Module) -> int:
    """How many gradient elements one step reduces."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
