"""benchmarks/ft/goodput_metrics.py on hand-made event logs (no processes, no torch)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "ft"))  # benchmarks/ is not a package
import goodput_metrics as gm  # noqa: E402
from event_log import EventLog  # noqa: E402

T0 = 1000.0  # the run's start


def _write(log_dir, name, replica, start, commits, failures=()):
    """One incarnation's file: a start at T0 + start, (T0 + t, step) commits, (T0 + t, kind, at_s) failures."""
    with open(os.path.join(log_dir, name + ".jsonl"), "w") as f:
        f.write(json.dumps({"t": T0 + start, "replica": replica, "event": "start"}) + "\n")
        for t, step in commits:
            f.write(json.dumps({"t": T0 + t, "replica": replica, "event": "commit", "step": step}) + "\n")
        for t, kind, at_s in failures:
            f.write(json.dumps({"t": T0 + t, "replica": replica, "event": "failure", "kind": kind, "at_s": at_s})
                    + "\n")


@pytest.fixture
def restart_run(tmp_path):
    """Two replicas commit steps 0-9 at t = 1..10; both killed, restarted at 12, redo 5-9 at 13..17, then 10-11."""
    for r in (0, 1):
        _write(tmp_path, f"a{r}", r, 0.0, [(1.0 + s, s) for s in range(10)])
        _write(tmp_path, f"b{r}", r, 12.0, [(13.0 + i, 5 + i) for i in range(7)])
    return gm.read_logs(str(tmp_path))


def test_read_logs_one_entry_per_incarnation(restart_run):
    assert [r["replica"] for r in restart_run] == [0, 1, 0, 1]
    assert restart_run[0]["start"] == T0 and restart_run[0]["commits"][0] == (T0 + 1.0, 0)


def test_rate_counts_each_step_index_once_within_the_window(restart_run):
    # steps 0-11 are distinct (5-9 redone): 12 in a 20 s window; a 10.5 s window holds 0-9
    assert gm.committed_rate(restart_run, T0, 20.0) == pytest.approx(12 / 20)
    assert gm.committed_rate(restart_run, T0, 10.5) == pytest.approx(10 / 10.5)
    assert gm.committed_rate(restart_run, T0, 20.0, per_replica=True) == pytest.approx(24 / 20)
    with pytest.raises(ValueError, match="duration_s=0"):
        gm.committed_rate(restart_run, T0, 0)


def test_kill_to_commit_is_the_next_commit_by_any_replica(restart_run):
    schedule = [{"at_s": 3.5, "replica": 1, "kind": "kill"}, {"at_s": 10.5, "replica": 0, "kind": "kill"},
                {"at_s": 4.0, "replica": 0, "kind": "hang"}, {"at_s": 25.0, "replica": 0, "kind": "kill"}]
    # 3.5 -> 4.0; 10.5 -> 13.0; the hang is not a kill; 25.0 is past the window's end (21)
    assert gm.kill_to_commit(restart_run, schedule, T0, T0 + 21.0) == pytest.approx([0.5, 2.5])
    # a kill with no commit after it inside the window is a None (counted as missing)
    assert gm.kill_to_commit(restart_run, [{"at_s": 20.5, "replica": 0, "kind": "kill"}], T0, T0 + 21.0) == [None]
    failures = gm.kill_to_commit(restart_run, schedule, T0, T0 + 21.0, kinds=("kill", "hang"))
    assert failures == pytest.approx([0.5, 1.0, 2.5])


def test_kill_to_commit_skips_a_straggler_finishing_an_earlier_step(tmp_path):
    # replica 1 commits step 3 at 4.0 and is killed at 4.1; replica 0 finishes step 3 at 4.2, then waits
    _write(tmp_path, "a0", 0, 0.0, [(1.0, 0), (4.2, 3), (6.0, 4)])
    _write(tmp_path, "a1", 1, 0.0, [(1.0, 0), (4.0, 3)])
    runs = gm.read_logs(str(tmp_path))
    assert gm.kill_to_commit(runs, [{"at_s": 4.1, "replica": 1, "kind": "kill"}], T0, T0 + 10.0) == pytest.approx([1.9])


