"""What needs a GPU: collectives on the module's device, checkpoints loaded onto CUDA, SyncBatchNorm's
fused kernels against torch.nn.SyncBatchNorm, and the timeline's GPU lanes.

The @pytest.mark.gpu tests skip without CUDA (tests/conftest.py) and run on one GPU: NCCL at world
size 1, several ranks on one GPU through gloo, which takes CUDA tensors for all_gather/all_reduce
(torch.nn.SyncBatchNorm itself relies on that). The few tests that need 2 GPUs say so and skip.
The two unmarked tests check the timeline's GPU lanes on CPU, with made-up CUDA events.
"""
import copy
import random
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import minidp
import minidp.train.syncbn as syncbn
from harness import run_ranks
from minidp.engine import timeline as timeline_module
from minidp.engine.collectives import all_gather_objects, check_same_across_ranks
from minidp.engine.timeline import GPU_LANE, GPU_TID0, HOST_LANE, Timeline, bucket_spans, trace_events
from models import build

F64 = torch.float64
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _deterministic():
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


# ---- timeline: GPU lanes (CPU, made-up events) --------------------------------------------------

def test_timeline_gpu_lanes_in_spans_and_trace():
    ms = 1_000_000
    events = [("launch", 1 * ms, {"bucket": 0}), ("done", 1 * ms + 50, {"bucket": 0}),
              ("gpu_start", 2 * ms, {"bucket": 0}), ("gpu_end", 5 * ms, {"bucket": 0})]
    (span,) = bucket_spans(events)
    assert (span["launch"], span["done"], span["gpu_start"], span["gpu_end"]) == (ms, ms + 50, 2 * ms, 5 * ms)
    trace = trace_events(events)
    lanes = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes[GPU_TID0] == f"bucket 0: {GPU_LANE}" and HOST_LANE in lanes[timeline_module.BUCKET_TID0]
    gpu = next(e for e in trace if e.get("name") == "all-reduce bucket 0 (GPU)")
    assert (gpu["tid"], gpu["ts"], gpu["dur"]) == (GPU_TID0, 1000.0, 3000.0)  # microseconds from the launch


class _FakeEvent:
    """torch.cuda.Event on a made-up GPU clock: the host clock plus 7 s."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter_ns() + 7_000_000_000

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) / 1e6


def test_timeline_watch_puts_cuda_events_on_the_host_clock(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    timeline, future = Timeline(), torch.futures.Future()
    before_watch = time.perf_counter_ns()
    timeline.watch(future, device="cuda:0", bucket=2)
    before_done = time.perf_counter_ns()
    future.set_result(torch.ones(1))
    after_done = time.perf_counter_ns()
    events = {kind: stamp for kind, stamp, _ in timeline.snapshot()}
    assert set(events) == {"done", "gpu_start", "gpu_end"}
    slack = 1_000_000  # the anchor's host time is the middle of a record .. synchronize round trip
    assert before_watch - slack <= events["gpu_start"] <= before_done + slack
    assert before_done - slack <= events["gpu_end"] <= after_done + slack
    assert timeline.snapshot() == sorted(timeline.snapshot(), key=lambda e: e[1])  # converted once, kept


def test_reducer_recorder_takes_the_gpu_start_at_launch_before_the_work_is_queued(monkeypatch):
    """A transport on the current stream queues its work between launch() and watch(): a start event
    recorded in watch() would follow that work and leave it out of the bucket's GPU time, so launch()
    records it."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    timeline, future = Timeline(), torch.futures.Future()
    recorder = timeline_module.ReducerRecorder(timeline, torch.device("cuda", 0))
    before_launch = time.perf_counter_ns()
    recorder.launch(1, 0)  # iteration 1, bucket 0
    time.sleep(0.05)  # the work queued on the current stream (50 ms on the made-up GPU clock too)
    queued = time.perf_counter_ns()
    recorder.watch(0, future)
    future.set_result(torch.ones(1))
    events = {kind: stamp for kind, stamp, _ in timeline.snapshot()}
    slack = 1_000_000
    assert before_launch - slack <= events["gpu_start"] <= queued - 40_000_000  # taken at launch, not at watch
    assert events["gpu_end"] - events["gpu_start"] >= 45_000_000  # the span covers the queued work


