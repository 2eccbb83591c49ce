"""Asynchronous waves paced by merges, stale diffs rebased by their keys, and the default
round sized in rollouts: the pure machines fed message by message (no bus, no threads)."""

from __future__ import annotations

import pytest

from actors.addresses import MERGER, PLANNER, SCHEDULER
from actors.machines.merger import Merger
from actors.machines.planner import Planner
from actors.machines.scheduler import Scheduler
from actors.machines.staleness import KeyHistory, merge_ready
from actors.policies.parallelism import (DataParallel, async_pacing, default_parallel,
                                         round_per_worker)
from protocol import (Baseline, Commit, Diff, EvalDone, EvalRequest, Flush, Hello, Lease,
                      LeaseBatch, LeaseDone, NeedWork, Open, RolloutResult, RoundClosed,
                      Settled, Start, WaveSettled)

IDS = [f"t{i}" for i in range(20)]


def diff(base: int, **ops) -> Diff:
    return Diff(f"d{base}{sorted(ops.items())}", "w", base, dict(ops))


def kinds(out):
    return [(to, type(m).__name__) for to, m in out]


# -- which commits a stale diff missed ---------------------------------------------------


def test_a_diff_whose_keys_no_later_commit_wrote_is_not_stale():
    h = KeyHistory()
    h.commit({}, {"a": "1"})                    # v1 writes a
    h.commit({"a": "1"}, {"a": "1", "b": "2"})  # v2 writes b
    h.commit({"a": "1", "b": "2"}, {"a": "x", "b": "2"})  # v3 rewrites a
    assert h.version == 3
    assert h.eta(diff(0, c="3"), 3) == 0        # c: untouched since v0
    assert h.eta(diff(1, b="9"), 3) == 1        # b: written by v2
    assert h.eta(diff(0, a="9"), 3) == 2        # a: written by v1 and v3
    assert h.eta(diff(2, a="9", b="9"), 3) == 1  # only v3 is after its base
    assert h.eta(diff(3, a="9"), 3) == 0        # made on the head


def test_a_single_slot_rewrite_is_as_stale_as_its_versions():
    h = KeyHistory()
    text = {}
    for v in range(4):
        new = {"value": f"text {v}"}
        h.commit(text, new)
        text = new
    assert h.eta(diff(1, value="mine"), 4) == 3


def test_the_merge_trigger_waits_for_the_wave_unless_the_backlog_is_full():
    assert merge_ready(1, waves=False, due=False)          # historical: first proposal
    assert not merge_ready(0, waves=False, due=True)       # nothing held: nothing to merge
    assert not merge_ready(3, waves=True, due=False, backlog=4)
    assert merge_ready(4, waves=True, due=False, backlog=4)
    assert merge_ready(1, waves=True, due=True, backlog=4)


# -- the Merger ----------------------------------------------------------------------------


def merger(v: int = 0, **kw) -> Merger:
    m = Merger(asynchronous=True, **kw)
    out = m.handle(Open(heldout_ids=["h"]))
    m.handle(EvalDone(eval_id=out[0][1].eval_id, score=0.0))
    return m


def commit_through(m: Merger, d: Diff, score: float) -> None:
    """Merge ``d`` alone and commit it (its gate scores ``score`` > the head's)."""
    out = m.handle(LeaseDone(lease_id="l", worker="w", round=0,
                             results=[RolloutResult("t1", 0.0, d)]))
    gate = [msg for _, msg in out if isinstance(msg, EvalRequest)][-1]
    m.handle(EvalDone(eval_id=gate.eval_id, score=score))


def test_rebase_keeps_a_diff_whose_keys_the_commits_since_did_not_write():
    m = merger(rebase=True, staleness="guarded", alpha=1)
    for v, key in enumerate(["a", "b", "c"]):
        commit_through(m, diff(v, **{key: "1"}), 0.2 + 0.1 * v)
    assert m.version == 3
    out = m.handle(LeaseDone(lease_id="l2", worker="w", round=0,
                             results=[RolloutResult("t2", 0.0, diff(0, d="1"))]))
    evals = [msg for _, msg in out if isinstance(msg, EvalRequest)]
    assert [e.task_ids for e in evals] == [["h"]]     # straight to the gate, unverified
    assert m.stats["rebased"] == 1 and "stale" not in m.outcomes


