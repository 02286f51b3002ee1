"""Process-group set-up: read who we are (args, torchrun or SLURM), pick a backend, pin a device.

The three sources, highest priority first:
  1. explicit arguments to `init(...)`;
  2. torchrun's (and `python -m minidp.run`'s) environment: RANK, LOCAL_RANK, WORLD_SIZE,
     LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT;
  3. SLURM's: SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NTASKS_PER_NODE, SLURM_NODEID.
With none of them, the process is a world of one.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import constants

from .validate import check_int, check_number

KNOWN_BACKENDS = {"gloo", "nccl", "mpi", "ucc"}
BACKEND_VARIABLE = "MINIDP_BACKEND"  # e.g. MINIDP_BACKEND=gloo: a test suite or CPU job on a GPU machine

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
    return DistEnv(rank, local_rank, world_size, node_rank, local_world_size, master_addr, master_port)


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


def default_backend() -> str:
    """NCCL when CUDA is usable, else gloo. (is_nccl_available() is True even without a GPU.)"""
    return "nccl" if torch.cuda.is_available() else "gloo"


def choose_backend(backend: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> str:
    """The backend init() uses: `backend` if given, else $MINIDP_BACKEND if set, else default_backend().

    Args:
        backend: "nccl", "gloo", "mpi" or "ucc" (any case). Default None.
        environ: where to read MINIDP_BACKEND. Default None: os.environ.
    """
    environ = os.environ if environ is None else environ
    if backend is not None:
        name, value = "backend", backend
    elif environ.get(BACKEND_VARIABLE):
        name, value = BACKEND_VARIABLE, environ[BACKEND_VARIABLE]
    else:
        return default_backend()
    if not isinstance(value, str):
        raise TypeError(f"{name}={value!r} must be a str, one of {sorted(KNOWN_BACKENDS)}")
    if value.lower() not in KNOWN_BACKENDS:
        raise ValueError(f"{name}={value!r} must be one of {sorted(KNOWN_BACKENDS)} (or unset: "
                         f"backend=, then ${BACKEND_VARIABLE}, then NCCL with CUDA, else gloo)")
    return value.lower()


def default_timeout(backend: str) -> datetime.timedelta:
    """torch's default collective timeout for `backend`: NCCL's (10 min in torch 2.x) is not gloo's (30 min)."""
    if backend == "nccl" and isinstance(constants.default_pg_nccl_timeout, datetime.timedelta):
        return constants.default_pg_nccl_timeout
    return constants.default_pg_timeout


def _check_nccl(spec: DistEnv) -> None:
    """NCCL needs CUDA and one GPU per rank on this node; say what to do instead."""
    if not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, and torch.cuda.is_available() is False; "
                         "use backend='gloo'")
    gpus = torch.cuda.device_count()
    if spec.local_world_size > gpus:
        raise ValueError(
            f"backend='nccl' with local_world_size={spec.local_world_size} ranks on this node but {gpus} GPU(s) "
            f"visible: NCCL needs one GPU per rank (two ranks on one GPU fail or hang). Start at most {gpus} "
            f"process(es) per node, or pass backend='gloo' (or set {BACKEND_VARIABLE}=gloo) to let ranks share")


def _as_timedelta(timeout: Union[float, datetime.timedelta, None], backend: str = "gloo") -> datetime.timedelta:
    if timeout is None:
        return default_timeout(backend)
    if isinstance(timeout, datetime.timedelta):
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout={timeout!r} must be positive")
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):  # the message names both forms
        raise TypeError(f"timeout={timeout!r} must be seconds (a number) or a datetime.timedelta")
    return datetime.timedelta(seconds=check_number("timeout", timeout, positive=True))


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
    timeout = _as_timedelta(timeout, backend)
    if backend == "nccl":
        _check_nccl(spec)
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
        # Ranks meet here: rank 0 hosts the rendezvous store, the others connect to it.
        dist.init_process_group(backend, store=_rendezvous_store(spec, timeout), rank=spec.rank,
                                world_size=spec.world_size, timeout=timeout)
    return dataclasses.replace(spec, device=device, backend=backend)


def _agent_store_serves(spec: DistEnv, environ: Mapping[str, str]) -> bool:
    """Whether torchrun's agent already hosts the store at spec's master_addr:master_port.

    torchrun (torch.distributed.run) runs a TCPStore on MASTER_ADDR:MASTER_PORT for its workers and
    says so with TORCHELASTIC_USE_AGENT_STORE=True; the promise holds for that address only, so
    explicit master_addr/master_port arguments that point elsewhere get minidp's own store. This is
    the test torch's env:// rendezvous makes (torch.distributed.rendezvous._agent_store_serves).
    """
    return (environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and environ.get("MASTER_ADDR") == spec.master_addr
            and environ.get("MASTER_PORT") == str(spec.master_port))


def _rendezvous_store(spec: DistEnv, timeout: datetime.timedelta) -> dist.Store:
    """The TCP key-value store the ranks meet through.

    Under torchrun every rank is a client of the agent's store, under the key prefix "default_pg",
    exactly as torch's env:// rendezvous (init_process_group without a store) connects. Elsewhere
    (minidp.run, minidp.launch, SLURM, explicit arguments) rank 0 hosts the store, listening on
    master_addr only. Why not init_method="tcp://...": torch's store server then listens on every
    interface; a socket bound to master_addr (127.0.0.1 on one node) keeps the rendezvous off the network.
    """
    if _agent_store_serves(spec, os.environ):
        store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False, timeout)
        return dist.PrefixStore("default_pg", store)  # the agent's store is shared: keep to our keys
    if spec.rank != 0:
        return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False, timeout)
    family = socket.AF_INET6 if ":" in spec.master_addr else socket.AF_INET
    try:
        server = socket.create_server((spec.master_addr, spec.master_port), family=family, backlog=1024)
    except OSError as exc:
        raise RuntimeError(f"rank 0 cannot listen on master_addr={spec.master_addr!r} "
                           f"master_port={spec.master_port}: {exc}") from exc
    try:
        return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, True, timeout,
                             wait_for_workers=False, master_listen_fd=server.fileno())
    except TypeError:  # an older torch without master_listen_fd: its server listens everywhere
        server.close()
        return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, True, timeout)
    finally:
        if server.fileno() >= 0:
            server.detach()  # the store owns the listening socket now


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
    """Destroy the default process group. Safe to call twice, or without init()."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
