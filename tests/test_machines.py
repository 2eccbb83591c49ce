"""The control actors driven by messages alone: no bus, no threads, no sleeps."""

from __future__ import annotations

import pytest

from actors.addresses import DRIVER, MERGER, PLANNER, SCHEDULER
from actors.machines.merger import Merger, conflict_groups
from actors.policies.parallelism import DataParallel
from actors.machines.planner import Planner, split_tasks
from actors.machines.scheduler import Scheduler
from protocol import (Barrier, Baseline, Commit, Diff, EvalDone, EvalRequest, Finish, Hello,
                      Lease, LeaseBatch, LeaseDone, Open, RolloutResult, RoundClosed,
                      RunDone, Settled, SettledBatch, Shutdown, Start)

IDS = [f"t{i}" for i in range(10)]


def start(**kw) -> Start:
    base = dict(run_id="r", seed=0, task_ids=IDS, n_workers=2, rounds=3, held_out_frac=0.4,
                max_concurrency=2)
    base.update(kw)
    return Start(**base)


def kinds(out):
    return [(to, type(m).__name__) for to, m in out]


# -- planner ---------------------------------------------------------------------------


def test_split_is_seeded_disjoint_complete_and_keeps_train_order():
    train, held = split_tasks(IDS, 0.4, seed=7)
    assert sorted(train + held) == sorted(IDS) and not set(train) & set(held)
    assert len(held) == 4 and train == [t for t in IDS if t in train]
    assert split_tasks(IDS, 0.4, seed=7) == (train, held)
    assert split_tasks(IDS, 0.4, seed=8) != (train, held)


def test_planner_opens_the_merger_then_plans_round_zero_after_the_baseline():
    p = Planner(DataParallel())
    out = p.handle(start())
    assert kinds(out) == [(MERGER, "Open")]
    assert sorted(out[0][1].heldout_ids) == sorted(p.heldout)
    out = p.handle(Baseline(version=0, heldout_reward=0.1))
    assert kinds(out) == [(SCHEDULER, "LeaseBatch")]
    batch = out[0][1]
    assert batch.round == 0
    assert sorted(t for lease in batch.leases for t in lease.task_ids) == sorted(p.train)
    assert [lease.lease_id for lease in batch.leases] == ["r0.u0", "r0.u1"]


def test_planner_stops_after_the_last_round_and_reports_progress():
    p = Planner(DataParallel())
    p.handle(start(rounds=2))
    p.handle(Baseline(version=0, heldout_reward=0.0))
    out = p.handle(RoundClosed(round=0, version=1, committed=True, heldout_reward=0.5))
    assert kinds(out) == [(DRIVER, "Progress"), (SCHEDULER, "LeaseBatch")]
    out = p.handle(RoundClosed(round=1, version=1, committed=False, heldout_reward=0.5))
    assert kinds(out) == [(DRIVER, "Progress"), (MERGER, "Finish"), (SCHEDULER, "Shutdown")]
    finish = out[1][1]
    assert finish.stop_reason == "rounds" and len(finish.history) == 2


@pytest.mark.parametrize("kw,closed,reason", [
    (dict(target_reward=0.5), dict(heldout_reward=0.5), "target_reward"),
    (dict(patience=1), dict(committed=False), "patience"),
])
def test_planner_stop_reasons(kw, closed, reason):
    p = Planner(DataParallel())
    p.handle(start(rounds=10, **kw))
    p.handle(Baseline(version=0, heldout_reward=0.0))
    base = dict(round=0, version=0, committed=True, heldout_reward=0.1)
    base.update(closed)
    out = p.handle(RoundClosed(**base))
    assert out[1][1].stop_reason == reason


