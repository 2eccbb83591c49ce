"""`evobus report LOG`: what the report reads from a log, and the page it writes.

The analysis is checked on a hand-written log with known times (a re-dispatch, a late
answer, starved and idle stretches) and on a real run; the charts and the page need
matplotlib and are skipped cleanly without it.
"""

from __future__ import annotations

import importlib.util
import random
import re
import sys

import pytest

from actors.cli.main import main
from actors.cli.render import analyse
from bus.log import FORMAT_VERSION, LogHeader, LogWriter
from protocol import (Baseline, Branch, BranchDone, EvalDone, EvalRequest, GroupStart,
                      GroupSuspended, Hello, Interaction, Lease, LeaseDone, Open,
                      PendingInteraction, RoundClosed, RunDone, Settled, encode)

pytestmark = pytest.mark.timeout(60)

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason='matplotlib is not installed (evobus[report])')


def write_log(path, entries, finished=True):
    """entries: (t, sender, receiver, message)."""
    header = LogHeader(format_version=FORMAT_VERSION, scenario="hand-written", seed=3,
                       run_id="abc")
    with LogWriter(path, header, fsync="never") as w:
        for seq, (t, sender, receiver, msg) in enumerate(entries, 1):
            w.append(seq, float(t), sender, receiver, encode(msg))
    return path


def lease(lid, kind="rollout"):
    return Lease(lease_id=lid, round=0, kind=kind, task_ids=["a"])


def done(lid, worker):
    return LeaseDone(lease_id=lid, worker=worker, round=0)


@pytest.fixture
def hand_log(tmp_path):
    # worker-0: busy 1-3 (r0.u0, then lost), worker-1: busy 1-2, then gets r0.u0
    # re-dispatched at 4 and answers at 5; worker-0's late answer arrives at 6.
    return write_log(tmp_path / "hand.evolog", [
        (0.0, "worker-0", "scheduler", Hello(worker="worker-0")),
        (0.0, "worker-1", "scheduler", Hello(worker="worker-1")),
        (0.5, "merger", "planner", Baseline(version=0, heldout_reward=0.25)),
        (1.0, "scheduler", "worker-0", lease("r0.u0")),
        (1.0, "scheduler", "worker-1", lease("r0.u1")),
        (2.0, "worker-1", "scheduler", done("r0.u1", "worker-1")),
        (2.0, "scheduler", "planner", Settled(lease_id="r0.u1", round=0, unit=1,
                                              scores=[("a", 1.0)])),
        (4.0, "scheduler", "worker-1", lease("r0.u0")),
        (5.0, "worker-1", "scheduler", done("r0.u0", "worker-1")),
        (6.0, "worker-0", "scheduler", done("r0.u0", "worker-0")),
        (7.0, "merger", "planner", RoundClosed(round=0, version=1, committed=True,
                                               heldout_reward=0.75, proposals=3,
                                               outcomes={"committed": 1, "duplicate": 2})),
        (8.0, "merger", "driver", RunDone(stop_reason="rounds", version=1, state={},
                                          final_reward=0.75, initial_reward=0.25,
                                          outcomes={"committed": 1, "duplicate": 2},
                                          rollouts=2)),
    ])


def test_the_analysis_counts_redispatches_and_late_answers(hand_log):
    a = analyse(hand_log)
    assert a.workers == ["worker-0", "worker-1"]
    assert a.redispatches == 1
    assert a.late_answers == 1
    assert a.baseline == (0.5, 0.25)
    assert [(r.round, r.version, r.committed, r.heldout, r.rollouts) for r in a.rounds] == \
        [(0, 1, True, 0.75, 1)]
    assert a.outcomes == {"committed": 1, "duplicate": 2}
    assert (a.initial_reward, a.final_reward, a.stop_reason) == (0.25, 0.75, "rounds")


def test_busy_starved_and_idle_time_per_worker(hand_log):
    a = analyse(hand_log)
    # worker-1 lives 0-5: idle 0-1 (no lease out), busy 1-2, starved 2-4 (worker-0 busy),
    # busy 4-5.
    assert a.worker_time("worker-1") == pytest.approx({"idle": 1.0, "busy": 2.0,
                                                       "starved": 2.0})
    # worker-0 lives 0-6: idle 0-1, busy 1-6 (its lease is only answered at 6).
    assert a.worker_time("worker-0") == pytest.approx({"idle": 1.0, "busy": 5.0})


