"""The Worker: rolls the artifact out on tasks and proposes edits. The edge where
nondeterminism lives (a model's answer, a crash); everything it reports is a message.

:class:`WorkerCore` is the logic (no bus, no threads): it turns a ``Lease`` into a
``LeaseDone``. :class:`Serve` is the one worker loop's dispatch (DESIGN section 2): what
each kind of work a worker takes (``Lease`` of kind rollout or eval, ``Branch``,
``Commit``, ``Cancel``) runs, whatever carries the messages in and the answers out: a
pykka thread (:mod:`actors.workers.local`) or a slot thread of a worker in another
process (:mod:`actors.workers.remote`, which process workers run too).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
import queue
from concurrent.futures import Future, wait
from typing import Any, Callable

import msgspec

from actors.errors import RetryLater, describe
from actors.throttle import Backoff
from actors.usage import bind, report, take
from actors.workers import scope
from actors.workers.chain import Chain
from actors.workers.scope import RunScope
from protocol import Branch, Cancel, Commit, Lease, LeaseDone, RolloutResult, Task

log = logging.getLogger(__name__)

#: A rollout scoring at least this is solved: no proposal is asked for it.
SOLVED = 0.999
#: A call of a lease of independent calls (an eval lease, an unchained rollout lease)
#: taking at least this long, most of it waiting (a model behind a network), has the
#: lease's other calls made up to ``call_concurrency`` at once. A faster call, or one
#: that kept a core busy for a quarter of its time or more (in this thread or in a
#: child process it waited for: a local evaluator), is work on this machine's cores,
#: where more of them at once only contend.
SLOW_CALL_S = 0.002
#: The most of a lease's calls a worker makes at once, whatever is asked
#: (``call_concurrency``; ``[workers] call_concurrency`` says the same): each is a thread.
MAX_CALL_CONCURRENCY = 256


class Awaiter:
    """Settles what user code returned: an awaitable (an ``async def`` target, run,
    propose, reward or agent method) runs to its end on the calling thread's own event
    loop, made at its first use and kept (a client the code opened on it stays usable
    on that thread); anything else is returned as it is. A loop runs on one thread, so
    each thread that settles something (a worker's, its call pool's) has its own."""

    __slots__ = ("_local", "_loops", "_lock")

    def __init__(self) -> None:
        self._local = threading.local()
        self._loops: list[asyncio.AbstractEventLoop] = []
        self._lock = threading.Lock()

    def __call__(self, value: Any) -> Any:
        if not hasattr(value, "__await__"):
            return value
        loop = getattr(self._local, "loop", None)
        if loop is None:
            loop = self._local.loop = asyncio.new_event_loop()
            with self._lock:
                self._loops.append(loop)
        return loop.run_until_complete(_as_coroutine(value))

    def close(self) -> None:
        """Close every loop made (none is running: the calls on them have ended)."""
        with self._lock:
            loops, self._loops = self._loops, []
        for loop in loops:
            loop.close()
        self._local = threading.local()


async def _as_coroutine(awaitable) -> Any:
    """Any awaitable (a coroutine, a future-like object) as a coroutine for the loop."""
    return await awaitable


def check_reward(value: Any, task: Task) -> float:
    """A reward must be a real number in [0, 1]; anything else is the caller's mistake."""
    if value.__class__ is float and 0.0 <= value <= 1.0:  # the common case, first (NaN fails)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"reward(task={task.id!r}, ...) returned {value!r}: a reward must be a float in "
            "[0, 1]; rescale or clamp it inside your reward function")
    return float(value)


def _cpu_seconds() -> float:
    """CPU time of this thread and of the child processes this process has waited for."""
    t = os.times()
    return time.thread_time() + t.children_user + t.children_system


def _waited(wall: float, cpu: float) -> bool:
    """Whether a call of ``wall`` seconds that used ``cpu`` seconds of CPU (this thread's
    and its children's) was slow and mostly waiting: a model behind a network spends a
    few percent of its time on a core; local work spends all of it, or a share of it
    when more threads are runnable than cores (a quarter: four times oversubscribed)."""
    return wall >= SLOW_CALL_S and cpu < wall / 4


