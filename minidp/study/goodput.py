"""Goodput at 1,024 ... 16,384 GPUs under failures: restart from a checkpoint, or heal from a live peer.

    python -m minidp.simulate goodput                       # Llama 3's failure rate, 1,024 ... 16,384 GPUs
    python -m minidp.simulate goodput --measured benchmarks/results/ft_goodput.json --json goodput.json

Goodput is useful training time / wall time: what the job trains, as a share of what the same GPUs train
with no failure. Each GPU fails as a Poisson process of rate r per hour, so a job of N GPUs fails every
MTBF = 3600 / (N r) seconds on average. What a failure costs:

(a) restart from a checkpoint (torchrun, `minidp.run --max-restarts`): every GPU stops for detection D
    and restart R (new processes, the checkpoint loaded), and the work since the last checkpoint is lost,
    P / 2 on average for a checkpoint every P seconds (failures uniform in time); each checkpoint stops
    the job for its write C. P defaults to Young/Daly's sqrt(2 C MTBF), which minimises C / P + P / (2 MTBF),
    this formula's loss to first order:

        goodput_restart = (1 - C / P) (1 - (D + R + P / 2) / MTBF)

(b) heal from a live peer (fault-tolerant replicas, torchft-style): the N GPUs are N / g replica groups
    of g GPUs. A failure stalls every replica for D and discards the step in flight, S; the failed group
    is then out for its restart R and the transfer H of the state from a live peer while the others train
    on at (N/g - 1) / (N/g) of the throughput; when it rejoins, every peer waits W for its first step.
    Every step pays the quorum and the commit vote, q:

        goodput_heal = S / (S + q) (1 - (D + S + W + (R + H) / (N / g)) / MTBF)

Both are first-order expected values: every failure pays its whole cost, as if failures never met.
monte_carlo() draws failures (a Poisson process per GPU; the GPU decides which group (b) loses) and plays
both out: a failure during a restart starts it again, one during a checkpoint write loses the interval,
groups out at once add up, a failure in a group already out restarts its restart. Where failures are
rare beside their cost the two agree; where not, the Monte-Carlo's goodput is higher by up to about
(cost of a failure / MTBF)^2, the term the first-order formulas drop (failures that overlap cost less).

Assumptions: weak scaling (step_s is the same at every N); the rate per GPU does not depend on N, and
counts every interruption (Llama 3's 419 include network and host ones); a spare is always ready
(restart_s includes getting it); (b) loses its group's samples while it is out (the others' batch does
not grow) and writes no checkpoints (a real job keeps rare ones, against losing every replica at once).
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, fields

from ..validate import check_int, check_number

LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)  # 419 unexpected interruptions, 54 days, 16,384 H100s
GPUS = (1024, 2048, 4096, 8192, 16384)
GPUS_PER_REPLICA = 8
RATE_SOURCE = ("from Llama 3 405B's pre-training: 419 unexpected interruptions in 54 days on 16,384 H100s, "
               "419 / (54 x 24 x 16,384)")
SOURCES = {  # where each cost's default comes from
    "step_s": "from Llama 3 405B: 6 x 405e9 x 16M tokens a step at 400 TFLOPS a GPU on 16,384 GPUs = 5.9 s",
    "detect_s": "assumed: a heartbeat or watchdog timeout (a dead process shows in seconds, a hang at NCCL's "
                "600 s default)",
    "restart_s": "assumed: a spare node, every process relaunched, NCCL set up, the checkpoint loaded",
    "checkpoint_write_s": "from Llama 3: up to 4 GB a GPU to storage that sustains 2 TB/s: 16,384 x 4 GB / 2 TB/s "
                          "= 33 s",
    "heal_s": "assumed: a node's state from a live peer (8 x 4 GB at 50 GB/s a GPU: under 1 s) and new "
              "process groups",
    "peer_wait_s": "assumed: the joiner's first step (allocator, kernels, process groups warming up)",
    "quorum_s": "assumed: torchft's quorum overlaps the forward; the commit vote (a flag all-reduced) does not",
}


def check_cost(name: str, value) -> float:
    """`value` as a finite number of seconds >= 0 (> 0 for a step time), else TypeError/ValueError naming `name`."""
    value = check_number(name, value, positive=name.strip("-").startswith("step"), low=0)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be finite")
    return float(value)


@dataclass(frozen=True)
class Costs:
    """What a step and a failure cost, in seconds; SOURCES says where each default comes from.

    Args:
        step_s: one training step (6.0).
        detect_s: from a failure to every survivor knowing of it (60.0).
        restart_s: new processes up and their state loaded, after detection (600.0).
        checkpoint_write_s: the job stopped while a checkpoint is written ((a) only; 30.0).
        heal_s: a rejoining group's state sent by a live peer ((b) only; 20.0).
        peer_wait_s: the peers' wait for a joiner's first step ((b) only; 30.0).
        quorum_s: quorum and commit vote, exposed per step ((b) only; 0.05).
    """

    step_s: float = 6.0
    detect_s: float = 60.0
    restart_s: float = 600.0
    checkpoint_write_s: float = 30.0
    heal_s: float = 20.0
    peer_wait_s: float = 30.0
    quorum_s: float = 0.05

    def __post_init__(self):
        for field in fields(self):
            check_cost(field.name, getattr(self, field.name))


def job_mtbf_s(gpus: int, failures_per_gpu_hour: float) -> float:
    """Mean seconds between failures of a job of `gpus` GPUs that each fail `failures_per_gpu_hour`."""
    check_int("gpus", gpus, 1)
    check_number("failures_per_gpu_hour", failures_per_gpu_hour, positive=True)
    return 3600.0 / (gpus * failures_per_gpu_hour)


def young_daly_interval_s(checkpoint_write_s: float, mtbf_s: float) -> float:
    """Young/Daly's checkpoint interval, sqrt(2 x write x MTBF): it minimises C / P + P / (2 MTBF)."""
    return math.sqrt(2 * check_cost("checkpoint_write_s", checkpoint_write_s) * mtbf_s)


