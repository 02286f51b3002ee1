"""minidp.resolve_env and init's choices (backend, NCCL's GPU check, timeout), without a process group."""
import dataclasses
import datetime

import pytest
import torch
from torch.distributed import constants

import minidp
from minidp.runtime import env as env_module
from minidp.runtime.env import DistEnv, _as_timedelta, choose_backend, resolve_env

TORCHRUN = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)",
         "SLURM_NODEID": "1", "SLURM_JOB_ID": "12345", "MASTER_ADDR": "node-a"}


def test_torchrun_environment():
    env = resolve_env(TORCHRUN)
    assert env == DistEnv(rank=5, local_rank=1, world_size=8, node_rank=1, local_world_size=4,
                          master_addr="10.1.2.3", master_port=29500)


def test_slurm_environment_and_derived_port():
    env = resolve_env(SLURM)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (6, 2, 8, 4, 1)
    assert env.master_addr == "node-a"
    assert env.master_port == 20000 + 12345 % 20000  # the same on every task of the job


def test_torchrun_variables_win_over_slurm():
    env = resolve_env({**SLURM, **TORCHRUN})
    assert env.rank == 5 and env.master_port == 29500


def test_explicit_arguments_win():
    env = resolve_env(TORCHRUN, rank=7, local_rank=3, master_addr="h", master_port=1234)
    assert (env.rank, env.local_rank, env.master_addr, env.master_port) == (7, 3, "h", 1234)
    assert env.world_size == 8  # not given: still from the environment


def test_nothing_set_is_a_world_of_one():
    env = resolve_env({})
    assert (env.rank, env.world_size, env.local_rank, env.node_rank, env.master_addr) == (0, 1, 0, 0, "127.0.0.1")


def test_node_rank_derived_when_missing():
    env = resolve_env({k: v for k, v in TORCHRUN.items() if k != "GROUP_RANK"})
    assert env.node_rank == 5 // 4


def test_env_is_frozen():
    env = resolve_env({})
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'rank'"):
        env.rank = 3


@pytest.mark.parametrize("environ, match", [
    ({**TORCHRUN, "RANK": "8"}, r"RANK=8 must be in \[0, WORLD_SIZE=8\)"),
    ({**TORCHRUN, "RANK": "-1"}, r"RANK=-1"),
    ({**TORCHRUN, "LOCAL_RANK": "4"}, r"LOCAL_RANK=4 must be in \[0, LOCAL_WORLD_SIZE=4\)"),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, r"world_size=0"),
    ({**TORCHRUN, "RANK": "two"}, r"rank='two' \(from RANK\) is not an integer"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, r"MASTER_ADDR is missing with 2 nodes"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, r"master_port='70000'"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, r"master_port=None"),
])
def test_bad_environment_raises_naming_the_value(environ, match):
    with pytest.raises(ValueError, match=match):
        resolve_env(environ)


def test_timeout_forms():
    assert _as_timedelta(None) == constants.default_pg_timeout  # torch's, 30 min
    assert _as_timedelta(None, "nccl") == constants.default_pg_nccl_timeout  # torch's for NCCL, 10 min
    assert constants.default_pg_nccl_timeout != constants.default_pg_timeout
    assert _as_timedelta(12.5) == datetime.timedelta(seconds=12.5)
    assert _as_timedelta(datetime.timedelta(minutes=2)) == datetime.timedelta(minutes=2)


