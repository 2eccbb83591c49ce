"""Progress inside a round, for the live panel of ``evobus run``: how many of the
round's leases are done, rollouts and backend calls so far, held-out evaluations done
of those asked for.

The runtime hands every delivered message to :meth:`InRound.push` on the bus's thread
(``Runtime(watch=...)``); ``push`` only queues the bytes. The panel calls
:meth:`InRound.snapshot` a few times a second, which decodes what was queued and folds
it in: the bus never waits on the display, and nothing is sampled or dropped.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

from protocol import (EvalDone, EvalRequest, LeaseBatch, LeaseDone, RoundClosed, decode)

__all__ = ["InRound", "RoundSnapshot"]

#: Receivers of the messages that say how far a round has got (the rest is not queued).
_WATCHED = ("scheduler", "merger")


@dataclass(frozen=True)
class RoundSnapshot:
    round: int | None        # the round (async: wave) being worked on; None before one
    leases_planned: int      # rollout leases of that round
    leases_done: int         # ... answered
    rollouts: int            # every rollout answered so far in the run
    calls: int               # backend calls those rollouts report (run + propose)
    evals_asked: int         # held-out scorings the merger asked for in this round
    evals_done: int
    closed: bool             # the round has closed (its line is printed)


class InRound:
    """Folds the messages of a live run into a :class:`RoundSnapshot`."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[str, str, bytes]] = collections.deque()
        self._lock = threading.Lock()
        self._answered: set[str] = set()
        self.round: int | None = None
        self.planned = self.done = self.rollouts = self.calls = 0
        self.evals_asked = self.evals_done = 0
        self.closed = False

    def push(self, sender: str, receiver: str, body: bytes) -> None:
        """Called by the bus for every delivered message: queue it (a deque append)."""
        if receiver in _WATCHED:
            self._queue.append((sender, receiver, body))

    def snapshot(self) -> RoundSnapshot:
        with self._lock:
            while self._queue:
                sender, receiver, body = self._queue.popleft()
                try:
                    self._fold(sender, receiver, decode(body))
                except ValueError:   # a frame the bus rejects too: not progress
                    continue
            return RoundSnapshot(self.round, self.planned, self.done, self.rollouts,
                                 self.calls, self.evals_asked, self.evals_done, self.closed)

    def _fold(self, sender: str, receiver: str, msg) -> None:
        match msg:
            case LeaseBatch(round=r, leases=leases) if sender == "planner":
                if r != self.round:
                    self.round, self.planned, self.done, self.closed = r, 0, 0, False
                    self.evals_asked = self.evals_done = 0
                self.planned += sum(1 for lease in leases if lease.kind == "rollout")
            case LeaseDone(lease_id=lid) if receiver == "scheduler":
                if lid in self._answered:   # a late answer of a re-dispatched lease
                    return
                self._answered.add(lid)
                if msg.kind == "rollout":   # what the planner counts as calls and rollouts
                    self.calls += sum(r.calls for r in msg.results)
                    self.rollouts += len(msg.results)
                    self.done += msg.round == self.round
            case EvalRequest() if sender == "merger":
                self.evals_asked += 1
            case EvalDone() if receiver == "merger":
                self.evals_done += 1
            case RoundClosed(round=r) if r == self.round:
                self.closed = True
            case _:
                pass
