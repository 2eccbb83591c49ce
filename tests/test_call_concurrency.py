"""A worker makes a lease's slow independent calls several at once (``call_concurrency``):
held-out scoring, and an unchained rollout lease's rollouts with their proposals; a gate
waits for its slowest chunk, a round for its slowest lease. Fast calls (work on this
machine's cores) and a chain's (each on the edits before it) stay one by one on the
lease's thread."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from actors.errors import ConfigError
from actors.artifacts import AppendRules, KeyedRules, SingleSlot
from actors.policies.parallelism import ClusterParallel, DataParallel, TensorParallel
from actors.policies.parallelism import uses_chain
from actors.runtime.evolve import evolve
from actors.usage import report
from actors.workers.core import SLOW_CALL_S, WorkerCore, _cpu_seconds, _waited
from protocol import Lease, Task

pytestmark = pytest.mark.timeout(60)

#: A bounded wait: a call that needs others running beside it gives up after this.
DEADLINE_S = 10.0


def _tasks(n: int) -> dict[str, Task]:
    return {f"t{i}": Task(f"t{i}", str(i)) for i in range(n)}


def _eval(task_ids: list[str]) -> Lease:
    return Lease(lease_id="e1.0", round=-1, kind="eval", task_ids=task_ids,
                 state={"value": "x"})


def _slow_first_then_together(n_together: int):
    """A run whose first call is slow (a model behind a network) and whose next
    ``n_together`` calls each wait at a barrier for the others: they can only answer if
    they are in flight at once. Each reports its own tokens and its thread."""
    barrier = threading.Barrier(n_together, timeout=DEADLINE_S)
    threads: dict[str, str] = {}
    daemons: dict[str, bool] = {}
    first = threading.Lock()

    def run(rendered: str, task: Task) -> str:
        threads[task.id] = threading.current_thread().name
        daemons[task.id] = threading.current_thread().daemon
        report(model="m", input_tokens=int(task.prompt), output_tokens=1)
        if first.acquire(blocking=False):
            time.sleep(SLOW_CALL_S * 5)   # the call's own latency: it makes it "slow"
        else:
            barrier.wait()   # BrokenBarrierError if the calls were not at once
        return task.prompt

    run.daemons = daemons
    return run, threads


def test_an_eval_lease_makes_its_slow_calls_at_once_results_in_task_order_each_metered():
    run, threads = _slow_first_then_together(5)
    core = WorkerCore("w0", _tasks(6), lambda task, out: float(out == "3"), run, None,
                      SingleSlot(), call_concurrency=8)
    try:
        done = core.run_lease(_eval([f"t{i}" for i in range(6)]))
    finally:
        core.close()
    assert done.fatal is None
    assert [r.task_id for r in done.results] == [f"t{i}" for i in range(6)]
    assert [r.score for r in done.results] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert all(r.error is None for r in done.results)
    # each result carries the tokens its own call reported, not a neighbour's
    assert [r.usage[0].input_tokens for r in done.results] == list(range(6))
    assert len({threads[f"t{i}"] for i in range(1, 6)}) == 5   # five threads at once
    assert all(run.daemons[f"t{i}"] for i in range(1, 6))   # a stuck call holds no exit
    assert threads["t0"] == threading.current_thread().name     # the first on the lease's


def test_fast_calls_stay_one_by_one_on_the_lease_thread():
    threads: list[str] = []

    def run(rendered: str, task: Task) -> str:
        threads.append(threading.current_thread().name)
        return task.prompt

    core = WorkerCore("w0", _tasks(20), lambda task, out: 1.0, run, None, SingleSlot(),
                      call_concurrency=8)
    done = core.run_lease(_eval([f"t{i}" for i in range(20)]))
    core.close()
    assert len(done.results) == 20
    assert set(threads) == {threading.current_thread().name}
    assert core._pool is None   # never made


def _spin(seconds: float) -> None:
    """Keep this thread's core busy for ``seconds`` of its CPU time (local work)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_what_fans_out_is_a_slow_call_that_mostly_waited():
    assert _waited(0.5, 0.01)                 # a model behind a network
    assert _waited(SLOW_CALL_S, 0.0)
    assert not _waited(SLOW_CALL_S / 2, 0.0)  # fast
    assert not _waited(0.5, 0.5)              # local work on a core
    assert not _waited(0.5, 0.2)              # the same, the machine twice oversubscribed