def test_rebase_still_discards_a_diff_on_a_key_rewritten_too_often_since():
    m = merger(rebase=True, staleness="guarded", alpha=1)
    for v in range(3):
        commit_through(m, diff(v, a=str(v)), 0.2 + 0.1 * v)
    out = m.handle(LeaseDone(lease_id="l2", worker="w", round=0,
                             results=[RolloutResult("t2", 0.0, diff(0, a="mine"))]))
    assert not any(isinstance(msg, EvalRequest) for _, msg in out)
    assert m.outcomes.get("stale") == 1


def test_without_rebase_the_same_diff_is_stale_by_versions():
    m = merger(staleness="guarded", alpha=1)
    for v, key in enumerate(["a", "b", "c"]):
        commit_through(m, diff(v, **{key: "1"}), 0.2 + 0.1 * v)
    m.handle(LeaseDone(lease_id="l2", worker="w", round=0,
                       results=[RolloutResult("t2", 0.0, diff(0, d="1"))]))
    assert m.outcomes.get("stale") == 1


def test_with_waves_the_merger_holds_proposals_until_the_wave_has_settled():
    m = merger(waves=True, backlog=10)
    for i in range(3):
        out = m.handle(LeaseDone(lease_id=f"l{i}", worker="w", round=0,
                                 results=[RolloutResult(f"t{i}", 0.0, diff(0, **{f"k{i}": "1"}))]))
        assert out == []                                   # held: the wave is not over
    out = m.handle(WaveSettled(wave=0))
    gates = [msg for _, msg in out if isinstance(msg, EvalRequest)]
    assert len(gates) == 1 and ("scheduler", "Merged") in kinds(out)
    assert gates[0].state == {"k0": "1", "k1": "1", "k2": "1"}   # one fused candidate


def test_with_waves_a_full_backlog_merges_before_the_wave_ends():
    m = merger(waves=True, backlog=2)
    m.handle(LeaseDone(lease_id="l0", worker="w", round=0,
                       results=[RolloutResult("t0", 0.0, diff(0, a="1"))]))
    out = m.handle(LeaseDone(lease_id="l1", worker="w", round=0,
                             results=[RolloutResult("t1", 0.0, diff(0, b="1"))]))
    assert any(isinstance(msg, EvalRequest) for _, msg in out)


def test_a_settled_wave_that_proposed_nothing_closes_at_once():
    m = merger(waves=True, backlog=10)
    out = m.handle(WaveSettled(wave=0))
    closed = [msg for to, msg in out if to == PLANNER and isinstance(msg, RoundClosed)]
    assert len(closed) == 1 and closed[0].proposals == 0 and not closed[0].committed


def test_a_wave_settled_during_a_merge_is_merged_when_it_closes():
    m = merger(waves=True, backlog=10)
    m.handle(LeaseDone(lease_id="l0", worker="w", round=0,
                       results=[RolloutResult("t0", 0.0, diff(0, a="1"))]))
    out = m.handle(WaveSettled(wave=0))
    gate = [msg for _, msg in out if isinstance(msg, EvalRequest)][0]
    m.handle(LeaseDone(lease_id="l1", worker="w", round=1,
                       results=[RolloutResult("t1", 0.0, diff(0, b="1"))]))
    assert m.handle(WaveSettled(wave=1)) == []             # the merge of wave 0 runs
    out = m.handle(EvalDone(eval_id=gate.eval_id, score=0.5))
    assert [type(msg).__name__ for _, msg in out].count("RoundClosed") == 1
    assert any(isinstance(msg, EvalRequest) and msg.state == {"a": "1", "b": "1"}
               for _, msg in out)                          # wave 1, on the new head



