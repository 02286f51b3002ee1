"""What only a GPU shows (marked gpu: skipped without CUDA): streams, host syncs and the timeline's GPU start.

A section each: the hook's exchange on a side stream, and with it SyncBatchNorm beside a compression
hook on NCCL with two GPUs (the hook's collectives, from its worker thread, and SyncBatchNorm's, from
autograd, interleave: they must not hang); RandomK's generator after a resume on another GPU (with
test_comm_gpu.py); CupyNccl on its own stream; a step, Sign and PowerSGD without a
host sync (one stalls the host until the GPU has drained, every step); the timeline's start event taken
at launch. "Sleep" is torch.cuda._sleep: GPU time on a stream while the host goes on, a slow peer made
visible.
"""
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import Loopback, run_ranks
from minidp import comm
from minidp.comm.sign import pack_bits, unpack_signs
from minidp.engine.failures import status_on_host
from minidp.engine.hooks import GradBucket
from minidp.engine.timeline import bucket_spans
from models import build

pytestmark = pytest.mark.gpu
SLEEP = 400_000_000  # cycles: ~0.2 s at 2 GHz
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


class SleepOnCurrentStream(Loopback):
    """One rank; each collective first sleeps on the current stream (which it records): a slow peer."""

    def __init__(self, cycles=SLEEP):
        self.cycles, self.streams = cycles, []

    def _done(self, tensor):
        if not tensor.is_cuda:  # the same method on CPU tensors: the identity
            return super()._done(tensor)
        self.streams.append(torch.cuda.current_stream(tensor.device))
        torch.cuda._sleep(self.cycles)
        fut = torch.futures.Future(devices=[tensor.device])
        fut.set_result(tensor)  # stream semantics: wait() makes the waiting stream wait for the sleep
        return fut


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _bucket(device, shapes=((20, 30), (10, 40)), seed=0):
    params = [nn.Parameter(torch.zeros(s, device=device)) for s in shapes]
    numels = [p.numel() for p in params]
    buffer = torch.randn(sum(numels), generator=torch.Generator().manual_seed(seed)).to(device)
    return GradBucket(0, buffer, params, [0, numels[0]], is_last=True)


def _passed(stream) -> bool:
    """Whether the GPU is past everything queued on `stream` so far (an event recorded now has completed)."""
    event = torch.cuda.Event()
    event.record(stream)
    return event.query()