def _states_by_definition(a, worker):
    """Busy, starved and idle seconds of ``worker`` as the report defines them, sampled
    on a grid: busy while it holds a lease, starved while free and another worker holds
    one, idle while no one holds one. The slow reference worker_states must agree with."""
    start, end = a.lifetimes[worker]
    spans = [(s.worker, s.start, s.end if s.end is not None else a.duration)
             for s in a.spans]
    out, steps = {"busy": 0.0, "starved": 0.0, "idle": 0.0}, 4000
    dt = (end - start) / steps
    for k in range(steps):
        t = start + (k + 0.5) * dt
        held = {w for w, s0, s1 in spans if s0 <= t < s1}
        out["busy" if worker in held else "starved" if held else "idle"] += dt
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_busy_starved_and_idle_follow_their_definition_with_overlapping_leases(seed):
    """Random leases (several at once on a worker with slots, gaps, re-dispatches to the
    same worker), seed in the test id: the report's split agrees with the definition."""
    from actors.cli.analysis import LeaseSpan, RunAnalysis

    rng = random.Random(seed)
    a = RunAnalysis(path="x", header=None, duration=10.0)
    for w in range(5):
        for i in range(rng.randrange(0, 12)):
            t0 = rng.uniform(0, 9.5)
            end = None if rng.random() < 0.05 else min(10.0, t0 + rng.uniform(0, 1.5))
            a.spans.append(LeaseSpan(f"l{w}.{i}", f"w{w}", "rollout", t0, end))
    a.workers = sorted({s.worker for s in a.spans})
    a.lifetimes = {w: (0.0, 10.0) for w in a.workers}
    for w in a.workers:
        got, want = a.worker_time(w), _states_by_definition(a, w)
        for state in want:
            assert got.get(state, 0.0) == pytest.approx(want[state], abs=0.02), (seed, w)


@pytest.mark.timeout(20)
def test_the_timeline_of_many_workers_and_leases_is_split_in_seconds():
    """32 workers of 1,000 leases each: each worker's free stretches were cut against
    every other lease (57 s for the report's two passes); one pass over the leases, once
    sorted, takes well under a second."""
    from actors.cli.analysis import LeaseSpan, RunAnalysis

    rng = random.Random(0)
    a = RunAnalysis(path="x", header=None)
    for w in range(32):
        t = 0.0
        for i in range(1000):
            t += rng.random() * 0.01
            d = rng.random() * 0.02
            a.spans.append(LeaseSpan(f"l{w}.{i}", f"worker-{w}", "rollout", t, t + d))
            t += d
    a.duration = max(s.end for s in a.spans)
    a.workers = [f"worker-{w}" for w in range(32)]
    a.lifetimes = {w: (0.0, a.duration) for w in a.workers}
    for _ in range(2):   # the chart, then the table
        for w in a.workers:
            assert sum(a.worker_time(w).values()) == pytest.approx(a.duration)