def checkpoint_interval_s(costs: Costs, mtbf_s: float, checkpoint_every_s: float | None = None) -> float:
    """(a)'s interval P: `checkpoint_every_s` if it is longer than a write, or Young/Daly's when it is None."""
    if checkpoint_every_s is None:
        if costs.checkpoint_write_s == 0:
            raise ValueError("checkpoint_write_s=0 makes Young/Daly's interval 0 (checkpoint without end): "
                             "give checkpoint_every_s")
        return young_daly_interval_s(costs.checkpoint_write_s, mtbf_s)
    if not check_cost("checkpoint_every_s", checkpoint_every_s) > costs.checkpoint_write_s:
        raise ValueError(f"checkpoint_every_s={checkpoint_every_s!r} must be > checkpoint_write_s="
                         f"{costs.checkpoint_write_s!r}: the job would only write checkpoints")
    return float(checkpoint_every_s)


def failure_cost_restart_s(costs: Costs, interval_s: float) -> float:
    """Wall seconds a failure costs every GPU in (a): detection, restart, half an interval of lost work."""
    return costs.detect_s + costs.restart_s + interval_s / 2


def failure_cost_heal_s(costs: Costs, replicas: int) -> float:
    """Whole-job seconds a failure costs in (b): the stall, the discarded step, the joiner's first step,
    and one group's restart and heal out of `replicas`."""
    return costs.detect_s + costs.step_s + costs.peer_wait_s + (costs.restart_s + costs.heal_s) / replicas


def goodput_restart(costs: Costs, mtbf_s: float, checkpoint_every_s: float | None = None) -> float:
    """(a)'s first-order goodput, (1 - C / P) (1 - (D + R + P / 2) / MTBF), at least 0.

    Args:
        costs: the step and failure costs.
        mtbf_s: the job's mean time between failures (job_mtbf_s).
        checkpoint_every_s: P, wall seconds from one checkpoint to the next. Default None: Young/Daly's.
    """
    check_number("mtbf_s", mtbf_s, positive=True)
    interval = checkpoint_interval_s(costs, mtbf_s, checkpoint_every_s)
    writing = max(0.0, 1 - costs.checkpoint_write_s / interval)
    return max(0.0, writing * (1 - failure_cost_restart_s(costs, interval) / mtbf_s))


def goodput_heal(costs: Costs, mtbf_s: float, replicas: int) -> float:
    """(b)'s first-order goodput, S / (S + q) (1 - (D + S + W + (R + H) / replicas) / MTBF), at least 0.

    Args:
        costs: the step and failure costs.
        mtbf_s: the job's mean time between failures (job_mtbf_s).
        replicas: replica groups (GPUs / gpus_per_replica), at least 2: a healer needs a live peer.
    """
    check_number("mtbf_s", mtbf_s, positive=True)
    check_int("replicas", replicas, 2)
    voting = costs.step_s / (costs.step_s + costs.quorum_s)
    return max(0.0, voting * (1 - failure_cost_heal_s(costs, replicas) / mtbf_s))


def failure_schedule(rng: random.Random, gpus: int, failures_per_gpu_hour: float, horizon_s: float) -> list:
    """[(time_s, gpu)] in [0, horizon_s): the failures of `gpus` independent Poisson processes, drawn as
    their sum (one process of rate gpus x rate, each failure's GPU uniform), which has the same law."""
    rate_s = gpus * failures_per_gpu_hour / 3600
    schedule, t = [], rng.expovariate(rate_s)
    while t < horizon_s:
        schedule.append((t, rng.randrange(gpus)))
        t += rng.expovariate(rate_s)
    return schedule