@pytest.mark.parametrize("call, error, match", [
    (lambda: _as_timedelta(0), ValueError, r"timeout=0 must be > 0"),
    (lambda: _as_timedelta(float("nan")), ValueError, r"timeout=nan must not be NaN"),
    (lambda: _as_timedelta(datetime.timedelta(seconds=-1)), ValueError, r"timeout=.*must be positive"),
    (lambda: _as_timedelta("10"), TypeError, r"timeout='10' must be seconds \(a number\) or a datetime.timedelta"),
    (lambda: _as_timedelta(True), TypeError, r"timeout=True"),
    (lambda: resolve_env({}, rank=1.5, world_size=2), TypeError, r"rank=1.5 must be an int"),
    (lambda: resolve_env({}, world_size="2"), TypeError, r"world_size='2' must be an int"),
    (lambda: resolve_env({}, local_rank=True), TypeError, r"local_rank=True must be an int"),
    (lambda: resolve_env({}, nodes=2), TypeError, r"unknown keyword\(s\) \['nodes'\]"),
    # init() checks the same things before it touches any process group
    (lambda: minidp.init(rank=1.5, world_size=2), TypeError, r"rank=1.5 must be an int"),
    (lambda: minidp.init(timeout=-3), ValueError, r"timeout=-3 must be > 0"),
])
def test_bad_arguments_raise_naming_the_value(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert type(info.value) is error  # not a subclass


# ---- backend: backend= wins, then MINIDP_BACKEND, then NCCL with CUDA, else gloo --------------------

@pytest.mark.parametrize("cuda", [True, False])
def test_backend_order(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert choose_backend(None, {}) == ("nccl" if cuda else "gloo")
    assert choose_backend(None, {"MINIDP_BACKEND": ""}) == ("nccl" if cuda else "gloo")  # empty: unset
    assert choose_backend(None, {"MINIDP_BACKEND": "Gloo"}) == "gloo"
    assert choose_backend("NCCL", {"MINIDP_BACKEND": "gloo"}) == "nccl"  # the argument wins


@pytest.mark.parametrize("backend, environ, error, match", [
    (None, {"MINIDP_BACKEND": "glo"}, ValueError, r"MINIDP_BACKEND='glo' must be one of \['gloo', 'mpi'"),
    ("carrier-pigeon", {}, ValueError, r"backend='carrier-pigeon' must be one of"),
    (3, {}, TypeError, r"backend=3 must be a str"),
])
def test_bad_backend_names_where_it_came_from(backend, environ, error, match):
    with pytest.raises(error, match=match):
        choose_backend(backend, environ)


class _Captured(Exception):
    pass


@pytest.fixture
def fake_gpus(monkeypatch):
    """A machine with N visible GPUs as far as init() can tell; init_process_group is captured, not run."""
    calls = []

    def init_process_group(backend, **kwargs):
        calls.append((backend, kwargs["timeout"]))
        raise _Captured

    def with_gpus(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(env_module.dist, "init_process_group", init_process_group)
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MINIDP_BACKEND"):
            monkeypatch.delenv(name, raising=False)
        return calls

    return with_gpus


def test_nccl_refused_with_more_local_ranks_than_gpus(fake_gpus):
    fake_gpus(1)
    two_on_one = dict(rank=0, world_size=2, local_world_size=2, master_port=29500)
    for backend in ("nccl", None):  # asked for, or the default because CUDA is there
        with pytest.raises(ValueError, match=r"backend='nccl' with local_world_size=2 ranks on this node but "
                                             r"1 GPU\(s\) visible.*backend='gloo' \(or set MINIDP_BACKEND=gloo\)"):
            minidp.init(backend=backend, **two_on_one)


def test_init_passes_the_backend_and_its_default_timeout(fake_gpus, monkeypatch):
    calls = fake_gpus(2)
    for backend, env_value in (("nccl", None), (None, "gloo"), (None, None)):
        if env_value:
            monkeypatch.setenv("MINIDP_BACKEND", env_value)
        with pytest.raises(_Captured):
            minidp.init(backend=backend, rank=0, world_size=1)
        monkeypatch.delenv("MINIDP_BACKEND", raising=False)
    with pytest.raises(_Captured):
        minidp.init(backend="gloo", world_size=1, timeout=7)
    assert calls == [("nccl", constants.default_pg_nccl_timeout), ("gloo", constants.default_pg_timeout),
                     ("nccl", constants.default_pg_nccl_timeout), ("gloo", datetime.timedelta(seconds=7))]
    fake_gpus(0)
    with pytest.raises(ValueError, match=r"backend='nccl' needs CUDA.*use backend='gloo'"):
        minidp.init(backend="nccl", world_size=1)