def test_patience_counts_gates_not_merges_that_carried_their_chains_ungated():
    p = Planner(DataParallel())
    p.handle(start(rounds=10, patience=2))
    p.handle(Baseline(version=0, heldout_reward=0.0))
    closed = dict(version=0, committed=False, heldout_reward=0.1, proposals=2)
    for r in range(3):   # carried on at no gate (actors/machines/branches.py)
        out = p.handle(RoundClosed(round=r, outcomes={"ungated": 2}, **closed))
        assert kinds(out)[-1] == (SCHEDULER, "LeaseBatch"), r
    out = p.handle(RoundClosed(round=3, outcomes={"below-threshold": 2}, **closed))
    assert kinds(out)[-1] == (SCHEDULER, "LeaseBatch")
    out = p.handle(RoundClosed(round=4, outcomes={"below-threshold": 2}, **closed))
    assert out[1][1].stop_reason == "patience"


def test_max_rollouts_trims_the_plan_and_stops_with_that_reason():
    p = Planner(DataParallel())
    p.handle(start(rounds=10, max_rollouts=5))
    batch = p.handle(Baseline(version=0, heldout_reward=0.0))[0][1]
    assert sum(len(lease.task_ids) for lease in batch.leases) == 5
    for lease in batch.leases:
        p.handle(Settled(lease_id=lease.lease_id, round=0, unit=lease.unit,
                         scores=[(t, 0.0) for t in lease.task_ids]))
    out = p.handle(RoundClosed(round=0, version=0, committed=False, heldout_reward=0.0))
    assert out[1][1].stop_reason == "max_rollouts" and out[1][1].rollouts == 5


def test_a_fatal_settlement_stops_the_run_with_the_callers_message():
    p = Planner(DataParallel())
    p.handle(start())
    p.handle(Baseline(version=0, heldout_reward=0.0))
    out = p.handle(Settled(lease_id="r0.u0", round=0, unit=0, fatal="reward out of range"))
    assert kinds(out) == [(MERGER, "Finish"), (SCHEDULER, "Shutdown")]
    assert out[0][1].fatal == "reward out of range"


def test_observe_is_fed_every_rollout_in_plan_order():
    seen = []

    class Watching(DataParallel):
        def observe(self, unit, task_id, score):
            seen.append((unit.worker, task_id, score))

    p = Planner(Watching())
    p.handle(start())
    batch = p.handle(Baseline(version=0, heldout_reward=0.0))[0][1]
    for lease in reversed(batch.leases):  # results arrive out of plan order
        p.handle(Settled(lease_id=lease.lease_id, round=0, unit=lease.unit,
                         scores=[(t, 0.5) for t in lease.task_ids]))
    p.handle(RoundClosed(round=0, version=0, committed=False, heldout_reward=0.0))
    expected = [(lease.unit, t, 0.5) for lease in batch.leases for t in lease.task_ids]
    assert seen == expected


# -- scheduler -------------------------------------------------------------------------


def lease(i: int, round_: int = 0, unit: int | None = None) -> Lease:
    return Lease(lease_id=f"r{round_}.u{i}", round=round_, unit=i if unit is None else unit,
                 task_ids=[f"t{i}"])


def done(lease_id: str, worker: str, round_: int = 0, diff=None, unit=0) -> LeaseDone:
    return LeaseDone(lease_id=lease_id, worker=worker, round=round_, unit=unit,
                     results=[RolloutResult("t", 0.0, diff)])


def test_scheduler_never_runs_more_than_max_concurrency_leases():
    s = Scheduler(max_concurrency=2)
    for w in range(4):
        s.handle(Hello(worker=f"w{w}"))
    out = s.handle(LeaseBatch(round=0, leases=[lease(i) for i in range(5)]))
    assert len([m for _, m in out if isinstance(m, Lease)]) == 2
    out = s.handle(done("r0.u0", "w0"))
    assert [type(m).__name__ for _, m in out] == ["Lease"]   # settlements wait for the barrier
    assert s.peak_running == 2