def test_a_wave_settled_after_the_final_round_closed_starts_no_merge():
    """The Planner's WaveSettled for the last wave and the Scheduler's Flush come from two
    senders, in either order. Once the Merger has sent its final RoundClosed the Planner
    stops the run on it (Shutdown), so a merge started after it asks for scores no
    Scheduler will count: a process worker made the calls, the endpoint served them, and
    the run's own calls total missed them (test_budgets's max_calls test, 2 runs in 30
    under load: the retire probe's control, 2 calls on the head after the final close)."""
    m = Merger(asynchronous=True, waves=True, backlog=10, retire=True)
    (_, ask), = m.handle(Open(heldout_ids=["h"], initial_state={"a": "0"}))
    m.handle(EvalDone(eval_id=ask.eval_id, score=0.0))
    # A proposal, and two train tasks failed at the head with no edit: stuck, so a merge
    # that commits nothing probes the head's keys on them (a control eval first).
    assert m.handle(LeaseDone(lease_id="l0", worker="w", round=0, version=0, results=[
        RolloutResult("t0", 0.0, diff(0, a="1")), RolloutResult("t1", 0.0),
        RolloutResult("t2", 0.0)])) == []
    gate, = [msg for _, msg in m.handle(Flush()) if isinstance(msg, EvalRequest)]
    out = m.handle(EvalDone(eval_id=gate.eval_id, score=0.0, unscored="max_calls"))
    (to, closed), = out
    assert to == PLANNER and closed.final and closed.outcomes == {"unscored-at-budget": 1}
    assert m.handle(WaveSettled(wave=0)) == []     # no merge, no eval, no second close
    assert m.handle(LeaseDone(lease_id="l1", worker="w", round=1, version=0, results=[
        RolloutResult("t3", 0.0, diff(0, a="2"))])) == []


# -- the Planner ---------------------------------------------------------------------------


def paced_planner(waves: int) -> tuple[Planner, list]:
    p = Planner(DataParallel(per_worker=2), waves=waves)
    p.handle(Start(run_id="r", seed=0, task_ids=IDS, n_workers=2, rounds=1,
                   held_out_frac=0.4, max_concurrency=2, asynchronous=True,
                   max_rollouts=1000))
    out = p.handle(Baseline(version=0, heldout_reward=0.0))
    return p, out[0][1].leases


def settle(p: Planner, lease: Lease) -> list:
    return p.handle(Settled(lease_id=lease.lease_id, round=lease.round, unit=lease.unit,
                            scores=[(t, 0.0) for t in lease.task_ids], calls=1))


def test_one_wave_at_a_time_the_next_once_the_merge_of_the_last_has_closed():
    p, leases = paced_planner(waves=1)
    assert sum(len(lease.task_ids) for lease in leases) == 4
    assert p.handle(NeedWork()) == []                       # wave 0 is rolling out
    assert settle(p, leases[0]) == []
    out = settle(p, leases[1])
    assert kinds(out) == [(MERGER, "WaveSettled")] and out[0][1].wave == 0
    out = p.handle(RoundClosed(round=0, version=1, committed=True, heldout_reward=0.5,
                               proposals=3))
    batches = [msg for _, msg in out if isinstance(msg, LeaseBatch)]
    assert len(batches) == 1 and batches[0].round == 1     # the ask held back, answered


def test_two_waves_the_next_rolls_out_while_the_last_is_merged():
    p, leases = paced_planner(waves=2)
    assert p.handle(NeedWork()) == []
    settle(p, leases[0])
    out = settle(p, leases[1])
    assert kinds(out) == [(MERGER, "WaveSettled"), (SCHEDULER, "LeaseBatch")]
    nxt = out[1][1].leases
    assert p.handle(NeedWork()) == []                       # wave 1 rolls out
    settle(p, nxt[0])
    out = settle(p, nxt[1])
    assert kinds(out) == [(MERGER, "WaveSettled")]          # two unmerged: wait
    out = p.handle(RoundClosed(round=0, version=1, committed=True, heldout_reward=0.5,
                               proposals=1))
    assert (SCHEDULER, "LeaseBatch") in kinds(out)


