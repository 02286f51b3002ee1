"""real_models.py with one or more of minidp's mechanisms switched off: does that mechanism cause a gap?

    python benchmarks/speed/real_models_ablate.py --off watchdog -- --world-sizes 2 --models resnet50 --pairs ddp
    python benchmarks/speed/real_models_ablate.py --off small-batch hold-back -- --quick

Everything after `--` goes to real_models.py as it is. The switches (each a patch of minidp, made in this
process before the ranks are forked, so every rank runs the patched engine, and undone after the run;
torch's side is untouched):
  watchdog     minidp.init starts no watchdog thread (runtime/watchdog.py: a daemon thread that publishes
               each rank's progress to the store, a few times a second while minidp's engine changes it)
  small-batch  every gradient is copied into its bucket at its hook (engine/layout.py SMALL_GRAD_NUMEL = 0:
               no small gradient waits for its bucket's launch to be copied in one batch)
  hold-back    the last bucket is launched at its last gradient's hook, as torch DDP does, not at the end
               of backward (engine/reducer.py holds it there for the failure protocol: failures.py; with
               this switch a rank whose backward raises leaves the others waiting; for measuring only)
  early-write-back  every bucket is written back after the step's verdict, as before 2026-12-06 (engine/
               reducer.py now writes each bucket but the last back as soon as it is reduced, while the
               later ones are still in flight, as torch's reducer does)
The switches are for measuring; results (gradients, weights) do not change with any of them.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]


def no_watchdog():
    import minidp.runtime.watchdog as watchdog

    # runtime/env.py calls watchdog.start(...) at init
    return mock.patch.object(watchdog, "start", lambda *args, **kwargs: None)


def no_small_batch():
    import minidp.engine.layout as layout

    return mock.patch.object(layout, "SMALL_GRAD_NUMEL", 0)  # read when a DDP builds its layout


def no_hold_back():
    from minidp.engine.reducer import Reducer

    launch = Reducer.launch_ready_buckets

    def launch_all_ready(self, step, at_end=False):
        return launch(self, step, at_end=True)  # at_end: the last bucket too, once it is full

    return mock.patch.object(Reducer, "launch_ready_buckets", launch_all_ready)


def no_early_write_back():
    from minidp.engine.reducer import Reducer

    return mock.patch.object(Reducer, "_writes_back_early", lambda self: False)


SWITCHES = {"watchdog": no_watchdog, "small-batch": no_small_batch, "hold-back": no_hold_back,
            "early-write-back": no_early_write_back}


@contextlib.contextmanager
def switched_off(names):
    """Inside the block, minidp runs with the named mechanisms off (ranks forked inside it too);
    after it, as before."""
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(SWITCHES[name]())
        yield


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--off", nargs="+", choices=sorted(SWITCHES), required=True, help="mechanisms to switch off")
    args = p.parse_args(ours)
    import real_models  # its ranks are forked (rank_memory.launch_json), so they run what is patched here

    print(f"minidp with {', '.join(args.off)} switched off (real_models_ablate.py)", flush=True)
    with switched_off(args.off):
        return real_models.main(rest + ["--note", f"minidp ablated: {' '.join(args.off)}"])


if __name__ == "__main__":
    sys.exit(main())
