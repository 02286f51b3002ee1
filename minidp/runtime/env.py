"""Process-group set-up: read who we are (args, torchrun or SLURM), pick a backend, pin a device.

The three sources, highest priority first:
  1. explicit arguments to `init(...)`;
  2. torchrun's (and `python -m minidp.run`'s) environment: RANK, LOCAL_RANK, WORLD_SIZE,
     LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT;
  3. SLURM's: SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NTASKS_PER_NODE, SLURM_NODEID.
With none of them, the process is a world of one.

Which backend and collective timeout init() picks is backend.py; the store the ranks meet through
is rendezvous.py.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
from typing import Mapping, Optional, Union

import torch
import torch.distributed as dist

from ..validate import check_int
from . import watchdog
from .backend import BACKEND_VARIABLE, KNOWN_BACKENDS, as_timedelta, check_nccl, choose_backend, default_backend
from .rendezvous import agent_store_serves, rendezvous_store

# Their names before backend.py and rendezvous.py were split out of this module (tests import them).
_as_timedelta, _agent_store_serves = as_timedelta, agent_store_serves
__all__ = ["BACKEND_VARIABLE", "KNOWN_BACKENDS", "DistEnv", "choose_backend", "default_backend", "init",
           "resolve_env", "shutdown"]

# (name in DistEnv, torchrun variable, SLURM variable)
_SOURCES = (
    ("rank", "RANK", "SLURM_PROCID"),
    ("local_rank", "LOCAL_RANK", "SLURM_LOCALID"),
    ("world_size", "WORLD_SIZE", "SLURM_NTASKS"),
    ("local_world_size", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"),
    ("node_rank", "GROUP_RANK", "SLURM_NODEID"),
)


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Who this process is in the job. Returned by `init()`; frozen so nobody edits it by accident."""

    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _as_int(value, name: str, source: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} (from {source}) is not an integer") from None


def _slurm_tasks_per_node(raw: str) -> str:
    # SLURM writes e.g. "4(x2)" when every node has 4 tasks; take the first count.
    return raw.split("(")[0].split(",")[0]


