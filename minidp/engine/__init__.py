"""The engine: what torch's DistributedDataParallel does, in files a learner reads in order (README.md).

First read, every file a default step runs through:
  ddp.py          the nn.Module wrapper: construct (check, broadcast, build the reducer), forward,
                  no_sync(), register_comm_hook(), enable_timeline()
  reducer.py      one hook per parameter, buckets launched in order as they fill, the end-of-backward
                  finalize that waits and writes the averages back; the failure protocol's methods
  step.py         one step's state, and the default readiness policy the reducer asks
  buckets.py      the flat buffers and their views: gradients copied in, reduced gradients written back
  layout.py       which bucket each gradient goes to: built at construction, rebuilt once in ready
                  order; bucket_cap_mb_list's limits and bucket_cap_mb="auto"'s tuner
  hooks.py        GradBucket, the default all-reduce hook, torch DDP's checks of a comm hook
  failures.py     a backward that raised on one rank, learned by the others with no host read
  progress.py     what a step reports: the watchdog's progress, torch's logging samples
  collectives.py  coalesced broadcast, cross-rank agreement checks (debug mode's, last)
Second read, one file per mode or feature, each saying what it changes in the core:
  arguments.py    the constructor's checks before any collective, choose(): the mode's policies,
                  and with device_ids each forward's inputs moved to the module's device
  planning.py     DDP's bucket layout rules (no torch)
  readiness.py    find_unused_parameters, skip_all_reduce_unused_params, static_graph
  bucket_kinds.py gradient_as_bucket_view, sparse gradients, mixed_precision: other bucket kinds
  join.py         uneven inputs on torch's Join protocol, and join()'s divisor
  timeline.py     the event recorder behind model.enable_timeline()
  compat.py       the torch-compat surface: torch DDP's attributes, legacy helpers, pickling, logging
  delayed.py      delay_all_reduce_named_params: parameters averaged apart, at a chosen hook
  graph_split.py  a torch.compile backend that cuts the graph at bucket boundaries, so gradients
                  arrive during backward under torch.compile, in both wrapping orders
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