def test_scheduler_sends_the_barrier_after_every_lease_of_the_round_settles():
    s = Scheduler(max_concurrency=4)
    s.handle(Hello(worker="w0"))
    s.handle(Hello(worker="w1"))
    s.handle(LeaseBatch(round=0, leases=[lease(0), lease(1)]))
    out = s.handle(done("r0.u0", "w0"))
    assert not any(isinstance(m, Barrier) for _, m in out)
    diff = Diff("d", "w1", 0, {"k": "v"})
    out = s.handle(done("r0.u1", "w1", diff=diff, unit=1))
    # The Planner hears of both leases in one message, before the Merger closes the round.
    assert kinds(out) == [(MERGER, "LeaseDone"), (PLANNER, "SettledBatch"), (MERGER, "Barrier")]
    assert [x.lease_id for x in out[1][1].settled] == ["r0.u0", "r0.u1"]


def test_a_fatal_settlement_is_reported_at_once_after_those_held_so_far():
    s = Scheduler(max_concurrency=4)
    for w in ("w0", "w1", "w2"):
        s.handle(Hello(worker=w))
    s.handle(LeaseBatch(round=0, leases=[lease(0), lease(1), lease(2)]))
    assert s.handle(done("r0.u0", "w0")) == []
    fatal = LeaseDone(lease_id="r0.u1", worker="w1", round=0, unit=1, fatal="reward 7 > 1")
    out = s.handle(fatal)
    assert kinds(out) == [(PLANNER, "SettledBatch")]
    assert [(x.lease_id, x.fatal) for x in out[0][1].settled] == [
        ("r0.u0", None), ("r0.u1", "reward 7 > 1")]


def test_async_settlements_are_reported_before_need_work_and_when_nothing_runs():
    s = Scheduler(max_concurrency=2, asynchronous=True, n_workers=2)
    s.handle(Hello(worker="w0"))
    s.handle(Hello(worker="w1"))
    s.handle(LeaseBatch(round=0, leases=[lease(0), lease(1), lease(2)]))
    assert kinds(s.handle(done("r0.u0", "w0"))) == [("w0", "Lease")]   # the queued lease
    out = s.handle(done("r0.u1", "w1"))
    assert kinds(out) == [(PLANNER, "SettledBatch"), (PLANNER, "NeedWork")]
    assert [x.lease_id for x in out[0][1].settled] == ["r0.u0", "r0.u1"]
    # asked already, the last running lease settles: reported alone, nothing else would
    assert kinds(s.handle(done("r0.u2", "w0"))) == [(PLANNER, "Settled")]


def test_async_report_each_asks_for_a_settled_per_lease():
    s = Scheduler(max_concurrency=2, asynchronous=True, n_workers=2)
    s.handle(Hello(worker="w0"))
    s.handle(Hello(worker="w1"))
    s.handle(LeaseBatch(round=0, leases=[lease(0), lease(1), lease(2)], report_each=True))
    assert kinds(s.handle(done("r0.u0", "w0"))) == [(PLANNER, "Settled"), ("w0", "Lease")]


def test_the_planner_takes_a_batch_as_its_settlements_in_order():
    p = Planner(DataParallel())
    p.handle(start(rounds=1, asynchronous=True, max_rollouts=2))
    p.handle(Baseline(version=0, heldout_reward=0.0))
    out = p.handle(SettledBatch(settled=[
        Settled(lease_id="w0.u0", round=0, unit=0, scores=[("a", 1.0)], calls=1),
        Settled(lease_id="w0.u1", round=0, unit=1, scores=[("b", 0.0)], calls=1,
                errors=["b: boom"])]))
    assert (p.rollouts, p.calls, p.backend_errors, p.first_error) == (2, 2, 1, "b: boom")
    assert kinds(out) == [(SCHEDULER, "Drain")]                  # max_rollouts reached


def test_an_empty_round_gets_its_barrier_at_once():
    s = Scheduler(max_concurrency=1)
    assert kinds(s.handle(LeaseBatch(round=3, leases=[]))) == [(MERGER, "Barrier")]


