"""Does minidp.fully_shard hold what torch's FSDP2 holds per rank, as predicted, at FSDP2's step time?

    python benchmarks/memory/fully_shard.py            # world sizes 2 and 4, 25 M parameters (minutes)
    python benchmarks/memory/fully_shard.py --quick    # tiny model, world size 2 only (seconds; the smoke test:
                                                       # the five in one launch, so its peak RSS mixes them)

Configurations on `layers` x (Linear(width, width), Tanh) (shared/rank_memory.py's model, as
memory/zero.py), AdamW on each, each configuration in fresh forked CPU ranks of its own (gloo, one
thread a rank) so that peaks do not mix:

  ddp                torch DDP (gradient_as_bucket_view=True: the gradients are the buckets)
  torch_fsdp         torch's fully_shard on each Linear, then on the root, reshard_after_forward=True
  minidp_fsdp        minidp.fully_shard, the same calls
  torch_fsdp_keep    reshard_after_forward=False (FSDP's SHARD_GRAD_OP, ZeRO-2-like)
  minidp_fsdp_keep   the same with minidp's
  torch_hsdp         torch_fsdp on a (replicate 2, shard 2) mesh: HSDP (world size 4 only)
  minidp_hsdp        the same with minidp's (reported "not run" while minidp refuses a 2-D mesh)
  minidp_fsdp_sync   (a diagnostic, asked for by name) minidp_fsdp waiting for each collective's work
                     at once and dropping gloo's Work object, the tensors kept as long as before:
                     what gloo holds for a collective in flight, apart (RESULTS.md, issue 41)

How the bytes are counted: each rank samples what it holds at many points of a step (every module's
forward pre-hook, after the unit's gather, and forward hook, before its free: both prepended to the
engines' own hooks; every module's full backward pre-hook and backward hook; each gathered
parameter's post-accumulate-grad hook, when its full gradient is complete and not yet reduced; after
backward; after the optimizer step), for `steps` steps. A sample is the bytes of three kinds of tensors, each storage
once (a storage resized to 0, a freed gathered weight, counts 0):
  parameters  the module's parameters (the sharded DTensors' local tensors) and, for the FSDPs, every
              gathered per-parameter copy alive (minidp: each ShardedParam's `full`; torch: each
              FSDPParam's `all_gather_outputs`, read from FSDP2's internals: a benchmark may, minidp may not)
  gradients   the parameters' .grad (FSDP: the sharded DTensor's) and the gathered copies' .grad
              (full gradients waiting for their reduce-scatter; FSDP2's unsharded_accumulated_grad)
  optimizer   the AdamW state (moments and `step`s)
The peak is the sample with the largest sum; its three parts are printed. Apart from them ("comm",
the most over the samples, and "+comm", the most of the sum with them): the collectives' flat buffers
in flight (all-gather outputs, reduce-scatter inputs and minidp's outputs not yet waited; FSDP2's from
its internals). Not counted: activations and autograd's saved tensors: the process's peak RSS (VmHWM,
shared/memory.py's peak_mib) holds them all.

The prediction is minidp.study.memory_model.predict_peak(units, N, stage, k=8, weight_bytes=4,
grad_bytes=4) (fp32 weights and gradients, AdamW's two fp32 moments; units: one [weight, bias] per
Linear, in forward order): stage DDP for ddp, ZeRO-3 for reshard_after_forward=True (HSDP: replicate=2),
ZeRO-2 for False. It is the stage's shards plus the working set at the peak (one unit gathered, the
next one's all-gather output, one unit's full gradients, the previous unit's reduce-scatter input; for
ZeRO-2 every unit not yet through backward still gathered): its "total" is compared with "+comm", its
"without_buffers" with the count of parameters, gradients and optimizer state alone ("total"). minidp
holds a unit's reduce-scatter output as a buffer until the next unit waits for it (FSDP2 makes it
the gradient at once), so its "total" is that much (g U / N) under FSDP2's. "row" is
predict_memory's stage row, the ZeRO paper's, with no working set.

Then the step time: the five 1-D configurations in the same two processes, alternating every step (a barrier before
each), medians after warm-up; ratios minidp / torch FSDP2 (each reshard setting) and minidp / DDP.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(os.path.dirname(HERE), "shared")
for path in (HERE, SHARED):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from heartbeat import heartbeat  # noqa: E402  (shared/heartbeat.py: a line every 30 s while ranks run)
from rank_memory import alternate_every_step, build_model, launch_json, rss_mib, state_bytes, storage_bytes  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import minidp  # noqa: E402
from memory import peak_mib  # noqa: E402  (shared/memory.py: VmHWM on CPU)
from minidp.sharded.fsdp.state import state_of  # noqa: E402
from minidp.study.memory_model import predict_memory, predict_peak  # noqa: E402

TIMED = ("ddp", "torch_fsdp", "minidp_fsdp", "torch_fsdp_keep", "minidp_fsdp_keep")
HSDP = ("torch_hsdp", "minidp_hsdp")  # a (replicate 2, shard 2) mesh: world size 4 only
SYNC = "minidp_fsdp_sync"  # a diagnostic: minidp with every collective waited for at once (the RSS gap)
CONFIGS = TIMED + HSDP
STAGE = {"ddp": 0, "torch_fsdp": 3, "minidp_fsdp": 3, "torch_fsdp_keep": 2, "minidp_fsdp_keep": 2,
         "torch_hsdp": 3, "minidp_hsdp": 3, SYNC: 3}
STAGE_NAME = {0: "DDP", 2: "ZeRO-2", 3: "ZeRO-3"}
PAIRS = (("minidp_fsdp", "torch_fsdp"), ("minidp_fsdp_keep", "torch_fsdp_keep"),
         ("minidp_fsdp", "ddp"), ("minidp_fsdp_keep", "ddp"), ("torch_fsdp", "ddp"))
LR = 1e-3
BATCH = 4


def hsdp_mesh():
    """The (replicate 2, shard 2) mesh of 4 ranks: fully_shard on it is HSDP (FSDP2's)."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def synchronous_minidp() -> None:
    """For this process (a forked rank): minidp.fully_shard waits for each collective's work as soon
    as it starts it, and drops gloo's Work object then, as FSDP2 does on CPU (its reduce-scatter and
    its prefetching all-gather are synchronous there). Every tensor lives as long as before (the
    reduce-scatter's buffers until the next unit's post-backward, the prefetch's output until its
    copy-out); only the backend's own working memory of a collective (gloo's copy of a reduce-scatter's
    input, held by its Work object) is gone before backward goes on. A diagnostic of the RSS gap
    (RESULTS.md, issue 41); minidp's code is unchanged, two of its methods are wrapped here."""
    from minidp.sharded.fsdp.collectives import ReducesInFlight
    from minidp.sharded.fsdp.unit import Unit

    add, unshard = ReducesInFlight.add, Unit.unshard

    def finish_work(collective) -> None:
        if collective is not None and collective.work is not None:
            collective.work.wait()
            collective.work = None  # its wait() then skips the collective and does the rest

    def add_waited(self, reduce):
        finish_work(reduce)
        add(self, reduce)

    def unshard_waited(self, async_op=False):
        unshard(self, async_op)
        finish_work(self.gather)

    ReducesInFlight.add, Unit.unshard = add_waited, unshard_waited


def make(config: str, width: int, layers: int, mesh):
    """(model to call, optimizer)."""
    model = build_model(width, layers)
    if config in HSDP:
        mesh = hsdp_mesh()
    if config == SYNC:
        synchronous_minidp()
    if config == "ddp":
        model = TorchDDP(model, gradient_as_bucket_view=True)
    else:
        shard = minidp.fully_shard if config.startswith("minidp") else torch_fully_shard
        reshard = not config.endswith("_keep")
        for m in model:
            if isinstance(m, nn.Linear):
                shard(m, mesh=mesh, reshard_after_forward=reshard)
        shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def gathered(model) -> tuple[list, list, list, list]:
    """(gathered parameter copies, their gradients, the collectives' flat buffers in flight, the
    gathered parameters autograd accumulates into) an FSDP holds now, minidp's or torch's."""
    params, grads, comm, leaves = [], [], [], []
    for m in model.modules():
        state = state_of(m)
        if state is not None and state.unit is not None:  # minidp
            for p in state.unit.params:
                params.append(p.full)
                leaves.append(p.unsharded)
                grads += [None if p.unsharded is None else p.unsharded.grad, p.accumulated]
            comm += [None if state.unit.gather is None else state.unit.gather.output]
        if state is not None and m is model and state.root is not None:  # minidp's, under its root
            comm += [t for r in state.root.reduces.pending for t in (r.scatter, r.mine)]
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is not None:  # torch's FSDP2: its internals
            for group in get_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    params += list(fp.all_gather_outputs)
                    unsharded = getattr(fp, "_unsharded_param", None)
                    grads += [None if unsharded is None else unsharded.grad,
                              fp.unsharded_accumulated_grad]
                    leaves.append(unsharded)
                result = group._all_gather_result
                comm += [None if result is None else result.all_gather_output]
                ctx = group.comm_ctx
                comm += [s.reduce_scatter_input for s in getattr(ctx, "reduce_scatter_states", [])]
                state = getattr(ctx, "all_gather_state", None)
                comm += [None if state is None else state.all_gather_result.all_gather_output]
                reduce = getattr(group, "_all_reduce_state", None)  # HSDP: its sharded gradient
                comm += [None if reduce is None else reduce.all_reduce_input]
    return params, grads, comm, [p for p in leaves if p is not None]


class Sampler:
    """What a rank holds, sampled at hooks: the sample with the most bytes (see the docstring)."""

    def __init__(self, model, opt):
        self.model, self.opt, self.peak = model, opt, {"total": 0, "comm_max": 0, "with_comm_max": 0}
        self.sharded = list(model.parameters())
        self.hooked = set()  # gathered parameters with a post-accumulate-grad hook (sample)
        for m in model.modules():
            m.register_forward_pre_hook(lambda *a: self.sample("forward"), prepend=True)
            m.register_forward_hook(lambda *a: self.sample("forward"), prepend=True)
            if not isinstance(m, (TorchDDP, nn.Sequential)):
                m.register_full_backward_pre_hook(lambda *a: self.sample("backward"))
                m.register_full_backward_hook(lambda *a: self.sample("backward"))

    def sample(self, where: str) -> None:
        seen = set()
        current = [p for m in self.model.modules() for p in m._parameters.values()]
        more_params, more_grads, comm, leaves = gathered(self.model)
        for leaf in leaves:  # also sample as each full gradient is complete, before its reduce-scatter
            if id(leaf) not in self.hooked:
                self.hooked.add(id(leaf))
                leaf.register_post_accumulate_grad_hook(lambda p: self.sample("grad"))
        params = storage_bytes(self.sharded + current + more_params, seen)
        grads = storage_bytes([p.grad for p in self.sharded + current] + more_grads, seen)
        comm = storage_bytes(comm, seen)
        state = state_bytes(self.opt)
        optimizer = state["moments"] + state["step"]
        total = params + grads + optimizer
        self.peak["comm_max"] = max(self.peak.get("comm_max", 0), comm)
        if total + comm > self.peak["with_comm_max"]:
            self.peak.update(with_comm_max=total + comm, with_comm_where=where)
        if total > self.peak["total"]:
            self.peak.update(total=total, params=params, grads=grads, optimizer=optimizer, where=where)


def step(model, opt, x, y, sampler=None) -> None:
    nn.functional.mse_loss(model(x), y).backward()
    if sampler is not None:
        sampler.sample("after backward")
    opt.step()
    if sampler is not None:
        sampler.sample("after step")
    opt.zero_grad()


def _quiet() -> None:
    """The sampler's full backward hooks make torch warn (the first Linear's input needs no grad; the
    root returns the hook's view): not the engines' doing."""
    for message in ("Full backward hook is firing", "FSDP2-wrapped module"):
        warnings.filterwarnings("ignore", message=message)


def _memory_rank(local_rank, configs, width, layers, steps, out_path):
    """Each configuration of `configs` in turn (one, but for --quick: its peak RSS then mixes them)."""
    torch.set_num_threads(1)
    _quiet()
    start_rss = rss_mib()
    minidp.init(backend="gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x, y = torch.randn(BATCH, width), torch.randn(BATCH, width)
    mine = []
    for config in configs:
        try:
            model, opt = make(config, width, layers, mesh)
        except NotImplementedError:  # minidp.fully_shard without HSDP (a 2-D mesh) yet
            mine.append(None)
            continue
        sampler = Sampler(model, opt)
        for _ in range(steps):
            step(model, opt, x, y, sampler)
        mine.append({"peak": sampler.peak, "state": state_bytes(opt), "start_rss_mib": start_rss,
                     "peak_mib": peak_mib(torch.device("cpu")), "rss_mib": rss_mib()})
        del model, opt, sampler
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # ranks meet here
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump([None if everyone[0][i] is None else [ranks[i] for ranks in everyone]
                       for i in range(len(configs))], f)
    minidp.shutdown()


def _timing_rank(local_rank, width, layers, steps, warmup, out_path):
    torch.set_num_threads(1)
    minidp.init(backend="gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    engines = {config: make(config, width, layers, mesh) for config in TIMED}
    x, y = torch.randn(BATCH, width), torch.randn(BATCH, width)
    times = alternate_every_step(engines, step, x, y, steps, warmup)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    minidp.shutdown()


def predicted(config: str, n: int, width: int, layers: int) -> dict:
    """predict_peak for `config` at world size n: fp32 weights and gradients, AdamW's two moments."""
    units = [[width * width, width]] * layers  # one unit per Linear, in forward order; the root holds none
    return predict_peak(units, n, STAGE_NAME[STAGE[config]], k=8, weight_bytes=4, grad_bytes=4,
                        replicate=2 if config in HSDP else 1)


def memory_table(args, params: int) -> list:
    """Run every configuration at every world size; print the table; return its rows."""
    header = (f"{'N':>2} {'config':<17} {'params':>7} {'grads':>7} {'optim':>7} {'total':>7} "
              f"{'pred':>7} {'over':>6} {'+comm':>7} {'pred':>7} {'over':>6} {'row':>7} "
              f"{'peak at':>10} {'peak RSS':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    for n in args.world_sizes:
        row_pred = predict_memory(params, n, k=8, weight_bytes=4, grad_bytes=4)
        configs = [c for c in args.configs if n == 4 or c not in HSDP]  # HSDP: a 2 x 2 mesh
        # one launch per configuration, so that peaks do not mix; --quick: one launch for all
        groups = [configs] if args.quick else [[c] for c in configs]
        measured = []
        for g in groups:
            with heartbeat(f"N={n} {', '.join(g)}: {args.steps} sampled steps on {n} ranks"):
                measured += launch_json(_memory_rank, n, (g, args.width, args.layers, args.steps))
        for config, ranks in zip(configs, measured):
            if ranks is None:
                print(f"{n:>2} {config:<17} not run: minidp.fully_shard refused the 2-D mesh", flush=True)
                continue
            top = max(ranks, key=lambda r: r["peak"]["total"])["peak"]
            pred = predicted(config, n, args.width, args.layers)
            row = row_pred[STAGE[config]]["total"] if config not in HSDP else \
                predict_memory(params, n // 2, k=8, weight_bytes=4, grad_bytes=4)[STAGE[config]]["total"]
            rss = max(r["peak_mib"] for r in ranks)
            with_comm = max(r["peak"]["with_comm_max"] for r in ranks)
            rows.append({"world_size": n, "config": config, "peaks": [r["peak"] for r in ranks],
                         "state": [r["state"] for r in ranks], "predicted_bytes": row,
                         "predicted_row": row_pred[STAGE[config]]["name"], "predict_peak": pred,
                         "peak_rss_mib": rss, "rss_at_end_mib": max(r["rss_mib"] for r in ranks),
                         "start_rss_mib": max(r["start_rss_mib"] for r in ranks),
                         "malloc": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}})
            mib = lambda b: f"{b / 2**20:7.1f}"  # noqa: E731
            print(f"{n:>2} {config:<17} {mib(top['params'])} {mib(top['grads'])} {mib(top['optimizer'])} "
                  f"{mib(top['total'])} {mib(pred['without_buffers'])} "
                  f"{top['total'] / pred['without_buffers'] - 1:+6.1%} {mib(with_comm)} {mib(pred['total'])} "
                  f"{with_comm / pred['total'] - 1:+6.1%} {mib(row)} {top['where']:>10} {rss:8.1f}",
                  flush=True)
    return rows


def compare(rows: list) -> None:
    """minidp against torch's FSDP2: the optimizer state rank by rank, the peaks."""
    for n in sorted({r["world_size"] for r in rows}):
        by = {r["config"]: r for r in rows if r["world_size"] == n}
        for mine, theirs in (*PAIRS[:2], ("minidp_hsdp", "torch_hsdp"), (SYNC, "torch_fsdp")):
            if mine not in by or theirs not in by:
                continue
            a, b = by[mine], by[theirs]
            same = [s["moments"] for s in a["state"]] == [s["moments"] for s in b["state"]]
            ta, tb = (max(p["total"] for p in r["peaks"]) for r in (a, b))
            print(f"N={n} {mine} / {theirs}: optimizer state per rank equal rank by rank: {same}; "
                  f"peak tensor bytes {ta / 2**20:.1f} / {tb / 2**20:.1f} MiB = {ta / tb:.3f}; "
                  f"peak RSS {a['peak_rss_mib']:.1f} / {b['peak_rss_mib']:.1f} MiB = "
                  f"{a['peak_rss_mib'] / b['peak_rss_mib']:.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, world size 2 only")
    p.add_argument("--width", type=int, default=2048, help="Linear width (default 2048)")
    p.add_argument("--layers", type=int, default=6, help="Linear layers, one unit each (default 6: 25.2 M)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=(*CONFIGS, SYNC),
                   help=f"default: all but {SYNC} (a diagnostic: minidp waiting for each collective at once)")
    p.add_argument("--steps", type=int, default=3, help="sampled steps per configuration (default 3)")
    p.add_argument("--no-timing", action="store_true", help="skip the step-time comparison")
    p.add_argument("--time-world-size", type=int, default=2)
    p.add_argument("--time-steps", type=int, default=40, help="timed steps per engine (default 40)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", help="also write every number here")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.world_sizes, args.steps = 128, 4, [2], 2
        args.time_steps, args.warmup = 6, 2
    params = sum(q.numel() for q in build_model(args.width, args.layers).parameters())
    print(f"minidp from {os.path.dirname(minidp.__file__)}, torch {torch.__version__}; forked CPU ranks, "
          f"gloo, 1 thread each")
    print(f"model: {args.layers} x (Linear({args.width}, {args.width}), Tanh) = {params:,} parameters, "
          f"one unit per Linear; batch {BATCH}; AdamW; {args.steps} sampled steps")
    print("MiB per rank at the sampled peak (the rank with the most): params + grads + optim = total; "
          "pred = predict_peak(units, N, stage, k=8, weight_bytes=4, grad_bytes=4)['without_buffers'] (stage: "
          "DDP, ZeRO-3 for reshard True and HSDP (replicate=2), ZeRO-2 for _keep); +comm = the most of "
          "total + the collectives' flat buffers in one sample, beside predict_peak's 'total'; over = "
          "measured / pred - 1; row = predict_memory's stage row (the paper's, no working set); "
          "peak RSS = max VmHWM")
    print()
    result = {"args": vars(args), "params": params, "memory": memory_table(args, params)}
    print()
    compare(result["memory"])
    if not args.no_timing:
        n = args.time_world_size
        with heartbeat(f"step time: {args.warmup} + {args.time_steps} steps of each of the five, alternating, "
                       f"on {n} ranks"):
            times = launch_json(_timing_rank, n, (args.width, args.layers, args.time_steps, args.warmup))
        result["step_ms"] = times
        print(f"step time, N={n}, {args.time_steps} timed steps each after {args.warmup}, the five "
              "alternating every step: median " + ", ".join(f"{k} {v:.1f} ms" for k, v in times.items()))
        print("ratios: " + ", ".join(f"{a} / {b} {times[a] / times[b]:.3f}" for a, b in PAIRS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
