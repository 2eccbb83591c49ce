"""evolve() end to end on real actors and a real ZeroMQ bus (and the in-memory bus)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import pytest

from actors import AppendRules, ConfigError, DataParallel, SingleSlot, Task, evolve
from bus.log import read_log
from protocol import decode
from scenarios import router


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_router_reaches_held_out_reward_one_with_four_workers(router_kwargs, bus):
    result = evolve(**router_kwargs, rounds=15, n_workers=4, seed=0, bus=bus)
    assert result.error is None
    assert result.initial_reward == 0.0
    assert result.final_reward == 1.0
    assert result.outcomes()["committed"] >= 4
    for category, words in router.KEYWORDS.items():
        assert router.rules(result.rendered)[category] == set(words)


#: agentdescent 0.7.0's synchronous evolve() on the same tasks and split, 4 workers:
#: run() calls to held-out 1.0, held-out scoring included (python -m bench.learning).
AGENTDESCENT_SYNC_CALLS = 460


def test_the_default_round_reaches_held_out_one_in_no_more_calls_than_agentdescent(
        router_kwargs):
    calls = [0]

    def counted(rendered, task):
        calls[0] += 1
        return router.run(rendered, task)

    kw = dict(router_kwargs, run=counted)
    result = evolve(**kw, n_workers=4, seed=0, rounds=300, target_reward=1.0)
    assert result.stop_reason == "target_reward"
    assert calls[0] == result.rollouts + result.stats["scoring_calls"]
    assert calls[0] <= AGENTDESCENT_SYNC_CALLS, calls[0]
    # The whole-shard round with each conflicting variant scored and every proposal
    # made on the head (the default before one gate a merge and chained leases) spends
    # far more.
    whole = evolve(**dict(router_kwargs), n_workers=4, seed=0, rounds=300,
                   target_reward=1.0, parallel=DataParallel(), conflicts="score",
                   chain=False)
    assert whole.rollouts + whole.stats["scoring_calls"] > AGENTDESCENT_SYNC_CALLS


def test_same_seed_same_inputs_same_artifact(router_kwargs):
    a = evolve(**router_kwargs, rounds=3, n_workers=4, seed=5)
    b = evolve(**router_kwargs, rounds=3, n_workers=4, seed=5)
    assert a.state == b.state and a.version == b.version
    assert [h.heldout_reward for h in a.history] == [h.heldout_reward for h in b.history]
    assert a.outcomes() == b.outcomes()


def test_an_agent_object_works_like_run_and_propose(router_kwargs):
    kw = dict(router_kwargs)
    del kw["run"], kw["propose"]
    result = evolve(**kw, agent=router.RouterAgent(), rounds=15, target_reward=1.0)
    assert result.final_reward == 1.0 and result.stop_reason == "target_reward"


def test_history_has_one_entry_per_round_with_its_fields(router_kwargs):
    result = evolve(**router_kwargs, rounds=4, n_workers=2)
    assert [h.round for h in result.history] == [0, 1, 2, 3]
    first = result.history[0]
    assert first.rollouts > 0 and first.proposals > 0 and first.elapsed > 0
    assert sum(h.rollouts for h in result.history) == result.rollouts
    assert result.stop_reason == "rounds"


def test_max_concurrency_bounds_the_leases_running_at_once(router_kwargs):
    result = evolve(**router_kwargs, rounds=2, n_workers=4, max_concurrency=1)
    assert result.bus["peak_running"] == 1


def test_budget_max_rollouts_stops_with_that_reason(router_kwargs):
    result = evolve(**router_kwargs, rounds=50, n_workers=4, max_rollouts=30)
    assert result.stop_reason == "max_rollouts" and result.rollouts == 30


def test_scoring_calls_are_reported_beside_the_train_calls(router_kwargs):
    import threading

    lock, seen = threading.Lock(), [0]
    solve = router_kwargs["run"]

    def counting(rendered, task):
        with lock:
            seen[0] += 1
        return solve(rendered, task)

    result = evolve(**{**router_kwargs, "run": counting}, rounds=3, n_workers=4, seed=0)
    # every run() call is a train rollout or held-out scoring, and each is counted once
    assert result.stats["scoring_calls"] > 0
    assert result.rollouts + result.stats["scoring_calls"] == seen[0]


def test_log_is_written_and_inspect_reads_it(router_kwargs, tmp_path, clean_env):
    path = tmp_path / "run.evolog"
    result = evolve(**router_kwargs, rounds=2, log=str(path))
    contents = read_log(path)
    kinds = [type(decode(r.body)).__name__ for r in contents.records]
    assert kinds[0] in ("Hello", "Start") and "RunDone" in kinds and "Commit" in kinds
    assert [r.seq for r in contents.records] == list(range(1, len(kinds) + 1))
    out = subprocess.run([sys.executable, "-m", "actors.cli", "inspect", str(path)],
                         capture_output=True, text=True, env=clean_env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "RunDone" in out.stdout and f"{len(kinds)} messages" in out.stdout
    assert result.log_path == str(path)


def test_a_flaky_backend_is_reported_in_error_not_raised(router_kwargs):
    calls = {"n": 0}

    def flaky(rendered, task):
        calls["n"] += 1
        if task.id.endswith("-0"):
            raise TimeoutError("backend timed out")
        return router.run(rendered, task)

    result = evolve(**{**router_kwargs, "run": flaky}, rounds=2)
    assert result.error is not None and "TimeoutError: backend timed out" in result.error
    assert result.outcomes()["rollout-error"] > 0


def test_single_slot_and_append_rules_strategies_evolve():
    tasks = [Task(f"t{i}", f"say {i % 3}", {"want": "polite"}) for i in range(12)]

    def run(rendered, task):
        return "polite" if "polite" in rendered else "rude"

    def reward(task, output):
        return 1.0 if output == task.meta["want"] else 0.0

    def propose(rendered, task, output, score):
        return "be polite"

    for strategy in (SingleSlot(), AppendRules()):
        result = evolve(tasks, reward, run=run, propose=propose, strategy=strategy, rounds=2)
        assert result.final_reward == 1.0, strategy
        assert "be polite" in result.rendered


# -- refused before the first rollout ---------------------------------------------------

def _never(*a):
    raise AssertionError("no rollout may happen")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(tasks=router.tasks()[:3]), "at least 4 tasks"),
    (dict(tasks=router.tasks()[:4] + router.tasks()[:1]), "duplicate task ids"),
    (dict(n_workers=0), "n_workers must be an integer >= 1"),
    (dict(run=None, propose=None), "either agent="),
    (dict(propose=None), "either agent="),
    (dict(rounds=0), "rounds must be"),
    (dict(held_out_frac=1.0), "held_out_frac"),
    (dict(max_concurrency=0), "max_concurrency"),
    (dict(solved_threshold=1.5), "solved_threshold must be in (0, 1]"),
    (dict(solved_threshold=0), "solved_threshold must be in (0, 1]"),
    (dict(tasks=["not a task"] * 5), "Task(id, prompt, meta)"),
])
def test_caller_mistakes_are_refused_before_the_first_rollout(kwargs, needle):
    base = dict(tasks=router.tasks(), reward=router.reward, run=_never, propose=_never)
    base.update(kwargs)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        evolve(**base)


def test_a_reward_outside_zero_one_is_raised_naming_the_task(router_kwargs):
    def bad_reward(task, output):
        return 1.5

    with pytest.raises(ConfigError, match=r"reward\(task='.*'.*returned 1.5.*\[0, 1\]"):
        evolve(**{**router_kwargs, "reward": bad_reward}, rounds=2)


def test_a_run_refused_at_its_first_call_leaves_no_log(router_kwargs, tmp_path):
    def bad_reward(task, output):
        return 1.5

    log = tmp_path / "refused.evolog"
    with pytest.raises(ConfigError, match=r"returned 1.5") as info:
        evolve(**{**router_kwargs, "reward": bad_reward}, rounds=2, log=str(log))
    assert not log.exists() and "keeps" not in str(info.value)
    # Corrected, the same path takes the run's log: nothing to overwrite.
    assert evolve(**router_kwargs, rounds=1, log=str(log)).error is None and log.exists()


def test_a_caller_mistake_found_after_rounds_keeps_the_log_and_says_so(router_kwargs,
                                                                         tmp_path):
    closed = threading.Event()

    def late_bad_reward(task, output):   # right until the first round has closed
        return 1.5 if closed.is_set() else router.reward(task, output)

    log = tmp_path / "late.evolog"
    with pytest.raises(ConfigError, match=r"returned 1.5") as info:
        evolve(**{**router_kwargs, "reward": late_bad_reward}, rounds=6, log=str(log),
               n_workers=1, on_progress=lambda record: closed.set())
    assert log.exists() and f"the log {log} keeps the " in str(info.value)
    assert "another log path or with --overwrite" in str(info.value)


def test_a_refused_run_never_removes_a_log_it_did_not_write(router_kwargs, tmp_path):
    log = tmp_path / "theirs.evolog"
    evolve(**router_kwargs, rounds=1, log=str(log))
    before = log.read_bytes()
    with pytest.raises(ConfigError, match="a log is already there"):
        evolve(**router_kwargs, rounds=1, log=str(log))
    assert log.read_bytes() == before


def test_an_agents_token_usage_reaches_the_result(router_kwargs):
    class Counting(router.RouterAgent):
        def __init__(self):
            self.usage = {"total_tokens": 0}

        def solve(self, rendered, task):
            self.usage["total_tokens"] += 3
            return super().solve(rendered, task)

    kw = dict(router_kwargs)
    del kw["run"], kw["propose"]
    agent = Counting()
    result = evolve(**kw, agent=agent, rounds=1)
    assert result.usage == {"total_tokens": agent.usage["total_tokens"]} and result.usage["total_tokens"] > 0


def test_progress_reports_the_workers_alive(router_kwargs):
    seen = []
    evolve(**router_kwargs, rounds=2, n_workers=3, on_progress=seen.append)
    assert [r.workers_alive for r in seen] == [3, 3]


def test_async_run_propose_and_reward_give_the_same_run_as_their_sync_forms(router_kwargs):
    import asyncio

    sync = evolve(**router_kwargs, rounds=4, seed=3)

    async def run(rendered, task):
        await asyncio.sleep(0)
        return router.run(rendered, task)

    async def propose(rendered, task, output, score):
        await asyncio.sleep(0)
        return router.propose(rendered, task, output, score)

    async def reward(task, output):
        return router.reward(task, output)

    result = evolve(**{**router_kwargs, "run": run, "propose": propose, "reward": reward},
                    rounds=4, seed=3)
    assert result.error is None and result.state == sync.state
    assert result.final_reward == sync.final_reward and result.rollouts == sync.rollouts


def test_an_async_agent_works_and_a_failing_async_run_is_evidence(router_kwargs):
    import asyncio

    timeouts = []

    class AsyncRouter(router.RouterAgent):
        async def solve(self, rendered, task):
            await asyncio.sleep(0)
            if task.id.endswith("-3"):
                timeouts.append(task.id)
                raise TimeoutError("the backend timed out")   # evidence, not a crash
            return super().solve(rendered, task)

    kw = {k: v for k, v in router_kwargs.items() if k not in ("run", "propose")}
    result = evolve(**kw, agent=AsyncRouter(), rounds=3)
    # The run goes on; the failures are reported, counted, with the first one's error.
    assert timeouts and result.rollouts > 0
    # (train rollouts: the held-out scoring that also timed out is not in this count)
    assert re.match(r"\d+ rollout\(s\) failed in the backend; first: ", result.error)
    assert "TimeoutError: the backend timed out" in result.error
    assert result.final_reward > result.initial_reward
