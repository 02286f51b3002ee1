"""Small models for the engine tests; each builder is seeded, so every call gives the same
weights."""
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                 nn.Linear(width, 4))

    def forward(self, x):
        return self.net(x)


class CNNWithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.head = nn.Linear(6 * 4 * 4, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


class UnusedBranch(nn.Module):
    """`rare` takes part only when asked; `never` never does (its grad must stay None, as in
    DDP)."""

    def __init__(self):
        super().__init__()
        self.body, self.rare, self.never = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)
        self.head = nn.Linear(16, 4)
        self.use_rare = False

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head(h) + (self.rare(h) if self.use_rare else 0)


class Tied(nn.Module):
    """One Parameter in two modules, and used twice in forward: it must be reduced once."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid = nn.Linear(8, 8, bias=False), nn.Linear(8, 8)
        self.out = nn.Linear(8, 8, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.inp(x))))[:, :4]


class MixedDtype(nn.Module):
    """A float32 layer, then a float64 one: two bucket groups (by dtype), two dtypes in DDP's
    logging data."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).double()).float()


class WithUnused(nn.Module):
    """a -> b -> (+ extra) -> c -> head, and a layer `unused` that no forward uses (static_graph's
    cases).

    Args:
        twice: b runs twice, under reentrant checkpointing (its gradient hooks fire twice).
            Default False.
        skip_on_rank: that rank leaves `extra` out (an unused set that differs by rank, fixed in
            time).
            Default None: every rank uses it.
    """

    def __init__(self, twice=False, skip_on_rank=None):
        super().__init__()
        self.a, self.b, self.extra, self.unused, self.c = (nn.Linear(6, 6) for _ in range(5))
        self.head = nn.Linear(6, 1)
        self.twice, self.skip_on_rank = twice, skip_on_rank

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.twice:
            h = (checkpoint(self.b, h, use_reentrant=True)
                 + checkpoint(self.b, h, use_reentrant=True))
        else:
            h = self.b(h)
        if self.skip_on_rank is None or self.skip_on_rank != dist.get_rank():
            h = h + self.extra(h)
        return self.head(torch.relu(self.c(h)))


# "wide": a 288x288 layer, 82,944 weights: above the engine's small-gradient size
# (layout.SMALL_GRAD_NUMEL), so its gradient goes into the bucket when ready, the others at the
# launch.
BUILDERS = {"mlp": MLP, "cnn_bn": CNNWithBatchNorm, "unused": UnusedBranch, "tied": Tied,
            "mixed": MixedDtype, "wide": lambda: MLP(width=288)}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[name]()


def input_shape(name: str):
    return (3, 4, 4) if name == "cnn_bn" else (8,)