# ---- timeline on a real GPU ------------------------------------------------------------------------

@pytest.mark.gpu
def test_timeline_times_the_gpu_work_not_the_enqueue():
    """A future that completes on the host at once while its GPU work runs 50+ ms (NCCL's case)."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.ones(1, device=device).sum().item()  # context up, nothing queued
    timeline, future = Timeline(), torch.futures.Future(devices=[device])
    timeline.record("launch", bucket=0)
    timeline.watch(future, device=device, bucket=0)
    work_start, work_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    work_start.record()
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time on the current stream
    work_end.record()
    future.set_result(torch.ones(1, device=device))  # the value is ready only after the sleep
    (span,) = bucket_spans(timeline.snapshot())
    work_ns = work_start.elapsed_time(work_end) * 1e6
    assert span["gpu_end"] - span["gpu_start"] >= work_ns - 2_000  # the GPU span covers the work
    assert span["done"] < span["gpu_end"]  # the host saw "done" long before the GPU finished
    assert span["done"] - span["launch"] < work_ns  # ... which is why the host lane is not the truth


def _ddp_timeline_worker():
    _deterministic()
    env = minidp.init(backend="nccl", timeout=60)
    model = minidp.DDP(build("mlp").to(env.device), device_ids=[env.device.index], bucket_cap_mb=0.0005)
    # World size 1 reduces nothing on the default path (no buckets); a comm hook gets every bucket.
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    for step in range(2):  # step 0 reduces one bucket (DDP's policy), step 1 the rebuilt layout
        timeline = model.enable_timeline() if step == 1 else None
        model(torch.randn(4, 8, device=env.device)).sum().backward()
    return bucket_spans(timeline.snapshot()), len(model.bucket_plan())


@pytest.mark.gpu
def test_ddp_timeline_on_nccl_has_a_gpu_span_per_bucket():
    # Needs the reducer to pass its bucket's device: timeline.watch(future, device=..., bucket=...).
    spans, n_buckets = run_ranks(_ddp_timeline_worker, 1, init=False)[0]
    assert n_buckets > 1 and len(spans) == n_buckets
    assert all(s["gpu_start"] is not None and s["gpu_start"] <= s["gpu_end"] for s in spans), spans


# ---- collectives, metrics and checkpoints on the module's device ---------------------------------

def _nccl_device_worker():
    env = minidp.init(backend="nccl", timeout=60)
    check_same_across_ranks("entry", [("a", (2, 3))], device=env.device)
    gathered = all_gather_objects({"rank": env.rank, "t": torch.arange(3)}, device=env.device)
    sums = minidp.all_reduce_sums({"n": torch.tensor(3, device=env.device), "loss": 0.5})
    return gathered[0]["rank"], torch.equal(gathered[0]["t"], torch.arange(3)), sums


@pytest.mark.gpu
def test_object_collectives_and_metrics_under_nccl():
    assert run_ranks(_nccl_device_worker, 1, init=False)[0] == (0, True, {"loss": 0.5, "n": 3})


def _never_set_device_worker(path):
    """torch's own init, no torch.cuda.set_device: every rank's current device stays cuda:0."""
    dist.init_process_group("nccl")  # env:// from minidp.launch's torchrun-style environment
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    check_same_across_ranks("entry", [("a", (2, 3))], device=device)  # ranks meet here
    gathered = all_gather_objects(rank, device=device)  # ranks meet here
    sums = minidp.all_reduce_sums({"n": torch.tensor(rank + 1, device=device)})  # ranks meet here
    model = minidp.DDP(build("mlp").to(device), device_ids=[rank])
    model(torch.randn(4, 8, device=device)).sum().backward()
    minidp.save_checkpoint(path, model, step=1)  # ranks meet here (RNG gather, barrier)
    return gathered, sums["n"], torch.cuda.current_device()


@pytest.mark.gpu
@two_gpus
def test_without_set_device_every_rank_stays_on_its_gpu(tmp_path):
    for rank, out in enumerate(run_ranks(_never_set_device_worker, 2, str(tmp_path / "c.pt"), init=False)):
        assert out == ([0, 1], 3, 0), (rank, out)


def _draws(device):
    return (torch.rand(3).tolist(), torch.rand(3, device=device).tolist(), random.random(),
            np.random.rand(2).tolist())


@pytest.mark.gpu
def test_checkpoint_loaded_onto_cuda_restores_rng_bitwise(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    model = build("mlp").to(device)
    path = tmp_path / "c.pt"
    minidp.save_checkpoint(path, model, step=3)
    saved_cuda_state = torch.cuda.get_rng_state(device)
    expected = _draws(device)
    _draws(device)  # move every generator on
    fresh = build("mlp").to(device)
    payload = minidp.load_checkpoint(path, fresh, map_location="cuda")
    assert _draws(device) == expected  # CPU, CUDA, python, numpy generators, bitwise
    (state,) = payload["rng"]
    assert state["torch"].is_cuda and torch.equal(state["cuda"].cpu(), saved_cuda_state)  # moved, yet restored
    assert all(p.is_cuda and torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))


# ---- SyncBatchNorm: fused kernels against torch.nn.SyncBatchNorm -----------------------------------

# (per-rank batch sizes, dtype, channels_last, momentum); bitwise where no rank is empty: the same
# kernels in the same order. With an empty rank torch drops it, we merge it last: mean within 1 ulp.
SYNCBN_CASES = [([2, 5], F64, False, None), ([3, 3], torch.float32, True, 0.1), ([0, 4], torch.float32, False, 0.1)]


def _syncbn_case(rank, sizes, dtype, channels_last, momentum, seed):
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda", torch.cuda.current_device())
    theirs = nn.SyncBatchNorm(3, momentum=momentum, dtype=dtype).to(device)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(3, generator=gen, dtype=dtype))
        theirs.bias.copy_(torch.randn(3, generator=gen, dtype=dtype))
    ours = syncbn.convert_sync_batchnorm(copy.deepcopy(theirs))
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    results = {"ours": [], "theirs": []}
    for _ in range(2):
        x = torch.randn(sum(sizes), 3, 4, 3, generator=gen, dtype=dtype)[lo:hi].to(device)
        g = torch.randn(sum(sizes), 3, 4, 3, generator=gen, dtype=dtype)[lo:hi].to(device)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        for name, m in (("ours", ours), ("theirs", theirs)):
            m.zero_grad()
            xi = x.clone().requires_grad_()
            y = m(xi)
            (y * g).sum().backward()
            # On an empty batch torch's gradients are None, ours zeros (DDP's hooks then fire on every rank).
            grads = [t if t is not None else torch.zeros_like(like)
                     for t, like in ((xi.grad, xi), (m.weight.grad, m.weight), (m.bias.grad, m.bias))]
            results[name] += [y.detach(), *grads, m.running_mean.clone(), m.running_var.clone()]
    return [(a - b).abs().max().item() if a.numel() else 0.0 for a, b in zip(results["ours"], results["theirs"])]


def _syncbn_worker():
    _deterministic()
    minidp.init(backend="gloo", timeout=60)  # two ranks on one GPU: NCCL needs one GPU per rank
    rank = dist.get_rank()
    return [_syncbn_case(rank, *case, seed=i) for i, case in enumerate(SYNCBN_CASES)]


@pytest.mark.gpu
def test_syncbn_matches_torch_syncbatchnorm():
    for rank, per_case in enumerate(run_ranks(_syncbn_worker, 2, init=False)):
        for case, diffs in zip(SYNCBN_CASES, per_case):
            empty_rank = 0 in case[0]
            assert all(d <= (1e-5 if empty_rank else 0.0) for d in diffs), (rank, case, diffs)


@pytest.mark.gpu
def test_syncbn_fused_path_makes_no_host_sync():
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(8, 3, 5, 5, device=device, requires_grad=True)
    weight, bias = torch.randn(3, device=device, requires_grad=True), torch.randn(3, device=device)
    running_mean, running_var = torch.zeros(3, device=device), torch.ones(3, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync below raises
    try:
        y = syncbn._FusedSyncBatchNormFn.apply(x, weight, bias, running_mean, running_var, 1e-5, 0.1, None)
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = nn.functional.batch_norm(x.detach(), None, None, weight.detach(), bias, True, 0.1, 1e-5)
    assert torch.allclose(y.detach(), expected, atol=1e-5) and x.grad is not None


# ---- fully_shard's CPU offload and HSDP on a GPU ----------------------------------------------

def _offload_worker(offload):
    """fully_shard on a CUDA mesh (NCCL, one rank), minidp's and torch's, 5 SGD steps; with
    CPUOffloadPolicy(pin_memory=True) the shards, their gradients and the optimizer state live on
    the CPU (pinned), the gathered weights and the compute on the GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    minidp.init(backend="nccl", timeout=60)
    mesh = init_device_mesh("cuda", (1,))
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=True)} if offload else {}
    out = {}
    for engine, shard in (("minidp", minidp.fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        shard(model[0], mesh=mesh, **policy)
        shard(model, mesh=mesh, **policy)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        seen = set()
        model[2].register_forward_hook(lambda module, args, output, seen=seen:
                                       seen.add(str(output.device)))
        for _ in range(5):
            x = torch.randn(4, 8, device="cuda")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        p = next(model.parameters())
        out[engine] = {"full": [q.full_tensor().cpu() for q in model.parameters()],
                       "shard": (str(p.device), p.to_local().is_pinned()),
                       "grad": str(p.grad.device), "compute": sorted(seen),
                       "state": str(opt.state[p]["exp_avg"].device)}
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True], ids=["on-gpu", "cpu-offload"])
def test_fully_shard_cpu_offload_on_cuda_as_fsdp2(offload):
    out = run_ranks(_offload_worker, 1, offload, init=False)[0]
    mine, theirs = out["minidp"], out["torch"]
    assert all(torch.equal(a, b) for a, b in zip(mine["full"], theirs["full"]))
    assert {k: v for k, v in mine.items() if k != "full"} == \
        {k: v for k, v in theirs.items() if k != "full"}
    home = "cpu" if offload else "cuda:0"
    assert mine["shard"] == (home, offload) and mine["grad"] == home and mine["state"] == home
    assert mine["compute"] == ["cuda:0"]


def _hsdp_cuda_worker():
    """HSDP on CUDA tensors through gloo (4 ranks on one GPU), minidp's against torch's, 5 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    minidp.init(backend="gloo", timeout=60)
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))
    full = {}
    for engine, shard in (("minidp", minidp.fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 3))
        shard(model[0], mesh=mesh)
        shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(5):
            model(torch.randn(4, 8, generator=gen).cuda()).sum().backward()
            opt.step()
            opt.zero_grad()
        full[engine] = [p.full_tensor().cpu() for p in model.parameters()]
    return all(torch.equal(a, b) for a, b in zip(full["minidp"], full["torch"]))


@pytest.mark.gpu
def test_fully_shard_hsdp_on_cuda_tensors_as_fsdp2():
    assert run_ranks(_hsdp_cuda_worker, 4, init=False) == [True] * 4
