"""Score reuse for a model declared deterministic: (state, task) scores are asked for once.
The pure pieces (actors/machines/reuse.py, the Merger fed messages) and the declaration
through evolve() and a scenario file."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from actors import KeyedRules, evolve
from actors.machines.merger import Merger
from actors.machines.reuse import PairScores, mean_in_id_order
from protocol import Barrier, Diff, EvalDone, EvalRequest, LeaseDone, Open, RolloutResult
from tests.merger_drive import answer_evals
from scenarios import router

HELD = [f"h{i}" for i in range(6)]


def solves(state: dict[str, str], task: str) -> float:
    return 1.0 if state.get(f"k{int(task[1:]) % 3}") == "on" else 0.0


def answer(m: Merger, out: list, asked: list) -> list:
    """Answer every EvalRequest with per-task scores (``asked`` keeps the requests)."""
    return answer_evals(m, out, solves, asked, mean=mean_in_id_order)


def test_pair_scores_split_what_is_known_and_complete_an_answer_to_a_full_one():
    pairs = PairScores()
    key = frozenset({("k0", "on")})
    assert pairs.split(key, ["h0", "h1"]) == ({}, ["h0", "h1"])
    pairs.record(key, {"h0": 1.0, "h1": 0.0})
    assert pairs.split(key, ["h1", "h2", "h0"]) == ({"h1": 0.0, "h0": 1.0}, ["h2"])
    done = pairs.answer(key, EvalDone(eval_id="e", score=1.0, scores={"h2": 1.0}),
                        {"h1": 0.0, "h0": 1.0})
    assert done.score == mean_in_id_order({"h0": 1.0, "h1": 0.0, "h2": 1.0}) == 2 / 3
    assert list(done.scores) == ["h0", "h1", "h2"]
    assert pairs.split(key, ["h2"]) == ({"h2": 1.0}, [])


def test_an_evaluation_with_a_failed_call_is_not_remembered():
    pairs = PairScores()
    key = frozenset()
    pairs.answer(key, EvalDone(eval_id="e", score=0.5, scores={"h0": 1.0, "h1": 0.0},
                               errors=1), None)
    assert pairs.split(key, ["h0"]) == ({}, ["h0"])
    with pytest.raises(ValueError, match="states"):
        PairScores(states=0)


def test_pair_scores_keep_the_states_used_last():
    pairs = PairScores(states=2)
    for i in range(3):
        pairs.record(frozenset({("k", str(i))}), {"h0": 1.0})
    assert pairs.split(frozenset({("k", "0")}), ["h0"])[1] == ["h0"]      # dropped
    assert pairs.split(frozenset({("k", "2")}), ["h0"])[1] == []


def test_a_deterministic_merger_asks_only_for_the_tasks_a_state_was_never_scored_on():
    # The close-call recheck scores a candidate again on tasks it was scored on already
    # (retire probes did, before they were aimed at stuck train tasks).
    runs = {}
    for reuse in (False, True):
        m = Merger(recheck=True, reuse=reuse)
        asked: list[EvalRequest] = []
        answer(m, m.handle(Open(heldout_ids=HELD)), asked)
        for r, keys in enumerate([["zz", "yy"], ["k0", "zz"], ["yy"], ["k1"], ["zz"],
                                  ["k2", "yy"]]):
            m.handle(LeaseDone(lease_id=f"r{r}.u0", worker="w", round=r, results=[
                RolloutResult(task_id=f"t{j}", score=0.0,
                              diff=Diff(f"{r}{k}", "w", 0, {k: "on"}))
                for j, k in enumerate(keys)]))
            answer(m, m.handle(Barrier(round=r)), asked)
        runs[reuse] = (sum(len(a.task_ids) for a in asked), m.state, m.score, m.outcomes)
    (full, state, score, outcomes), (fewer, state2, score2, outcomes2) = runs[False], runs[True]
    assert (state2, score2, outcomes2) == (state, score, outcomes)   # the same decisions
    assert fewer < full


class CountingRun:
    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, rendered, task):
        with self.lock:
            self.calls += 1
        return router.run(rendered, task)


def test_evolve_with_a_declared_deterministic_model_reuses_scores_and_ends_alike():
    results = []
    for deterministic in (False, True):
        run = CountingRun()
        result = evolve(router.tasks(), router.reward, run=run, propose=router.propose,
                        strategy=KeyedRules(router.CATEGORIES), n_workers=1, seed=0,
                        rounds=300, target_reward=1.0, recheck=True,
                        deterministic=deterministic)
        results.append((result, run.calls))
    (plain, calls), (reused, fewer) = results
    assert plain.final_reward == reused.final_reward == 1.0
    assert reused.stats["reused_scores"] > 0 and "reused_scores" not in plain.stats
    assert fewer == calls - reused.stats["reused_scores"]


def test_a_scenario_declares_its_model_deterministic():
    from actors.runtime.launch import evolve_kwargs
    from protocol.scenario import parse_scenario

    toml = Path(__file__).resolve().parent.parent / "scenarios" / "router.toml"
    text = toml.read_text()
    assert evolve_kwargs(parse_scenario(text))["deterministic"] is False
    declared = text.replace('agent = "scenarios.router:RouterAgent"\n',
                            'agent = "scenarios.router:RouterAgent"\ndeterministic = true\n')
    assert evolve_kwargs(parse_scenario(declared))["deterministic"] is True


def test_a_run_with_reused_scores_and_paced_async_waves_replays_identically(tmp_path):
    from actors.replay.verify import replay_log

    for name, kw in (("det", dict(rounds=300, retire=True, deterministic=True)),
                     ("async", dict(asynchronous=True, max_rollouts=300))):
        log = tmp_path / f"{name}.evolog"
        evolve(router.tasks(), router.reward, run=router.run, propose=router.propose,
               strategy=KeyedRules(router.CATEGORIES), n_workers=2, seed=0,
               target_reward=1.0, log=str(log), **kw)
        report = replay_log(log)
        assert report.ok, report
