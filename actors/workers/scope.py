"""The run a call belongs to: what a parallel group started inside evolve()'s run,
propose or agent (or inside a branch of one) needs to run as part of that run.

A :class:`RunScope` is made once per run by evolve() and shared by its thread workers;
each worker sets the :class:`CallScope` of the call it is making (:func:`enter`,
:func:`leave`). A group started on that thread (``actors.groups``) finds it with
:func:`current` and then runs on the run's runtime (its messages in the run's log),
charges its branch starts to the run's ``max_calls``, and reports them with the
rollout (``RolloutResult.calls``), which is how the run's Planner counts them.
"""

from __future__ import annotations

import contextvars
import hashlib
import threading
from typing import Any

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


def enter(run: RunScope, key: str) -> tuple[CallScope, contextvars.Token]:
    """Start call ``key`` here (counted in the run's calls): the new scope and the token
    that :func:`leave` restores the one before with."""
    run.add(1)
    scope = CallScope(run, key)
    return scope, _call.set(scope)


def leave(token: contextvars.Token) -> None:
    _call.reset(token)
