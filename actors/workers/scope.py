"""The run a call belongs to: what a parallel group started inside evolve()'s run,
propose or agent (or inside a branch of one) needs to run as part of that run.

A :class:`RunScope` is made once per run by evolve() and shared by its thread workers
(a run with no budget);
each worker sets the :class:`CallScope` of the call it is making (:func:`enter`,
:func:`leave`). A group started on that thread (``actors.groups``) finds it with
:func:`current` and then runs on the run's runtime (its messages in the run's log),
charges its branch starts to the run's ``max_calls``, and reports them with the
rollout (``RolloutResult.calls``), which is how the run's Planner counts them.

When the run has a budget, each worker (each slot of a worker in another process)
gets an :class:`AskedRun` instead, whose branch starts ask the Scheduler (``CallsAsk``,
answered ``CallsGranted``) to reserve them against the run's budget ledger, as leases
are, so that no call starts past a budget wherever it runs. A worker in another
process runs its groups on its process's own runtime.
"""

from __future__ import annotations

import contextvars
import hashlib
import threading
from typing import Any, Callable

from actors.errors import BudgetExhausted
from protocol import CallsAsk, CallsGranted, Message

#: The call this code runs in. A context variable rather than a thread-local, so that
#: code the call hands to another thread with the context copied (``asyncio.to_thread``,
#: as ``parallel_async`` does) or runs on an event loop still belongs to the call.
_call: contextvars.ContextVar["CallScope | None"] = contextvars.ContextVar(
    "evobus_call", default=None)


class RunScope:
    """One run, as seen by its thread workers: its runtime, its calls budget, and (on
    resume) what its groups had finished before the crash."""

    def __init__(self, runtime: Any, run_id: str, max_calls: int | None,
                 finished: dict[str, dict[int, Any]] | None = None) -> None:
        self.runtime = runtime
        self.run_id = run_id
        self.max_calls = max_calls
        self.lock = threading.Lock()
        self.calls = 0   # calls started by this process's workers: run, propose, branches
        #: group id -> {branch: result} a resumed run's groups had finished (from the log)
        self.finished = finished or {}

    @property
    def limited(self) -> bool:
        """Whether a branch start must be checked (:meth:`take`) rather than counted."""
        return self.max_calls is not None

    def entered(self, lease_id: str) -> None:
        """A call of lease ``lease_id`` starts (only :class:`AskedRun` needs to know)."""

    def add(self, n: int = 1) -> None:
        """Count calls that go ahead whatever the count (the Planner gates rollouts)."""
        with self.lock:
            self.calls += n

    def take(self, n: int = 1) -> bool:
        """Count ``n`` calls if the budget allows them; False (nothing counted) if not."""
        with self.lock:
            if self.max_calls is not None and self.calls + n > self.max_calls:
                return False
            self.calls += n
            return True


class BudgetAsks:
    """The asks of one worker process to the run's budget ledger: ``send`` one
    ``CallsAsk``, wait (at most ``deadline`` seconds) for :meth:`answer` to be given
    its ``CallsGranted`` by the thread that receives the worker's messages."""

    def __init__(self, worker: str, send: Callable[[Message], None],
                 deadline: float = 30.0) -> None:
        self.worker, self.send, self.deadline = worker, send, deadline
        self.lock = threading.Lock()
        self.asked = 0
        self.pending: dict[int, list] = {}   # ask -> [event, answer]

    def ask(self, lease_id: str, calls: int) -> str:
        """Reserve ``calls`` calls for ``lease_id``: "" when reserved, else why not."""
        with self.lock:
            self.asked += 1
            ask = self.asked
            slot = self.pending[ask] = [threading.Event(), None]
        self.send(CallsAsk(worker=self.worker, lease_id=lease_id, ask=ask, calls=calls))
        if not slot[0].wait(self.deadline):
            with self.lock:
                self.pending.pop(ask, None)
            return (f"worker {self.worker}: no answer from the coordinator's Scheduler to "
                    f"a budget ask within {self.deadline:g} s (is the run still going?)")
        return slot[1].refused

    def deliverer(self, other: Callable[[Any], None]) -> Callable[[Any], None]:
        """A bus delivery function: answers to asks are given here at once (the thread
        that asked is waiting, perhaps inside the very lease the worker runs); anything
        else goes to ``other``."""
        def deliver(delivery) -> None:
            if type(delivery.msg) is CallsGranted:
                self.answer(delivery.msg)
            else:
                other(delivery)
        return deliver

    def answer(self, msg: CallsGranted) -> None:
        with self.lock:
            slot = self.pending.pop(msg.ask, None)
        if slot is not None:   # (None: an answer after its ask gave up waiting)
            slot[1] = msg
            slot[0].set()


class AskedRun(RunScope):
    """A run seen from one worker (a thread worker, or one slot of a worker in another
    process, whose groups run on the process's own runtime: ``runtime`` None): with
    ``asks`` (the run has a calls, tokens or cost budget) every branch start is reserved
    against the run's ledger first, under the lease the worker is running."""

    def __init__(self, run_id: str, asks: BudgetAsks | None, runtime: Any = None,
                 finished: dict[str, dict[int, Any]] | None = None) -> None:
        super().__init__(runtime, run_id, None, finished)
        self.asks = asks
        self.lease_id = ""

    @property
    def limited(self) -> bool:
        return self.asks is not None

    def entered(self, lease_id: str) -> None:
        self.lease_id = lease_id

    def take(self, n: int = 1) -> bool:
        if self.asks is not None:
            refused = self.asks.ask(self.lease_id, n)
            if refused:
                raise BudgetExhausted(refused)
        self.add(n)
        return True


class CallScope:
    """One call to run/propose/an agent's method: the groups it starts and their calls."""

    __slots__ = ("run", "key", "groups", "calls")

    def __init__(self, run: RunScope, key: str) -> None:
        self.run = run
        self.key = key        # the lease, task and role of the call
        self.groups = 0       # groups started in this call so far
        self.calls = 0        # branch starts of those groups (reported with the rollout)

    def next_group_id(self) -> str:
        """A group id that the same call gets again when a resumed run repeats it."""
        self.groups += 1
        text = f"{self.run.run_id}/{self.key}/{self.groups}"
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def current() -> CallScope | None:
    return _call.get()


def enter(run: RunScope, key: str, lease_id: str = "") -> tuple[CallScope, contextvars.Token]:
    """Start call ``key`` of lease ``lease_id`` here (counted in the run's calls): the new
    scope and the token that :func:`leave` restores the one before with."""
    run.entered(lease_id)
    run.add(1)
    scope = CallScope(run, key)
    return scope, _call.set(scope)


def leave(token: contextvars.Token) -> None:
    _call.reset(token)