def simulate_restart(schedule: list, horizon_s: float, costs: Costs, interval_s: float) -> float:
    """(a) played over one failure schedule: the goodput of [0, horizon_s) (work not yet saved at the
    end counts). A failure loses the work since the last checkpoint written; a failure while the job
    is down starts detection and restart again."""
    down = costs.detect_s + costs.restart_s
    work = max(0.0, interval_s - costs.checkpoint_write_s)
    times = [t for t, _ in schedule] + [math.inf]
    t = useful = 0.0
    i = 0
    while t < horizon_s:
        until = min(times[i], horizon_s)
        periods = math.floor((until - t) / interval_s)  # checkpoints written before the next failure
        useful += periods * work
        t += periods * interval_s
        if until == horizon_s:
            return (useful + min(horizon_s - t, work)) / horizon_s
        t = times[i] + down  # back up at the last checkpoint, unless another failure comes first
        i += 1
        while times[i] < t:
            t = times[i] + down
            i += 1
    return useful / horizon_s


def simulate_heal(schedule: list, horizon_s: float, costs: Costs, gpus_per_replica: int, replicas: int) -> float:
    """(b) played over one failure schedule: the goodput of [0, horizon_s). A failure stalls the job
    for detection and the discarded step, then its group is out for restart and heal, and the job
    stalls again at its first step back; a failure in a group already out restarts its restart."""
    stall_s, away_s = costs.detect_s + costs.step_s, costs.restart_s + costs.heal_s
    stalls, outages, current = [], [], {}
    for t, gpu in schedule:
        group = gpu // gpus_per_replica
        out = current.get(group)
        if out is not None and t < out[1]:  # not in the quorum: nobody else waits for it
            out[1] = max(out[1], t + costs.detect_s + away_s)
            continue
        stalls.append((t, t + stall_s))
        current[group] = out = [t + stall_s, t + stall_s + away_s]
        outages.append(out)
    stalls += [(end, end + costs.peer_wait_s) for _, end in outages]
    voting = costs.step_s / (costs.step_s + costs.quorum_s)
    return voting * _trained_s(stalls, outages, horizon_s, replicas) / horizon_s


def _trained_s(stalls: list, outages: list, horizon_s: float, replicas: int) -> float:
    """Seconds of whole-job training in [0, horizon_s): none while any stall lasts, (replicas - out) /
    replicas while groups are out."""
    events = sorted([(s, 1, 0) for s, _ in stalls] + [(e, -1, 0) for _, e in stalls]
                    + [(s, 0, 1) for s, _ in outages] + [(e, 0, -1) for _, e in outages])
    trained = last = 0.0
    stalled = out = 0
    for t, stall_step, out_step in events + [(horizon_s, 0, 0)]:
        t = min(t, horizon_s)
        if not stalled:
            trained += (t - last) * (replicas - out) / replicas
        last, stalled, out = t, stalled + stall_step, out + out_step
    return trained


def monte_carlo(gpus: int, failures_per_gpu_hour: float, costs: Costs, gpus_per_replica: int = GPUS_PER_REPLICA,
                checkpoint_every_s: float | None = None, runs: int = 20, failures_per_run: int = 1000,
                seed: int = 0) -> dict:
    """Both ways played over `runs` random failure schedules, each as long as `failures_per_run` MTBFs.

    Args:
        gpus: GPUs in the job, a multiple of gpus_per_replica.
        failures_per_gpu_hour: each GPU's failure rate.
        costs: the step and failure costs.
        gpus_per_replica: GPUs (b) loses with one (8: a node).
        checkpoint_every_s: (a)'s interval. Default None: Young/Daly's.
        runs: independent schedules, at least 2 (20).
        failures_per_run: expected failures in each (1000).
        seed: the schedules' seed, with `gpus` (0).

    Returns:
        dict: restart and heal, each (mean goodput, its standard error over the runs); both ways see the
        same schedules.
    """
    replicas = replica_groups(gpus, gpus_per_replica)
    check_int("runs", runs, 2)
    check_int("failures_per_run", failures_per_run, 1)
    mtbf_s = job_mtbf_s(gpus, failures_per_gpu_hour)
    interval = checkpoint_interval_s(costs, mtbf_s, checkpoint_every_s)
    rng = random.Random(f"{seed}/{gpus}")
    horizon_s = failures_per_run * mtbf_s
    restart, heal = [], []
    for _ in range(runs):
        schedule = failure_schedule(rng, gpus, failures_per_gpu_hour, horizon_s)
        restart.append(simulate_restart(schedule, horizon_s, costs, interval))
        heal.append(simulate_heal(schedule, horizon_s, costs, gpus_per_replica, replicas))
    return {name: (statistics.fmean(values), statistics.stdev(values) / math.sqrt(runs))
            for name, values in (("restart", restart), ("heal", heal))}


def replica_groups(gpus: int, gpus_per_replica: int) -> int:
    """gpus / gpus_per_replica, if whole and at least 2 (a healer needs a live peer), else ValueError."""
    check_int("gpus", gpus, 1)
    check_int("gpus_per_replica", gpus_per_replica, 1)
    if gpus % gpus_per_replica:
        raise ValueError(f"gpus={gpus} must be a multiple of gpus_per_replica={gpus_per_replica}")
    if gpus // gpus_per_replica < 2:
        raise ValueError(f"gpus={gpus} makes {gpus // gpus_per_replica} replica of gpus_per_replica="
                         f"{gpus_per_replica}: healing needs a live peer, at least 2 replicas")
    return gpus // gpus_per_replica

