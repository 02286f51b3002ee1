"""Predict one step of data-parallel training at any scale from a recorded timeline and a network model.

    python -m minidp.explain resnet18 --world-size 1 --input-shape 3,32,32 --batch 32 --out runs/explain  # record
    python -m minidp.simulate --events runs/explain/explain_resnet18_events.json --plot runs/scaling.png
    python -m minidp.simulate --events ... --bucket-cap-mb 5 --compression 0.5 --algorithm tree --caps 1,5,25,100
    python -m minidp.simulate --study benchmarks/results/compression_study.json   # time to target (time_to_target.py)
    python -m minidp.simulate goodput   # goodput under failures at 1,024-16,384 GPUs: restart vs heal (goodput.py)

The recorded step gives the compute: forward, the time each gradient became ready after backward
began, its size, the write-back after the last all-reduce, the optimizer. The simulator cuts the
gradients into buckets as DDP does (in ready order, 1 MiB first then bucket_cap_mb, or one cap),
launches each bucket when all its gradients are ready and every earlier bucket has been launched,
runs the all-reduces one after another on one channel (network.py gives each one's time), and ends
backward when both the compute and the last all-reduce are done:

    step = forward + max(backward, end of the last all-reduce) + write-back + optimizer

Assumptions, and where they stop holding:
  * every rank computes like the recorded one, in lock-step. Stragglers are not modelled: in
    reality every all-reduce waits for the slowest rank, so a slow rank's delay is everyone's.
  * communication does not slow the compute (a NIC or NVLink moves the bytes). Where it needs the
    same cores (gloo on CPU ranks, one core each, as on the 2-core machine this was built on), set
    Network.shared_cores: then nothing hides and step = compute + all the all-reduces.
  * the recorded compute has no communication in it: record at world size 1, or where communication
    runs beside the compute; a recording from shared cores carries their slowdown into every N.
  * one dtype (one bucket group), no compression cost (compression only shrinks the bytes sent),
    no contention between jobs on the network, all-reduces of one step never run in parallel.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from ..engine.planning import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES, MIB, bucket_limits, plan_rebuilt
from ..validate import check_int, check_number
from .memory_table import add_memory_arguments, check_memory_args, main_memory
from .network import Network, allreduce_time
from .plot import check_writable

WORLD_SIZES = tuple(2 ** k for k in range(11))  # 1 ... 1,024


@dataclass
class Profile:
    """One rank's step without communication, in seconds; gradients listed in the order they became ready."""

    forward_s: float
    names: list
    ready_s: list  # after backward began
    nbytes: list
    backward_s: float
    finalize_s: float  # writing the averaged gradients back, after the last all-reduce
    optimizer_s: float

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.finalize_s + self.optimizer_s

    @classmethod
    def from_events(cls, events, param_bytes: dict) -> "Profile":
        """From one step's Timeline events (model.enable_timeline(); forward_start, backward_start and
        step_end recorded by the loop) and each parameter's gradient size in bytes, by name."""
        first = {}
        for kind, stamp, _ in sorted(events, key=lambda e: e[1]):
            first.setdefault(kind, stamp)
        missing = [k for k in ("backward_start", "backward_end", "finalize_end", "grad_ready") if k not in first]
        if missing:
            raise ValueError(f"the recorded step has no {missing} event: record a whole step, with "
                             "timeline.record('backward_start') before loss.backward() (see Timeline)")
        start = first["backward_start"]
        ready = sorted((stamp, f["param"]) for kind, stamp, f in events if kind == "grad_ready")
        unknown = [name for _, name in ready if name not in param_bytes]
        if unknown:
            raise ValueError(f"no size for the recorded gradient(s) {unknown[:3]}: param_bytes lacks them")
        last_done = max([stamp for kind, stamp, _ in events if kind == "done"] + [first["backward_end"]])
        end = max(stamp for _, stamp, _ in events)
        return cls(forward_s=(start - first.get("forward_start", start)) / 1e9,
                   names=[name for _, name in ready], ready_s=[(t - start) / 1e9 for t, _ in ready],
                   nbytes=[param_bytes[name] for _, name in ready],
                   backward_s=(first["backward_end"] - start) / 1e9,
                   finalize_s=max(0, first["finalize_end"] - last_done) / 1e9,
                   optimizer_s=(first.get("step_end", end) - first["finalize_end"]) / 1e9)

    @classmethod
    def median(cls, profiles: list) -> "Profile":
        """Per quantity, the median over several recorded steps (gradients matched by name): steadier than one step."""
        import statistics

        first = profiles[0]
        ready = {n: statistics.median(p.ready_s[p.names.index(n)] for p in profiles) for n in first.names}
        names = sorted(first.names, key=ready.get)
        pick = lambda field: statistics.median(getattr(p, field) for p in profiles)  # noqa: E731
        return cls(pick("forward_s"), names, [ready[n] for n in names],
                   [first.nbytes[first.names.index(n)] for n in names], pick("backward_s"), pick("finalize_s"),
                   pick("optimizer_s"))

    @classmethod
    def load(cls, path: str, rank: int = 0) -> "Profile":
        """From the events file `python -m minidp.explain` writes (explain_<model>_events.json)."""
        with open(path) as f:
            data = json.load(f)
        if str(rank) not in data.get("events", {}):
            raise ValueError(f"rank={rank}: {path} holds the ranks {sorted(data.get('events', {}))}")
        return cls.from_events(data["events"][str(rank)], {name: nbytes for name, _, nbytes in data["params"]})


