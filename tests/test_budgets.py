"""Budgets that mean what they say, throttling handled, a failing backend stopped
(docs/budgets.md), against bench.endpoint.SimulatedEndpoint: real HTTP on 127.0.0.1.

The machine tests feed messages; the run tests count calls with a wrapper around
solve/propose (tests/budget_domain.py, a file shared with worker processes) and with
what the endpoint received, never with our own counters alone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from email.utils import formatdate
from pathlib import Path

import pytest

pytest.importorskip("httpx")

from actors import evolve  # noqa: E402
from actors.addresses import DRIVER, MERGER, PLANNER, SCHEDULER  # noqa: E402
from actors.errors import ConfigError, RetryLater  # noqa: E402
from actors.machines.merger import Merger  # noqa: E402
from actors.machines.planner import Planner  # noqa: E402
from actors.machines.scheduler import Scheduler  # noqa: E402
from actors.openai_agent import OpenAIAgent  # noqa: E402
from actors.policies.parallelism import DataParallel  # noqa: E402
from actors.runtime.launch import run_scenario  # noqa: E402
from actors.throttle import parse_retry_after  # noqa: E402
from actors.usage import report  # noqa: E402
from bench.endpoint import SimulatedEndpoint  # noqa: E402
from protocol import (Baseline, Budget, Diff, EvalDone, EvalRequest, Hello, Lease,  # noqa: E402
                      LeaseBatch, LeaseDone, Open, RolloutResult, RoundClosed, Settled,
                      SettledBatch, Start, Unhalt, Usage)
from protocol.scenario import parse_scenario  # noqa: E402
from tests import budget_domain as bd  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
IDS = [f"t{i}" for i in range(10)]


def kinds(out):
    return [(to, type(m).__name__) for to, m in out]


def scheduler(budget: Budget, workers: int = 1, **kw) -> Scheduler:
    s = Scheduler(max_concurrency=workers, n_workers=workers, **kw)
    s.handle(budget)
    for i in range(workers):
        s.handle(Hello(worker=f"w{i}"))
    return s


def rollout(lease_id: str, tasks: list[str], unit: int = 0) -> Lease:
    return Lease(lease_id=lease_id, round=int(lease_id[1]), unit=unit, task_ids=tasks)


def used(task: str, tokens: int = 0, calls: int = 1, **kw) -> RolloutResult:
    usage = [Usage(phase="run", model="m", input_tokens=tokens)] if tokens else []
    return RolloutResult(task_id=task, score=0.5, calls=calls, usage=usage, **kw)


# -- the Scheduler reserves before it dispatches ---------------------------------------------


def test_a_lease_is_cut_to_the_calls_max_calls_leaves_and_the_cut_is_reported():
    s = scheduler(Budget(max_calls=7, calls_per_task=2))
    out = s.handle(LeaseBatch(round=0, leases=[rollout("r0.u0", ["a", "b", "c", "d", "e"])]))
    (to, sent), = out
    assert to == "w0" and sent.task_ids == ["a", "b", "c"]        # 3 x 2 calls <= 7
    out = s.handle(LeaseDone(lease_id="r0.u0", worker="w0", round=0,
                             results=[used(t, calls=2) for t in "abc"]))
    settled = next(m for to, m in out if isinstance(m, Settled))
    assert (settled.exhausted, settled.skipped) == ("max_calls", 2)
    assert s.ledger.summary()["calls"]["total"] == 6


def test_no_lease_starts_once_the_calls_are_spent():
    s = scheduler(Budget(max_calls=4, calls_per_task=2))
    s.handle(LeaseBatch(round=0, leases=[rollout("r0.u0", ["a", "b"])]))
    s.handle(LeaseDone(lease_id="r0.u0", worker="w0", round=0,
                       results=[used(t, calls=2) for t in "ab"]))
    out = s.handle(LeaseBatch(round=1, leases=[rollout("r1.u0", ["c"])]))
    assert not [m for _, m in out if isinstance(m, Lease)]        # nothing dispatched
    settled = [m for _, m in out if isinstance(m, Settled)]
    assert settled and settled[0].exhausted == "max_calls" and settled[0].scores == []
    assert ("merger", "Barrier") in kinds(out)                   # the round still closes


def test_a_scoring_request_the_budget_cannot_pay_in_full_is_answered_unscored():
    s = scheduler(Budget(max_calls=3), workers=2)
    out = s.handle(EvalRequest(eval_id="e1", state={}, task_ids=["h1", "h2", "h3", "h4"]))
    assert kinds(out) == [(MERGER, "EvalDone")] and out[0][1].unscored == "max_calls"
    out = s.handle(EvalRequest(eval_id="e2", state={}, task_ids=["h1", "h2", "h3"]))
    assert sorted(kinds(out)) == [("w0", "Lease"), ("w1", "Lease")]  # 3 calls fit: all go


def test_a_token_budget_is_reserved_at_what_calls_used_so_far():
    s = scheduler(Budget(max_tokens=100), workers=1)
    s.handle(LeaseBatch(round=0, leases=[rollout("r0.u0", ["a", "b"]),
                                         rollout("r0.u1", ["c", "d", "e", "f"], unit=1)]))
    out = s.handle(LeaseDone(lease_id="r0.u0", worker="w0", round=0,
                             results=[used("a", 20), used("b", 20)]))  # 20 a call so far
    # 60 tokens left, a rollout task expects 20 (run) + 20 (propose, not seen yet):
    # one task of the next lease fits.
    sent = next(m for _, m in out if isinstance(m, Lease))
    assert sent.task_ids == ["c"]
    assert s.ledger.summary()["tokens"]["total"] == 40


def test_a_call_that_reports_no_usage_under_a_token_budget_stops_the_run_by_name():
    s = scheduler(Budget(max_tokens=100))
    s.handle(LeaseBatch(round=0, leases=[rollout("r0.u0", ["a"])]))
    out = s.handle(LeaseDone(lease_id="r0.u0", worker="w0", round=0, results=[used("a")]))
    fatal = next(m for _, m in out if isinstance(m, Settled)).fatal
    assert "max_tokens is set but run() on task 'a' reported no usage" in fatal


def test_max_cost_with_a_model_that_has_no_price_stops_the_run_naming_it():
    s = scheduler(Budget(max_cost=1.0, prices={"other": (1.0, 1.0)}))
    s.handle(LeaseBatch(round=0, leases=[rollout("r0.u0", ["a"])]))
    out = s.handle(LeaseDone(lease_id="r0.u0", worker="w0", round=0,
                             results=[used("a", 10)]))
    fatal = next(m for _, m in out if isinstance(m, Settled)).fatal
    assert "model 'm' has no price" in fatal and "prices=" in fatal


def test_cost_is_priced_per_million_tokens_by_kind():
    s = scheduler(Budget(max_cost=10.0, prices={"m": (2.0, 4.0)}))
    s.handle(LeaseBatch(round=0, leases=[rollout("r0.u0", ["a"])]))
    result = RolloutResult(task_id="a", score=0.5, calls=2, usage=[
        Usage(phase="run", model="m", input_tokens=1000, output_tokens=500),
        Usage(phase="propose", model="m", input_tokens=100, cost=0.5)])
    s.handle(LeaseDone(lease_id="r0.u0", worker="w0", round=0, results=[result]))
    cost = s.ledger.summary()["cost"]
    assert cost["rollout"] == pytest.approx((1000 * 2.0 + 500 * 4.0) / 1e6)
    assert cost["proposal"] == 0.5                    # the agent's own price is kept


# -- the Merger, the Planner ------------------------------------------------------------------


def test_a_merge_whose_scoring_was_refused_commits_nothing_and_says_why():
    m = Merger()
    m.handle(Open(heldout_ids=["h"], initial_state={}))
    m.handle(EvalDone(eval_id="e1", score=0.2))
    diffs = [RolloutResult(task_id=t, score=0.1,
                           diff=Diff(diff_id=t, author="w", base_version=0, ops={t: "x"}))
             for t in ("a", "b")]
    m.handle(LeaseDone(lease_id="r0.u0", worker="w", round=0, results=diffs))
    (_, request), = m.handle(__import__("protocol").Barrier(round=0))
    out = m.handle(EvalDone(eval_id=request.eval_id, score=0.0, unscored="max_calls"))
    (to, closed), = out
    assert to == PLANNER and isinstance(closed, RoundClosed) and not closed.committed
    assert closed.outcomes == {"unscored-at-budget": 2}


def _planner(n_workers: int = 2, **kw) -> Planner:
    p = Planner(DataParallel())
    p.handle(Start(run_id="r", seed=0, task_ids=IDS, n_workers=n_workers, rounds=50,
                   held_out_frac=0.4, max_concurrency=n_workers, **kw))
    p.handle(Baseline(version=0, heldout_reward=0.0))
    return p


def _round(p: Planner, r: int, failing: list[bool]):
    settled = [Settled(lease_id=f"r{r}.u{u}", round=r, unit=u, scores=[(f"t{u}", None if f
                                                                        else 0.5)],
                       errors=[f"t{u}: ConnectError at http://x"] if f else [])
               for u, f in enumerate(failing)]
    p.handle(SettledBatch(settled=settled))
    return p.handle(RoundClosed(round=r, version=0, committed=False, heldout_reward=0.0))


def test_three_rounds_of_failed_rollouts_halt_the_run_until_a_resume_unhalts_it():
    p = _planner()
    for r in range(2):
        assert (SCHEDULER, "LeaseBatch") in kinds(_round(p, r, [True, True]))
    out = _round(p, 2, [True, True])
    halted = next(m for to, m in out if to == DRIVER and type(m).__name__ == "Halted")
    assert halted.reason == "backend_failing" and p.halted and not p.finished
    assert "the backend is failing" in halted.error and "ConnectError at http://x" in halted.error
    assert (SCHEDULER, "LeaseBatch") not in kinds(out)     # nothing more is planned
    # A resume sends Unhalt: the Planner plans the next round, counting failures afresh.
    out = p.handle(__import__("protocol").Unhalt())
    assert kinds(out) == [(SCHEDULER, "LeaseBatch")] and p.failing == 0


def test_a_baseline_whose_every_call_failed_halts_the_run_and_a_resume_scores_it_again():
    p = Planner(DataParallel())
    p.handle(Start(run_id="r", seed=0, task_ids=IDS, n_workers=2, rounds=50,
                   held_out_frac=0.4, max_concurrency=2))
    out = p.handle(Baseline(version=0, heldout_reward=0.0, errors=4,
                            failed="t1: LLMError: cannot reach http://x"))
    halted = next(m for to, m in out if to == DRIVER)
    assert halted.reason == "backend_failing" and p.halted and not p.finished
    assert halted.error == ("the baseline could not be scored: all 4 held-out call(s) "
                            "failed; first error: t1: LLMError: cannot reach http://x")
    assert (SCHEDULER, "LeaseBatch") not in kinds(out)     # nothing is planned
    # A resume: the Merger is opened again (the baseline asked for anew), then round 0.
    assert kinds(p.handle(Unhalt())) == [(MERGER, "Open")]
    assert kinds(p.handle(Baseline(version=0, heldout_reward=0.25))) == [
        (SCHEDULER, "LeaseBatch")]


def test_a_baseline_that_failed_is_not_remembered_as_a_score_of_zero():
    m = Merger()
    (_, ask), = m.handle(Open(heldout_ids=["t1", "t2"], initial_state={}))
    out = m.handle(EvalDone(eval_id=ask.eval_id, score=0.0, scores={"t1": 0.0, "t2": 0.0},
                            errors=2, failed="t1: boom"))
    assert out == [(PLANNER, Baseline(version=0, heldout_reward=0.0, failed="t1: boom",
                                      errors=2))]
    (_, again), = m.handle(Open(heldout_ids=["t1", "t2"], initial_state={}))
    assert isinstance(again, EvalRequest)   # asked again, not answered from a cached 0.0


def test_a_scoring_says_it_failed_only_when_every_call_did():
    def scored(results):
        s = Scheduler(max_concurrency=1)
        s.handle(Hello(worker="w", slots=1))
        out = s.handle(EvalRequest(eval_id="e1", state={}, task_ids=["t1", "t2"]))
        lease = next(m for _, m in out if isinstance(m, Lease))
        out = s.handle(LeaseDone(lease_id=lease.lease_id, worker="w", round=-1, kind="eval",
                                 results=results))
        return next(m for _, m in out if isinstance(m, EvalDone))

    failed = [RolloutResult(task_id=t, error=f"{t}: down")
              for t in ("t2", "t1")]
    assert scored(failed).failed == "t1: t1: down" and scored(failed).errors == 2
    half = [failed[0], RolloutResult(task_id="t1", score=1.0)]
    assert scored(half).failed is None and scored(half).errors == 1


def test_a_flaky_backend_is_evidence_and_the_run_goes_on():
    p = _planner()
    for r in range(8):
        out = _round(p, r, [True, r % 3 == 0])  # one lease in three rounds works
        assert (SCHEDULER, "LeaseBatch") in kinds(out), r


def test_the_planner_tells_the_scheduler_the_budgets_before_opening_the_merger():
    p = Planner(DataParallel())
    out = p.handle(Start(run_id="r", seed=0, task_ids=IDS, n_workers=2, rounds=3,
                         held_out_frac=0.4, max_concurrency=2, max_tokens=500))
    assert kinds(out) == [(SCHEDULER, "Budget"), (MERGER, "Open")]
    assert kinds(Planner(DataParallel()).handle(Start(
        run_id="r", seed=0, task_ids=IDS, n_workers=2, rounds=3, held_out_frac=0.4,
        max_concurrency=2))) == [(MERGER, "Open")]   # no budget: the logs stay as they were


# -- evolve() refuses budgets it could not enforce ------------------------------------------


def test_a_token_budget_with_an_agent_that_reports_no_usage_is_refused_by_name():
    from scenarios import router

    with pytest.raises(ConfigError, match=r"max_tokens=100 but RouterAgent does not report"):
        evolve(router.tasks(), router.reward, agent=router.RouterAgent(), max_tokens=100)


def test_max_calls_below_the_baseline_scoring_is_refused():
    from scenarios import router

    with pytest.raises(ConfigError, match=r"max_calls=5 cannot pay for the run"):
        evolve(router.tasks(), router.reward, agent=router.RouterAgent(), max_calls=5)


# -- runs against the simulated endpoint -------------------------------------------------------

PARALLEL = {
    "DataParallel": 'kind = "DataParallel"',
    "TensorParallel": 'kind = "TensorParallel"\nn_sections = 2',
    "ClusterParallel": 'kind = "ClusterParallel"\ncluster_of = "tests.budget_domain:route"',
}
WORKERS = {"local": "local = 4",
           "process": "local = 0\nprocesses = 2\nallow = ['tests.budget_domain', 'scenarios']"}


def scenario(url: str, workers: str, parallel: str, mode: str, budgets: str,
             agent: str = "", agent_ref: str = "tests.budget_domain:CountingAgent") -> str:
    return f'''name = "budget"
{"mode = 'async'" if mode == "async" else "rounds = 40"}
seed = 0
[domain]
tasks = "tests.budget_domain:tasks"
reward = "tests.budget_domain:reward"
[domain.agent]
ref = "{agent_ref}"
[domain.agent.kwargs]
base_url = "{url}"
model = "sim"
api_key_env = ""
edit_format = "Write it as category: keywords."
{agent}
[strategy]
kind = "KeyedRules"
categories = ["billing", "shipping", "technical", "account"]
[parallel]
{parallel}
[workers]
{workers}
[budgets]
{budgets}
'''


@pytest.fixture
def calls_file(tmp_path, monkeypatch):
    path = tmp_path / "calls.txt"
    monkeypatch.setenv(bd.CALLS_ENV, str(path))
    return str(path)


def _run(calls_file, workers, parallel, mode, budgets, **kw):
    with SimulatedEndpoint(latency=0.002, sigma=0.5, seed=1, reply=bd.router_reply) as ep:
        result = run_scenario(parse_scenario(scenario(ep.url, WORKERS[workers],
                                                      PARALLEL[parallel], mode, budgets,
                                                      **kw)))
    return result, bd.counted(calls_file), ep.counts


def _matrix(process_too: bool):
    out = []
    for workers in ("local", "process") if process_too else ("local",):
        for parallel in PARALLEL:
            for mode in ("sync", "async"):
                marks = [pytest.mark.slow] if workers == "process" else []
                out.append(pytest.param(workers, parallel, mode, marks=marks,
                                        id=f"{workers}-{parallel}-{mode}"))
    return out


@pytest.mark.parametrize("workers,parallel,mode", _matrix(process_too=True))
def test_calls_counted_by_a_wrapper_never_pass_max_calls(calls_file, workers, parallel, mode):
    result, counted, served = _run(calls_file, workers, parallel, mode, "max_calls = 150")
    assert result.stop_reason == "max_calls"
    calls = result.budget["calls"]
    # Every call reserved before it started: no overshoot at all, whatever ran in flight.
    assert counted["total"] <= 150, (counted, calls)
    assert counted["total"] == calls["total"] == served["ok"]
    assert counted["propose"] == calls["proposal"] and calls["scoring"] > 0


@pytest.mark.parametrize("workers,parallel,mode", _matrix(process_too=True))
def test_tokens_served_pass_max_tokens_by_no_more_than_the_calls_in_flight(
        calls_file, workers, parallel, mode):
    result, counted, served = _run(calls_file, workers, parallel, mode, "max_tokens = 4000")
    b = result.budget
    tokens = served["prompt_tokens"] + served["completion_tokens"]
    assert result.stop_reason == "max_tokens" and b["spent"] == "max_tokens"
    assert b["tokens"]["total"] == tokens            # what travelled is what was served
    assert tokens <= 4000 + b["in_flight_when_spent"] * served["max_call_tokens"], b
    assert counted["total"] == served["ok"] == b["calls"]["total"]


@pytest.mark.parametrize("workers,parallel,mode", _matrix(process_too=True))
def test_cost_of_what_was_served_passes_max_cost_by_no_more_than_the_calls_in_flight(
        calls_file, workers, parallel, mode):
    budgets = 'max_cost = 0.004\nprices = {sim = [1.0, 2.0]}'
    result, counted, served = _run(calls_file, workers, parallel, mode, budgets)
    b = result.budget
    cost = (served["prompt_tokens"] * 1.0 + served["completion_tokens"] * 2.0) / 1e6
    assert result.stop_reason == "max_cost"
    assert b["cost"]["total"] == pytest.approx(cost, rel=1e-6)
    assert cost <= 0.004 + b["in_flight_when_spent"] * served["max_call_tokens"] * 2.0 / 1e6
    assert counted["total"] == served["ok"]


# -- calls made inside parallel groups run from a rollout -------------------------------------

GROUPS = dict(agent_ref="tests.budget_domain:GroupAgent")


@pytest.mark.parametrize("workers,mode", [
    pytest.param("process", "sync", id="process-sync"),
    pytest.param("process", "async", marks=pytest.mark.slow, id="process-async"),
    pytest.param("local", "sync", id="local-sync")])
def test_branches_of_groups_inside_rollouts_never_pass_max_calls(calls_file, workers, mode):
    # A worker in another process asks the Scheduler's ledger before each branch starts
    # (CallsAsk), and so does a thread worker: branches are reserved as rollouts are, so
    # no call starts past the cap.
    result, counted, served = _run(calls_file, workers, "DataParallel", mode,
                                   "max_calls = 250", **GROUPS)
    calls = result.budget["calls"]
    assert result.stop_reason == "max_calls" and counted["branch"] > counted["solve"], counted
    assert counted["total"] <= 250, (counted, calls)
    assert counted["total"] == calls["total"], (counted, calls)
    # A solve whose group a spent budget refused never sends its own request.
    assert served["ok"] <= counted["total"] and calls["rollout"] > counted["propose"]


@pytest.mark.parametrize("workers", ["process", "local"])
def test_branches_of_groups_inside_rollouts_count_their_tokens(calls_file, workers):
    result, counted, served = _run(calls_file, workers, "DataParallel", "sync",
                                   "max_tokens = 1500", **GROUPS)
    b = result.budget
    tokens = served["prompt_tokens"] + served["completion_tokens"]
    assert counted["branch"] > 0 and b["spent"] == "max_tokens", b
    assert b["tokens"]["total"] == tokens            # the branches' tokens travelled too
    assert tokens <= 1500 + b["in_flight_when_spent"] * served["max_call_tokens"], b
    # A solve whose group the spent budget refused never sends its own request.
    assert served["ok"] <= counted["total"] == b["calls"]["total"]


# -- throttling ---------------------------------------------------------------------------------


def test_an_agent_that_says_retry_later_is_called_again_and_counted_once():
    from scenarios import router

    class Busy(router.RouterAgent):
        def __init__(self):
            self.n = 0
            self.lock = threading.Lock()

        def solve(self, rendered, task):
            with self.lock:
                self.n += 1
                busy = self.n % 2 == 1
            if busy:
                raise RetryLater("quota window", retry_after=0.001)
            report(model="m", input_tokens=3, output_tokens=1)
            return super().solve(rendered, task)

    agent = Busy()
    result = evolve(router.tasks(), router.reward, agent=agent, rounds=2, max_calls=500,
                    strategy=__import__("actors").KeyedRules(router.CATEGORIES))
    assert "rollout-error" not in result.outcomes() and result.error is None
    b = result.budget
    solves = b["calls"]["rollout"] + b["calls"]["scoring"]   # one call each, retried or not
    assert agent.n > solves and b["attempts"] > 0             # the retries were reported


def test_retry_after_is_read_as_seconds_milliseconds_or_an_http_date():
    assert parse_retry_after({"retry-after": "3"}) == 3.0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "1"}) == 0.25
    later = parse_retry_after({"retry-after": formatdate(time.time() + 30, usegmt=True)})
    assert 28 <= later <= 31
    assert parse_retry_after({"retry-after": "soon"}) is None and parse_retry_after({}) is None


# -- evobus run against a dead and a throttling endpoint -------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _evobus_run(tmp_path, text: str, timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    path = tmp_path / "run.toml"
    path.write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "actors.cli", "run", str(path), "--json",
                          "--log", str(tmp_path / "run.evolog")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - t0


def test_a_dead_endpoint_stops_the_run_non_zero_within_seconds_naming_it(tmp_path):
    port = _closed_port()
    text = scenario(f"http://127.0.0.1:{port}/v1", "local = 4", PARALLEL["DataParallel"],
                    "sync", "max_calls = 5000")
    out, elapsed = _evobus_run(tmp_path, text)
    assert out.returncode == 1, out.stderr[-2000:]
    assert elapsed < 30, elapsed
    # Its first calls, the baseline's, all fail: nothing was scored, and it says so.
    assert "halted: the baseline could not be scored: all " in out.stderr, out.stderr
    assert "held-out call(s) failed; first error: " in out.stderr
    assert "held-out 0.000" not in out.stdout + out.stderr
    assert f"127.0.0.1:{port}" in out.stderr and "ConnectError" in out.stderr
    log = tmp_path / "run.evolog"
    assert f"evobus resume {log}" in out.stderr


def test_a_halted_run_resumes_once_the_backend_answers(tmp_path, calls_file):
    """Sync and the same log: halted against a closed port, then `evobus resume` with an
    endpoint listening on that very port finishes the run."""
    with SimulatedEndpoint(latency=0.001, seed=4, reply=bd.router_reply) as ep:
        port = int(ep.url.rsplit(":", 1)[1].split("/")[0])
        ep.stop()   # the port is closed now: nothing listens there
        text = scenario(f"http://127.0.0.1:{port}/v1", "local = 2", PARALLEL["DataParallel"],
                        "sync", "max_calls = 400")
        out, _ = _evobus_run(tmp_path, text)
        assert out.returncode == 1 and "halted" in out.stderr, out.stderr[-2000:]
    back = SimulatedEndpoint(latency=0.001, seed=4, reply=bd.router_reply)
    back.start(port=port)
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        resumed = subprocess.run([sys.executable, "-m", "actors.cli", "resume",
                                  str(tmp_path / "run.evolog"), "--json"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=90)
    finally:
        back.stop()
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads(resumed.stdout)
    # It halted at its baseline (every call failed), which the resume scored anew: no
    # rollout of the chain failed.
    assert summary["stop_reason"] == "max_calls" and summary["error"] is None
    assert back.counts["ok"] > 0
    replay = subprocess.run([sys.executable, "-m", "actors.cli", "replay", summary["log"]],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]


def test_a_throttling_endpoint_finishes_with_no_rollout_failed_by_throttling(tmp_path):
    with SimulatedEndpoint(throttle=1 / 3, latency=0.002, seed=3, reply=bd.router_reply) as ep:
        text = scenario(ep.url, "local = 4", PARALLEL["DataParallel"], "sync",
                        "max_calls = 400", agent="backoff = 0.01\nmax_backoff = 0.05")
        out, _ = _evobus_run(tmp_path, text)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert "rollout-error" not in summary["outcomes"], summary["outcomes"]
    assert summary["error"] is None
    assert ep.counts["throttled"] > 0.25 * ep.counts["requests"]      # about a third
    assert summary["budget"]["attempts"] == ep.counts["requests"]     # every attempt reported
    assert summary["budget"]["calls"]["total"] == ep.counts["ok"] <= 400


def test_calls_reported_from_inside_a_call_count_in_max_calls():
    s = scheduler(Budget(max_calls=100))
    s.handle(LeaseBatch(round=0, leases=[rollout("r0.u0", ["a"])]))
    result = RolloutResult(task_id="a", score=0.5, calls=1,
                           usage=[Usage(phase="run", calls=7)])   # a group's 7 branches
    s.handle(LeaseDone(lease_id="r0.u0", worker="w0", round=0, results=[result]))
    assert s.ledger.summary()["calls"]["rollout"] == 8


def test_an_agent_given_prices_reports_the_cost_of_each_call():
    from actors.usage import metered

    with SimulatedEndpoint(seed=5) as ep:
        agent = OpenAIAgent(model="sim", base_url=ep.url, api_key_env="",
                            prices={"sim": [2.0, 8.0]})
        _, usage, error = metered("run", agent.solve, "be brief",
                                  __import__("protocol").Task(id="t", prompt="one two three"))
    assert error is None
    (u,) = usage
    assert (u.model, u.input_tokens, u.attempts) == ("sim", ep.counts["prompt_tokens"], 1)
    assert u.cost == pytest.approx((u.input_tokens * 2.0 + u.output_tokens * 8.0) / 1e6)


def test_stalls_and_server_errors_are_retried_until_every_call_succeeds():
    """One thread, so the endpoint's seeded draws meet the requests in a fixed order."""
    task = __import__("protocol").Task(id="t", prompt="where is my parcel")
    with SimulatedEndpoint(stalls=0.3, stall_seconds=5, errors=0.2, seed=6) as ep:
        agent = OpenAIAgent(model="sim", base_url=ep.url, api_key_env="", timeout=0.2,
                            max_retries=20, backoff=0.01, max_backoff=0.02)
        answers = [agent.solve("rules", task) for _ in range(10)]
    assert answers == ["parcel my is where"] * 10
    assert ep.counts["stalls"] > 0 and ep.counts["errors"] > 0
    assert agent.usage.retries == ep.counts["requests"] - 10


