"""A replica of a fault-tolerant run (minidp.ft), for the tests and the soak benchmark.

    python -m minidp.run --ft --nproc-per-node 3 tests/scripts/ft_train.py --steps 12 --out DIR \
        --inject kill@5:1,exception@3:2,hang@8:0

Trains a small MLP through minidp.DDP (a world of one per replica) with ft.AverageGradients, or
DiLoCo (--policy diloco); an `--inject kind@committed_step:replica` event fires once in the whole
run (a file in DIR remembers it), mid-step: after forward, before backward, at the named replica's
first step with at least committed_step steps committed and a peer in the round, and (all but killserve,
which only arms) once the run is whole again: every replica this process has seen in a round is back in
this one, and nobody heals in it or healed in the one before. So the failures come one at a time: on a
loaded machine a hang, and in another run the exception, fell in the round where a source killed
mid-transfer died, and that round's record named the death, not them.
Each replica appends
what it did to DIR/replica<id>.jsonl as it goes (a SIGKILL loses nothing written), and its final
state to DIR/final<id>.pt.
"""
import argparse
import json
import os
import signal
import time

import torch
from torch import nn

import minidp
from minidp import ft
from minidp.ft import transfer
from minidp.ft.replay import state_hash

transfer.CHUNK_BYTES = 1024  # several pieces a state: a source can die mid-transfer

SAMPLES, BATCH = 512, 8


def build(policy_name="ddp", period=3, ddp_kwargs=None):
    torch.manual_seed(int(os.environ.get("MINIDP_FT_REPLICA_ID", "0")) + 100)  # replicas differ until healed
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    model = minidp.DDP(net, **(ddp_kwargs or {})) if ddp_kwargs is not None else net
    if policy_name == "ddp":
        policy = ft.AverageGradients(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        policy = ft.DiLoCo(inner, outer, period=period)
    return model, policy, ft.SampleStream(SAMPLES, BATCH, seed=0)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=g)
    return x, (x @ torch.randn(8, 4, generator=g)).argmax(1)


X, Y = data()


def body(model, policy, stream, rank, count, inject=lambda: None):
    for inner_step in range(policy.inner_steps):
        idx = stream.indices(rank, count, inner_step)
        loss = nn.functional.cross_entropy(model(X[idx]), Y[idx])
        inject()
        loss.backward()
        if isinstance(policy, ft.DiLoCo):
            policy.inner.step()
            policy.inner.zero_grad()


def arm_kill_while_serving(replica):
    """Die after the first piece of the next state this replica serves to a joiner that has another source."""
    serve = replica.server.send_chunk

    def send_chunk(wfile, chunk):
        serve(wfile, chunk)
        if any(len(sources) > 1 for sources in replica.last_quorum["heal"].values()):
            wfile.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    replica.server.send_chunk = send_chunk


def injector(events, replica, out, ft_replica=None):
    """A function that fires this replica's due event once in the run (mid-step)."""
    fired_path = os.path.join(out, "fired")
    most = [0]  # the most participants this process has seen in a round

    def fire(committed, participants, healing=False):
        most[0] = max(most[0], participants)
        if participants < 2:  # a failure alone in a round would test nothing: keep it for a round with peers
            return
        # event -> the round it fired in, as the file says (every replica appends to it)
        fired = dict(line.split() for line in open(fired_path)) if os.path.exists(fired_path) else {}
        now = ft_replica.last_round if ft_replica is not None else 0
        e = next((e for e in events if e not in fired), None)  # one at a time, in the order given
        if e is None:
            return
        kind, at = e.split("@")
        step, who = at.split(":")
        # at this replica's first step at or after `step` with a peer: one that healed past it (left out
        # of a round on a loaded machine, say) still gets its event
        if int(who) != replica or committed < int(step):
            return
        # the last failure is not over: its round is this one, someone is missing, or someone heals in
        # this round or healed in the last (a source killed mid-transfer dies in the round after the
        # joiner's, as the transfer ends)
        healed_last = ft_replica is not None and bool((ft_replica.last_quorum or {}).get("heal"))
        last_round = max((int(r) for r in fired.values()), default=0)
        if kind != "killserve" and (healing or healed_last or participants < most[0] or now <= last_round):
            return
        with open(fired_path, "a") as f:
            f.write(f"{e} {now}\n")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "killserve":  # die mid-transfer the next time a joiner reads this replica's state
            arm_kill_while_serving(ft_replica)
        elif kind == "hang":
            time.sleep(float(os.environ.get("FT_HANG_S", "4")))
        else:
            raise RuntimeError(f"injected exception at step {committed} on replica {replica}")
    return fire


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--policy", default="ddp", choices=["ddp", "diloco"])
    p.add_argument("--out", required=True)
    p.add_argument("--inject", default="")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--ddp-kwargs", default="{}", help="JSON keywords for minidp.DDP; 'none': a plain module")
    a = p.parse_args()
    torch.set_num_threads(1)
    minidp.init()
    kwargs = None if a.ddp_kwargs == "none" else json.loads(a.ddp_kwargs)
    model, policy, stream = build(a.policy, ddp_kwargs=kwargs)
    replica = ft.Replica(model, policy, stream, timeout=a.timeout, record=a.out)
    fire = injector([e for e in a.inject.split(",") if e], replica.id, a.out, replica)
    while replica.committed < a.steps:
        with replica.step() as r:
            count, healing = len(r.participants), bool(r.q.get("heal"))
            body(model, policy, stream, r.rank, count,
                 lambda count=count, healing=healing: fire(replica.committed, count, healing))
            time.sleep(float(os.environ.get("FT_STEP_S", "0")))  # slower steps: a woken replica rejoins
    torch.save({"model": model.state_dict(), "policy": policy.state_dict(), "hash": state_hash(model, policy)},
               os.path.join(a.out, f"final{replica.id}.pt"))
    replica.close()


if __name__ == "__main__":
    main()