@needs_matplotlib
def test_off_a_terminal_the_report_says_what_it_reads_then_that_it_draws(hand_log, capsys):
    """Plain lines on stderr as it goes (a big log takes seconds); the page on stdout;
    --quiet says nothing and still writes it."""
    assert main(["report", str(hand_log)]) == 0
    captured = capsys.readouterr()
    size = hand_log.stat().st_size / 1000
    assert captured.err.splitlines()[0] == f"report: reading {hand_log} ({size:.1f} KB)"
    assert re.fullmatch(r"report: 12 records, 2 workers, 3 leases, 1 round read in "
                        r"\d+\.\d s; drawing the charts", captured.err.splitlines()[1])
    assert len(captured.err.splitlines()) == 2, captured.err
    assert captured.out.startswith("report: ") and "index.html" in captured.out
    page = hand_log.with_name("hand-report") / "index.html"
    page.unlink()
    assert main(["report", str(hand_log), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "") and page.exists()


def test_only_held_out_scores_are_candidates(tmp_path):
    log = write_log(tmp_path / "evals.evolog", [
        (0.0, "planner", "merger", Open(heldout_ids=["h1", "h2"])),
        (1.0, "merger", "scheduler", EvalRequest(eval_id="e1", state={}, task_ids=["h2", "h1"])),
        (2.0, "scheduler", "merger", EvalDone(eval_id="e1", score=0.5)),
        (3.0, "merger", "scheduler", EvalRequest(eval_id="e2", state={}, task_ids=["a"])),
        (4.0, "scheduler", "merger", EvalDone(eval_id="e2", score=1.0)),
    ])
    a = analyse(log)
    assert a.candidates == [(2.0, 0.5)]
    assert a.other_evals == 1


@pytest.fixture
def group_log(tmp_path):
    pending = PendingInteraction(id="q1", branch=1, kind="approve", prompt="refund?")
    return write_log(tmp_path / "group.evolog", [
        (0.0, "driver", "collector.g", GroupStart(group_id="g", items=[1, 2], workers=[
            "branch-worker.g.0", "branch-worker.g.1"], max_concurrency=2, max_items=8)),
        (1.0, "collector.g", "branch-worker.g.0", Branch(group_id="g", lease_id="g.0",
                                                          indices=[0], items=[1])),
        (1.0, "collector.g", "branch-worker.g.1", Branch(group_id="g", lease_id="g.1",
                                                          indices=[1], items=[2])),
        (2.0, "branch-worker.g.1", "collector.g", Interaction(group_id="g", lease_id="g.1",
                                                              index=1, pending=pending)),
        (3.0, "branch-worker.g.0", "collector.g", BranchDone(group_id="g", lease_id="g.0",
                                                             indices=[0], values=["ok"])),
        (4.0, "collector.g", "driver", GroupSuspended(group_id="g", status="approval_pending",
                                                      pending=[pending], finished={0: "ok"})),
    ])


def test_a_parallel_group_log_shows_branches_and_waiting(group_log):
    a = analyse(group_log)
    assert a.workers == ["branch-worker.g.0", "branch-worker.g.1"]
    assert not a.evolves and a.complete
    assert a.groups == {"g": {"items": 2, "bound": 2, "leases": 2,
                              "status": "approval_pending", "finished": 1, "failed": 0,
                              "waiting": 1}}
    assert [(s.worker, s.kind, s.start, s.end) for s in a.spans] == [
        ("branch-worker.g.0", "branch", 1.0, 3.0), ("branch-worker.g.1", "branch", 1.0, 2.0),
        ("branch-worker.g.1", "waiting", 2.0, 4.0)]


@needs_matplotlib
def test_the_page_of_a_group_log_has_no_reward_chart(group_log):
    assert main(["report", str(group_log)]) == 0
    page = (group_log.with_name("group-report") / "index.html").read_text()
    assert "Parallel groups" in page and "approval_pending" in page
    assert "<th>leases</th>" in page and "<td>g</td><td>2</td><td>2</td><td>2</td>" in page
    assert "Held-out reward" not in page and "did not finish" not in page
    assert page.count("data:image/png") == 1


def test_a_log_cut_short_has_no_result_but_still_reports(tmp_path):
    log = write_log(tmp_path / "cut.evolog", [
        (0.0, "worker-0", "scheduler", Hello(worker="worker-0")),
        (1.0, "scheduler", "worker-0", lease("r0.u0")),
    ])
    a = analyse(log)
    assert a.stop_reason is None and a.rounds == []
    assert a.worker_time("worker-0") == pytest.approx({"idle": 1.0})
    assert a.spans[0].end == a.duration


@pytest.fixture(scope="module")
def run_log(tmp_path_factory):
    from actors import KeyedRules, evolve
    from scenarios import router

    path = tmp_path_factory.mktemp("run") / "router.evolog"
    result = evolve(router.tasks(), router.reward, agent=router.RouterAgent(),
                    strategy=KeyedRules(router.CATEGORIES), rounds=4, n_workers=3,
                    log=str(path), target_reward=1.0)
    return path, result


def test_the_analysis_of_a_real_run_matches_its_result(run_log):
    path, result = run_log
    a = analyse(path)
    assert a.workers == ["worker-0", "worker-1", "worker-2"]
    assert len(a.rounds) == len(result.history)
    assert [r.heldout for r in a.rounds] == [h.heldout_reward for h in result.history]
    assert a.outcomes == result.outcomes()
    assert a.final_reward == result.final_reward and a.redispatches == 0
    assert sum(r.rollouts for r in a.rounds) == result.rollouts
    for w in a.workers:
        start, end = a.lifetimes[w]
        assert sum(a.worker_time(w).values()) == pytest.approx(end - start)


@needs_matplotlib
def test_the_report_is_one_self_contained_page_with_its_pngs(run_log, tmp_path, capsys):
    path, _ = run_log
    out = tmp_path / "report"
    assert main(["report", str(path), "-o", str(out)]) == 0
    assert f"report: {out / 'index.html'}" in capsys.readouterr().out
    page = (out / "index.html").read_text()
    for name in ("reward", "timeline", "outcomes"):
        assert (out / f"{name}.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert page.count('src="data:image/png;base64,') == 3
    # Self-contained: no script, no external stylesheet, image or font.
    assert "<script" not in page
    assert not re.search(r'(src|href)="(?!data:)', page)
    for text in ("Held-out reward over time", "Workers over time", "starved", "idle",
                 "re-dispatches", "late answers dropped", "worker-2", "committed"):
        assert text in page


@needs_matplotlib
def test_the_default_output_sits_beside_the_log(hand_log, capsys):
    assert main(["report", str(hand_log)]) == 0
    page = hand_log.with_name("hand-report") / "index.html"
    assert page.exists()
    assert "did not finish" not in page.read_text()


@needs_matplotlib
def test_a_cut_short_log_is_reported_as_unfinished(tmp_path):
    log = write_log(tmp_path / "cut.evolog", [
        (0.0, "worker-0", "scheduler", Hello(worker="worker-0")),
        (1.0, "scheduler", "worker-0", lease("r0.u0"))])
    assert main(["report", str(log)]) == 0
    assert "did not finish" in (tmp_path / "cut-report" / "index.html").read_text()


def test_without_matplotlib_the_command_names_the_extra(hand_log, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["report", str(hand_log)]) == 2
    err = capsys.readouterr().err
    assert 'pip install "evobus[report]"' in err and "Traceback" not in err
    assert not hand_log.with_name("hand-report").exists()


def test_a_missing_log_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["report", str(tmp_path / "nope.evolog")]) == 2
    err = capsys.readouterr().err
    assert "nope.evolog: cannot read the log" in err and len(err.strip().splitlines()) == 1
