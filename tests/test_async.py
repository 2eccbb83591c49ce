"""Barrier-free (async) mode: the same actors, no Barrier, every strategy honoured."""

from __future__ import annotations

import warnings

import pytest

from actors import ClusterParallel, ConfigError, KeyedRules, TensorParallel, evolve
from actors.addresses import MERGER, PLANNER, SCHEDULER
from actors.machines.merger import Merger
from actors.machines.scheduler import Scheduler
from bus.log import read_log
from protocol import (Commit, Diff, Drain, EvalDone, EvalRequest, Flush, Hello, Lease,
                      LeaseBatch, LeaseDone, Merged, NeedWork, Open, Refresh, RolloutResult,
                      RoundClosed, decode)
from scenarios import parallelism, router


def run_async(**kw):
    base = dict(tasks=router.tasks(), reward=router.reward, run=router.run,
                propose=router.propose, strategy=KeyedRules(router.CATEGORIES), n_workers=4,
                seed=0, asynchronous=True)
    base.update(kw)
    return evolve(**base)


def test_async_learns_the_router_domain():
    result = run_async(target_reward=1.0, max_rollouts=5000)
    assert result.final_reward == 1.0 and result.stop_reason == "target_reward"
    assert result.error is None


def test_async_history_has_one_entry_per_merge_with_the_sync_fields():
    result = run_async(max_rollouts=400)
    assert result.history
    assert [h.round for h in result.history] == sorted(h.round for h in result.history)
    for h in result.history:
        assert h.proposals > 0 or h.committed
        assert set(h.reasons) <= {"committed", "below-threshold", "conflict", "duplicate",
                                  "unchanged", "stale", "stale-rejected", "section-violation",
                                  "screened-out", "harmful", "retired", "held"}   # the default rules
    assert sum(h.rollouts for h in result.history) <= result.rollouts


def test_async_with_routed_tensor_parallel_has_zero_violations():
    result = run_async(parallel=TensorParallel(4, route=router.route), max_rollouts=600)
    assert "section-violation" not in result.outcomes()
    assert result.final_reward > result.initial_reward


def test_async_with_unrouted_tensor_parallel_counts_violations():
    result = run_async(parallel=TensorParallel(4), max_rollouts=300)
    assert result.outcomes().get("section-violation", 0) > 0


def test_async_feeds_observe_every_rollout_and_runs_custom_strategies():
    seen = []

    class Watched(ClusterParallel):
        def observe(self, unit, task_id, score):
            seen.append(task_id)
            super().observe(unit, task_id, score)

    result = run_async(parallel=Watched(router.cluster_of), max_rollouts=300)
    assert len(seen) == result.rollouts == 300
    custom = run_async(parallel=parallelism.BlockParallel(), max_rollouts=300)
    assert custom.rollouts == 300


def test_a_work_budget_stop_merges_or_counts_every_completed_rollouts_proposal(tmp_path):
    log = tmp_path / "async.evolog"
    result = run_async(max_rollouts=250, log=str(log))
    assert result.stop_reason == "max_rollouts" and result.rollouts == 250
    proposed = 0
    for rec in read_log(log).records:
        msg = decode(rec.body)
        if isinstance(msg, LeaseDone) and msg.kind == "rollout" and rec.receiver == "scheduler":
            proposed += sum(r.diff is not None for r in msg.results)
    decided = sum(v for k, v in result.outcomes().items() if k != "rollout-error")
    assert proposed > 0 and decided == proposed


@pytest.mark.parametrize("budget,reason", [
    (dict(max_rollouts=120), "max_rollouts"),
    (dict(max_calls=150), "max_calls"),
    (dict(target_reward=0.5, max_rollouts=5000), "target_reward"),
    (dict(patience=2, max_rollouts=5000), "patience"),
    (dict(max_seconds=0.3), "max_seconds"),
])
def test_async_budgets_stop_with_the_right_reason(budget, reason):
    result = run_async(**budget)
    assert result.stop_reason == reason
    if reason == "max_rollouts":
        assert result.rollouts == 120  # the planner never plans past the budget
    if reason == "max_calls":
        # every call counts (scoring too), and none starts past the budget
        calls = result.budget["calls"]
        assert calls["total"] <= 150 and calls["scoring"] > 0, calls
        assert calls["rollout"] + calls["proposal"] == result.calls