@pytest.mark.parametrize("where", ["thread", "child process"])
def test_the_cpu_a_call_used_counts_its_thread_and_the_children_it_waited_for(where):
    """What _waited is given: CPU seconds, not wall clock, so a loaded machine does not
    change them. A child process's count once it has been waited for."""
    before = _cpu_seconds()
    if where == "thread":
        _spin(0.05)
    else:
        subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.05\n"
                        "while time.process_time() < end: pass"], check=True,
                       timeout=DEADLINE_S)
    assert _cpu_seconds() - before >= 0.05


def test_a_call_judged_local_keeps_the_lease_one_by_one(monkeypatch):
    import actors.workers.core as core_module

    monkeypatch.setattr(core_module, "_waited", lambda wall, cpu: False)
    threads: list[str] = []

    def run(rendered: str, task: Task) -> str:
        threads.append(threading.current_thread().name)
        time.sleep(SLOW_CALL_S * 2)
        return task.prompt

    core = WorkerCore("w0", _tasks(3), lambda task, out: 1.0, run, None, SingleSlot(),
                      call_concurrency=8)
    done = core.run_lease(_eval(["t0", "t1", "t2"]))
    core.close()
    assert [r.error for r in done.results] == [None] * 3
    assert set(threads) == {threading.current_thread().name} and core._pool is None


def test_one_at_a_time_when_asked():
    seen: list[str] = []

    def run(rendered: str, task: Task) -> str:
        seen.append(threading.current_thread().name)
        time.sleep(SLOW_CALL_S * 2)   # slow calls, but call_concurrency=1
        return task.prompt

    core = WorkerCore("w0", _tasks(3), lambda task, out: 1.0, run, None, SingleSlot(),
                      call_concurrency=1)
    done = core.run_lease(_eval(["t0", "t1", "t2"]))
    core.close()
    assert [r.task_id for r in done.results] == ["t0", "t1", "t2"]
    assert set(seen) == {threading.current_thread().name}


def test_a_reward_out_of_range_on_a_pooled_call_is_fatal_once_every_call_ended():
    run, _ = _slow_first_then_together(3)
    ended: list[str] = []

    def reward(task: Task, out: str) -> float:
        ended.append(task.id)
        return 7.0 if task.id == "t2" else 1.0

    core = WorkerCore("w0", _tasks(4), reward, run, None, SingleSlot(), call_concurrency=4)
    done = core.run_lease(_eval(["t0", "t1", "t2", "t3"]))
    core.close()
    assert "returned 7.0" in done.fatal
    assert sorted(ended) == ["t0", "t1", "t2", "t3"]   # none left running after the answer
    # the calls that were made are reported (their calls count), the failed one is not
    assert [r.task_id for r in done.results] == ["t0", "t1", "t3"]


def test_a_cancelled_lease_starts_no_pooled_call():
    calls: list[str] = []

    def run(rendered: str, task: Task) -> str:
        calls.append(task.id)
        time.sleep(SLOW_CALL_S * 2)
        return task.prompt

    core = WorkerCore("w0", _tasks(4), lambda task, out: 1.0, run, None, SingleSlot(),
                      call_concurrency=4)
    cancelled = threading.Event()

    def first_then_cancel() -> bool:
        was = cancelled.is_set()
        cancelled.set()   # cancelled once the lease has begun
        return was

    done = core.run_lease(_eval(["t0", "t1", "t2", "t3"]), cancelled=first_then_cancel)
    core.close()
    assert calls == ["t0"] and [r.task_id for r in done.results] == ["t0"]


