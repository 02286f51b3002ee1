"""Training that keeps going when a replica is lost: minidp.ft under `python -m minidp.run --ft`.

    python -m minidp.run --ft --nproc-per-node 3 --max-restarts 1 examples/fault_tolerant.py --kill 1@20

Three replicas (one process each) train a small classifier on synthetic data. `--kill 1@20` makes
replica 1 SIGKILL itself in the middle of step 20 (once: its restart does not): the other two discard
that step and go on without it, the launcher starts replica 1 again alone, and the new process loads
the weights, the optimizer's momentum, the step count and the sample position from a live peer over
the network, then trains with them again. At the end every replica prints the digest of its state:
the same on all of them, bit for bit.
"""
from __future__ import annotations

import argparse
import os
import signal

import torch
from torch import nn

from minidp import ft
from minidp.ft.replay import state_hash


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps to commit (default 300)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per replica and step (default 32)")
    p.add_argument("--kill", default=None, metavar="REPLICA@STEP",
                   help="that replica SIGKILLs itself mid-step at that step, once (default: none)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.batch_size < 1:
        p.error(f"--steps {a.steps} and --batch-size {a.batch_size} must be >= 1")
    if a.kill is not None:
        try:
            a.kill = tuple(int(v) for v in a.kill.split("@"))
            assert len(a.kill) == 2
        except (ValueError, AssertionError):
            p.error(f"--kill {a.kill!r} must be REPLICA@STEP, e.g. 1@20")
    return a


def synthetic_data(samples=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 20, generator=g)
    return x, (x @ torch.randn(20, 5, generator=g)).argmax(1)


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = synthetic_data()
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    steps, batch_size = a.steps, a.batch_size

    def lose_this_machine_if_asked():  # --kill: a SIGKILL mid-step, no exception, no cleanup
        if a.kill == (replica.id, replica.committed) and first_life:
            os.kill(os.getpid(), signal.SIGKILL)

    replica = ft.Replica(model, ft.AverageGradients(optimizer), ft.SampleStream(len(x), batch_size))
    while replica.committed < steps:
        with replica.step() as r:            # ranks meet: who takes part (a replica behind heals first)
            idx = r.indices()                # this replica's cut of the step's samples
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            lose_this_machine_if_asked()
            loss.backward()
        # here the step is averaged over the participants and stepped on all of them, or on none
    replica.close()

    healed = getattr(replica, "last_heal", None)  # (at step 0 every replica but 0 loads replica 0's weights)
    came = (f", healed at step {healed['committed']} from replica {healed['source']} in "
            f"{healed['seconds']:.2f} s" if healed and healed["committed"] else "")
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    print(f"replica {replica.id}: {replica.committed} steps, accuracy {accuracy:.3f}{came}, "
          f"state digest {state_hash(model, replica.policy)}", flush=True)


if __name__ == "__main__":
    main()