class _CallPool:
    """Threads that make a lease's independent calls at once. Daemon threads, as a worker's:
    a call stuck in user code (a stalled endpoint) must not keep the process alive once
    the run has stopped. Made as needed, up to ``size``."""

    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        if len(self._threads) < self.size:   # one thread per call waiting, at most size
            t = threading.Thread(target=self._serve, daemon=True,
                                 name=f"{self.name}_{len(self._threads)}")
            self._threads.append(t)
            t.start()
        return future

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:   # handed to the lease's thread, which decides
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Idle threads end (the leases wait for their calls, so none is in one)."""
        for _ in self._threads:
            self._queue.put(None)
        self._threads = []


class WorkerCore:
    def __init__(self, name: str, tasks: dict[str, Task], reward: Callable, run: Callable,
                 propose: Callable | None, strategy, solved: float = SOLVED,
                 initial_state: dict[str, str] | None = None,
                 scope: RunScope | None = None, call_concurrency: int = 1) -> None:
        self.name = name
        self.tasks = tasks
        self.reward = reward
        self.run = run
        self.propose = propose
        self.strategy = strategy
        self.solved = solved
        self.version = 0
        self.state: dict[str, str] = dict(initial_state if initial_state is not None
                                          else strategy.initial())
        self.rendered = strategy.render(self.state)
        self.settle = Awaiter()   # async run / propose / reward (one core per thread)
        #: The run, for parallel groups started inside run/propose (actors.workers.scope).
        self.scope = scope
        # A call that raises RetryLater is called again (docs/budgets.md): 1 s doubling to
        # 30 s, jittered, for 2 minutes at most; then it fails as Throttled.
        self.backoff = Backoff(initial=1.0, maximum=30.0, deadline=120.0)
        self._local = threading.local()   # what each thread's calls report (actors.usage)
        #: How many of a lease's independent calls run at once when they are slow
        #: (SLOW_CALL_S): an eval lease's held-out scoring (a gate waits for its slowest
        #: chunk) and an unchained rollout lease's rollouts, each with its proposal.
        self.call_concurrency = call_concurrency
        self._pool: _CallPool | None = None   # made at the first slow lease
        self._slow = False   # the last calls made were slow and waiting: start pooled

    @property
    def meter(self) -> dict[str, list]:
        """What the calls made on this thread report (actors.usage), per call: the lease's
        thread and each of the call pool's threads has its own."""
        try:
            return self._local.meter
        except AttributeError:
            self._local.meter = meter = {}
            return meter

    def close(self) -> None:
        """The worker is done: close the event loops async code ran on, if any."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.settle.close()

    def on_commit(self, msg: Commit) -> None:
        if msg.version >= self.version:
            self.version = msg.version
            self.state = dict(msg.state)
            self.rendered = self.strategy.render(self.state)

    def run_lease(self, lease: Lease, cancelled: Callable[[], bool] | None = None) -> LeaseDone:
        if lease.kind == "eval":
            rendered = self.strategy.render(lease.state or {})
            state, version, may_propose = lease.state or {}, lease.version, False
        else:   # a lease given a state rolls out on it (a branch: RoundClosed.bases)
            rendered, state, version = self.rendered, self.state, self.version
            if lease.state is not None:
                state, rendered = lease.state, self.strategy.render(lease.state)
            may_propose = self.propose is not None
        bind(self.meter)  # on the thread that runs the lease: the calls report into it
        chained = lease.chain and may_propose
        if self.call_concurrency > 1 and len(lease.task_ids) > 1 and not chained:
            results, fatal = self._at_once(lease, rendered, state, version, may_propose,
                                           cancelled)
        else:
            results, fatal = self._roll_out(lease, rendered, state, version, may_propose,
                                            cancelled)
        bind(None)  # what this thread runs next (a group's branch, say) is not this lease's
        self.meter.clear()
        return LeaseDone(lease_id=lease.lease_id, worker=self.name, round=lease.round,
                         kind=lease.kind, unit=lease.unit, section=lease.section,
                         version=version, results=results, fatal=fatal)

    def _roll_out(self, lease: Lease, rendered: str, state, version: int, may_propose: bool,
                  cancelled: Callable[[], bool] | None
                  ) -> tuple[list[RolloutResult], str | None]:
        """A lease's tasks one after another (chained: each on the edits before it)."""
        results: list[RolloutResult] = []
        fatal = None
        chain = Chain(self.strategy, state, rendered) if lease.chain and may_propose else None
        for task_id in lease.task_ids:
            if cancelled is not None and cancelled():
                break
            if chain is not None:   # the lease's edits so far (actors/workers/chain.py)
                rendered, state = chain.rendered, chain.state
            task = self.tasks.get(task_id)
            if task is None:
                fatal = self._no_task(task_id)
                break
            try:
                result = self._call(lease.lease_id, task, rendered, state, version,
                                    may_propose)
            except ValueError as exc:  # a caller's mistake (reward range): fatal for the run
                fatal = str(exc)
                break
            if chain is not None and result.diff is not None:
                chain.add(len(results), result.diff)
            results.append(result)
        if chain is not None:
            results = chain.report(results)
        return results, fatal

    def _no_task(self, task_id: str) -> str:
        return (f"worker {self.name} has no task {task_id!r}: the worker was started with a "
                "different task list than the coordinator")

    def _call(self, lease_id: str, task: Task, rendered: str, state, version: int,
              may_propose: bool) -> RolloutResult:
        """One rollout (and its proposal), as a call of the run when it has a scope."""
        if self.scope is None:
            return self._one(task, rendered, state, version, may_propose)
        return self._scoped(lease_id, task, rendered, state, version, may_propose)

    def _at_once(self, lease: Lease, rendered: str, state, version: int, may_propose: bool,
                 cancelled: Callable[[], bool] | None) -> tuple[list[RolloutResult], str | None]:
        """A lease's independent calls (an eval lease's, or an unchained rollout lease's:
        each task's rollout and its proposal), one by one on this thread while they are
        fast or keep a core busy; once one is slow and mostly waiting (:func:`_waited`: a
        model behind a network), the rest up to ``call_concurrency`` at once on the
        core's pool, each thread with its own meter and event loop. A worker whose calls
        were seen waiting starts its next lease on the pool at once, until most of a
        lease's calls made there come back fast or busy on a core. The results in the
        lease's task order; a call's ValueError (a caller's mistake) is fatal, as when
        the calls run one by one, once every call of the lease has ended."""
        rest: list[Task] = []
        for task_id in lease.task_ids:
            task = self.tasks.get(task_id)
            if task is None:
                return [], self._no_task(task_id)
            rest.append(task)

        def one(task: Task) -> RolloutResult:
            return self._call(lease.lease_id, task, rendered, state, version, may_propose)

        results: list[RolloutResult] = []
        rest.reverse()
        try:
            while rest and not self._slow:
                if cancelled is not None and cancelled():
                    return results, None
                began, busy = time.perf_counter(), _cpu_seconds()
                results.append(one(rest.pop()))
                self._slow = _waited(time.perf_counter() - began, _cpu_seconds() - busy)
        except ValueError as exc:
            return results, str(exc)
        if not rest:
            return results, None
        if self._pool is None:
            self._pool = _CallPool(self.call_concurrency, f"evobus-{self.name}-call")
        stop = cancelled or (lambda: False)
        futures = [self._pool.submit(self._pooled, one, task, stop) for task in reversed(rest)]
        wait(futures)   # no call of the lease goes on after its answer
        fatal = None
        waited = 0
        for future in futures:   # every call made is reported (its calls are counted)
            try:
                result, slow = future.result()
            except ValueError as exc:
                fatal = fatal or str(exc)
                continue
            waited += slow
            if result is not None:
                results.append(result)
        # Still slow and waiting while most calls at once were: stay on the pool.
        self._slow = 2 * waited > len(futures)
        return results, fatal

    def _pooled(self, one: Callable[[Task], RolloutResult], task: Task,
                cancelled: Callable[[], bool]) -> tuple[RolloutResult | None, bool]:
        """One call on a pool thread, its usage metered on that thread; and whether it was
        slow and mostly waiting."""
        if cancelled():
            return None, False
        bind(self.meter)
        began, busy = time.perf_counter(), _cpu_seconds()
        try:
            return one(task), _waited(time.perf_counter() - began, _cpu_seconds() - busy)
        finally:
            bind(None)
            self.meter.clear()

    def _scoped(self, lease_id: str, task: Task, rendered: str, state, version: int,
                may_propose: bool) -> RolloutResult:
        """:meth:`_one` as a call of the run: the groups run/propose start on this thread
        run on the run's runtime, and their branch starts count with the rollout's calls."""
        call, token = scope.enter(self.scope, f"{lease_id}/{task.id}", lease_id)
        try:
            result = self._one(task, rendered, state, version, may_propose)
        finally:
            scope.leave(token)
        if result.calls > 1:   # propose ran: a call of the run too
            self.scope.add(result.calls - 1)
        if call.calls:
            result = msgspec.structs.replace(result, calls=result.calls + call.calls,
                                             group_calls=call.calls)
        return result

    def _one(self, task: Task, rendered: str, state, version: int, may_propose: bool):
        meter = self.meter
        try:
            try:  # the fast path, inline: most rollouts pass here and nowhere else
                output = self.run(rendered, task)
                if output.__class__ is not str and hasattr(output, "__await__"):
                    output = self.settle(output)
            except RetryLater as exc:
                output = self._again(self.run, (rendered, task), exc)
        except Exception as exc:  # a flaky backend is evidence: reported in the result
            return RolloutResult(task_id=task.id, error=describe(exc), calls=1,
                                 usage=take(meter, "run"))
        usage = take(meter, "run") if meter else ()
        score = self.reward(task, output)
        if score.__class__ is not float:   # an int, or an async reward's coroutine
            score = self.settle(score)
        score = check_reward(score, task)
        if not may_propose or score >= self.solved:
            return RolloutResult(task_id=task.id, score=score, calls=1, usage=usage)
        try:
            text = self._retried(self.propose, (rendered, task, output, score))
        except Exception as exc:  # reported with the rollout; the score still counts
            return RolloutResult(task_id=task.id, score=score, error="propose: " + describe(exc),
                                 calls=2, usage=usage + take(meter, "propose"))
        if meter:
            usage = usage + take(meter, "propose")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"propose(task={task.id!r}, ...) returned "
                             f"{type(text).__name__}; it must return a str or None")
        diff = self.strategy.to_diff(state, text, self.name, version) if text else None
        return RolloutResult(task_id=task.id, score=score, diff=diff, calls=2, usage=usage)

    def _retried(self, fn: Callable, args: tuple):
        """One call to run or propose (an awaitable it returns is awaited), called again
        while it raises RetryLater."""
        try:
            return self._once(fn, args)
        except RetryLater as exc:
            return self._again(fn, args, exc)

    def _again(self, fn: Callable, args: tuple, first: RetryLater):
        """The call said "retry later": call it again with backoff until it answers or
        the deadline passes (Throttled); the attempts and seconds waited are reported."""
        value, attempts, slept = self.backoff.call(lambda: self._once(fn, args), first=first)
        report(attempts=attempts, throttled=slept)
        return value

    def _once(self, fn: Callable, args: tuple):
        value = fn(*args)
        if value.__class__ is not str and hasattr(value, "__await__"):   # async code
            value = self.settle(value)
        return value


