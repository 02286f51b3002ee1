"""minidp.resolve_env: torchrun-, SLURM- and argument-shaped identities, without a process group."""
import dataclasses
import datetime

import pytest

from minidp.env import DistEnv, _as_timedelta, resolve_env

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
    assert _as_timedelta(None).total_seconds() == 1800
    assert _as_timedelta(12.5) == datetime.timedelta(seconds=12.5)
    with pytest.raises(ValueError, match="timeout=.*positive"):
        _as_timedelta(0)
    with pytest.raises(TypeError, match="timeout='10'"):
        _as_timedelta("10")
