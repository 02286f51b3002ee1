"""Fault-tolerant replicas (minidp.ft): real processes, real failures, checked bitwise against a replay.

The launches run in the background between other tests (tests/scripts/background.py), each a real
`python -m minidp.run --ft` (or a coordinator and one torchrun per replica) of tests/scripts/ft_train.py,
with failures injected at given steps, once in the whole run:
  exception  a replica's step raises after forward: every participant discards the step, nobody restarts
  kill       a replica SIGKILLs itself mid-step: the others discard the step and go on without it; the
             launcher restarts it alone and it heals from a live peer
  hang       a replica sleeps past the collective timeout and the join timeout: left out, then healed
  killserve  a replica dies mid-transfer while a joiner reads its state: the joiner takes it from another
Each run records every round (minidp.ft.Replica(record=...)); minidp.ft.replay replays the recorded
membership in one process with a plain module and no failure machinery, and every recorded commit of
every replica must have the replay's digest (bitwise), the final states too.
"""
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from minidp import ft
from minidp.data.sampler import DistributedSampler
from minidp.ft.coordinator import Coordinator
from minidp.ft.coordinator import main as coordinator_main
from minidp.ft.membership import decide_quorum
from minidp.ft.replay import check_run, read_record, state_hash
from minidp.launcher.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
sys.path.insert(0, SCRIPTS)
import ft_train  # noqa: E402
from background import folder, prelaunch  # noqa: E402
from processes import VENV_BIN, Command, clean_env  # noqa: E402

from harness import run_ranks  # noqa: E402

