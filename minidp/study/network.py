"""A network model for all-reduce: latency and bandwidth per link (alpha-beta), nodes of ranks, ring or tree.

Costs, for an all-reduce of S bytes over n ranks (Thakur, Rabenseifner and Gropp, "Optimization of
Collective Communication Operations in MPICH", 2005), with a link's latency a (seconds per message)
and inverse bandwidth b (seconds per byte; the reduction's own arithmetic is folded into b):

  ring  (reduce-scatter, then all-gather; what NCCL and gloo use for large buffers):
        T = 2 (n - 1) a + 2 (n - 1) / n * S * b
        Every step moves S / n bytes over every link of the ring at once, so a ring that spans
        several nodes runs at the pace of its slowest link: the inter-node one.
  tree  (binomial reduce to a root, then broadcast; no pipelining):
        T = 2 * (levels_intra (a_intra + S b_intra) + levels_inter (a_inter + S b_inter))
        levels_intra = ceil(log2(ranks on a node)), levels_inter = ceil(log2(nodes)): the tree is
        built inside each node first, then across nodes.

The ring's bandwidth term hardly grows with n (2 S b at most) while its latency term grows
linearly; the tree's latency grows with log2(n) but it sends all S bytes at each level. So the tree
wins for small buffers at large n, the ring for large buffers.

fit_ring() turns a measured all-reduce sweep (bytes -> seconds at one world size, all ranks on one
node) into the intra-node link: a least-squares line T = c0 + c1 S, then a = c0 / (2 (n - 1)) and
b = c1 n / (2 (n - 1)).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..validate import check_choice, check_int, check_number


@dataclass(frozen=True)
class Link:
    """One hop: `latency_s` per message, `bandwidth` in bytes per second."""

    latency_s: float
    bandwidth: float

    def __post_init__(self):
        check_number("latency_s", self.latency_s, low=0.0)
        check_number("bandwidth", self.bandwidth, positive=True)


@dataclass(frozen=True)
class Network:
    """Ranks grouped in nodes of `ranks_per_node`; `intra` links inside a node, `inter` between nodes.

    Args:
        intra, inter: the two kinds of Link.
        ranks_per_node: ranks sharing a node (e.g. GPUs per server). Default 8.
        algorithm: "ring" or "tree". Default "ring".
        shared_cores: True when the communication needs the same processor as the compute (gloo
            on CPU ranks with one core each): then nothing overlaps and the step is compute plus
            communication. False (default): a separate engine (NIC, NVLink/DMA) moves the bytes
            while backward goes on.
    """

    intra: Link
    inter: Link
    ranks_per_node: int = 8
    algorithm: str = "ring"
    shared_cores: bool = False

    def __post_init__(self):
        check_int("ranks_per_node", self.ranks_per_node, 1)
        check_choice("algorithm", self.algorithm, ("ring", "tree"))

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for people: algorithm, node size, both links."""
        link = lambda k: f"{k.latency_s * 1e6:.1f} us, {k.bandwidth / 1e9:.2f} GB/s"  # noqa: E731
        return (f"{self.algorithm} all-reduce, {self.ranks_per_node} rank(s) per node; inside a node "
                f"{link(self.intra)}; between nodes {link(self.inter)}"
                + ("; shared cores (nothing overlaps)" if self.shared_cores else ""))

    @classmethod
    def from_dict(cls, data: dict) -> "Network":
        return cls(Link(**data["intra"]), Link(**data["inter"]), data.get("ranks_per_node", 8),
                   data.get("algorithm", "ring"), data.get("shared_cores", False))


# A GPU cluster of the kind DDP usually runs on: 8 GPUs per server on NVLink-class links, 100 Gb/s
# between servers. Round, typical figures; fit or pass your own for predictions that matter.
CLUSTER = Network(intra=Link(5e-6, 100e9), inter=Link(15e-6, 12.5e9), ranks_per_node=8)


