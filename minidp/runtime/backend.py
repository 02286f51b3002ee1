"""Which backend init() uses, how long its collectives may wait, and whether NCCL can run here.

The order: `backend=` if given, else $MINIDP_BACKEND if set, else NCCL when CUDA is usable, else
gloo. The timeout: `timeout=` if given, else torch's default for that backend (NCCL's and gloo's differ).
"""
from __future__ import annotations

import datetime
import os
from typing import Mapping, Optional, Union

import torch
from torch.distributed import constants

from ..validate import check_number

KNOWN_BACKENDS = {"gloo", "nccl", "mpi", "ucc"}
BACKEND_VARIABLE = "MINIDP_BACKEND"  # e.g. MINIDP_BACKEND=gloo: a test suite or CPU job on a GPU machine


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


def as_timedelta(timeout: Union[float, datetime.timedelta, None], backend: str = "gloo") -> datetime.timedelta:
    """init()'s `timeout` as a timedelta.

    Args:
        timeout: seconds (a number > 0), a positive timedelta, or None for default_timeout(backend).
        backend: whose default applies to None. Default "gloo".
    """
    if timeout is None:
        return default_timeout(backend)
    if isinstance(timeout, datetime.timedelta):
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout={timeout!r} must be positive")
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):  # the message names both forms
        raise TypeError(f"timeout={timeout!r} must be seconds (a number) or a datetime.timedelta")
    return datetime.timedelta(seconds=check_number("timeout", timeout, positive=True))


def check_nccl(local_world_size: int) -> None:
    """NCCL needs CUDA and one GPU per rank on this node; say what to do instead.

    Args:
        local_world_size: the ranks on this node.
    """
    if not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, and torch.cuda.is_available() is False; "
                         "use backend='gloo'")
    gpus = torch.cuda.device_count()
    if local_world_size > gpus:
        raise ValueError(
            f"backend='nccl' with local_world_size={local_world_size} ranks on this node but {gpus} GPU(s) "
            f"visible: NCCL needs one GPU per rank (two ranks on one GPU fail or hang). Start at most {gpus} "
            f"process(es) per node, or pass backend='gloo' (or set {BACKEND_VARIABLE}=gloo) to let ranks share")
