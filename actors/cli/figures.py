"""The figures of a run, folded from its messages: one source for the live panel of
``evobus run`` (the runtime's tap hands it every delivered message as it is delivered)
and for ``evobus inspect --summary`` (the same messages, read back from the log).

Per closed round (async: merge) the rollouts are counted as the Planner counts them for
its ``RoundRecord``: the rollouts settled since the previous recorded close (an async
merge with no proposal and no commit is not recorded, and its rollouts go to the next
one). Calls, tokens and cost are counted by the Scheduler's own ledger
(actors.machines.budget) over the same answers, against the budgets the Planner sent.
Time is *working* time: from the first message that starts work (the run's ``Start``, or
a resumed run's first lease or scoring request), so waiting for remote workers to
connect is not in any rate.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from actors.replay.chain import read_chain
from actors.machines.budget import Ledger
from protocol import (Baseline, Budget, Commit, EvalDone, EvalRequest, Hello, Lease,
                      LeaseBatch, LeaseDone, RoundClosed, Settled, SettledBatch, Start, decode)

__all__ = ["Closed", "RunFigures", "log_baseline"]


@dataclass
class Closed:
    """One closed round (async: merge)."""

    round: int
    version: int
    committed: bool
    heldout: float
    rollouts: int        # as the Planner records them (see the module's note)
    leases: int          # rollout leases settled in those rollouts
    proposals: int
    outcomes: dict[str, int]
    t: float             # working seconds when it closed
    recorded: bool = True   # the Planner made a RoundRecord of it
    #: Decisions about diffs earlier rounds held for this merge (RoundClosed.carried).
    carried: dict[str, int] = field(default_factory=dict)


@dataclass
class RunFigures:
    """Fold messages in with :meth:`add`; read the figures off the attributes."""

    word: str = "round"
    closed: list[Closed] = field(default_factory=list)
    rollouts: int = 0            # settled rollouts (the Planner's count)
    commits: int = 0             # Commit messages from the merger (fused ones too)
    answered_rollouts: int = 0   # rollouts answered, ahead of settling (live)
    late_answers: int = 0
    redispatches: int = 0
    ledger: Ledger = field(default_factory=Ledger)
    #: The open round (async: wave): its number, rollout leases planned and answered,
    #: held-out scorings asked and answered since it opened.
    round: int | None = None
    planned: int = 0
    done: int = 0
    evals_asked: int = 0
    evals_done: int = 0
    round_closed: bool = False   # the open round has closed (sync runs)
    started: float | None = None   # when work began (the caller's clock)
    last: float = 0.0
    asynchronous: bool = False
    #: The baseline's held-out calls: how many, how many failed (scored 0), the first
    #: error; None until the Planner has the baseline.
    baseline_calls: int | None = None
    baseline_errors: int = 0
    baseline_error: str | None = None
    #: Workers in other processes the registry admitted (its Hello to the Scheduler).
    joined: set[str] = field(default_factory=set)
    _last_eval: EvalDone | None = None   # the scoring a Baseline reports (just before it)
    _pending: list[int] = field(default_factory=lambda: [0, 0])   # rollouts, leases
    _answered: set[str] = field(default_factory=set)
    _dispatched: Counter = field(default_factory=Counter)

    def working(self, now: float | None = None) -> float:
        """Seconds of work up to ``now`` (default: the last message)."""
        if self.started is None:
            return 0.0
        return max(0.0, (self.last if now is None else now) - self.started)

    @property
    def rollouts_per_close(self) -> float | None:
        """Rollouts per recorded round (async: per merge), or None before one."""
        recorded = [c for c in self.closed if c.recorded]
        return sum(c.rollouts for c in recorded) / len(recorded) if recorded else None

    def add(self, sender: str, receiver: str, msg, t: float) -> None:
        self.last = t
        if self.started is None and isinstance(msg, (Start, LeaseBatch, EvalRequest)):
            self.started = t
        match msg:
            case Start(asynchronous=asynchronous):
                self.asynchronous = asynchronous
                self.word = "merge" if asynchronous else "round"
            case Hello(worker=worker) if sender == "registry":
                self.joined.add(worker)
            case Budget() if receiver == "scheduler":
                self.ledger.limits = msg
            case LeaseBatch(round=r, leases=leases) if sender == "planner":
                if r != self.round:
                    self.round, self.planned, self.done, self.round_closed = r, 0, 0, False
                    self.evals_asked = self.evals_done = 0
                self.planned += sum(1 for lease in leases if lease.kind == "rollout")
            case Lease(lease_id=lid) if sender == "scheduler":
                self.redispatches += bool(self._dispatched[lid])
                self._dispatched[lid] += 1
            case LeaseDone(lease_id=lid) if receiver == "scheduler":
                self._answer(msg)
            case Settled():
                self._settle(msg)
            case SettledBatch(settled=settled):
                for one in settled:
                    self._settle(one)
            case EvalRequest() if sender == "merger":
                self.evals_asked += 1
            case EvalDone() if receiver == "merger":
                self.evals_done += 1
                self._last_eval = msg
            case Baseline() if receiver == "planner" and self._last_eval is not None:
                done = self._last_eval
                self.baseline_calls, self.baseline_errors = len(done.scores), done.errors
                self.baseline_error = done.first_error or done.failed
            case RoundClosed() if receiver == "planner":
                self._close(msg, t)
            case Commit() if sender == "merger":
                self.commits += 1
            case _:
                pass

    def _answer(self, msg: LeaseDone) -> None:
        if msg.lease_id in self._answered:   # a late answer of a re-dispatched lease
            self.late_answers += 1
            return
        self._answered.add(msg.lease_id)
        self.ledger.settle(msg, msg.results)   # a LeaseDone names its kind and id too
        if msg.kind == "rollout":
            self.answered_rollouts += len(msg.results)
            self.done += msg.round == self.round

    def _settle(self, msg: Settled) -> None:
        self.rollouts += len(msg.scores)
        self._pending[0] += len(msg.scores)
        self._pending[1] += 1

    def _close(self, msg: RoundClosed, t: float) -> None:
        self.round_closed = self.round_closed or (msg.round == self.round
                                                  and not self.asynchronous)
        recorded = bool(msg.proposals or msg.committed or not self.asynchronous)
        rollouts, leases = self._pending if recorded else (0, 0)
        self.closed.append(Closed(msg.round, msg.version, msg.committed, msg.heldout_reward,
                                  rollouts, leases, msg.proposals, dict(msg.outcomes),
                                  self.working(t), recorded, dict(msg.carried)))
        if recorded:
            self._pending = [0, 0]

    @property
    def open_rollouts(self) -> int:
        """Rollouts settled since the last recorded close."""
        return self._pending[0]

    def usage(self) -> dict:
        """Calls, tokens and cost so far by kind, with their limits (Ledger.summary)."""
        return self.ledger.summary()

    def baseline(self) -> dict | None:
        """The baseline's held-out calls as JSON (``--json``, ``inspect --summary
        --json``): how many, how many failed (scored 0), the first error (None when none
        failed); None before the Planner had the baseline."""
        if self.baseline_calls is None:
            return None
        return {"calls": self.baseline_calls, "failed": self.baseline_errors,
                "first_error": self.baseline_error if self.baseline_errors else None}


def log_baseline(path: str | None) -> dict | None:
    """:meth:`RunFigures.baseline` of the run whose (newest) log is ``path``, read from
    the chain's first segment on (where the baseline is): what ``inspect --summary``
    says of it, for a verb's ``--json`` (which may run with ``--quiet``: no live fold)."""
    if not path:
        return None
    figures = RunFigures()
    for contents in read_chain(path):
        for rec in contents.records:
            if rec.receiver in ("merger", "planner"):
                try:
                    figures.add(rec.sender, rec.receiver, decode(rec.body), rec.t)
                except ValueError:   # a frame the bus rejects too: not a figure
                    continue
                if figures.baseline_calls is not None:
                    return figures.baseline()
    return None


def baseline_lines(figures: RunFigures) -> list[str]:
    """A line when some of the baseline's held-out calls failed: they scored 0, so the
    reward the run starts from is partly unscored (none when every call answered)."""
    if not figures.baseline_errors:
        return []
    return [f"baseline: {figures.baseline_errors} of {figures.baseline_calls} held-out "
            f"call(s) failed and scored 0, so the starting reward is partly unscored; "
            f"first error: {figures.baseline_error}"]