def test_async_calls_run_at_once_each_thread_on_its_own_event_loop():
    barrier = threading.Barrier(3, timeout=DEADLINE_S)
    loops: dict[str, int] = {}
    together = {"t1", "t2", "t3"}

    async def run(rendered: str, task: Task) -> str:
        loops[task.id] = id(asyncio.get_running_loop())
        if task.id in together:
            await asyncio.to_thread(barrier.wait)
        else:
            await asyncio.sleep(SLOW_CALL_S * 5)
        return task.prompt

    core = WorkerCore("w0", _tasks(6), lambda task, out: 1.0, run, None, SingleSlot(),
                      call_concurrency=4)
    try:
        done = core.run_lease(_eval(["t0", "t1", "t2", "t3"]))
        assert [r.error for r in done.results] == [None] * 4
        assert len({loops[t] for t in ("t1", "t2", "t3")}) == 3
        together.clear()
        again = core.run_lease(_eval(["t0", "t4", "t5"]))   # the pool's threads again
        assert [r.error for r in again.results] == [None] * 3
    finally:
        core.close()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, 257])
def test_evolve_refuses_a_call_concurrency_that_is_not_a_count(bad):
    with pytest.raises(ConfigError, match="call_concurrency"):
        evolve([Task("a", "1"), Task("b", "2")], lambda t, o: 1.0, run=lambda r, t: r,
               propose=lambda *a: None, call_concurrency=bad, rounds=1)


def test_a_run_scores_its_gates_on_more_threads_than_workers():
    """Two workers, slow calls (a model's latency): the held-out scoring's calls are
    made by the workers' eval pools too, the rollouts only by the workers' own threads."""
    tasks = [Task(f"t{i}", str(i), meta={"k": i % 3}) for i in range(30)]
    lock = threading.Lock()
    threads: dict[str, set[str]] = {"run": set(), "propose": set()}

    def run(rendered: str, task: Task) -> str:
        with lock:
            threads["run"].add(threading.current_thread().name)
        time.sleep(SLOW_CALL_S * 2)   # the model's latency
        return "ok" if task.prompt in rendered else "no"

    def propose(rendered: str, task: Task, output: str, score: float) -> str:
        with lock:
            threads["propose"].add(threading.current_thread().name)
        return f"{rendered} {task.prompt}"

    result = evolve(tasks, lambda t, o: float(o == "ok"), run=run, propose=propose,
                    strategy=SingleSlot(), n_workers=2, rounds=2, seed=1,
                    call_concurrency=6)
    assert result.calls > 0
    pooled = {t for t in threads["run"] if "-call" in t}
    assert len(pooled) >= 2, threads
    assert not any("-call" in t for t in threads["propose"])
    assert len(threads["run"] - pooled) == 2   # and the two workers' own threads


def test_a_scenario_names_it_under_workers_and_evolve_gets_it():
    from pathlib import Path

    from actors.runtime.launch import evolve_kwargs
    from protocol.scenario import parse_scenario

    text = Path(__file__).resolve().parents[1].joinpath("scenarios", "router.toml").read_text()
    assert evolve_kwargs(parse_scenario(text, "router.toml"))["call_concurrency"] == 8
    text = text.replace("local = 4", "local = 4\ncall_concurrency = 3")
    assert evolve_kwargs(parse_scenario(text, "router.toml"))["call_concurrency"] == 3


@pytest.mark.parametrize("asked,got", [(5, 5), (100_000, 256)])
def test_a_worker_in_another_process_takes_it_from_the_runs_spec_capped(monkeypatch,
                                                                       asked, got):
    """Each slot's core gets the run's call_concurrency (Spec), at most 256 threads."""
    from actors.workers import remote
    from protocol import Spec

    made: list[int] = []
    real = remote.WorkerCore

    def spy(*args, **kwargs):
        made.append(kwargs["call_concurrency"])
        return real(*args, **kwargs)

    monkeypatch.setattr(remote, "WorkerCore", spy)
    w = remote.RemoteWorker("tcp://127.0.0.1:1", worker_id="r0", slots=2)
    w.resolved = remote.Resolved(tasks=_tasks(1), reward=lambda t, o: 1.0,
                                 run=lambda r, t: r, propose=None, strategy=SingleSlot(),
                                 fingerprint="")
    w.spec = Spec(run_id="x", call_concurrency=asked)
    w._start_threads()
    try:
        assert made == [got, got]
    finally:
        w._release_slots()