def allreduce_time(nbytes: float, world_size: int, net: Network) -> float:
    """Seconds to all-reduce `nbytes` over `world_size` ranks on `net` (0 for one rank)."""
    n = world_size
    if n <= 1 or nbytes <= 0:
        return 0.0
    nodes = math.ceil(n / net.ranks_per_node)
    if net.algorithm == "ring":
        link = net.intra if nodes == 1 else _slowest(net.intra, net.inter)
        return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bandwidth
    per_node = min(n, net.ranks_per_node)
    levels = ((math.ceil(math.log2(per_node)), net.intra), (math.ceil(math.log2(nodes)), net.inter))
    return 2 * sum(k * (link.latency_s + nbytes / link.bandwidth) for k, link in levels)


def _slowest(a: Link, b: Link) -> Link:
    return Link(max(a.latency_s, b.latency_s), min(a.bandwidth, b.bandwidth))


def fit_ring(sweep: dict, world_size: int) -> Link:
    """The intra-node Link that best explains a measured ring all-reduce sweep {bytes: seconds}.

    Least squares on relative error (each point weighted by 1/T^2), so that the microsecond
    latencies of small buffers count as much as the large buffers' bandwidth.
    """
    check_int("world_size", world_size, 2)
    if len(sweep) < 2:
        raise ValueError(f"sweep has {len(sweep)} point(s): fit_ring needs two sizes or more")
    points = [(float(s), float(t), 1.0 / float(t) ** 2) for s, t in sweep.items()]
    sw = sum(w for _, _, w in points)
    mx = sum(w * s for s, _, w in points) / sw
    my = sum(w * t for _, t, w in points) / sw
    slope = (sum(w * (s - mx) * (t - my) for s, t, w in points)
             / sum(w * (s - mx) ** 2 for s, _, w in points))
    intercept = max(0.0, my - slope * mx)
    n = world_size
    return Link(latency_s=intercept / (2 * (n - 1)), bandwidth=2 * (n - 1) / (n * slope))


SWEEP_BYTES = tuple(4 ** k * 1024 for k in range(9))  # 1 KiB ... 64 MiB


def measure_allreduce(world_size: int = 2, sizes=SWEEP_BYTES, repeats: int = 10, timeout: float = 300.0) -> dict:
    """Time gloo all-reduces of float32 buffers on `world_size` CPU processes: {bytes: median seconds}.

    Run it on an otherwise idle machine (`flock` with whoever shares it): other work on the cores
    slows gloo down and the fit would blame the network.
    """
    import os
    import tempfile

    import torch

    from ..launcher.spawn import launch

    check_int("world_size", world_size, 2)
    with tempfile.TemporaryDirectory(prefix="minidp-sweep-") as tmp:
        launch(_sweep_worker, nprocs=world_size, args=(list(sizes), repeats, tmp), timeout=timeout)
        return {int(k): v for k, v in torch.load(os.path.join(tmp, "sweep.pt")).items()}


def _sweep_worker(local_rank: int, sizes: list, repeats: int, out_dir: str) -> None:
    import os
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from ..runtime.env import init, shutdown

    torch.set_num_threads(1)
    env = init(backend="gloo", timeout=120)
    result = {}
    for nbytes in sizes:
        buffer = torch.ones(nbytes // 4)
        times = []
        for _ in range(repeats + 2):  # two warm-ups
            dist.barrier()  # ranks meet here: every rank starts the all-reduce together
            start = time.perf_counter()
            dist.all_reduce(buffer)  # ranks meet here
            times.append(time.perf_counter() - start)
        result[nbytes] = statistics.median(times[2:])
    if env.rank == 0:
        torch.save(result, os.path.join(out_dir, "sweep.pt"))
    shutdown()


def measure_network(path: str) -> Network:
    """Sweep gloo all-reduces on 2 local processes, fit a Link, write a shared-cores Network to `path`."""
    import json
    import os

    sweep = measure_allreduce(2)
    link = fit_ring(sweep, 2)
    net = Network(link, Link(link.latency_s, link.bandwidth), ranks_per_node=os.cpu_count() or 1,
                  shared_cores=True)
    with open(path, "w") as f:
        json.dump(net.to_dict() | {"sweep": {str(k): v for k, v in sweep.items()}}, f, indent=1)
    print(f"measured gloo all-reduce at 2 ranks: {link.latency_s * 1e6:.1f} us latency, "
          f"{link.bandwidth / 1e9:.2f} GB/s; wrote {path}")
    return net