def test_a_late_answer_for_a_lease_already_answered_is_dropped_and_counted():
    s = Scheduler(max_concurrency=1)
    s.handle(Hello(worker="w0"))
    s.handle(LeaseBatch(round=0, leases=[lease(0)]))
    s.handle(done("r0.u0", "w0"))
    assert s.handle(done("r0.u0", "w0")) == []
    assert s.duplicates_dropped == 1


def test_leases_prefer_the_worker_of_their_unit():
    s = Scheduler(max_concurrency=3)
    for w in range(3):
        s.handle(Hello(worker=f"w{w}"))
    out = s.handle(LeaseBatch(round=0, leases=[lease(2), lease(0), lease(1)]))
    assert [(to, m.unit) for to, m in out] == [("w2", 2), ("w0", 0), ("w1", 1)]


def test_eval_requests_are_split_over_workers_and_answered_with_the_mean():
    s = Scheduler(max_concurrency=2)
    s.handle(Hello(worker="w0"))
    s.handle(Hello(worker="w1"))
    out = s.handle(EvalRequest(eval_id="e1", state={"k": "v"}, task_ids=["a", "b", "c"]))
    leases = [m for _, m in out]
    assert [m.kind for m in leases] == ["eval", "eval"]
    assert sorted(t for m in leases for t in m.task_ids) == ["a", "b", "c"]
    scores = {"a": 1.0, "b": 0.0, "c": 0.5}
    outs = []
    for to, m in out:
        outs += s.handle(LeaseDone(lease_id=m.lease_id, worker=to, round=-1, kind="eval",
                                   results=[RolloutResult(t, scores[t]) for t in m.task_ids]))
    assert kinds(outs) == [(MERGER, "EvalDone")]
    assert outs[0][1].score == pytest.approx(0.5)


def test_commits_are_forwarded_to_every_worker_and_shutdown_stops_them():
    s = Scheduler(max_concurrency=1)
    s.handle(Hello(worker="w0"))
    s.handle(Hello(worker="w1"))
    assert kinds(s.handle(Commit(version=1, state={}))) == [("w0", "Commit"), ("w1", "Commit")]
    assert kinds(s.handle(Shutdown())) == [("w0", "Stop"), ("w1", "Stop")]


def test_a_worker_registering_late_gets_the_head_version_first():
    s = Scheduler(max_concurrency=1)
    s.handle(Commit(version=3, state={"k": "v"}))
    out = s.handle(Hello(worker="late"))
    assert isinstance(out[0][1], Commit) and out[0][1].version == 3


# -- merger ----------------------------------------------------------------------------


def d(author: str, **ops) -> Diff:
    return Diff(f"{author}:{sorted(ops)}", author, 0, dict(ops))


def opened_merger(score: float = 0.2, sections=None, **options) -> Merger:
    m = Merger(**options)
    out = m.handle(Open(heldout_ids=["h1", "h2"], sections=sections))
    assert kinds(out) == [(SCHEDULER, "EvalRequest")]
    out = m.handle(EvalDone(eval_id=out[0][1].eval_id, score=score))
    assert kinds(out) == [(PLANNER, "Baseline")]
    return m


def proposals(m: Merger, round_: int, *diffs: Diff, section=None, unit=0) -> None:
    m.handle(LeaseDone(lease_id=f"r{round_}.u{unit}", worker="w", round=round_, unit=unit,
                       section=section, results=[RolloutResult("t", 0.0, x) for x in diffs]))


def answer(m: Merger, out, scorer) -> list:
    """Answer every EvalRequest in ``out`` with ``scorer(state)``, until none is left."""
    result = []
    pending = list(out)
    while pending:
        to, msg = pending.pop(0)
        if isinstance(msg, EvalRequest):
            pending += m.handle(EvalDone(eval_id=msg.eval_id, score=scorer(msg.state)))
        else:
            result.append((to, msg))
    return result