def bucket_indices(profile: Profile, bucket_cap_mb: float | None = None) -> list:
    """Which gradients share each bucket: DDP's rebuilt layout for one dtype, by index into profile.names.

    This is the layout minidp.DDP (and torch DDP) use from the second iteration on, made by the
    engine's own planning functions: gradients in the order they became ready, cut when a bucket
    reaches its limit (DEFAULT_FIRST_BUCKET_BYTES for the first bucket when bucket_cap_mb is None,
    then the cap: DEFAULT_BUCKET_CAP_MB by default).

    Args:
        profile: the recorded step; its gradients are listed in ready order.
        bucket_cap_mb: DDP's bucket_cap_mb. Default None: DDP's default.
    """
    limits = bucket_limits(bucket_cap_mb, first_iteration=False, needs_rebuild=True)
    count = len(profile.nbytes)
    return plan_rebuilt(profile.nbytes, [None] * count, limits, ready_order=range(count))


def plan_buckets(profile: Profile, bucket_cap_mb: float | None = None) -> list:
    """[(bytes, ready_s)] per bucket, in launch order: bucket_indices' buckets, each ready with its last gradient.

    Args:
        profile: the recorded step.
        bucket_cap_mb: DDP's bucket_cap_mb. Default None: DDP's default.
    """
    return [(sum(profile.nbytes[i] for i in bucket), max(profile.ready_s[i] for i in bucket))
            for bucket in bucket_indices(profile, bucket_cap_mb)]


ZERO_MODES = ("broadcast", "reduce_scatter", "reduce_scatter_overlap")


def simulate_step(profile: Profile, net: Network, world_size: int, bucket_cap_mb: float | None = None,
                  compression: float = 1.0, zero: str | None = None) -> dict:
    """Predict one step at `world_size` ranks.

    Args:
        profile: the recorded compute (Profile.from_events or Profile.load).
        net: the network (network.CLUSTER, or a fitted one).
        world_size: ranks.
        bucket_cap_mb: DDP's bucket_cap_mb. Default None (1 MiB first bucket, then 25 MiB).
        compression: bytes sent / gradient bytes (0.5 for fp16 or bf16 hooks). Default 1.0.
        zero: ZeRO-1 beside DDP. None (default): plain DDP. "broadcast": torch's (and minidp's plain)
            ZeroRedundancyOptimizer: the all-reduces, then after the step the shards' broadcasts,
            (N-1)/N of the parameters, exposed: 3(N-1)/N in all. "reduce_scatter":
            ZeroRedundancyOptimizer(reduce_scatter=True): a reduce-scatter per bucket instead of
            the all-reduce, then an all-gather after the step, exposed: 2(N-1)/N, DDP's bytes.
            "reduce_scatter_overlap": the all-gather hidden behind the next forward as far as it
            lasts (overlap_param_gather=True). A ring's reduce-scatter, all-gather or broadcast is
            half of its all-reduce (N-1 steps of (N-1)/N of the bytes).

    Returns:
        dict: world_size, step_s, compute_s, comm_s (all all-reduces end to end), exposed_s (what the
        step pays for communication), hidden (share of comm_s that overlapped compute, None at one
        rank), efficiency (compute_s / step_s: weak scaling, same batch per rank), buckets.
    """
    check_int("world_size", world_size, 1)
    check_number("compression", compression, positive=True, high=1.0)
    if zero is not None and zero not in ZERO_MODES:
        raise ValueError(f"zero={zero!r} must be None or one of {ZERO_MODES}")
    # a reduce-scatter in place of each all-reduce: half of it
    per_bucket = 0.5 if zero in ("reduce_scatter", "reduce_scatter_overlap") else 1.0
    launched = channel_free = 0.0
    comm = 0.0
    for nbytes, ready in plan_buckets(profile, bucket_cap_mb):
        launched = max(ready, launched)  # in order: a bucket waits for every earlier one to launch
        duration = per_bucket * allreduce_time(nbytes * compression, world_size, net)
        channel_free = max(launched, channel_free) + duration  # one all-reduce at a time
        comm += duration
    if net.shared_cores:
        backward_end = profile.backward_s + comm  # the cores do the compute, then the communication
    else:
        backward_end = max(profile.backward_s, channel_free)
    step = profile.forward_s + backward_end + profile.finalize_s + profile.optimizer_s
    # ZeRO-1's weights after the step: broadcasts or an all-gather, half an all-reduce of them all
    after = 0.0 if zero is None else 0.5 * allreduce_time(sum(profile.nbytes), world_size, net)
    comm += after
    hidden_after = min(after, profile.forward_s) if zero == "reduce_scatter_overlap" else 0.0
    step += after - (0.0 if net.shared_cores else hidden_after)
    exposed = step - profile.compute_s
    return {"world_size": world_size, "step_s": step, "compute_s": profile.compute_s, "comm_s": comm,
            "exposed_s": exposed, "hidden": None if comm == 0 else min(1.0, max(0.0, 1 - exposed / comm)),
            "efficiency": profile.compute_s / step, "buckets": len(plan_buckets(profile, bucket_cap_mb)),
            "zero": zero}