def resolve_env(environ: Optional[Mapping[str, str]] = None, **explicit) -> DistEnv:
    """Work out rank, sizes and rendezvous address without touching any process group.

    A pure function of `environ` (default: os.environ) and the explicit keyword arguments, which win.
    Keywords: rank, local_rank, world_size, local_world_size, node_rank, master_addr, master_port.
    """
    environ = os.environ if environ is None else environ
    unknown = set(explicit) - {s[0] for s in _SOURCES} - {"master_addr", "master_port"}
    if unknown:
        raise TypeError(f"resolve_env() got unknown keyword(s) {sorted(unknown)}")
    use_slurm = "RANK" not in environ and "SLURM_PROCID" in environ
    values = {}
    for name, torchrun_var, slurm_var in _SOURCES:
        if explicit.get(name) is not None:
            values[name] = check_int(name, explicit[name])  # ranges: _check_ranks, with the others
        elif torchrun_var in environ:
            values[name] = _as_int(environ[torchrun_var], name, torchrun_var)
        elif use_slurm and slurm_var in environ:
            raw = environ[slurm_var]
            raw = _slurm_tasks_per_node(raw) if name == "local_world_size" else raw
            values[name] = _as_int(raw, name, slurm_var)

    rank = values.get("rank", 0)
    world_size = values.get("world_size", 1)
    local_rank = values.get("local_rank", rank)
    local_world_size = values.get("local_world_size", world_size)
    node_rank = values.get("node_rank", rank // max(local_world_size, 1))
    _check_ranks(rank, world_size, local_rank, local_world_size, node_rank)

    master_addr, master_port = _master_address(environ, explicit, use_slurm, world_size, local_world_size)
    return DistEnv(rank, local_rank, world_size, node_rank, local_world_size, master_addr, master_port)


def _master_address(environ, explicit, use_slurm: bool, world_size: int, local_world_size: int):
    """(master_addr, master_port) for resolve_env: explicit, else MASTER_ADDR/MASTER_PORT, else defaults.

    A single node defaults to 127.0.0.1; several nodes need the address. Under SLURM without
    MASTER_PORT the port is derived from the job id; a world of one needs no port (0).
    """
    nnodes = -(-world_size // local_world_size)
    master_addr = explicit.get("master_addr") or environ.get("MASTER_ADDR")
    if not master_addr:
        if nnodes > 1:
            raise ValueError(
                f"MASTER_ADDR is missing with {nnodes} nodes (world_size={world_size}, "
                f"local_world_size={local_world_size}): pass master_addr= or set MASTER_ADDR "
                "to the address of the node that runs rank 0"
            )
        master_addr = "127.0.0.1"
    port = explicit.get("master_port") or environ.get("MASTER_PORT")
    if port is None and use_slurm and "SLURM_JOB_ID" in environ:
        port = 20000 + int(environ["SLURM_JOB_ID"]) % 20000  # same on every task of the job
    master_port = _as_int(port, "master_port", "MASTER_PORT") if port is not None else 0
    if world_size > 1 and not 0 < master_port < 65536:
        raise ValueError(f"master_port={port!r} with world_size={world_size}: set MASTER_PORT to a free port")
    return master_addr, master_port


def _check_ranks(rank, world_size, local_rank, local_world_size, node_rank) -> None:
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    if not 1 <= local_world_size <= world_size:
        raise ValueError(f"local_world_size={local_world_size} must be in [1, world_size={world_size}]")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} must be in [0, LOCAL_WORLD_SIZE={local_world_size})")
    if node_rank < 0:
        raise ValueError(f"node_rank={node_rank} must be >= 0")


def init(
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    local_rank: Optional[int] = None,
    local_world_size: Optional[int] = None,
    node_rank: Optional[int] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    backend: Optional[str] = None,
    timeout: Union[float, datetime.timedelta, None] = None,
) -> DistEnv:
    """Create the default process group and pin this process's device.

    Args:
        rank, world_size, local_rank, local_world_size, node_rank, master_addr, master_port:
            override what the environment says (torchrun's, then SLURM's). Default: read them.
        backend: "nccl" or "gloo" (or "mpi", "ucc"). Default: the MINIDP_BACKEND environment
            variable if set, else NCCL when CUDA is available, else gloo. NCCL is refused with
            more ranks on this node than GPUs.
        timeout: seconds (or a timedelta) a collective may wait for the other ranks before it
            raises. Default: torch's for the backend (NCCL 10 min, gloo 30 min in torch 2.x).
            When an engine collective fails or times out, the error names the ranks that did not
            arrive, with their progress and Python stacks (watchdog.py).

    Example:
        env = minidp.init()          # under torchrun or `python -m minidp.run`
        model = minidp.DDP(model.to(env.device))
    """
    if dist.is_initialized():
        raise RuntimeError("minidp.init(): the default process group exists already; call minidp.shutdown() first")
    spec = resolve_env(
        rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
        node_rank=node_rank, master_addr=master_addr, master_port=master_port,
    )
    backend = choose_backend(backend)
    timeout = as_timedelta(timeout, backend)
    if backend == "nccl":
        check_nccl(spec.local_world_size)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        # Several processes may share one GPU (gloo), hence the modulo.
        device = torch.device("cuda", spec.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    _export(spec)
    if spec.world_size == 1:
        # A world of one needs no network: an in-memory store will do.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        # Ranks meet here: rank 0 (or torchrun's agent) hosts the rendezvous store, the others connect to it.
        store = rendezvous_store(spec, timeout)
        dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
        watchdog.start(store, spec.rank, spec.world_size)  # a daemon thread: progress out, stacks on request
    return dataclasses.replace(spec, device=device, backend=backend)


def _export(spec: DistEnv) -> None:
    """Leave the resolved identity in the environment, as torchrun does, for the rank helpers.

    Not in a world of one: there the helpers need nothing, and a RANK variable would make later
    "am I under a launcher?" checks (and child processes) believe there is one.
    """
    if spec.world_size == 1:
        return
    os.environ.update(
        RANK=str(spec.rank), LOCAL_RANK=str(spec.local_rank), WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.local_world_size), GROUP_RANK=str(spec.node_rank),
    )


def shutdown() -> None:
    """The safe end of a script: stop the watchdog, destroy the default process group, let gloo settle.

    Call it last (`minidp.shutdown()` as a script's final line, or in a `finally`). Why: torch's gloo
    backend frees a finished work on its own worker thread; if the script ends right after a
    collective, that can happen after Python began finalizing, when the thread can no longer take
    the GIL, and the process aborts ("terminate called without an active exception", seen in about
    1 run in 5 when runs overlap). shutdown() returns once every other thread of the process is idle,
    so nothing is left to free late. No collective: a rank may call it after its peers died. Safe to
    call twice, or without init().
    """
    watchdog.stop()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        settle_threads()


def settle_threads(limit_s: float = 2.0, poll_s: float = 0.005) -> bool:
    """Wait until no other thread of this process runs (all asleep twice in a row); at most `limit_s`.

    Sleeping between looks releases the GIL, so a communication thread waiting for it can finish.

    Args:
        limit_s: the longest wait, seconds. Default 2.0.
        poll_s: between two looks, seconds. Default 0.005.

    Returns:
        True if the threads settled, False at the limit or without /proc (then it slept `limit_s`'s worth of polls).
    """
    deadline, quiet = time.monotonic() + limit_s, 0
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        busy = _running_threads()
        if busy is None:
            return False
        quiet = quiet + 1 if busy == 0 else 0
        if quiet >= 2:
            return True
    return False


def _running_threads():
    """How many threads other than the caller are running or runnable (state R), or None without /proc."""
    me = str(getattr(os, "gettid", lambda: os.getpid())())
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    running = 0
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                running += f.read().rpartition(")")[2].split()[0] == "R"
        except OSError:  # the thread just ended
            continue
    return running