def crashed(name: str, lease: Lease, exc: BaseException) -> LeaseDone:
    """The answer of a lease whose run raised (a bug in user code or a strategy), for a
    worker whose crash nobody else sees (one in another process): the run fails with it."""
    log.exception("worker %s: lease %s failed", name, lease.lease_id)
    return LeaseDone(lease_id=lease.lease_id, worker=name, round=lease.round, kind=lease.kind,
                     unit=lease.unit, section=lease.section, version=lease.version,
                     fatal=f"worker {name} crashed running lease {lease.lease_id}: "
                           f"{describe(exc)}")


class Serve:
    """The one dispatch of a worker's loop: each message it takes, in arrival order, to
    the code that runs it. Only the transport differs between the loops that call it:

    - ``answer(done)`` carries a lease's ``LeaseDone`` to the Scheduler;
    - ``branch(lease)`` runs a parallel group's ``Branch`` lease (its branch lane: a
      thread worker's lease box, or a worker process's branch service; both run
      :class:`actors.groups.worker.BranchRunner`, which sits above this layer);
    - ``cancelled`` holds the leases cancelled so far (a loop whose cancels arrive on
      another thread, mid-lease, adds them there: the lease stops before its next task);
    - ``crash(lease, exc)``: a lease whose run raised, answered (see :func:`crashed`);
      None lets the exception through (a thread worker's supervisor stops the run).

    With ``core`` None (a worker of parallel groups only) a ``Lease`` or ``Commit`` is
    not this loop's work. Calling it returns False for what it does not serve."""

    __slots__ = ("answer", "branch", "cancelled", "core", "crash")

    def __init__(self, core: WorkerCore | None, answer: Callable[[LeaseDone], None],
                 branch: Callable[[Branch], None] | None, cancelled: set[str],
                 crash: Callable[[Lease, BaseException], LeaseDone] | None = None) -> None:
        self.core = core
        self.answer = answer
        self.branch = branch
        self.cancelled = cancelled
        self.crash = crash

    def __call__(self, msg) -> bool:
        match msg:
            case Lease() as lease if self.core is not None:
                self._lease(lease)
            case Branch() as lease if self.branch is not None:
                self.branch(lease)
            case Commit() as commit if self.core is not None:
                self.core.on_commit(commit)
            case Cancel(lease_id=lease_id):
                self.cancelled.add(lease_id)
            case _:
                return False
        return True

    def _lease(self, lease: Lease) -> None:
        lease_id, cancelled = lease.lease_id, self.cancelled
        if lease_id in cancelled:
            return
        try:
            done = self.core.run_lease(lease, cancelled=lambda: lease_id in cancelled)
        except Exception as exc:
            if self.crash is None:
                raise
            done = self.crash(lease, exc)
        self.answer(done)