def test_conflict_groups_connect_diffs_that_disagree_on_a_key():
    a, b, c, e = d("a", k="1"), d("b", k="2"), d("c", j="x"), d("e", k="1")
    free, groups = conflict_groups([a, b, c, e])
    assert free == [c] and groups == [[a, b, e]]


def test_conflict_groups_connect_multi_key_diffs_through_any_shared_clash():
    # a and b clash on k, b and c on j: one group [a, b, c] (in diff order) though a and
    # c share no key; e agrees with a on k (no clash of its own) but writes k, so it is
    # in the group too; f is free (its key m is written once).
    a, b = d("a", k="1"), d("b", k="2", j="x")
    c, e, f = d("c", j="y"), d("e", k="1", n="0"), d("f", m="1")
    free, groups = conflict_groups([a, f, b, c, e])
    assert free == [f] and groups == [[a, b, c, e]]
    # Two separate clashes: two groups, in the order of their first diff.
    g, h = d("g", p="1", q="1"), d("h", p="2")
    i, j = d("i", r="1"), d("j", r="2", s="1")
    free, groups = conflict_groups([i, g, j, h, f])
    assert free == [f] and groups == [[i, j], [g, h]]


def test_fused_candidate_that_beats_the_head_is_committed():
    m = opened_merger(0.2)
    proposals(m, 0, d("a", k="1"), d("b", j="2"))
    out = answer(m, m.handle(Barrier(round=0)), lambda s: 0.2 + 0.3 * len(s))
    assert kinds(out) == [(SCHEDULER, "Commit"), (PLANNER, "RoundClosed")]
    closed = out[1][1]
    assert closed.committed and closed.version == 1 and closed.outcomes == {"committed": 2}
    assert out[0][1].state == {"k": "1", "j": "2"}


def test_an_exact_tie_with_the_head_is_never_accepted():
    m = opened_merger(0.5)
    proposals(m, 0, d("a", k="1"))
    out = answer(m, m.handle(Barrier(round=0)), lambda s: 0.5)
    assert kinds(out) == [(PLANNER, "RoundClosed")]
    assert out[0][1].outcomes == {"below-threshold": 1} and not out[0][1].committed


def test_a_conflict_is_resolved_by_held_out_score():
    m = opened_merger(0.0)
    proposals(m, 0, d("a", k="weak"), d("b", k="strong"))
    out = answer(m, m.handle(Barrier(round=0)),
                 lambda s: {"weak": 0.3, "strong": 0.6}.get(s.get("k"), 0.0))
    commit = out[0][1]
    assert commit.state == {"k": "strong"}
    assert out[1][1].outcomes == {"conflict": 1, "committed": 1}


def test_the_score_cache_keeps_the_states_used_last_and_scores_a_dropped_one_again():
    m = opened_merger(0.9, cache_states=3)
    asked: list[dict] = []

    def scorer(state):
        asked.append(dict(state))
        return 0.1   # never beats the head: nothing commits, every round scores anew

    heldout = m.cache[("h1", "h2")]
    for r in range(6):   # each round: a conflict between two new values of k
        proposals(m, r, d("a", k=f"x{r}"), d("b", k=f"y{r}"))
        answer(m, m.handle(Barrier(round=r)), scorer)
        assert len(heldout) <= 3, (r, len(heldout))
    assert frozenset({("k", "y5")}) in heldout and frozenset({("k", "x0")}) not in heldout
    # Met again: a state still cached is answered from it, a dropped one is scored again.
    asked.clear()
    proposals(m, 6, d("a", k="y5"), d("b", k="x0"))
    answer(m, m.handle(Barrier(round=6)), scorer)
    assert asked == [{"k": "x0"}]


def test_cache_states_is_a_positive_integer():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cache_states"):
            Merger(cache_states=bad)