def scaling(profile: Profile, net: Network, world_sizes=WORLD_SIZES, bucket_cap_mb: float | None = None,
            compression: float = 1.0, zero: str | None = None) -> list:
    """simulate_step for each world size."""
    return [simulate_step(profile, net, n, bucket_cap_mb, compression, zero) for n in world_sizes]


def best_cap(profile: Profile, net: Network, world_size: int, caps, compression: float = 1.0):
    """(the cap with the shortest predicted step, {cap: step_s}); None stands for DDP's default."""
    steps = {cap: simulate_step(profile, net, world_size, cap, compression)["step_s"] for cap in caps}
    return min(steps, key=steps.get), steps


def format_table(rows: list, net: Network) -> str:
    """The terminal table of scaling()'s rows."""
    lines = [f"{'ranks':>6} {'nodes':>5} {'step ms':>9} {'all-reduce ms':>13} {'hidden':>7} {'efficiency':>10}"]
    for r in rows:
        nodes = -(-r["world_size"] // net.ranks_per_node)
        hidden = "-" if r["hidden"] is None else f"{100 * r['hidden']:.0f}%"
        lines.append(f"{r['world_size']:>6} {nodes:>5} {1e3 * r['step_s']:>9.1f} {1e3 * r['comm_s']:>13.1f} "
                     f"{hidden:>7} {100 * r['efficiency']:>9.0f}%")
    return "\n".join(lines)


def network_from_args(args) -> Network:
    """--network FILE (e.g. from --measure-network), else network.CLUSTER with the flags applied."""
    from .network import CLUSTER, Link

    if args.network:
        with open(args.network) as f:
            net = Network.from_dict(json.load(f))
    else:
        net = CLUSTER
    intra = Link(_pick(args.intra_latency_us, 1e-6, net.intra.latency_s),
                 _pick(args.intra_gbs, 1e9, net.intra.bandwidth))
    inter = Link(_pick(args.inter_latency_us, 1e-6, net.inter.latency_s),
                 _pick(args.inter_gbs, 1e9, net.inter.bandwidth))
    return Network(intra, inter, args.ranks_per_node or net.ranks_per_node, args.algorithm or net.algorithm,
                   args.shared_cores or net.shared_cores)


def _pick(value, unit, default):
    return default if value is None else value * unit


def _number(kind, flag: str, text: str, item: str):
    """int or float of one comma-separated item; ValueError naming the flag, the item and the form."""
    try:
        return kind(item)
    except ValueError:
        raise ValueError(f"{flag}={text!r}: {item.strip()!r} is not a{'n integer' if kind is int else ' number'}; "
                         f"give a comma-separated list, e.g. {flag} {'2,8,64' if kind is int else '1,5,25'}") from None


def parse_args(argv=None):
    import argparse

    p = argparse.ArgumentParser(prog="python -m minidp.simulate", description=__doc__.split("\n")[0],
                                epilog="python -m minidp.simulate goodput --help: goodput under failures (goodput.py)")
    p.add_argument("--events", help="a recorded step: the _events.json that python -m minidp.explain writes")
    p.add_argument("--rank", type=int, default=0, help="whose recorded step to use (default 0)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help=f"default: DDP's ({DEFAULT_FIRST_BUCKET_BYTES // MIB} MiB first, then {DEFAULT_BUCKET_CAP_MB})")
    p.add_argument("--compression", type=float, default=1.0, help="bytes sent / gradient bytes (default 1)")
    p.add_argument("--zero", choices=ZERO_MODES, default=None,
                   help="ZeRO-1 beside DDP: torch's (broadcast), reduce_scatter=True, or it with "
                        "overlap_param_gather (default: plain DDP)")
    p.add_argument("--world-sizes", default=",".join(map(str, WORLD_SIZES[1:])), help="default 2,4,...,1024")
    p.add_argument("--caps", default=None, help="also compare bucket caps, e.g. 1,5,25,100")
    net = p.add_argument_group("network (default: 8 ranks per node, 5 us and 100 GB/s inside, 15 us and "
                               "12.5 GB/s between nodes)")
    net.add_argument("--network", help="a network JSON (from --measure-network)")
    net.add_argument("--ranks-per-node", type=int)
    net.add_argument("--algorithm", choices=("ring", "tree"))
    net.add_argument("--intra-latency-us", type=float)
    net.add_argument("--intra-gbs", type=float, help="intra-node bandwidth, GB/s")
    net.add_argument("--inter-latency-us", type=float)
    net.add_argument("--inter-gbs", type=float, help="inter-node bandwidth, GB/s")
    net.add_argument("--shared-cores", action="store_true", help="communication uses the compute's cores")
    p.add_argument("--measure-network", metavar="OUT_JSON",
                   help="time gloo all-reduces on 2 local processes, fit the link, write it here")
    p.add_argument("--plot", help="PNG of step time, hidden share and efficiency against ranks")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    study = p.add_argument_group("time to target (time_to_target.py): --study FILE from "
                                 "benchmarks/compression/study.py")
    study.add_argument("--study", help="a compression study JSON: time to target per method at 8 ... 1,024 ranks")
    study.add_argument("--bandwidths", default="10,25,100,400", help="link Gb/s for --study (default 10,25,100,400)")
    study.add_argument("--compute-scale", type=float, default=1.0, help="--study: compute x this (default 1)")
    study.add_argument("--validate", action="store_true", help="--study: predicted vs measured time to target")
    study.add_argument("--methods", help="--study: compare only these methods with exact (comma-separated)")
    add_memory_arguments(p)
    args = p.parse_args(argv)
    args.world_sizes_given = any(a.startswith("--world-sizes") for a in (argv if argv is not None else sys.argv))
    try:  # every check before any work, each failure one line (argparse's usage would bury it)
        args.world_sizes = [check_int("--world-sizes", _number(int, "--world-sizes", args.world_sizes, n), 1)
                            for n in args.world_sizes.split(",")]
        args.caps = None if args.caps is None else [
            check_number("--caps", _number(float, "--caps", args.caps, c), positive=True) for c in args.caps.split(",")]
        if args.plot:
            check_writable("--plot", args.plot)
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    if not (args.events or args.measure_network or args.study or args.memory):
        p.error("give --events FILE (from python -m minidp.explain), --study FILE, --memory or --measure-network OUT "
                "(or the subcommand: python -m minidp.simulate goodput)")
    check_memory_args(p, args)
    return p, args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["goodput"]:  # a subcommand of its own; the --flag forms below are unchanged
        from .goodput_table import main as main_goodput

        return main_goodput(argv[1:])
    p, args = parse_args(argv)
    if args.memory:
        return main_memory(args, p)
    if args.measure_network:
        from .network import measure_network

        measure_network(args.measure_network)
        if not args.events:
            return 0
    if args.study:
        from .validation import main_study

        return main_study(args, p)
    try:
        profile = Profile.load(args.events, args.rank)
        net = network_from_args(args)
        rows = scaling(profile, net, args.world_sizes, args.bucket_cap_mb, args.compression, args.zero)
        caps = args.caps and {n: best_cap(profile, net, n, args.caps, args.compression) for n in args.world_sizes}
    except (OSError, ValueError, TypeError, KeyError) as e:
        p.error(f"{type(e).__name__}: {e}")
    if args.plot:
        from .plot import plot_scaling

        try:
            plot_scaling(args.plot, rows, f"{args.events}: predicted step, {net.algorithm} all-reduce")
        except ImportError:
            p.error("--plot needs matplotlib (pip install matplotlib)")
    if args.json:
        print(json.dumps({"network": net.to_dict(), "rows": rows,
                          "caps": caps and {n: {"best": b, "steps": s} for n, (b, s) in caps.items()}}, indent=1))
        return 0
    print(f"compute of one step (recorded): {1e3 * profile.compute_s:.1f} ms, {len(profile.names)} gradients, "
          f"{sum(profile.nbytes) / MIB:.1f} MiB\nnetwork: {net.describe()}")
    print(format_table(rows, net))
    for n, (best, steps) in (caps or {}).items():
        listed = ", ".join(f"{c:g}: {1e3 * s:.1f}" for c, s in steps.items())
        print(f"{n} ranks, step ms by bucket_cap_mb: {listed} -> best {best:g}")
    return 0