def test_rounds_in_async_mode_is_warned_about_once_and_ignored():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_async(rounds=2, max_rollouts=200)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "rounds has no meaning" in messages[0]
    assert result.rollouts == 200


def test_async_only_options_given_to_a_sync_run_are_warned_about_by_name():
    kw = dict(tasks=router.tasks(), reward=router.reward, run=router.run,
              propose=router.propose, strategy=KeyedRules(router.CATEGORIES), rounds=1)

    def warned(**extra) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            evolve(**kw, **extra)
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    assert warned() == []
    (one,) = warned(async_ratio=5)
    assert one.startswith("evolve(asynchronous=False): async_ratio only shapes "
                          "asynchronous mode and is ignored")
    (two,) = warned(staleness="full", stall_merges=2)
    assert "staleness, stall_merges only shape asynchronous mode and are ignored" in two
    with pytest.raises(ConfigError, match="stall_merges must be an integer >= 1"):
        evolve(**{**kw, "rounds": None}, asynchronous=True, max_rollouts=10, stall_merges=0)


def test_async_only_keys_in_a_sync_scenario_are_warned_about():
    from protocol.scenario import parse_scenario

    base = ('name = "s"\nmode = "sync"\n{extra}\n[domain]\ntasks = "scenarios.router:tasks"\n'
            'reward = "scenarios.router:reward"\nagent = "scenarios.router:RouterAgent"\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_scenario(base.format(extra=""), "s.toml")
        parse_scenario(base.format(extra='async_ratio = 5\nstaleness = "full"'), "s.toml")
    (message,) = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert message.startswith('s.toml: `async_ratio` and `staleness` only shape mode = '
                              '"async" and are ignored in sync mode')


def test_workers_keys_for_other_processes_in_an_all_local_scenario_are_warned_about():
    from protocol.scenario import parse_scenario

    base = ('name = "s"\n[domain]\ntasks = "scenarios.router:tasks"\n'
            'reward = "scenarios.router:reward"\nagent = "scenarios.router:RouterAgent"\n'
            '[workers]\n{extra}\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_scenario(base.format(extra="local = 2\nmax_concurrency = 2"), "s.toml")
        parse_scenario(base.format(extra="local = 1\nprocesses = 1\nheartbeat = 0.5"),
                       "s.toml")
        parse_scenario(base.format(extra='local = 2\nbind = "tcp://127.0.0.1:5555"\n'
                                         'heartbeat = 0.5'), "s.toml")
    (message,) = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert message.startswith("s.toml: `workers.bind`, `workers.heartbeat` only concern "
                              "workers in other processes")


def test_async_without_a_stop_condition_is_refused():
    with pytest.raises(ConfigError, match="needs a stop condition"):
        run_async()


def test_the_lag_budget_holds_no_stale_proposal_is_kept_unverified():
    result = run_async(max_rollouts=600, async_ratio=2, staleness="guarded")
    assert result.stats["max_eta_kept"] <= 2


def test_the_stall_guard_fires_in_a_configuration_built_to_stall():
    # A huge lag budget and staleness="full": workers keep proposing from stale
    # snapshots, which drop keywords the head already has, so merges commit nothing.
    result = run_async(max_rollouts=1500, async_ratio=1000, staleness="full",
                       stall_merges=2)
    assert result.stats["stall_refreshes"] >= 1


# -- the machines, message by message ---------------------------------------------------


def d(base: int, **ops) -> Diff:
    return Diff(f"d{base}{sorted(ops)}", "w", base, dict(ops))


def merger_at_version(v: int, **kw) -> Merger:
    m = Merger(asynchronous=True, **kw)
    out = m.handle(Open(heldout_ids=["h"]))
    m.handle(EvalDone(eval_id=out[0][1].eval_id, score=0.0))
    m.version = v
    return m


def feed(m: Merger, diff: Diff) -> list:
    return m.handle(LeaseDone(lease_id="l", worker="w", round=0,
                              results=[RolloutResult("t1", 0.0, diff)]))


@pytest.mark.parametrize("policy,eta,decision", [
    ("full", 0, "keep"), ("full", 2, "keep"), ("full", 9, "keep"),
    ("guarded", 0, "keep"), ("guarded", 1, "verify"), ("guarded", 3, "verify"),
    ("guarded", 4, "stale"),
    ("reflective", 0, "keep"), ("reflective", 1, "verify"), ("reflective", 9, "verify"),
])
def test_staleness_decision_table(policy, eta, decision):
    m = merger_at_version(10, staleness=policy, alpha=3)
    out = feed(m, d(10 - eta, k="v"))
    evals = [msg for _, msg in out if isinstance(msg, EvalRequest)]
    if decision == "keep":  # straight to the held-out gate
        assert [e.task_ids for e in evals] == [["h"]]
    elif decision == "verify":  # re-verified on its own evidence task first
        assert sorted(e.task_ids for e in evals) == [["t1"], ["t1"]]
    else:
        assert evals == []
        assert m.outcomes == {"stale": 1}


def test_reverification_keeps_a_diff_that_still_helps_on_its_evidence():
    m = merger_at_version(5, staleness="guarded", alpha=3)
    out = feed(m, d(4, k="v"))
    for _, msg in out:
        if isinstance(msg, EvalRequest):
            out2 = m.handle(EvalDone(eval_id=msg.eval_id, score=1.0 if msg.state else 0.0))
    gate = [msg for _, msg in out2 if isinstance(msg, EvalRequest)]
    assert gate and gate[0].task_ids == ["h"] and m.stats["reverified"] == 1


def test_the_merger_signals_consumed_proposals_and_the_final_merge():
    m = merger_at_version(0)
    out = feed(m, d(0, k="v"))
    assert (SCHEDULER, Merged(consumed=1, version=0)) in out
    m.handle(Flush())
    gate = [msg for _, msg in out if isinstance(msg, EvalRequest)][0]
    out = m.handle(EvalDone(eval_id=gate.eval_id, score=1.0))
    closed = [msg for to, msg in out if isinstance(msg, RoundClosed)][0]
    assert closed.final and closed.committed


def test_the_scheduler_asks_for_work_holds_back_under_backpressure_and_drains():
    s = Scheduler(max_concurrency=2, asynchronous=True, async_ratio=1, n_workers=1)
    out = s.handle(Hello(worker="w0"))
    assert (PLANNER, NeedWork()) in out
    leases = [Lease(lease_id=f"w0.u{i}", round=0, unit=0, task_ids=[f"t{i}"]) for i in range(3)]
    out = s.handle(LeaseBatch(round=0, leases=leases))
    assert [m.lease_id for _, m in out if isinstance(m, Lease)] == ["w0.u0"]
    diffs = [RolloutResult("t0", 0.0, d(0, a="1")), RolloutResult("t0", 0.0, d(0, b="1"))]
    out = s.handle(LeaseDone(lease_id="w0.u0", worker="w0", round=0, results=diffs))
    assert not any(isinstance(m, Lease) for _, m in out) and s.held_back == 1  # 2 > 1
    out = s.handle(Merged(consumed=2))
    assert [m.lease_id for _, m in out if isinstance(m, Lease)] == ["w0.u1"]
    out = s.handle(Drain(reason="max_rollouts"))
    assert out == [] and s.cancelled == 1
    out = s.handle(LeaseDone(lease_id="w0.u1", worker="w0", round=0, results=[]))
    assert (MERGER, Flush(cancelled=1)) in out


def test_an_async_worker_queues_one_rollout_lease_behind_the_one_it_runs():
    # max_concurrency counts leases running: a lease queued behind a running one (the
    # worker's prefetch) is not one more running, and it starts when that one ends.
    s = Scheduler(max_concurrency=1, asynchronous=True, n_workers=2)
    s.handle(Hello(worker="w0", prefetch=1))
    s.handle(Hello(worker="w1", prefetch=1))
    leases = [Lease(lease_id=f"w0.u{i}", round=0, unit=0, task_ids=[f"t{i}"]) for i in range(3)]
    out = s.handle(LeaseBatch(round=0, leases=leases))
    # w1 is idle but one lease runs already: the second queues at w0, the third waits
    assert [(to, m.lease_id) for to, m in out if isinstance(m, Lease)] == [
        ("w0", "w0.u0"), ("w0", "w0.u1")]
    assert (s.active, s.running, s.peak_running) == (1, 2, 1)
    out = s.handle(LeaseDone(lease_id="w0.u0", worker="w0", round=0, results=[]))
    assert [(to, m.lease_id) for to, m in out if isinstance(m, Lease)] == [("w0", "w0.u2")]
    assert (s.active, s.running, s.peak_running) == (1, 2, 1)
    # an eval never queues behind a rollout: it waits for a free slot
    out = s.handle(EvalRequest(eval_id="e1", state={}, task_ids=["h"]))
    assert not any(isinstance(m, Lease) for _, m in out)
    out = s.handle(LeaseDone(lease_id="w0.u1", worker="w0", round=0, results=[]))
    assert not any(isinstance(m, Lease) for _, m in out)   # w0.u2 runs now: still 1
    out = s.handle(LeaseDone(lease_id="w0.u2", worker="w0", round=0, results=[]))
    assert [m.kind for _, m in out if isinstance(m, Lease)] == ["eval"]


def test_prefetch_is_for_async_mode_only_and_room_to_queue_asks_for_work():
    sync = Scheduler(max_concurrency=4)
    sync.handle(Hello(worker="w0", prefetch=1))
    out = sync.handle(LeaseBatch(round=0, leases=[Lease(lease_id=f"r0.u{i}", round=0,
                                                        task_ids=["t"]) for i in range(2)]))
    assert len([m for _, m in out if isinstance(m, Lease)]) == 1
    s = Scheduler(max_concurrency=4, asynchronous=True, n_workers=1)
    s.handle(Hello(worker="w0", prefetch=1))
    out = s.handle(LeaseBatch(round=0, leases=[Lease(lease_id="w0.u0", round=0,
                                                     task_ids=["t"])]))
    # the lease runs; the worker can still queue one, so the next wave is asked for now
    assert [type(m).__name__ for _, m in out] == ["Lease", "NeedWork"]


def test_async_evolve_never_runs_more_rollouts_at_once_than_max_concurrency():
    import threading

    lock, now, most = threading.Lock(), [0], [0]

    def run(rendered, task):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            return router.run(rendered, task)
        finally:
            with lock:
                now[0] -= 1

    result = run_async(run=run, n_workers=4, max_concurrency=2, max_rollouts=400)
    assert result.bus["peak_running"] <= 2 and most[0] <= 2


def test_the_scheduler_refreshes_a_worker_whose_snapshot_lags_past_the_budget():
    s = Scheduler(max_concurrency=1, asynchronous=True, async_ratio=2, n_workers=1)
    s.handle(Hello(worker="w0"))
    for v in (1, 2, 3):
        s.handle(Commit(version=v, state={"v": str(v)}))
    out = s.handle(LeaseBatch(round=0, leases=[Lease(lease_id="a", round=0, task_ids=["t"])]))
    assert [type(m).__name__ for _, m in out] == ["Commit", "Lease"]
    assert out[1][1].version == 3
    out = s.handle(Refresh())
    assert out == []  # already at the head


def test_an_async_scenario_file_runs_async(tmp_path):
    from actors.runtime.launch import run_scenario
    from protocol.scenario import load_scenario

    result = run_scenario(load_scenario("scenarios/router_async.toml"),
                          log=str(tmp_path / "a.evolog"))
    assert result.stop_reason == "target_reward" and result.final_reward == 1.0
    kinds = {type(decode(r.body)).__name__ for r in read_log(tmp_path / "a.evolog").records}
    assert "NeedWork" in kinds and "Barrier" not in kinds


def test_an_async_scenario_without_a_budget_is_refused():
    from protocol.scenario import ScenarioError, parse_scenario

    text = open("scenarios/router_async.toml").read().split("[budgets]")[0]
    with pytest.raises(ScenarioError, match="expected a stop condition"):
        parse_scenario(text, "x.toml")