def test_the_first_proposer_wins_an_exact_tie_between_conflicting_diffs():
    m = opened_merger(0.0)
    proposals(m, 0, d("a", k="first"), d("b", k="second"))
    out = answer(m, m.handle(Barrier(round=0)), lambda s: 0.5 if s else 0.0)
    assert out[0][1].state == {"k": "first"}


def test_when_the_fused_candidate_loses_the_best_single_diff_can_still_win():
    m = opened_merger(0.2)
    proposals(m, 0, d("a", good="1"), d("b", bad="1"))
    scorer = lambda s: 0.2 + (0.3 if "good" in s else 0) - (0.4 if "bad" in s else 0)  # noqa: E731
    out = answer(m, m.handle(Barrier(round=0)), scorer)
    assert out[0][1].state == {"good": "1"}
    assert out[1][1].outcomes == {"committed": 1, "below-threshold": 1}


def test_duplicates_and_unchanged_diffs_are_counted_not_merged():
    m = opened_merger(0.0)
    proposals(m, 0, d("a", k="1"), d("b", k="1"))
    out = answer(m, m.handle(Barrier(round=0)), lambda s: 1.0 if s else 0.0)
    assert out[1][1].outcomes == {"duplicate": 1, "committed": 1}
    proposals(m, 1, d("c", k="1"))
    out = answer(m, m.handle(Barrier(round=1)), lambda s: 1.0)
    assert out[0][1].outcomes == {"unchanged": 1}


def test_an_out_of_section_diff_is_rejected_and_counted():
    m = opened_merger(0.0, sections={"a": 0, "b": 1})
    proposals(m, 0, d("w", a="x"), section=0)
    proposals(m, 0, d("w", a="y"), section=1, unit=1)
    proposals(m, 0, d("w", zzz="y"), section=1, unit=1)
    out = answer(m, m.handle(Barrier(round=0)), lambda s: 1.0 if s else 0.0)
    assert out[0][1].state == {"a": "x"}
    assert out[1][1].outcomes == {"section-violation": 2, "committed": 1}


def test_a_known_candidate_is_never_scored_twice():
    m = opened_merger(0.0)
    calls = []

    def scorer(s):
        calls.append(dict(s))
        return 0.0
    proposals(m, 0, d("a", k="1"))
    answer(m, m.handle(Barrier(round=0)), scorer)
    proposals(m, 1, d("a", k="1"))  # same candidate again: answered from the cache
    out = answer(m, m.handle(Barrier(round=1)), scorer)
    assert calls == [{"k": "1"}]
    assert kinds(out) == [(PLANNER, "RoundClosed")]


def test_finish_answers_the_driver_with_the_head():
    m = opened_merger(0.25)
    out = m.handle(Finish(stop_reason="rounds", rollouts=7))
    assert kinds(out) == [(DRIVER, "RunDone")]
    assert isinstance(out[0][1], RunDone) and out[0][1].final_reward == 0.25


@pytest.mark.parametrize("kw, each", [(dict(asynchronous=True, max_calls=50), True),
                                      (dict(asynchronous=True, max_rollouts=50), False),
                                      (dict(max_calls=50), False)])
def test_the_planner_asks_for_a_settled_per_lease_only_for_an_async_call_budget(kw, each):
    p = Planner(DataParallel())
    p.handle(start(**kw))
    (_, batch), = p.handle(Baseline(version=0, heldout_reward=0.0))
    assert batch.report_each is each


def test_a_ticker_is_due_once_per_period_and_never_bursts_to_catch_up():
    from actors.runtime.clock import Ticker

    t = Ticker(0.1)
    assert t.due(0.0) and not t.due(0.05) and t.wait(0.05) == pytest.approx(0.05)
    assert t.due(0.1)
    assert t.due(5.0) and not t.due(5.05)   # a late loop: one tick, the next a period on
    with pytest.raises(ValueError, match="period must be > 0"):
        Ticker(0)