def test_a_pooled_call_told_to_retry_later_is_retried_and_its_attempts_reported():
    """A 429 on one of the calls made at once: that call is retried with backoff on its
    pool thread, the others go on; its attempts travel with its own result."""
    from actors.errors import RetryLater
    from actors.throttle import Backoff

    run, threads = _slow_first_then_together(1)   # t1..t3 need no company here
    refused = {"t2": 2}   # t2 answers 429 twice, then answers
    lock = threading.Lock()

    def flaky(rendered: str, task: Task) -> str:
        with lock:
            left = refused.get(task.id, 0)
            refused[task.id] = left - 1
        if left > 0:
            raise RetryLater("429", retry_after=0.0)
        return run(rendered, task)

    core = WorkerCore("w0", _tasks(4), lambda task, out: 1.0, flaky, None, SingleSlot(),
                      call_concurrency=4)
    core.backoff = Backoff(initial=0.001, maximum=0.002, deadline=DEADLINE_S)
    done = core.run_lease(_eval(["t0", "t1", "t2", "t3"]))
    core.close()
    assert [r.task_id for r in done.results] == ["t0", "t1", "t2", "t3"]
    assert [r.error for r in done.results] == [None] * 4
    attempts = {r.task_id: sum(u.attempts for u in r.usage) for r in done.results}
    assert attempts["t2"] == 3 and attempts["t1"] == attempts["t3"] == 0
    assert "-call" in threads["t2"]   # retried on its pool thread


def _rollout(task_ids: list[str], chain: bool) -> Lease:
    return Lease(lease_id="r0.u0", round=0, kind="rollout", task_ids=task_ids, chain=chain)


def test_an_unchained_rollout_lease_makes_its_rollouts_and_proposals_at_once():
    """Without a chain a lease's tasks are independent: once a call is slow, the others
    (each rollout with its proposal) go at once; every proposal is made on the lease's
    state, the results in task order."""
    run, threads = _slow_first_then_together(4)
    proposed: dict[str, str] = {}

    def propose(rendered: str, task: Task, output: str, score: float) -> str:
        proposed[task.id] = rendered
        return f"{task.id}: fix"

    core = WorkerCore("w0", _tasks(5), lambda task, out: 0.0, run, propose,
                      KeyedRules([f"t{i}" for i in range(5)]), call_concurrency=8)
    try:
        done = core.run_lease(_rollout([f"t{i}" for i in range(5)], chain=False))
    finally:
        core.close()
    assert done.fatal is None
    assert [r.task_id for r in done.results] == [f"t{i}" for i in range(5)]
    assert [sorted(r.diff.ops) for r in done.results] == [[f"t{i}"] for i in range(5)]
    assert all(r.calls == 2 for r in done.results)
    assert set(proposed.values()) == {core.rendered}   # none on another's edit
    assert len({threads[f"t{i}"] for i in range(1, 5)}) == 4


def test_a_chained_lease_stays_one_by_one_when_calls_are_slow():
    """A chain's next task rolls out on the edits before it: its calls cannot overlap."""
    threads: list[str] = []
    seen: list[str] = []

    def run(rendered: str, task: Task) -> str:
        threads.append(threading.current_thread().name)
        seen.append(rendered)
        time.sleep(SLOW_CALL_S * 2)   # the model's latency
        return "no"

    core = WorkerCore("w0", _tasks(3), lambda task, out: 0.0, run,
                      lambda r, task, o, s: f"{task.id}: fix", KeyedRules(["t0", "t1", "t2"]),
                      call_concurrency=8)
    done = core.run_lease(_rollout(["t0", "t1", "t2"], chain=True))
    core.close()
    assert set(threads) == {threading.current_thread().name} and core._pool is None
    assert "fix" not in seen[0] and "fix" in seen[1] and seen[2].count("fix") == 2
    assert [r.task_id for r in done.results] == ["t0", "t1", "t2"]


