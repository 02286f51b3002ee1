"""Inputs moved to the module's device as torch DDP moves them (device_ids), and device checks.

The moving logic is compared with torch's own (`torch.distributed.utils._recursive_to`) on the CPU,
moving to the "meta" device (a real device change, no GPU needed). The GPU tests run the real
forward under minidp.DDP and torch DDP side by side.
"""
import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.utils import _recursive_to
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.utils.rnn import PackedSequence, pack_sequence

import minidp
from harness import run_ranks
from minidp.engine.arguments import move_inputs

Batch = namedtuple("Batch", ["x", "mask", "name"])


@dataclasses.dataclass
class Extra:
    t: torch.Tensor


def _inputs():
    packed = pack_sequence([torch.randn(3, 2), torch.randn(2, 2)])
    extra = Extra(torch.randn(2))
    args = (torch.randn(2, 3), Batch(torch.randn(2), torch.ones(2, dtype=torch.bool), "b"), packed, [1, "s", None],
            (), extra)
    kwargs = OrderedDict(y=torch.randn(1), nested={"z": [torch.randn(1), 2.0]}, empty={})
    return args, kwargs


def _same_structure(ours, theirs, path="inputs"):
    """Same types all the way down; tensors on the same device with the same shape and dtype."""
    assert type(ours) is type(theirs), (path, type(ours), type(theirs))
    if isinstance(ours, PackedSequence):
        ours, theirs = ours.data, theirs.data
    if isinstance(ours, torch.Tensor):
        assert (ours.device, ours.shape, ours.dtype) == (theirs.device, theirs.shape, theirs.dtype), path
    elif isinstance(ours, dict):
        assert list(ours) == list(theirs), path
        for key in ours:
            _same_structure(ours[key], theirs[key], f"{path}[{key!r}]")
    elif isinstance(ours, (tuple, list)):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same_structure(a, b, f"{path}[{i}]")
    else:
        assert ours is theirs or ours == theirs, path


def test_inputs_moved_like_torch_ddp():
    meta = torch.device("meta")
    args, kwargs = _inputs()
    for obj in (args, kwargs):
        ours, theirs = move_inputs(obj, meta), _recursive_to(obj, meta, False)[0]
        _same_structure(ours, theirs)
    moved = move_inputs(args, meta)
    assert isinstance(moved[1], Batch) and moved[1].x.device == meta and moved[1].name == "b"
    assert isinstance(moved[2], PackedSequence) and moved[2].data.device == meta
    assert moved[3] is args[3] and moved[4] is args[4]  # nothing to move: the same object
    assert moved[5] is args[5] and moved[5].t.device.type == "cpu"  # dataclasses pass unchanged, as in DDP
    moved_kwargs = move_inputs(kwargs, meta)
    assert type(moved_kwargs) is OrderedDict and moved_kwargs["nested"]["z"][0].device == meta


def test_inputs_already_on_the_device_are_returned_as_they_are():
    args, kwargs = _inputs()
    cpu = torch.device("cpu")
    assert move_inputs(args, cpu) is args and move_inputs(kwargs, cpu) is kwargs
    assert _recursive_to(args, cpu, False)[0] is args  # torch DDP does the same


class _RecordsTo(torch.Tensor):
    """A tensor that records the keyword arguments of every .to() call on it."""

    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            cls.calls.append((args[1:], dict(kwargs or {})))
        return super().__torch_function__(func, types, args, kwargs)


def test_copy_is_blocking_as_in_torch_ddp():
    _RecordsTo.calls.clear()
    move_inputs((torch.randn(3).as_subclass(_RecordsTo),), torch.device("meta"))
    assert _RecordsTo.calls == [((torch.device("meta"),), {})]  # never non_blocking=True


class _TwoDevices(nn.Module):
    def __init__(self, second: str):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2, device=second)


@pytest.mark.parametrize("make, device_ids, error, words", [
    (lambda: _TwoDevices("meta"), None, ValueError, ["one type of device", "meta", "cpu"]),
    (lambda: nn.Linear(2, 2), [0], ValueError, ["device_ids=[0]", "on the CPU"]),
    (lambda: nn.Linear(2, 2, device="meta"), [0, 1], ValueError, ["device_ids=[0, 1]", "one device"]),
    (lambda: nn.Linear(2, 2, device="meta"), 0, TypeError, ["device_ids=0", "list"]),
    (lambda: nn.Linear(2, 2, device="meta"), [torch.device("meta", 1)], ValueError,
     ["the module is on meta, not on meta:1"]),
    # [] means None, as in DDP: the next check is the missing process group.
    (lambda: nn.Linear(2, 2), [], RuntimeError, ["call minidp.init() first"]),
])
def test_device_checks_at_construction(make, device_ids, error, words):
    assert not dist.is_initialized()
    with pytest.raises(error) as info:
        minidp.DDP(make(), device_ids=device_ids)
    for word in words:
        assert word in str(info.value), str(info.value)


# ---- GPU: the real forward, side by side with torch DDP -----------------------------------------

class _TakesEverything(nn.Module):
    """Checks what forward receives: types kept, tensors on the module's device, dataclass untouched."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, batch, packed, extra, scale=None):
        device = self.lin.weight.device
        assert isinstance(batch, Batch) and batch.x.device == device and batch.name == "b"
        assert isinstance(packed, PackedSequence) and packed.data.device == device
        assert isinstance(extra, Extra) and extra.t.device.type == "cpu"
        assert scale["w"].device == device
        return self.lin(x).sum() * scale["w"] + packed.data.sum() + batch.x.sum() + extra.t.to(device).sum()


def _gpu_worker():
    minidp.init(backend="nccl", timeout=60)  # the suite sets MINIDP_BACKEND=gloo: ask for NCCL by name
    device = torch.device("cuda", torch.cuda.current_device())
    out = {}
    for label, engine in (("minidp", minidp.DDP), ("torch", TorchDDP)):
        torch.manual_seed(0)
        model = engine(_TakesEverything().to(device), device_ids=[device.index])
        torch.manual_seed(1)
        x, packed = torch.randn(3, 2), pack_sequence([torch.randn(3, 2), torch.randn(2, 2)])
        batch, extra = Batch(torch.randn(2), torch.ones(2, dtype=torch.bool), "b"), Extra(torch.randn(2))
        loss = model(x, batch, packed, extra, scale={"w": torch.tensor(2.0)})
        loss.backward()
        out[label] = [loss.detach().cpu()] + [p.grad.cpu() for p in model.parameters()]
    wrong = (torch.device("cuda", device.index + 1),)
    try:
        minidp.DDP(nn.Linear(2, 2).to(device), device_ids=list(wrong))
        out["wrong_device"] = None
    except ValueError as exc:
        out["wrong_device"] = str(exc)
    return out


@pytest.mark.gpu
def test_gpu_inputs_moved_and_results_equal_torch_ddp():
    out = run_ranks(_gpu_worker, 1, init=False)[0]
    assert all(torch.equal(a, b) for a, b in zip(out["minidp"], out["torch"]))
    assert out["wrong_device"] is not None and "not on cuda:" in out["wrong_device"]