def test_kill_to_commit_starts_when_the_failure_fired(tmp_path):
    # replica 1's kill due at 3.5 fires at its next mid-step poll, 3.9; the one due at 8.0 never fires
    _write(tmp_path, "a0", 0, 0.0, [(1.0 + s, s) for s in range(4)] + [(6.0, 4)])
    _write(tmp_path, "a1", 1, 0.0, [(1.0 + s, s) for s in range(3)] + [(3.8, 3)], failures=[(3.9, "kill", 3.5)])
    runs = gm.read_logs(str(tmp_path))
    assert runs[1]["failures"] == [(T0 + 3.9, "kill", 3.5)]
    schedule = [{"at_s": 3.5, "replica": 1, "kind": "kill"}, {"at_s": 8.0, "replica": 0, "kind": "kill"}]
    # from 3.9: replica 0's commit of step 3 at 4.0 is a straggler's (replica 1 committed 3 at 3.8)
    assert gm.kill_to_commit(runs, schedule, T0, T0 + 10.0) == pytest.approx([2.1])
    s = gm.summarize(runs, schedule, T0, 10.0)
    assert (s["failures_scheduled"], s["failures_fired"]) == (2, 1)


def test_event_log_poll_logs_due_failures_before_the_injector_fires(tmp_path):
    class FakeInjector:
        run_start = 0.0  # every event is due
        events = [{"at_s": 1.0, "replica": 0, "kind": "hang"}]
        polled = False

        def poll(self):
            self.polled = True

    log, injector = EventLog(str(tmp_path), replica=0), FakeInjector()
    log.poll(injector)
    log.close()
    assert injector.polled and gm.read_logs(str(tmp_path))[0]["failures"][0][1:] == ("hang", 1.0)


def test_restart_to_commit_skips_each_replicas_first_incarnation(restart_run, tmp_path):
    assert gm.restart_to_commit(restart_run, T0, T0 + 30.0) == pytest.approx([1.0, 1.0])
    # an incarnation that never commits before the end is a None; one that starts after the end is not counted
    _write(tmp_path, "c0", 0, 22.0, [])
    _write(tmp_path, "d1", 1, 31.0, [(32.0, 12)])
    runs = gm.read_logs(str(tmp_path))
    assert gm.restart_to_commit(runs, T0, T0 + 30.0) == pytest.approx([1.0, 1.0, None])


def test_spread_min_max_when_few_p10_p90_from_ten():
    few = gm.spread([3.0, 1.0, None, 2.0])
    assert few == {"n": 3, "missing": 1, "median": 2.0, "lo": 1.0, "hi": 3.0, "range": "min-max"}
    many = gm.spread([float(i) for i in range(11)])  # 0..10
    assert (many["median"], many["lo"], many["hi"], many["range"]) == (5.0, 1.0, 9.0, "p10-p90")
    assert gm.spread([None])["median"] is None


def test_summarize_goodput_against_a_baseline(restart_run):
    s = gm.summarize(restart_run, [{"at_s": 10.5, "replica": 0, "kind": "kill"}], T0, 20.0, baseline_rate=1.2)
    assert s["committed_steps_per_s"] == pytest.approx(0.6) and s["goodput"] == pytest.approx(0.5)
    assert s["incarnations"] == 4 and s["kill_to_commit_s"] == pytest.approx([2.5])
    assert gm.summarize(restart_run, [], T0, 20.0)["goodput"] is None


def test_event_log_round_trip(tmp_path):
    log = EventLog(str(tmp_path), replica=2)
    log.commit(0)
    log.commit(1)
    log.close()
    (run,) = gm.read_logs(str(tmp_path))
    assert run["replica"] == 2 and [s for _, s in run["commits"]] == [0, 1] and run["start"] <= run["commits"][0][0]
    with pytest.raises(ValueError, match="replica=-1"):
        EventLog(str(tmp_path), replica=-1)


def test_bad_lines_and_folders_are_named(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"t": 1.0, "event": "start"}\n')
    with pytest.raises(ValueError, match="x.jsonl:1"):
        gm.read_logs(str(tmp_path))
    with pytest.raises(ValueError, match="log_dir="):
        gm.read_logs(str(tmp_path / "missing"))
