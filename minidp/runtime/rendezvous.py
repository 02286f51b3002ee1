"""The key-value store the ranks meet through when init() creates the process group.

Under torchrun every rank is a client of the store torchrun's agent already runs; elsewhere
(minidp.run, minidp.launch, SLURM, explicit arguments) rank 0 hosts one, listening on master_addr only.

torchrun's agent keeps its store across restarts (`--max-restarts`) and rendezvous rounds
(`--nnodes MIN:MAX`): the keys an attempt's ranks left there (gloo's addresses, among others) are
still there when the next attempt's ranks meet, and a fast rank would read its peers' old
addresses ("Gloo connectFullMesh failed ... Connection refused"). So each attempt meets under keys
of its own (attempt_prefix).
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Mapping

import torch.distributed as dist

# `spec` below is env.py's DistEnv (rank, world_size, master_addr, ...), unannotated so that this
# module need not import env.py, its caller.


def agent_store_serves(spec, environ: Mapping[str, str]) -> bool:
    """Whether torchrun's agent already hosts the store at spec's master_addr:master_port.

    torchrun (torch.distributed.run) runs a TCPStore on MASTER_ADDR:MASTER_PORT for its workers and
    says so with TORCHELASTIC_USE_AGENT_STORE=True; the promise holds for that address only, so
    explicit master_addr/master_port arguments that point elsewhere get minidp's own store. This is
    the test torch's env:// rendezvous makes (torch.distributed.rendezvous._agent_store_serves).

    Args:
        spec: this process's resolved identity (resolve_env).
        environ: the environment torchrun's variables are read from.
    """
    return (environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and environ.get("MASTER_ADDR") == spec.master_addr
            and environ.get("MASTER_PORT") == str(spec.master_port))


def attempt_prefix(store: dist.Store, spec, environ: Mapping[str, str]) -> str:
    """The key prefix this attempt's ranks meet under in torchrun's agent store.

    The restart count (TORCHELASTIC_RESTART_COUNT) tells a failed attempt from its restart, but a
    rendezvous round that only changes membership (elastic --nnodes MIN:MAX) keeps the count. So the
    ranks also count their arrivals under the count and the world size: arrivals 1..W are the
    first group of that size, W+1..2W the next, and so on.

    Args:
        store: the agent's store (a client).
        spec: this process's resolved identity.
        environ: where TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_RUN_ID are read.
    """
    run_id, count = environ.get("TORCHELASTIC_RUN_ID", "none"), environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    attempt = f"minidp/{run_id}/attempt{count}"
    arrived = store.add(f"{attempt}/world{spec.world_size}/arrivals", 1)  # ranks meet here (a counter)
    return f"{attempt}/world{spec.world_size}/group{(arrived - 1) // spec.world_size}/"


def rendezvous_store(spec, timeout: datetime.timedelta) -> dist.Store:
    """The TCP key-value store the ranks meet through.

    Under torchrun every rank is a client of the agent's store, under a key prefix of this attempt's
    own (attempt_prefix), then "default_pg" as torch's env:// rendezvous does. Elsewhere
    (minidp.run, minidp.launch, SLURM, explicit arguments) rank 0 hosts the store, listening on
    master_addr only; a restarted rank 0 hosts a new one. Why not init_method="tcp://...": torch's
    store server then listens on every interface; a socket bound to master_addr (127.0.0.1 on one
    node) keeps the rendezvous off the network.

    Args:
        spec: this process's resolved identity (rank, world size, master_addr, master_port).
        timeout: how long to wait for the other ranks.
    """
    if agent_store_serves(spec, os.environ):
        store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False, timeout)
        # The agent's store is shared by attempts and by torchrun itself: keep to this attempt's keys.
        return dist.PrefixStore(attempt_prefix(store, spec, os.environ) + "default_pg", store)
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
