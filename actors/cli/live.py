"""Progress inside a round, for the live panel of ``evobus run``: how many of the
round's leases are done, rollouts, calls, tokens and cost so far, held-out evaluations
done of those asked for, and the working time they took.

The runtime hands every delivered message to :meth:`InRound.push` on the bus's thread
(``Runtime(watch=...)``); ``push`` only stamps and queues the bytes. The panel calls
:meth:`InRound.snapshot` a few times a second, which decodes what was queued and folds
it into a :class:`actors.cli.figures.RunFigures`, the fold `evobus inspect --summary`
runs over the log: the bus never waits on the display, nothing is sampled or dropped,
and the live figures are the summary's.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

from actors.cli.figures import RunFigures
from protocol import RoundClosed, decode

__all__ = ["InRound", "RoundSnapshot"]

#: Receivers of the messages the figures are folded from (the rest is not queued).
_WATCHED = ("scheduler", "merger", "planner")


@dataclass(frozen=True)
class RoundSnapshot:
    round: int | None        # the round (async: wave) being worked on; None before one
    leases_planned: int      # rollout leases of that round
    leases_done: int         # ... answered
    rollouts: int            # every rollout answered so far in the run
    calls: int               # every backend call answered so far (what max_calls counts)
    evals_asked: int         # held-out scorings the merger asked for in this round
    evals_done: int
    closed: bool             # the round has closed (its line is printed)
    working: float = 0.0     # seconds since work began (not waiting for workers)
    tokens: int = 0
    cost: float = 0.0
    usage: dict = field(default_factory=dict)   # RunFigures.usage(): by kind, limits
    closes: int = 0          # rounds (async: merges) closed
    committed: int = 0       # ... of them committed
    per_close: float | None = None   # rollouts per recorded round (async: merge)
    joined: int = 0          # workers in other processes registered so far


class InRound:
    """Folds the messages of a live run into a :class:`RoundSnapshot`."""

    def __init__(self, clock=time.monotonic) -> None:
        self._queue: collections.deque[tuple[float, str, str, bytes]] = collections.deque()
        self._lock = threading.Lock()
        self._clock = clock
        self.figures = RunFigures()

    def push(self, sender: str, receiver: str, body: bytes) -> None:
        """Called by the bus for every delivered message: stamp and queue it."""
        if receiver in _WATCHED:
            self._queue.append((self._clock(), sender, receiver, body))

    def carry_on(self, contents) -> tuple[float, list[RoundClosed]]:
        """A resumed run: fold in the messages its earlier logs (``contents``, oldest
        first) hold, and go on on their clock, so rates, the working time and the rounds
        count the whole run. The seconds those logs cover and the rounds they closed."""
        offset, closed = 0.0, []
        for content in contents:
            for rec in content.records:
                if rec.receiver not in _WATCHED:
                    continue
                try:
                    msg = decode(rec.body)
                except ValueError:   # a frame the bus rejects too: not progress
                    continue
                self.figures.add(rec.sender, rec.receiver, msg, offset + rec.t)
                if isinstance(msg, RoundClosed) and rec.receiver == "planner":
                    closed.append(msg)
            offset += content.records[-1].t if content.records else 0.0
        clock, start = self._clock, self._clock()
        self._clock = lambda: offset + clock() - start
        return offset, closed

    def fold(self) -> RunFigures:
        """Fold in what was queued; the figures (read them under no other thread)."""
        with self._lock:
            while self._queue:
                t, sender, receiver, body = self._queue.popleft()
                try:
                    self.figures.add(sender, receiver, decode(body), t)
                except ValueError:   # a frame the bus rejects too: not progress
                    continue
            return self.figures

    def snapshot(self, now: float | None = None) -> RoundSnapshot:
        f = self.fold()
        with self._lock:
            usage = f.usage()
            return RoundSnapshot(f.round, f.planned, f.done,
                                 max(f.answered_rollouts, f.rollouts),
                                 usage["calls"]["total"], f.evals_asked, f.evals_done,
                                 f.round_closed,
                                 f.working(self._clock() if now is None else now),
                                 usage["tokens"]["total"], usage["cost"]["total"], usage,
                                 len(f.closed), sum(c.committed for c in f.closed),
                                 f.rollouts_per_close, len(f.joined))
