"""The engine: what torch's DistributedDataParallel does, in files a learner reads in order (README.md).

First read, the default step:
  ddp.py          the nn.Module wrapper: construct (check, broadcast, build the reducer), forward,
                  no_sync(), register_comm_hook()
  reducer.py      one hook per parameter, buckets launched in order as they fill, and the
                  end-of-backward finalize that waits and writes the averaged gradients back
  buckets.py      the flat buffers and their views: gradients copied in, reduced gradients written back
  layout.py       which bucket each gradient goes to: built at construction, rebuilt once in ready order
  planning.py     DDP's bucket layout rules
  hooks.py        GradBucket and the default all-reduce hook (DDP's comm-hook contract)
Second read, one file per mode or feature, each saying what it changes in the core:
  modes.py        reads the mode keywords once: the readiness policy, bucket kind and cap the core gets
  readiness.py    the readiness policies: default and find_unused_parameters
  static_graph.py static_graph=True as a readiness policy: hook counts learned in the first iteration
  skip_unused.py  skip_all_reduce_unused_params=True: wholly unused buckets are not all-reduced
  delayed.py      delay_all_reduce_named_params: parameters averaged apart, at a chosen hook
  recovery.py     a backward that raised on one rank: the step closed on every rank, the status exchange
  join.py         uneven inputs on torch's Join protocol, and join()'s divisor
  sparse.py       sparse gradients as a bucket kind
  grad_views.py   gradient_as_bucket_view=True as a bucket kind
  mixed_precision.py  mixed_precision: low-precision forward/backward, reduce_dtype buckets
  autocap.py      bucket_cap_mb="auto": time a few caps, keep rank 0's fastest
  cap_list.py     bucket_cap_mb_list: the buckets cut by the user's list of limits
  debug.py        debug mode: per-step fingerprints of what each rank reduces
  timeline.py     the event recorder behind model.enable_timeline() (does nothing when off)
  inspection.py   enable_timeline(), bucket_plan(), auto_bucket_cap
  compat.py       the torch-compat surface: torch DDP's attributes, legacy helpers, pickling
  logging_data.py _get_ddp_logging_data(): torch DDP's logging dictionary, what minidp knows
  hook_checks.py  torch DDP's checks of a comm hook at registration
  arguments.py    the constructor's checks before any collective: arguments, device_mesh, transport
  devices.py      one device per process: device_ids checked, inputs moved there as DDP does
  collectives.py  coalesced broadcast, cross-rank agreement checks
  graph_split.py  a torch.compile backend that cuts the graph at bucket boundaries, so gradients
                  arrive during backward under torch.compile, in both wrapping orders
  progress.py     where this rank is in its step, for the watchdog that names a stuck or lost rank
"""
import atexit
import sys


def _settle_at_exit() -> None:
    """gloo frees a finished collective's work on its own thread, and minidp's buckets are tensors Python
    made: if the last reference goes after Python began finalizing (a script that ends without
    minidp.shutdown(), e.g. under Lightning, which keeps the process group), that thread cannot take the
    GIL and the process aborts ("terminate called without an active exception"). So before finalizing,
    wait (at most 2 s) until every other thread is idle, as shutdown() does. Only where torch is loaded:
    the planner and the simulator import this package without torch, and must not import it at exit."""
    if "torch" in sys.modules:
        from ..runtime.env import settle_threads
        settle_threads()


atexit.register(_settle_at_exit)
