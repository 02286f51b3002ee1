"""A backward that raises (on every rank, or on one rank only) and is caught by the training loop.

torch DDP refuses every later step ("Expected to have finished reduction in the prior iteration").
minidp closes the failed iteration at the next forward: the failing rank posts its failure to the
store and launches the buckets it had not, filled with NaNs; every other rank finds a NaN in its last
reduced bucket, reads the post, and raises too (engine/failures.py). Every rank's loop then skips
the same step, so training goes on with the ranks equal: bitwise equal to torch DDP trained on the
same batches minus that step.

Under a comm hook, what is guaranteed depends on the hook (engine/README.md): a hook that sums what
each rank sends (torch's allreduce and fp16 hooks, minidp.comm's FP16) behaves as the default path; a
stateful one (PowerSGD) still makes every rank raise in the failed step, but keeps the NaNs in its
state; local SGD's and DiLoCo's local steps send nothing, so only the failing rank loses its step.
"""
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import run_ranks
from minidp import comm
from minidp.engine import failures
from minidp.engine.failures import Verdicts, status_on_host
from training import bitwise_equal, offset_by_rank, shard_of, snapshot

STEPS, SHARD = 6, 4
CAP_MB = 0.004  # two buckets once rebuilt: the failure falls between them (one launched, one not)


class RaiseInBackward(torch.autograd.Function):
    """Identity in forward; raises in backward while `armed` (set per step by the loop)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if RaiseInBackward.armed:
            raise RuntimeError("test: backward failed on purpose")
        return grad


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):  # backward reaches c and b, then raises before a
        return self.c(torch.tanh(self.b(RaiseInBackward.apply(torch.tanh(self.a(x))))))


def _scenarios(world_size):
    last = world_size - 1
    return {
        "every_rank": {"step": 2, "ranks": list(range(world_size))},
        "one_rank": {"step": 3, "ranks": [1]},
        "one_rank_first_iteration": {"step": 0, "ranks": [last]},  # one bucket, before the rebuild
        "one_rank_find_unused_bucket_view": {"step": 2, "ranks": [0],
                                             "ddp": {"find_unused_parameters": True,
                                                     "gradient_as_bucket_view": True}},
        # failures.status_on_host: the status on CPU tensors over a gloo copy of the group (no GPU read)
        "one_rank_status_on_host": {"step": 3, "ranks": [last], "host_status": True},
        "one_rank_find_unused_status_on_host": {"step": 2, "ranks": [0], "host_status": True,
                                                "ddp": {"find_unused_parameters": True}},
        # under a comm hook (the same hook on torch DDP, the reference)
        "one_rank_allreduce_hook": {"step": 3, "ranks": [last], "hook": "allreduce"},
        "one_rank_fp16_hook": {"step": 3, "ranks": [0], "hook": "fp16"},
        "one_rank_comm_fp16": {"step": 2, "ranks": [last], "hook": "comm_fp16"},
    }


HOOKS = {"allreduce": lambda: (None, default_hooks.allreduce_hook),
         "fp16": lambda: (None, default_hooks.fp16_compress_hook),
         "comm_fp16": lambda: comm.compression_hook(comm.FP16()),
         "powersgd": lambda: (torch_powersgd.PowerSGDState(None, matrix_approximation_rank=1,
                                                           start_powerSGD_iter=2),
                              torch_powersgd.powerSGD_hook)}

# local steps: (the method on a model, ) -> its step() follows each optimizer step, failed ones too
LOCAL = {"local_sgd": lambda model: comm.PeriodicAverager(model, period=4),
         "diloco": lambda model: comm.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.7),
                                             period=4)}


def _train(engine, cfg, fail: bool, steps=STEPS):
    """Train; on the failing step, the failing ranks raise in backward (fail=True) or every rank skips it.

    Its own loop, not tests/training.train: catching a backward's error and skipping that step is what
    this file tests.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = offset_by_rank(Net(), rank)
    wrapped = engine(model, bucket_cap_mb=cfg.get("cap", CAP_MB), **cfg.get("ddp", {}))
    if "hook" in cfg:
        wrapped.register_comm_hook(*HOOKS[cfg["hook"]]())
    if cfg.get("host_status") and engine is minidp.DDP:
        status_on_host(wrapped)  # ranks meet here (a new gloo group)
        assert wrapped.reducer.status_group is not None
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    gen, errors = torch.Generator().manual_seed(1234), []
    for step in range(steps):
        x, y = shard_of((torch.randn(world_size * SHARD, 8, generator=gen),
                         torch.randn(world_size * SHARD, 4, generator=gen)), rank, SHARD)
        if step == cfg["step"] and not fail:
            continue  # the reference: this step never happened
        RaiseInBackward.armed = fail and step == cfg["step"] and rank in cfg["ranks"]
        try:
            nn.functional.mse_loss(wrapped(x), y).backward()
        except RuntimeError as exc:  # the loop skips the step, as after a caught out-of-memory
            errors.append((step, str(exc)))
            opt.zero_grad()
            continue
        finally:
            RaiseInBackward.armed = False
        opt.step()
        opt.zero_grad()
    return snapshot(model), errors


