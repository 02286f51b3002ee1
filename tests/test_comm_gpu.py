"""minidp.comm on CUDA (marked gpu: skipped without CUDA): the CuPy transport against torch's NCCL, compressors on CUDA.

Written for one GPU: NCCL at world size 1 (the CuPy transport next to torch's process group), and
two ranks sharing the GPU over gloo (which takes CUDA tensors for all-reduce).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import run_ranks
from minidp import comm
from minidp.comm.context import RandomStream
from models import build
from training import bitwise_equal, rank_batches, train

pytestmark = pytest.mark.gpu

COMPRESSORS = {"FP16": comm.FP16, "BF16": comm.BF16, "TopK": lambda: comm.TopK(0.05),
               "RandomK": lambda: comm.RandomK(0.05), "QSGD": lambda: comm.QSGD(16), "Sign": comm.Sign,
               "PowerSGD": lambda: comm.PowerSGD(1, min_compression_rate=0)}


def _train(engine, device, hook=None, steps=4, **ddp_kwargs):
    torch.backends.cudnn.deterministic = True
    module = build("mlp").to(device)
    model = engine(module, device_ids=[device.index], **ddp_kwargs)
    if hook is not None:
        model.register_comm_hook(*hook)
    batches = [(x.to(device), y.to(device)) for x, y in rank_batches(steps, dist.get_rank())]
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches)
    return [p.detach().cpu() for p in module.parameters()]


def _cupy_primitives(device):
    """CupyNccl's collectives against torch's NCCL ones, bitwise, in several dtypes; the wrong-device error."""
    transport, out = comm.CupyNccl(), {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        x = torch.randn(4099, device=device).to(dtype)
        ours, theirs = x.clone(), x.clone()
        transport.all_reduce(ours).wait()
        dist.all_reduce(theirs)
        out[f"all_reduce_{dtype}"] = torch.equal(ours, theirs)
    x = torch.arange(64, device=device, dtype=torch.uint8)
    gathered, exchanged = torch.empty_like(x), torch.empty_like(x)
    transport.all_gather(gathered, x).wait()
    transport.all_to_all(exchanged, x).wait()
    out["all_gather"], out["all_to_all"] = torch.equal(gathered, x), torch.equal(exchanged, x)
    try:
        transport.all_reduce(torch.ones(3))
        out["wrong_device"] = "no error"
    except ValueError as exc:
        out["wrong_device"] = str(exc)
    return out


def _world_of_one_nccl():
    minidp.init(backend="nccl", timeout=60)  # explicit: the suite's MINIDP_BACKEND says gloo
    device = torch.device("cuda", torch.cuda.current_device())
    out = {"backend": dist.get_backend(), "primitives": _cupy_primitives(device)}
    reference = _train(TorchDDP, device)
    for engine in (TorchDDP, minidp.DDP):  # the exact average over the CuPy transport, as a hook
        hooked = _train(engine, device, (comm.CupyNccl(), comm.allreduce_hook))
        out[f"allreduce_hook_{engine.__module__}"] = bitwise_equal(reference, hooked)
    # the engine's default path over it: minidp.DDP(model, transport=comm.CupyNccl())
    out["engine_transport"] = bitwise_equal(reference, _train(minidp.DDP, device, transport=comm.CupyNccl()))
    fp16 = _train(TorchDDP, device, (None, default_hooks.fp16_compress_hook))
    out["fp16_cupy"] = bitwise_equal(fp16, _train(minidp.DDP, device,
                                                  comm.compression_hook(comm.FP16(), transport=comm.CupyNccl())))
    for name, make in COMPRESSORS.items():
        for transport in (comm.CupyNccl, comm.TorchDist):
            state, hook = comm.compression_hook(make(), memory=comm.ErrorFeedback(), transport=transport())
            params = _train(minidp.DDP, device, (state, hook), bucket_cap_mb=0.002)
            stats = state.stats()
            out[(name, transport.__name__)] = (all(torch.isfinite(p).all() for p in params),
                                               stats["bytes_sent"] == state.bytes_analytical > 0, stats["steps"])
    return out


def test_cupy_transport_and_compressors_on_one_gpu():
    out = run_ranks(_world_of_one_nccl, 1, init=False, timeout=300)[0]
    assert out["backend"] == "nccl"
    prims = out.pop("primitives")
    assert all(v is True for k, v in prims.items() if k != "wrong_device"), prims
    assert "runs on tensors of cuda:" in prims["wrong_device"] and "got tensors on cpu" in prims["wrong_device"]
    for key, value in out.items():
        if isinstance(key, tuple):
            assert value == (True, True, 4), (key, value)
        elif key != "backend":
            assert value is True, (key, value)


def _two_ranks_on_one_gpu_over_gloo():
    env = minidp.init(backend="gloo", timeout=60)
    device = env.device
    out = {"exact": bitwise_equal(_train(TorchDDP, device), _train(minidp.DDP, device))}
    fp16 = _train(TorchDDP, device, (None, default_hooks.fp16_compress_hook))
    for engine in (TorchDDP, minidp.DDP):
        hooked = _train(engine, device, comm.compression_hook(comm.FP16()))
        out[f"fp16_{engine.__module__}"] = bitwise_equal(fp16, hooked)
    return out


def test_two_ranks_on_one_gpu_over_gloo():
    for out in run_ranks(_two_ranks_on_one_gpu_over_gloo, 2, init=False, timeout=300):
        assert all(out.values()), out


def test_the_hooks_generator_goes_on_from_its_saved_state_on_any_gpu():
    """The state's generator is not keyed by device: saved on cuda:0, it goes on on the last GPU (another index
    where there are two; the old per-device generators restarted their stream there, silently)."""
    stream = RandomStream(3)
    first = torch.device("cuda", 0)
    torch.rand(4, generator=stream.on(first), device=first)
    saved = stream.state_dict()
    expected = torch.rand(4, generator=stream.on(first), device=first).cpu()
    resumed = RandomStream(3)
    resumed.load_state_dict(saved)
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    assert torch.equal(torch.rand(4, generator=resumed.on(last), device=last).cpu(), expected)