def test_a_paced_wave_that_proposed_nothing_counts_towards_patience():
    p = Planner(DataParallel(per_worker=2), waves=1)
    p.handle(Start(run_id="r", seed=0, task_ids=IDS, n_workers=2, rounds=1,
                   held_out_frac=0.4, max_concurrency=2, asynchronous=True, patience=2))
    p.handle(Baseline(version=0, heldout_reward=0.0))
    out = []
    for r in range(2):
        out = p.handle(RoundClosed(round=r, version=0, committed=False, heldout_reward=0.0))
    assert any(type(m).__name__ == "Drain" for _, m in out)


def test_planner_waves_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="waves"):
        Planner(DataParallel(), waves=0)


# -- the Scheduler's lag budget, and the pacing evolve() uses ------------------------------


def test_with_no_lag_budget_a_worker_gets_the_head_before_every_rollout_lease():
    s = Scheduler(max_concurrency=1, asynchronous=True, n_workers=1, lag=0)
    s.handle(Hello(worker="w0"))
    s.handle(Commit(version=1, state={"a": "1"}))
    out = s.handle(LeaseBatch(round=0, leases=[Lease(lease_id="w0.u0", round=0, unit=0,
                                                     task_ids=["t0"])]))
    assert [type(m).__name__ for to, m in out if to == "w0"] == ["Commit", "Lease"]
    lagging = Scheduler(max_concurrency=1, asynchronous=True, n_workers=1)   # lag 3
    lagging.handle(Hello(worker="w0"))
    lagging.handle(Commit(version=1, state={"a": "1"}))
    out = lagging.handle(LeaseBatch(round=0, leases=[Lease(lease_id="w0.u0", round=0,
                                                           unit=0, task_ids=["t0"])]))
    assert [type(m).__name__ for to, m in out if to == "w0"] == ["Lease"]


def test_async_pacing_bounds_the_backlog_and_keeps_an_explicit_lag():
    paced = async_pacing(4, 3)
    assert paced == {"planner": {"waves": 1}, "scheduler": {"lag": 0},
                     "merger": {"rebase": True, "waves": True, "hold_waves": True,
                                "backlog": 12}}
    assert async_pacing(4, 3, lag=5)["scheduler"] == {"lag": 5}


@pytest.mark.parametrize("n,per_worker", [(1, 4), (2, 4), (4, 4), (8, 2), (16, 1), (64, 1)])
def test_the_default_round_is_about_sixteen_rollouts_whatever_the_worker_count(n, per_worker):
    assert round_per_worker(n) == per_worker
    assert round_per_worker(16, units=6) == 2   # six non-empty units share the round
    # evolve()'s own round: four leases of four, on four of the workers beyond four.
    busy = None if n <= 4 else 4
    assert default_parallel(n) == DataParallel(per_worker=4, busy=busy)
    units = default_parallel(n).plan(n, 0, [f"t{i}" for i in range(64)])
    b = min(n, 4)
    assert len(units) == n and [len(u.keys) for u in units[:b]] == [4] * b
    assert not any(u.keys for u in units[b:])


@pytest.mark.parametrize("n,per_worker,busy", [(1, 64, None), (2, 32, None), (4, 16, None),
                                               (8, 16, 4), (16, 16, 4)])
def test_a_single_slots_own_round_is_planned_on_four_workers_beyond_four(n, per_worker,
                                                                          busy):
    """64 tasks a round (``SingleSlot.round_tasks``): on every worker up to four, on four
    of them beyond (the others share the gates), so a lease chains as much as at four."""
    from actors import SingleSlot

    assert default_parallel(n, SingleSlot()) == DataParallel(per_worker=per_worker,
                                                             busy=busy)
    units = default_parallel(n, SingleSlot()).plan(n, 0, [f"t{i}" for i in range(144)])
    assert sum(len(u.keys) for u in units) == 64
    assert sum(1 for u in units if u.keys) == min(n, 4)