def test_a_call_still_throttled_at_its_deadline_fails_saying_so():
    task = __import__("protocol").Task(id="t", prompt="hi")
    with SimulatedEndpoint(throttle=1.0, seed=7) as ep:
        agent = OpenAIAgent(model="sim", base_url=ep.url, api_key_env="",
                            retry_deadline=0.3, backoff=0.01, max_backoff=0.05)
        t0 = time.monotonic()
        with pytest.raises(__import__("actors.openai_agent").openai_agent.LLMError,
                           match=r"still told to retry later after \d+ attempt.*deadline 0.3 s"):
            agent.solve("rules", task)
    assert time.monotonic() - t0 < 5
    assert 1 < ep.counts["throttled"] == ep.counts["requests"] < 30   # backed off, not hammered


def test_a_flaky_endpoint_is_evidence_and_the_run_finishes(calls_file):
    with SimulatedEndpoint(errors=0.4, latency=0.001, seed=8, reply=bd.router_reply) as ep:
        text = scenario(ep.url, "local = 4", PARALLEL["DataParallel"], "sync",
                        "max_calls = 300", agent="max_retries = 0\nbackoff = 0.01")
        result = run_scenario(parse_scenario(text))
    assert result.stop_reason == "max_calls"
    assert result.outcomes().get("rollout-error", 0) > 0 and "500" in result.error
