"""A step costs what torch DDP's step costs: the same collectives, and no host read on the default step.

torch's profiler records every c10d collective (`c10d::allreduce_`, `c10d::broadcast_`, ...), whether
minidp's Python or torch DDP's C++ reducer issued it, so both engines are counted the same way: one
synced step (forward, backward, optimizer step) after the bucket rebuild, on every rank. Under a comm
hook a step issues the hook's collectives and nothing more (minidp's failure protocol adds none,
engine/failures.py), and a local step of local SGD or DiLoCo issues none.

Host reads: on a GPU, reading a device value on the host (`.item()`, `.tolist()`, `bool(t)`) waits
for the device. The default step makes none from minidp's code: counted here, on the CPU, by
catching every such read (the dispatcher's `_local_scalar_dense`, and `Tensor.tolist`) made while a
frame of minidp/ is on the stack.
"""
import functools
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import minidp
from harness import run_ranks
from minidp import comm
from models import MLP, CNNWithBatchNorm, UnusedBranch

WARM_STEPS = 3  # the first step, the rebuild before the second, then steady steps
ALL_THREADS = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
MINIDP = os.path.dirname(os.path.abspath(minidp.__file__))

# name -> (model builder, input shape, DDP keywords); each runs under both engines
CASES = {
    "default": (MLP, (8,), {}),
    "small_buckets": (lambda: MLP(width=64), (8,), {"bucket_cap_mb": 0.01}),
    "buffers": (CNNWithBatchNorm, (3, 4, 4), {}),
    "bucket_view": (MLP, (8,), {"gradient_as_bucket_view": True}),
    "find_unused": (UnusedBranch, (8,), {"find_unused_parameters": True}),
}


def _powersgd(group):
    # start_powerSGD_iter=2 (torch's minimum): steady steps compress; rank-1 tensors all-reduced
    return torch_powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2), torch_powersgd.powerSGD_hook


# name -> (group -> (state, hook)): the same hook on both engines, registered before training
HOOKS = {
    "torch_allreduce": lambda group: (group, default_hooks.allreduce_hook),
    "torch_fp16": lambda group: (group, default_hooks.fp16_compress_hook),
    "torch_bf16": lambda group: (group, default_hooks.bf16_compress_hook),
    "torch_powersgd": _powersgd,
    "comm_fp16": lambda group: comm.compression_hook(comm.FP16()),
    "comm_bf16": lambda group: comm.compression_hook(comm.BF16()),
    "comm_topk_ef": lambda group: comm.compression_hook(comm.TopK(0.1), memory=comm.ErrorFeedback()),
    "comm_randomk": lambda group: comm.compression_hook(comm.RandomK(0.1)),
    "comm_qsgd": lambda group: comm.compression_hook(comm.QSGD(16)),
    "comm_sign_ef": lambda group: comm.compression_hook(comm.Sign(), memory=comm.ErrorFeedback()),
    "comm_powersgd": lambda group: comm.compression_hook(comm.PowerSGD(2)),
}

# name -> (model, outer optimizer or None) -> an object whose step() follows the optimizer's;
# the counted step is a local one (no averaging due): its hook issues no collective
LOCAL = {
    "local_sgd": lambda model: comm.PeriodicAverager(model, period=100),
    "diloco": lambda model: comm.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.7), period=100),
    "streaming_diloco": lambda model: comm.StreamingDiLoCo(
        model, torch.optim.SGD(model.parameters(), lr=0.7), period=100, fragments=2),
}