TRAIN = os.path.join(SCRIPTS, "ft_train.py")
# --max-restarts: the restarts each run needs, no more (a warm spare, a process importing torch, is
# started for each restart still allowed: seconds of CPU on this 2-core machine).
RUN_FT = [sys.executable, "-m", "minidp.run", "--ft", "--nproc-per-node", "3", "--join-timeout", "1.5"]
RESTARTS = {"ddp": 2, "diloco": 1}
TIMEOUT_S = 150
# Slow steps (0.2 s, sleeping) so that restarted and woken replicas find the run still going, and heal.
ENV = {"FT_STEP_S": "0.2", "FT_HANG_S": "4.5", "CUDA_VISIBLE_DEVICES": ""}
SCENARIOS = {
    # minidp.DDP with gradient-as-bucket-view and small buckets inside each replica. From step 1, replica 0
    # dies mid-transfer the first time it serves a joiner that has another source (replica 1 after its
    # kill, or replica 2 after its hang): the joiner takes the state from the other; replica 0 restarts.
    "ddp": ["--policy", "ddp", "--steps", "80", "--inject", "killserve@1:0,kill@3:1,exception@5:2,hang@14:2",
            "--ddp-kwargs", json.dumps({"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005})],
    # DiLoCo (3 inner steps a round) over minidp.DDP with static_graph
    "diloco": ["--policy", "diloco", "--steps", "30", "--inject", "kill@2:1,exception@3:2,hang@6:0",
               "--ddp-kwargs", json.dumps({"static_graph": True})],
}
HUNG = {"ddp": 2, "diloco": 0}
# ddp's hang must outlast the peers' 2 s timeout even when they reach the collective late (a loaded
# machine: a 4.5 s hang was once over before they timed out, so nobody was left out or healed)
HANG_ENV = {"ddp": {"FT_HANG_S": "8"}}
_OUT: dict = {}


def _start(name):
    out = _OUT[name] = folder(f"ft-{name}")
    if name == "torchrun":
        return _torchrun_commands(out)
    env = clean_env(**{**ENV, **HANG_ENV.get(name, {})})
    return [Command([*RUN_FT, "--max-restarts", str(RESTARTS[name]), TRAIN, "--out", out, "--timeout", "2",
                     *SCENARIOS[name]], ROOT, env, timeout=TIMEOUT_S)]


def _torchrun_commands(out):
    """A coordinator and one torchrun per replica (--max-restarts 1): replica 1 killed at step 3.

    80 steps of 0.2 s: torchrun takes seconds to notice and restart (more on a loaded machine)."""
    port = free_port()
    coordinator = [sys.executable, "-m", "minidp.ft.coordinator", "--port", str(port), "--max-replicas", "2",
                   "--join-timeout", "1.5"]
    commands = [Command(coordinator, ROOT, clean_env(**ENV), timeout=TIMEOUT_S)]
    for replica in range(2):
        env = clean_env(**ENV, MINIDP_FT_COORDINATOR=f"127.0.0.1:{port}", MINIDP_FT_REPLICA_ID=str(replica))
        commands.append(Command([os.path.join(VENV_BIN, "torchrun"), "--nproc-per-node", "1", "--max-restarts",
                                 "1", "--master-port", str(free_port()), TRAIN, "--out", out, "--timeout", "2",
                                 "--steps", "80", "--inject", "kill@3:1"], ROOT, env, timeout=TIMEOUT_S))
    return commands


LAUNCHES = {name: prelaunch(f"test_ft.py: {name}", lambda name=name: _start(name), module="test_ft.py")
            for name in [*SCENARIOS, "torchrun"]}


def _finished(name):
    results = LAUNCHES[name].results()
    for r in results:
        assert r.returncode == 0, str(r)
    return _OUT[name], "\n".join(r.output for r in results)


def _entries(out, replica):
    with open(os.path.join(out, f"replica{replica}.jsonl")) as f:
        return [json.loads(line) for line in f]


def _check_bitwise(out, policy):
    """Every commit of every replica equals the replay's; so do the final states of those that finished."""
    report = check_run(out, lambda: ft_train.build(policy), ft_train.body)
    assert report["commits"] > report["steps"] and not report["mismatches"], report["mismatches"][:5]
    finals = [r for r in range(3) if os.path.exists(os.path.join(out, f"final{r}.pt"))]
    assert len(finals) >= 2
    for replica in finals:
        final = torch.load(os.path.join(out, f"final{replica}.pt"), weights_only=False)
        model, policy_obj, _ = ft_train.build(policy)
        policy_obj.attach(model)
        model.load_state_dict(report["states"][replica]["model"])
        policy_obj.load_state_dict(report["states"][replica]["policy"])
        assert state_hash(model, policy_obj) == final["hash"]
    return report


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_failure_kind_survived_bitwise_equal_to_the_replay(name):
    out, output = _finished(name)
    policy = SCENARIOS[name][1]
    _, heals, _ = read_record(out)
    report = _check_bitwise(out, policy)
    assert report["steps"] == int(SCENARIOS[name][3])
    try:
        _check_the_story(name, out, output, heals)
    except AssertionError as e:  # pytest.fail: the whole run's story, not pytest's truncated repr
        pytest.fail(f"{e}\n{_story(out, output)}")


def _story(out, output) -> str:
    """Each replica's rounds (round, step or heal, committed, why) and the launcher's lines."""
    rows = []
    for r in range(3):
        rows.append(f"replica {r}: " + " ".join(
            f"{e['round']}:{'heal' if e.get('heal') else e['step']}{'' if e.get('committed') else '!'}"
            for e in _entries(out, r)))
        rows += [f"  round {e['round']}: {e.get('why')}" for e in _entries(out, r) if e.get("why")]
    lines = [line for line in output.splitlines() if "[minidp.ft]" in line or "minidp.run" in line]
    return "\n".join(rows + ["the launcher:"] + lines[-60:])


def _check_the_story(name, out, output, heals):
    """What each injected failure must have done (the bitwise check passed already)."""
    discarded = [e for r in range(3) for e in _entries(out, r) if not e.get("heal") and not e["committed"]]
    whys = " | ".join(e["why"] for e in discarded)
    assert "injected exception" in whys  # exception: the step discarded by every participant, no restart
    # hang: the others' collective timed out (gloo's recv, or a store wait), the step discarded
    assert "Timed out" in whys or "wait timeout" in whys, whys
    # kill: the others go on without it; the launcher restarts it alone; it heals from a live peer and
    # is bitwise equal to its peers from its first commit (every commit's digest checked above)
    assert "participants [0, 1, 2] -> [0, 2]" in output  # the launcher's log names membership changes
    assert f"restarting replica 1 alone (restart 1 of {RESTARTS[name]})" in output
    assert any(h["replica"] == 1 and h["committed"] > 0 for h in heals)
    hung = [e for e in _entries(out, HUNG[name]) if e.get("heal") and e["committed"] > 0]
    if name == "ddp":  # the hung replica came back after it was left out, and healed
        assert hung, "the hung replica never healed with a commit behind it"
        cut = [e for r in (1, 2) for e in _entries(out, r) if e.get("heal") and e["failed"]]
        assert len(cut) == 1 and cut[0]["source"] != 0 and "replica 0: IncompleteRead" in cut[0]["failed"][0], cut
        assert "restarting replica 0 alone (restart 2 of 2)" in output  # the source that died mid-transfer


def test_torchrun_per_replica_restarts_one_replica_which_heals():
    out, output = _finished("torchrun")
    report = _check_bitwise(out, "ddp")
    assert report["steps"] == 80
    assert "failed (exitcode: -9)" in output  # torchrun saw its replica's worker SIGKILLed, and restarted it
    assert any(e.get("heal") and e["committed"] > 0 for e in _entries(out, 1))


# ------------------------------------------------------------------------------ the rules, no processes
def test_quorum_rule():
    fresh = {"step": 0, "has_state": False}
    q = decide_quorum(1, {0: fresh, 1: fresh, 2: fresh}, None)
    assert (q["train"], q["participants"], q["heal"], q["seed_source"]) == (False, [], {"1": [0], "2": [0]}, 0)
    last = {**q, "committed": True}
    held = {"step": 4, "has_state": True}
    q2 = decide_quorum(2, {0: held, 1: held, 2: {"step": 3, "has_state": True}, 3: fresh}, last)
    assert q2["participants"] == [0, 1] and q2["step"] == 4 and q2["train"]
    assert q2["heal"] == {"2": [0, 1], "3": [1, 0]}  # joiners spread over the sources
    same = decide_quorum(3, {0: held, 1: held}, {**q2, "committed": True})
    assert same["epoch"] == q2["epoch"]  # same participants, last round committed: the group is reused
    assert decide_quorum(3, {0: held, 1: held}, {**q2, "committed": False})["epoch"] == q2["epoch"] + 1
    # the quorum names the process each ask came from: a restarted replica tells its predecessor's place
    q3 = decide_quorum(4, {0: {**held, "incarnation": "pid 7"}, 1: held}, None)
    assert q3["incarnations"] == {"0": "pid 7", "1": None}


def test_sample_stream_follows_the_membership_and_matches_distributed_sampler():
    s = ft.SampleStream(100, 4, seed=3)
    epoch0 = list(DistributedSampler(list(range(100)), num_replicas=1, rank=0, shuffle=True, seed=3))
    seen = []
    for count in (3, 3, 2, 1, 3, 2, 2):  # the participants of successive committed steps
        step = [i for rank in range(count) for i in s.indices(rank, count)]
        assert s.indices(0, count) == step[:4]
        seen += step
        s.advance(count, 1)
    assert seen == epoch0[:len(seen)]  # nothing skipped, nothing repeated, torch's permutation
    d = ft.SampleStream(100, 2)
    assert d.indices(1, 2, inner_step=1) == [d._index(p) for p in (6, 7)]  # (1 x 2 + 1) x 2


def test_ordered_mean_keeps_none_gradients_and_sums_in_rank_order():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    policy = ft.AverageGradients(torch.optim.SGD(model.parameters(), lr=1.0))
    policy.attach(model)
    model[0](torch.ones(1, 2)).sum().backward()  # model[1] gets no gradient
    (flat,) = policy.contribution()
    assert flat[-4:].tolist() == [1.0, 1.0, 0.0, 0.0]
    before = model[1].weight.detach().clone()
    policy.commit([flat.clone()])
    assert model[1].weight.grad is None and torch.equal(model[1].weight, before)


# Each set trains a model with a parameter the forward skips: DDP's keywords that allow it.
DDP_KEYWORDS = [{"find_unused_parameters": True},
                {"find_unused_parameters": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005},
                {"static_graph": True}, {"static_graph": True, "broadcast_buffers": False, "bucket_cap_mb": 0.001}]


class _Net(nn.Module):
    """Two layers used, and one (`unused`) that the forward skips: find_unused_parameters' case."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _one_replica_per_keyword_set():
    """A replica over minidp.DDP (its world of one) with each keyword set, against plain SGD (one process)."""
    torch.set_num_threads(1)
    import minidp
    x, y = ft_train.X[:32], ft_train.Y[:32]
    out = []
    for kwargs in DDP_KEYWORDS:
        torch.manual_seed(0)
        net, reference = _Net(), _Net()
        reference.load_state_dict(net.state_dict())
        c = Coordinator(port=0)
        threading.Thread(target=c.serve, daemon=True).start()
        model = minidp.DDP(net, **kwargs)
        policy = ft.AverageGradients(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        replica = ft.Replica(model, policy, ft.SampleStream(32, 8), replica_id=0, coordinator=f"127.0.0.1:{c.port}")
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        for _ in range(4):
            with replica.step() as r:
                idx = r.indices()
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()  # through DDP's forward
            nn.functional.cross_entropy(reference(x[idx]), y[idx]).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        replica.close()
        out.append(all(torch.equal(a, b) for a, b in zip(net.parameters(), reference.parameters()))
                   and net.unused.weight.grad is None and replica.committed == 4)
    return out


def test_every_ddp_keyword_set_composes():
    """minidp.DDP's keywords act inside a replica; the replica's mean and step on top are plain SGD's."""
    assert run_ranks(_one_replica_per_keyword_set, 1)[0] == [True] * len(DDP_KEYWORDS)


# ------------------------------------------------------------------------------ bad input and misuse
@pytest.fixture(scope="module")
def coordinator():
    c = Coordinator(port=0, min_replicas=1)  # its store lives as long as it does: held until the module ends
    threading.Thread(target=c.serve, kwargs={"stop_after_s": 60}, daemon=True).start()
    yield f"127.0.0.1:{c.port}"


def _replica(coordinator, replica_id, width=4, timeout=2):
    model = nn.Linear(width, 2)
    return ft.Replica(model, ft.AverageGradients(torch.optim.SGD(model.parameters(), lr=0.1)),
                      replica_id=replica_id, coordinator=coordinator, timeout=timeout)


def test_two_replicas_cannot_claim_one_id(coordinator):
    first = _replica(coordinator, 7)
    with pytest.raises(RuntimeError, match="replica_id=7 is held by a live process"):
        _replica(coordinator, 7)
    first.close()


def test_a_joiner_with_another_model_is_refused_naming_the_first_mismatch(coordinator):
    first = _replica(coordinator, 10)
    with pytest.raises(ValueError, match=r"'weight' has shape \(2, 5\) here but \(2, 4\) in the run's model"):
        _replica(coordinator, 11, width=5)
    first.close()


def test_an_unreachable_coordinator_is_one_clear_error():
    with pytest.raises(RuntimeError, match=r"no coordinator at 127\.0\.0\.1:\d+"):
        _replica(f"127.0.0.1:{free_port()}", 0, timeout=0.5)
    with pytest.raises(ValueError, match="coordinator='nowhere' must be 'host:port'"):
        _replica("nowhere", 0)


def test_bad_launch_arguments_are_one_line_before_any_work(capsys):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "minidp.run", *args, TRAIN], capture_output=True, text=True,
                              env=clean_env(), timeout=60)
    r = run("--ft", "--nproc-per-node", "3", "--min-replicas", "4")
    assert r.returncode == 2 and r.stderr.strip() == ("minidp.run: error: --min-replicas 4 must be between 1 and "
                                                      "--nproc-per-node 3 (the replicas there are)")
    with pytest.raises(ValueError, match="min_replicas=3 is larger than the 2 replicas"):
        Coordinator(port=0, min_replicas=3, max_replicas=2)
    lin = nn.Linear(1, 1)
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1)  # the first optimizer imports seconds of torch
    started = time.monotonic()
    with pytest.raises(ValueError, match="MINIDP_FT_REPLICA_ID is not set"):
        ft.Replica(lin, ft.AverageGradients(sgd))
    with pytest.raises(TypeError, match=r"policy=SGD is not a round policy \(no attach\(\)\)"):
        ft.Replica(lin, sgd, replica_id=0, coordinator="127.0.0.1:1")
    with pytest.raises(ValueError, match="period=0 must be an int >= 1"):
        ft.DiLoCo(sgd, sgd, 0)
    assert time.monotonic() - started < 1
    taken = Coordinator(port=0)
    assert coordinator_main(["--port", str(taken.port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"minidp.ft.coordinator: error: cannot listen on 127.0.0.1:{taken.port}"), err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.gpu
def test_a_replica_on_a_gpu_averages_and_steps_like_plain_sgd():
    """GPU-only (skipped here): gradients on the device, the mean's sums there too; count 1 (one GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    net, reference = _Net().cuda(), _Net().cuda()
    reference.load_state_dict(net.state_dict())
    policy = ft.AverageGradients(torch.optim.SGD(net.parameters(), lr=0.1))
    policy.attach(net)
    x, y = ft_train.X[:8].cuda(), ft_train.Y[:8].cuda()
    nn.functional.cross_entropy(net(x), y).backward()
    policy.commit(ft.ordered_mean(policy.contribution(), None, 0, 1))
    nn.functional.cross_entropy(reference(x), y).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), reference.parameters()))
    assert net.unused.weight.grad is None


def test_the_record_gives_heals_in_the_order_they_happened(tmp_path):
    """Replica 0 healed from 2 after 2 had healed from 1 (both after one commit): replay must copy 1's state
    to 2 first. The files are read in id order, so the heals must be put back in round order."""
    lines = {0: [{"heal": True, "round": 7, "source": 2, "committed": 1}],
             1: [{"round": 3, "step": 0, "participants": [1], "committed": True, "hash": "x"}],
             2: [{"heal": True, "round": 5, "source": 1, "committed": 1}]}
    for replica, entries in lines.items():
        (tmp_path / f"replica{replica}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    rounds, heals, digests = read_record(str(tmp_path))
    assert [(h["replica"], h["source"]) for h in heals] == [(2, 1), (0, 2)]
    assert rounds == [{"step": 0, "participants": [1]}] and digests == {(0, 1): "x"}


def test_a_restarted_replica_never_takes_the_place_its_dead_predecessor_asked_for(tmp_path):
    """Replica 0's process asks in a round and dies before the round forms; the launcher's restart (a new
    process, id 0) asks in the same round, whose quorum, formed from the dead process's ask, names id 0 a
    participant. The new process must not train there from its fresh weights (CI saw every commit of that
    step differ from the replay): it voids its place, heals from replica 1 next round, and the run equals
    the replay."""
    c = Coordinator(port=0, max_replicas=2, join_timeout=30)  # the round waits for replica 1 to ask
    threading.Thread(target=c.serve, kwargs={"stop_after_s": 60}, daemon=True).start()
    address = f"127.0.0.1:{c.port}"

    def make(replica_id):
        os.environ["MINIDP_FT_REPLICA_ID"] = "0"  # ft_train.build seeds by it: every process the same weights
        model, policy, stream = ft_train.build("ddp")
        return model, ft.Replica(model, policy, stream, replica_id=replica_id, coordinator=address, timeout=2,
                                 record=str(tmp_path))

    def train(model, replica, steps):
        while replica.committed < steps:
            with replica.step() as r:
                ft_train.body(model, replica.policy, replica.stream, r.rank, len(r.participants))

    (m0, first), (m1, other) = make(0), make(1)
    threads = [threading.Thread(target=train, args=(m0, first, 3)), threading.Thread(target=train, args=(m1, other, 3))]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    asked: dict = {}
    threading.Thread(target=lambda: asked.update(first.quorum()), daemon=True).start()  # asks, and waits ...
    while not c.store.check([f"ask/{c.round}/0"]) or c.store.check([f"ask/{c.round}/1"]):
        time.sleep(0.01)
    round_asked = c.round
    first._beating.set()  # ... and dies before the round forms: its heartbeat stops, it never acts again
    first.server.close()
    m0b, restarted = make(0)  # takes the id once the old heartbeat has stood still for a lease
    survivor = threading.Thread(target=train, args=(m1, other, 8))  # replica 1 asks: the round forms
    survivor.start()
    train(m0b, restarted, 8)
    survivor.join(60)
    other.close(), restarted.close()
    assert asked["participants"] == [0, 1] and asked["incarnations"]["0"] == first.incarnation != restarted.incarnation
    assert restarted.last_heal["source"] == 1 and restarted.committed == other.committed == 8
    assert all(torch.equal(a, b) for a, b in zip(m0b.parameters(), m1.parameters()))
    whys = [e["why"] for e in _entries(str(tmp_path), 1) if not e.get("heal") and not e["committed"]]
    assert whys == [f"replica 0: replica 0 restarted after its previous process asked in round {round_asked}: "
                    "that process's place in the round is void"], whys
    report = check_run(str(tmp_path), lambda: ft_train.build("ddp"), ft_train.body)
    assert report["steps"] == 8 and report["commits"] > 8 and not report["mismatches"], report