def _no_sync(fn):
    """fn() with any host sync raising (torch.cuda.set_sync_debug_mode('error'), every thread)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- the hook's exchange on its own side stream ---------------------------------------------------

def test_the_hooks_exchange_runs_on_a_side_stream_and_the_compute_stream_waits_only_at_the_future():
    device, transport = _device(), SleepOnCurrentStream()
    state, hook = comm.compression_hook(comm.FP16(), transport=transport)
    bucket = _bucket(device)
    expected = bucket.buffer().half().float()  # world size 1: FP16's round trip
    compute = torch.cuda.current_stream(device)
    torch.cuda.synchronize()
    future = hook(state, bucket)
    state._queue.join()  # the worker has queued the exchange (and its sleep) on the GPU
    assert transport.streams and transport.streams[0] != compute
    assert _passed(compute), "the compute stream waits on the exchange before the future is waited on"
    assert not _passed(transport.streams[0])  # the side stream is still in the sleep
    result = future.wait()  # now, and only now, the compute stream waits on the side stream
    assert not _passed(compute)
    torch.cuda.synchronize()
    assert torch.equal(result, expected)
    state.close()


def _syncbn_beside_hook_on_nccl():
    env = minidp.init(backend="nccl", timeout=60)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    model = minidp.DDP(minidp.convert_sync_batchnorm(net).to(env.device), device_ids=[env.device.index],
                       bucket_cap_mb=0.001)
    state, hook = comm.compression_hook(comm.PowerSGD(1), memory=comm.ErrorFeedback(), start_iter=2)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(30):  # the hook's collectives (worker thread) and SyncBatchNorm's (autograd) interleave
        x = torch.randn(8, 3, 16, 16, generator=gen).to(env.device)
        y = torch.randint(0, 10, (8,), generator=gen).to(env.device)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    parts = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(parts, flat)
    state.close()
    return torch.equal(parts[0], parts[1])


@two_gpus
def test_syncbatchnorm_beside_a_compression_hook_on_nccl_does_not_hang():
    assert run_ranks(_syncbn_beside_hook_on_nccl, 2, init=False, timeout=180) == [True, True]


# ---- RandomK's generator after a resume on another GPU --------------------------------------------

def test_randomk_after_a_resume_on_another_gpu_draws_the_positions_the_run_would_have_drawn():
    first, last = torch.device("cuda", 0), torch.device("cuda", torch.cuda.device_count() - 1)
    state, hook = comm.compression_hook(comm.RandomK(0.1), transport=SleepOnCurrentStream(1))
    hook(state, _bucket(first, seed=0)).wait()
    saved = state.state_dict()
    going_on = hook(state, _bucket(first, seed=1)).wait().cpu()
    resumed, hook2 = comm.compression_hook(comm.RandomK(0.1), transport=SleepOnCurrentStream(1))
    resumed.load_state_dict(saved)
    assert torch.equal(hook2(resumed, _bucket(last, seed=1)).wait().cpu(), going_on)
    state.close()
    resumed.close()


# ---- CupyNccl on its own stream -------------------------------------------------------------------

def _cupy_stream_worker():
    env = minidp.init(backend="nccl", timeout=60)
    transport, compute = comm.CupyNccl(), torch.cuda.current_stream(env.device)
    x = torch.ones(1 << 20, device=env.device)
    torch.cuda.synchronize()
    with torch.cuda.stream(transport.stream):
        torch.cuda._sleep(SLEEP)  # the NCCL stream is busy: the all-reduce queues behind the sleep
    future = transport.all_reduce(x)
    free = _passed(compute)  # kernels queued on the compute stream now would run at once
    future.wait()
    waits = not _passed(compute)  # ... until the caller waits on the future
    torch.cuda.synchronize()
    return {"own_stream": transport.stream != compute, "compute_free": free, "waits_at_future": waits,
            "value": bool((x == 1).all())}


def test_cupy_nccl_runs_on_its_own_stream_and_the_caller_waits_at_the_future():
    pytest.importorskip("cupy")
    out = run_ranks(_cupy_stream_worker, 1, init=False, timeout=120)[0]
    assert all(out.values()), out


# ---- a step without a host sync ------------------------------------------------------------------

def _step(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


# name -> (engine, DDP keywords, comm hook or None). World size 1 on NCCL (one GPU): the transport or
# the hook gives minidp buckets there (no NaN flag: at world size 1 nobody else can fail).
SYNC_CASES = {
    "minidp transport": (minidp.DDP, {"transport": "TorchDist"}, None),
    "minidp hook": (minidp.DDP, {}, "allreduce"),
    "torch hook": (TorchDDP, {}, "allreduce"),
    "minidp find_unused status on host": (minidp.DDP, {"transport": "TorchDist",
                                                       "find_unused_parameters": True}, None),
    "minidp find_unused": (minidp.DDP, {"transport": "TorchDist", "find_unused_parameters": True},
                           None),
}


def _warmed(name: str, env, x, y):
    """SYNC_CASES[name]'s model and optimizer, after 3 steps (the rebuild's own host read among them)."""
    engine, kwargs, hook = SYNC_CASES[name]
    kwargs = {k: comm.TorchDist() if v == "TorchDist" else v for k, v in kwargs.items()}
    model = engine(build("mlp").to(env.device), device_ids=[env.device.index], **kwargs)
    if hook is not None:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    if name.endswith("on host"):
        status_on_host(model)  # the use counts on CPU tensors, a gloo group
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        _step(model, opt, x, y)
    return model, opt


def _host_syncs_worker():
    env = minidp.init(backend="nccl", timeout=60)
    x, y = torch.randn(4, 8, device=env.device), torch.randn(4, 4, device=env.device)
    out = {}
    for name in SYNC_CASES:
        model, opt = _warmed(name, env, x, y)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _step(model, opt, x, y)
                _step(model, opt, x, y)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out[name] = sum("synchroniz" in str(w.message) for w in caught)
    # Under "error" (any host sync raises), a step of each engine with a transport or hook runs.
    for name in ("minidp transport", "torch hook"):
        model, opt = _warmed(name, env, x, y)
        _no_sync(lambda: _step(model, opt, x, y))  # noqa: B023 (called at once)
        out[f"{name}, error mode"] = "ran"
    return out


def test_a_default_step_makes_no_host_sync_as_torch_ddps():
    out = run_ranks(_host_syncs_worker, 1, init=False, timeout=120)[0]
    assert out["minidp transport"] == out["minidp hook"] == out["torch hook"] == 0, out
    assert out["minidp find_unused status on host"] == 0, out
    assert out["minidp find_unused"] >= 1, out  # the control: its use counts are read on the host
    assert out["minidp transport, error mode"] == out["torch hook, error mode"] == "ran", out


# ---- Sign and PowerSGD on CUDA without host syncs ----------------------------------------------------

def test_sign_bit_packing_on_the_gpu_makes_no_host_sync_and_matches_the_cpu():
    bits = torch.rand(800, generator=torch.Generator().manual_seed(0)) > 0.5
    on_gpu = bits.to(_device())
    packed, signs = _no_sync(lambda: (pack_bits(on_gpu), unpack_signs(pack_bits(on_gpu), torch.float32)))
    assert torch.equal(packed.cpu(), pack_bits(bits))
    assert torch.equal(signs.cpu(), unpack_signs(pack_bits(bits), torch.float32))


def _reduce_one(hook, state, bucket):
    return hook(state, bucket).wait()


@pytest.mark.parametrize("make", [comm.Sign, lambda: comm.PowerSGD(1, min_compression_rate=0)],
                         ids=["Sign", "PowerSGD"])
def test_multi_round_methods_run_on_cuda_without_a_host_sync_and_as_on_the_cpu(make):
    """PowerSGD's new Q: torch's CPU draws, copied from pinned memory (same values, no host wait)."""
    results = {}
    for device in (torch.device("cpu"), _device()):
        state, hook = comm.compression_hook(make(), memory=comm.ErrorFeedback(), transport=SleepOnCurrentStream(1))
        run = functools.partial(_reduce_one, hook, state, _bucket(device))
        results[device.type] = (_no_sync(run) if device.type == "cuda" else run()).cpu()
        state.close()
    assert torch.allclose(results["cuda"], results["cpu"], rtol=1e-4, atol=1e-5)


# ---- the timeline's GPU start, taken at launch -------------------------------------------------------

def _timeline_current_stream_worker():
    env = minidp.init(backend="nccl", timeout=60)
    transport = SleepOnCurrentStream()
    model = minidp.DDP(build("mlp").to(env.device), device_ids=[env.device.index], transport=transport,
                       bucket_cap_mb=0.0005)
    x = torch.randn(4, 8, device=env.device)
    model(x).sum().backward()  # the first step: one bucket, then the rebuild
    timeline = model.enable_timeline()
    model(x).sum().backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP)
    end.record()
    torch.cuda.synchronize()
    return bucket_spans(timeline.snapshot()), start.elapsed_time(end) * 1e6


def test_the_timeline_spans_work_a_transport_queues_on_the_current_stream():
    spans, sleep_ns = run_ranks(_timeline_current_stream_worker, 1, init=False, timeout=120)[0]
    assert len(spans) > 1
    assert all(s["gpu_end"] - s["gpu_start"] >= 0.8 * sleep_ns for s in spans), (spans, sleep_ns)