def _collectives(prof) -> dict:
    counts = {}
    for event in prof.events():
        if event.name.startswith("c10d::") and event.name != "c10d::barrier":
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def _collectives_of_one_step(engine, build, shape, kwargs, hook=None, local=None) -> dict:
    """{collective op name: count} for one step after WARM_STEPS, on this rank."""
    torch.manual_seed(0)
    model = engine(build(), **kwargs)
    if hook is not None:
        model.register_comm_hook(*hook(None))
    after_step = local(model).step if local is not None else (lambda: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, *shape), torch.randn(4, 4)

    def step():
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        after_step()

    for _ in range(WARM_STEPS):
        step()
    # every thread: a hook's later collectives start in its futures' callbacks, on gloo's threads
    with profile(activities=[ProfilerActivity.CPU], experimental_config=ALL_THREADS) as prof:
        step()
        dist.barrier()  # ranks meet here: every callback of the step has run (outside the count)
    return _collectives(prof)


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host made while a frame of minidp/ is on the stack."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero):
            self.note(str(func))
        return func(*args, **(kwargs or {}))

    def note(self, what: str) -> None:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.startswith(MINIDP):
                self.reads.append(f"{what} in {frame.f_code.co_filename}:{frame.f_lineno}")
                return
            frame = frame.f_back


def _host_reads_of_one_step(build, shape, kwargs, hook=None) -> list:
    """The host reads minidp's code makes in one steady step (forward, backward, optimizer step)."""
    torch.manual_seed(0)
    model = minidp.DDP(build(), **kwargs)
    if hook is not None:
        model.register_comm_hook(*hook(None))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, *shape), torch.randn(4, 4)
    for _ in range(WARM_STEPS):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    counter = HostReads()
    tolist = torch.Tensor.tolist

    @functools.wraps(tolist)
    def counted_tolist(self):
        counter.note("Tensor.tolist")
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.Tensor.tolist = tolist
    return counter.reads


def _worker():
    engines = {"minidp": minidp.DDP, "torch": TorchDDP}
    out = {"cases": {name: {key: _collectives_of_one_step(engine, build, shape, kwargs)
                            for key, engine in engines.items()}
                     for name, (build, shape, kwargs) in CASES.items()}}
    out["hooks"] = {name: {key: _collectives_of_one_step(engine, MLP, (8,), {}, hook=hook)
                           for key, engine in engines.items()}
                    for name, hook in HOOKS.items()}
    out["local"] = {name: {key: _collectives_of_one_step(engine, MLP, (8,), {}, local=local)
                           for key, engine in engines.items()}
                    for name, local in LOCAL.items()}
    out["reads"] = {name: _host_reads_of_one_step(build, shape, kwargs)
                    for name, (build, shape, kwargs) in CASES.items()}
    out["reads"]["torch_allreduce_hook"] = _host_reads_of_one_step(MLP, (8,), {},
                                                                   HOOKS["torch_allreduce"])
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def counted(request):
    return run_ranks(_worker, request.param, timeout=240)


@pytest.mark.parametrize("kind,name", [("cases", c) for c in CASES] + [("hooks", h) for h in HOOKS])
def test_a_step_issues_the_collectives_torch_ddp_issues(counted, kind, name):
    """A step after the rebuild, per mode, and under each comm hook: the hook's collectives only."""
    for rank, result in enumerate(counted):
        ours, theirs = result[kind][name]["minidp"], result[kind][name]["torch"]
        assert sum(theirs.values()) > 0, f"{name}: torch DDP issued no collective: the count sees nothing"
        assert ours == theirs, f"{name}, rank {rank}: minidp {ours}, torch DDP {theirs}"


@pytest.mark.parametrize("method", list(LOCAL))
def test_a_local_step_issues_no_collective(counted, method):
    for rank, result in enumerate(counted):
        assert result["local"][method] == {"minidp": {}, "torch": {}}, (method, rank)


@pytest.mark.parametrize("case", [c for c in CASES if c != "find_unused"] + ["torch_allreduce_hook"])
def test_a_default_step_reads_nothing_on_the_host(counted, case):
    for rank, result in enumerate(counted):
        assert result["reads"][case] == [], f"{case}, rank {rank}: {result['reads'][case]}"


def test_the_host_read_count_sees_a_read(counted):
    """find_unused_parameters reads its use counts on the host (so does torch DDP's step): seen."""
    for result in counted:
        reads = result["reads"]["find_unused"]
        assert len(reads) == 1 and "Tensor.tolist in" in reads[0] and "failures.py" in reads[0], reads