def _try_step(model, opt, batch, armed: bool, errors: list, step) -> None:
    """One step whose backward raises if `armed`: the error is noted and the step skipped."""
    RaiseInBackward.armed = armed
    try:
        nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
        opt.step()
    except RuntimeError as exc:  # as after a caught out-of-memory
        errors.append((step, str(exc)))
    finally:
        RaiseInBackward.armed = False
    opt.zero_grad()


def _train_local(engine, method: str, fail: bool):
    """Local SGD or DiLoCo, 7 steps; rank 1 raises in the backward of step 2 (fail) or skips that
    step (the reference). Every rank calls the method's step() after each step, failed ones too, so
    all average at the same steps; after the loop, every rank averages once more."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = offset_by_rank(Net(), rank)
    wrapped = engine(model, bucket_cap_mb=CAP_MB)
    method_ = LOCAL[method](wrapped)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    gen, errors = torch.Generator().manual_seed(1234), []
    for step in range(7):
        x, y = shard_of((torch.randn(world_size * SHARD, 8, generator=gen),
                         torch.randn(world_size * SHARD, 4, generator=gen)), rank, SHARD)
        failing = step == 2 and rank == 1
        if not (failing and not fail):
            _try_step(wrapped, opt, (x, y), fail and failing, errors, step)
        method_.step()
    if method == "local_sgd":
        method_.average()  # ranks meet here
    else:
        method_.sync()  # ranks meet here
    return snapshot(model), errors


def _powersgd_failure():
    """torch's PowerSGD hook, rank 0 raises at step 3 of 6: every rank raises there; its state then
    holds the NaNs (later gradients are NaN). Returns (errors, any parameter NaN at the end).

    One bucket: PowerSGD starts its second and third all-reduce in its futures' callbacks, so with
    several buckets in flight the order of collectives across ranks is a race (a failed rank's late
    buckets lose it: a hang on gloo, in torch DDP as in minidp)."""
    cfg = {"step": 3, "ranks": [0], "hook": "powersgd", "cap": 25}
    params, errors = _train(minidp.DDP, cfg, fail=True)
    return errors, any(math.isnan(v) for t in params for v in t.reshape(-1).tolist())


def _nan_gradients(engine):
    """One step whose loss is NaN on rank 0 only: every averaged gradient is NaN, and no rank failed."""
    torch.manual_seed(0)
    model = engine(Net())
    x = torch.randn(SHARD, 8)
    if dist.get_rank() == 0:
        x[0, 0] = float("nan")
    model(x).sum().backward()  # must not raise: a NaN is not a failure
    return [p.grad.view(torch.int32).clone() for p in model.parameters()]  # bits: NaN == NaN


def _worker():
    out = {"nan_gradients_equal": bitwise_equal(_nan_gradients(minidp.DDP), _nan_gradients(TorchDDP))}
    for name, cfg in _scenarios(dist.get_world_size()).items():
        ours, errors = _train(minidp.DDP, cfg, fail=True)
        reference, _ = _train(TorchDDP, cfg, fail=False)
        out[name] = {"equal": bitwise_equal(ours, reference), "errors": errors}
    for method in LOCAL:
        ours, errors = _train_local(minidp.DDP, method, fail=True)
        reference, _ = _train_local(TorchDDP, method, fail=False)
        out[method] = {"equal": bitwise_equal(ours, reference), "errors": errors}
    out["powersgd"] = _powersgd_failure()
    # torch DDP itself, failing on every rank: it refuses every later step.
    out["torch_ddp"] = _train(TorchDDP, _scenarios(dist.get_world_size())["every_rank"], fail=True, steps=5)[1]
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout=240, collective_timeout=30)


@pytest.mark.parametrize("scenario", ["every_rank", "one_rank", "one_rank_first_iteration",
                                      "one_rank_find_unused_bucket_view", "one_rank_status_on_host",
                                      "one_rank_find_unused_status_on_host", "one_rank_allreduce_hook",
                                      "one_rank_fp16_hook", "one_rank_comm_fp16"])
def test_training_goes_on_with_equal_ranks(results, scenario):
    world_size, per_rank = results
    cfg = _scenarios(world_size)[scenario]
    for rank, result in enumerate(per_rank):
        res = result[scenario]
        # Equal to torch DDP without the failed step, so equal across ranks, bitwise.
        assert res["equal"], f"{scenario}, rank {rank}: parameters differ from torch DDP without step {cfg['step']}"
        assert [step for step, _ in res["errors"]] == [cfg["step"]], res["errors"]  # every rank, once
        message = res["errors"][0][1]
        if rank in cfg["ranks"]:
            assert "failed on purpose" in message
        else:
            assert f"raised on rank(s) {cfg['ranks']}" in message and "Skip optimizer.step()" in message


@pytest.mark.parametrize("method", list(LOCAL))
def test_a_failed_local_step_is_that_ranks_alone(results, method):
    """Local SGD and DiLoCo: a local step sends nothing, so only the failing rank raises, and the run
    ends bitwise as torch DDP's where that rank skipped that step."""
    _, per_rank = results
    for rank, result in enumerate(per_rank):
        res = result[method]
        assert res["equal"], f"{method}, rank {rank}: differs from torch DDP without rank 1's step 2"
        assert [step for step, _ in res["errors"]] == ([2] if rank == 1 else []), res["errors"]