def test_a_worker_seen_waiting_starts_its_next_lease_at_once_until_calls_are_fast():
    """The first slow call of a worker's first lease is made alone (is it a model behind a
    network?); its next lease's calls all go at once; once they come back fast, the
    lease after that is one by one on the lease's thread again."""
    threads: dict[str, str] = {}

    def slow(rendered: str, task: Task) -> str:
        threads[task.id] = threading.current_thread().name
        time.sleep(SLOW_CALL_S * 2)   # the model's latency
        return task.prompt

    core = WorkerCore("w0", _tasks(8), lambda task, out: 1.0, slow, None, SingleSlot(),
                      call_concurrency=4)
    try:
        core.run_lease(_eval(["t0", "t1", "t2"]))   # t0 alone, then t1 and t2 pooled
        assert threads["t0"] == threading.current_thread().name
        gate = threading.Barrier(3, timeout=DEADLINE_S)

        def together(rendered: str, task: Task) -> str:
            threads[task.id] = threading.current_thread().name
            gate.wait()   # all three in flight at once, or BrokenBarrierError
            time.sleep(SLOW_CALL_S * 2)
            return task.prompt

        core.run = together
        done = core.run_lease(_eval(["t3", "t4", "t5"]))
        assert [r.error for r in done.results] == [None] * 3
        assert all("-call" in threads[t] for t in ("t3", "t4", "t5"))

        def fast(rendered: str, task: Task) -> str:
            threads[task.id] = threading.current_thread().name
            return task.prompt

        core.run = fast
        core.run_lease(_eval(["t6", "t7"]))    # pooled (still judged slow), seen fast
        core.run_lease(_eval(["t0", "t1"]))
        assert threads["t0"] == threads["t1"] == threading.current_thread().name
    finally:
        core.close()


@pytest.mark.parametrize("strategy,parallel,asked,chained", [
    (SingleSlot(), DataParallel(), None, True),
    (KeyedRules(["a", "b"]), DataParallel(), None, False),
    (AppendRules(), DataParallel(per_worker=4), None, False),
    (KeyedRules(["a", "b"]), TensorParallel(2), None, True),
    (KeyedRules(["a", "b"]), ClusterParallel(len), None, True),
    (AppendRules(), object(), None, True),   # a plan() of the user's own
    (KeyedRules(["a", "b"]), DataParallel(), True, True),
    (SingleSlot(), ClusterParallel(len), False, False)])
def test_leases_chain_by_default_but_for_a_data_parallel_shard(strategy, parallel, asked,
                                                               chained):
    """One declared key: every diff conflicts, only a chain puts several edits in one
    candidate. A lease of alike tasks (a section, a cluster) chains: they fail for the
    same reasons. A DataParallel lease is a mixed shard: unchained, its calls can go at
    once. What the caller asks for wins."""
    assert uses_chain(asked, strategy, parallel) is chained


def test_evolve_records_the_chain_it_chose_in_the_runs_start(tmp_path):
    from bus.log import read_log
    from protocol import Start, decode

    tasks = [Task(f"t{i}", str(i)) for i in range(12)]
    for parallel, chained in ((None, False), (ClusterParallel(lambda t: int(t[1:]) % 2), True)):
        log = tmp_path / f"{chained}.evolog"
        evolve(tasks, lambda t, o: 1.0, run=lambda r, t: "x", propose=lambda *a: None,
               strategy=KeyedRules(["a", "b"]), parallel=parallel, rounds=1, log=str(log))
        starts = [m for m in (decode(r.body) for r in read_log(log).records)
                  if isinstance(m, Start)]
        assert [s.chain for s in starts] == [chained]
