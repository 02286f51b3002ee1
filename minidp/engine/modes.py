"""The wrapper's mode keywords, read in one place: what the core is given instead of `if mode` branches.

What it changes in the core: nothing; it picks. The reducer asks a readiness policy (readiness.py,
static_graph.py); the layout makes its buckets with a factory (buckets.py, grad_views.py, sparse.py,
which also says which gradients are sparse), cuts them by a list of limits (planning.py, or
cap_list.py's bucket_cap_mb_list) and lets a tuner change its cap (autocap.py). `choose`
picks them from the keywords, once per reducer (again when a pickled wrapper is loaded), so no file
of the first read imports a mode's file.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from . import planning
from .autocap import AutoCap
from .buckets import Bucket
from .cap_list import limits_of
from .grad_views import ViewBucket
from .mixed_precision import MixedPrecisionBucket, MixedPrecisionState
from .readiness import EveryParameter, FindUnused
from .skip_unused import SkipUnused
from .sparse import SparseBucket, sparse_gradient_flags
from .static_graph import StaticGraph


class Mode(NamedTuple):
    """What `choose` gives the reducer (readiness) and its layout (the rest).

    readiness: the policy the reducer asks whether a gradient is final (readiness.py).
    sparse: by parameter, whether its gradient is sparse (sparse.py): a bucket of its own and kind.
    new_bucket: (index, param_indices, params, sparse) -> a bucket of the mode's kind.
    needs_rebuild: torch's `static_graph or not find_unused_parameters`: rebuilt once, in ready order.
    cap: the cap (MiB) the layout starts with: bucket_cap_mb (None: DDP's default), or under "auto"
        the tuner's first candidate; with bucket_cap_mb_list, the list's largest (as torch's).
    limits: (cap, first_iteration, needs_rebuild) -> the byte limits of a plan: planning's
        bucket_limits, or bucket_cap_mb_list's (cap_list.py).
    tuner: bucket_cap_mb="auto"'s AutoCap, which changes the layout's cap in the first iterations.
    compile_cap: the cap torch.compile's graph is cut at (graph_split.py): bucket_cap_mb, or DDP's
        default (None) under "auto", whose cap is not chosen yet when the module is compiled.
    """

    readiness: object
    sparse: list[bool]
    new_bucket: Callable
    needs_rebuild: bool
    cap: float | None
    limits: Callable
    tuner: AutoCap | None
    compile_cap: float | None


def choose(ddp, params: list, names: list[str]) -> Mode:
    """The mode of the wrapper `ddp`'s keywords (static_graph wins over find_unused_parameters).

    Args:
        ddp: the minidp.DistributedDataParallel; its bucket_cap_mb, find_unused_parameters,
            static_graph and gradient_as_bucket_view are read (its keywords, validated already),
            and its module, process_group and transport (which gradients are sparse, and whether
            they can be reduced there: sparse.py).
        params, names: the reducer's parameters and their names.
    """
    sparse = sparse_gradient_flags(ddp.module, params, names, ddp.process_group, ddp.transport)
    bucket_cap_mb = ddp.bucket_cap_mb
    static_graph = ddp.static_graph
    find_unused_parameters = ddp.find_unused_parameters
    if static_graph:
        readiness = StaticGraph(names)
    elif find_unused_parameters:  # skip_all_reduce_unused_params: less some all-reduces
        skip = ddp.torch_keywords["skip_all_reduce_unused_params"]
        readiness = (SkipUnused if skip else FindUnused)(names)
    else:
        readiness = EveryParameter(names)
    dense = ViewBucket if ddp.gradient_as_bucket_view else Bucket
    if ddp.mixed_precision is not None:  # mixed_precision.py: buckets in reduce_dtype
        dense = functools.partial(MixedPrecisionBucket, state=MixedPrecisionState(ddp, sparse))
    tuner = AutoCap() if bucket_cap_mb == "auto" else None  # the one place that reads "auto"
    caps = ddp.torch_keywords["bucket_cap_mb_list"]  # None, or a non-empty list (cap_list.py)
    limits = planning.bucket_limits if caps is None else functools.partial(limits_of, caps)
    bucket_cap_mb = bucket_cap_mb if caps is None else max(caps)  # torch ignores it then
    return Mode(readiness=readiness,
                sparse=sparse,
                new_bucket=functools.partial(new_bucket, dense=dense),
                needs_rebuild=static_graph or not find_unused_parameters,
                cap=bucket_cap_mb if tuner is None else tuner.cap,
                limits=limits,
                tuner=tuner,
                compile_cap=bucket_cap_mb if tuner is None else None)


def new_bucket(index: int, param_indices: list[int], params: list, sparse: bool, dense=Bucket):
    """A bucket of the mode's kind: a sparse gradient's own (sparse.py), else `dense`."""
    kind = SparseBucket if sparse else dense
    return kind(index, param_indices, params)