def test_a_stateful_hook_raises_on_every_rank_and_keeps_the_nans(results):
    """torch's PowerSGD: the failed step raises everywhere; its error feedback and low-rank factors
    took the NaNs, so later steps are NaN (documented: re-create the model and its hook)."""
    _, per_rank = results
    for rank, (errors, has_nan) in enumerate(result["powersgd"] for result in per_rank):
        assert [step for step, _ in errors] == [3], (rank, errors)
        assert has_nan, rank


def test_a_nan_gradient_is_not_a_failure(results):
    """A NaN in the last bucket makes the ranks exchange their status, which says nobody failed."""
    _, per_rank = results
    assert all(result["nan_gradients_equal"] for result in per_rank)


def test_torch_ddp_refuses_later_steps(results):
    _, per_rank = results
    for errors in (result["torch_ddp"] for result in per_rank):
        assert [step for step, _ in errors] == [2, 3, 4]
        assert all("Expected to have finished reduction in the prior iteration" in m for _, m in errors[1:])


def test_status_on_host_checks_its_model():
    with pytest.raises(TypeError, match=r"status_on_host: model=Linear must be a minidp.DDP"):
        status_on_host(nn.Linear(2, 2))


class _ArrivesLater:
    """What Verdicts asks of a CUDA event, for a flag that reaches the host one query later."""

    def __init__(self):
        self.queried, self.waited = 0, 0

    def query(self) -> bool:
        self.queried += 1
        return self.queried > 1

    def synchronize(self) -> None:
        self.waited += 1


class _OnlyIfWaited(_ArrivesLater):
    def query(self) -> bool:
        return self.waited > 0


def test_a_flag_is_read_once_it_has_arrived_and_waited_for_only_when_asked():
    verdicts = Verdicts()
    late, later = _ArrivesLater(), _OnlyIfWaited()
    verdicts.pending.extend([(1, torch.tensor([False]), None), (2, torch.tensor([True]), late),
                             (3, torch.tensor([True]), later)])
    assert verdicts.arrived(wait=False) == [] and len(verdicts.pending) == 2  # 1 read, 2 not yet
    assert verdicts.arrived(wait=False) == [2] and len(verdicts.pending) == 1  # 3: not yet
    assert verdicts.arrived(wait=True) == [3] and later.waited == 1 and late.waited == 0
    verdicts.record(4, torch.tensor([True]))  # a CPU flag: on the host at once
    assert verdicts.arrived(wait=False) == [4] and not verdicts.pending


def _late_flag_worker():
    """Rank 1 raises in the backward of step 2; rank 0's NaN flag reaches the host late (as a GPU's
    can): its step goes on, and its next forward raises, naming rank 1 and what may have happened.
    Then the same with same_step_recovery(model): rank 0 waits for the flag and raises in step 2."""
    record = Verdicts.record

    def record_late(self, iteration, flag):
        record(self, iteration, flag)
        index, host, _ = self.pending.pop()
        self.pending.append((index, host, _ArrivesLater()))  # on the host at the next look

    Verdicts.record = record_late
    try:
        return {same_step: _fail_at_step_2(same_step) for same_step in (False, True)}
    finally:
        Verdicts.record = record


def _fail_at_step_2(same_step: bool) -> list:
    rank, errors = dist.get_rank(), []
    torch.manual_seed(0)
    model = minidp.DDP(Net(), bucket_cap_mb=CAP_MB)
    if same_step:
        failures.same_step_recovery(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        batch = torch.randn(SHARD, 8), torch.randn(SHARD, 4)
        _try_step(model, opt, batch, step == 2 and rank == 1, errors, step)
    try:
        with torch.no_grad():
            model(torch.randn(SHARD, 8))  # rank 1 closes its step here; rank 0 learns of it
    except RuntimeError as exc:
        errors.append(("eval", str(exc)))
    return errors


def test_a_flag_that_arrives_late_raises_at_a_later_forward():
    rank0, rank1 = (result[False] for result in run_ranks(_late_flag_worker, 2, timeout=120))
    assert [step for step, _ in rank1] == [2] and "failed on purpose" in rank1[0][1]
    assert [step for step, _ in rank0] == ["eval"], rank0
    assert "iteration 3 raised on rank(s) [1]; this rank learned it at iteration 3" in rank0[0][1]
    assert "same_step_recovery" in rank0[0][1]


def test_same_step_recovery_waits_for_the_flag_and_raises_in_the_failed_step():
    rank0, rank1 = (result[True] for result in run_ranks(_late_flag_worker, 2, timeout=120))
    assert [step for step, _ in rank1] == [2] and "failed on purpose" in rank1[0][1]
    assert [step for step, _ in rank0] == [2], rank0
    assert "iteration 3 raised on rank(s) [1], so every rank discards" in rank0[0][1]
