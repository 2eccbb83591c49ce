"""What a run report reads from a message log, with no drawing: :func:`analyse` turns a
log (or a resumed run's chain) into a :class:`RunAnalysis` (leases per worker, rounds,
outcomes, parallel groups, what was learned), which :mod:`actors.cli.render` draws and
``evobus inspect`` summarises."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from typing import Iterator

from actors.cli.learned import Learned, learned_from, renderer
from actors.replay.chain import read_chain
from bus.log import Record
from protocol import decode


@dataclass
class LeaseSpan:
    lease_id: str
    worker: str
    kind: str  # rollout | eval | branch
    start: float
    end: float | None = None
    redispatch: bool = False


@dataclass
class RoundRow:
    round: int
    t: float
    version: int
    committed: bool
    heldout: float
    proposals: int
    outcomes: dict[str, int]
    rollouts: int = 0


@dataclass
class RunAnalysis:
    """Everything the report shows, read from one log."""

    path: str
    header: Any
    records: int = 0
    undecodable: int = 0
    dropped_tail: int = 0
    duration: float = 0.0
    kinds: Counter = field(default_factory=Counter)
    baseline: tuple[float, float] | None = None  # (t, held-out reward of version 0)
    rounds: list[RoundRow] = field(default_factory=list)
    candidates: list[tuple[float, float]] = field(default_factory=list)  # (t, score)
    other_evals: int = 0  # scored on other tasks than the held-out set (re-verification)
    spans: list[LeaseSpan] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    lifetimes: dict[str, tuple[float, float]] = field(default_factory=dict)
    redispatches: int = 0
    late_answers: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    stop_reason: str | None = None
    final_reward: float | None = None
    initial_reward: float | None = None
    rollouts: int | None = None
    stats: dict[str, float] = field(default_factory=dict)
    mode: str = "sync"
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    segments: list[str] = field(default_factory=list)  # the logs of a resumed run
    learned: Learned | None = None
    render: Any = None   # state -> the artifact's text
    #: When any worker held a lease (_cover), with the spans and duration it was made of.
    cover: Any = field(default=None, repr=False, compare=False)

    @property
    def evolves(self) -> bool:
        """Whether the log holds an evolve run (rounds, a baseline), not only groups."""
        return bool(self.rounds or self.baseline or self.candidates or self.kinds["Start"])

    @property
    def complete(self) -> bool:
        """The log reaches its run's end (a result, or every group ended or paused)."""
        if self.evolves:
            return self.stop_reason is not None
        return bool(self.groups) and all(g["status"] != "running"
                                         for g in self.groups.values())

    def worker_time(self, worker: str) -> dict[str, float]:
        """Seconds busy / starved / idle over the worker's lifetime."""
        return worker_states(self, worker)[1]


#: Messages that show their sender (or, for leases, their receiver) is a worker.
_FROM_WORKER = ("Hello", "Heartbeat", "LeaseDone", "BranchDone", "BranchFailed", "Interaction")
_TO_WORKER = ("Lease", "Branch")
_LEASE_END = ("LeaseDone", "BranchDone", "BranchFailed")


_GROUP_KINDS = ("GroupStart", "Branch", "GroupResult", "GroupSuspended")


def track_group(groups: dict[str, dict[str, Any]], kind: str, msg: Any) -> None:
    """Fold one of a parallel group's messages (``_GROUP_KINDS``) into ``groups``: per
    group id, its items, bound, leases sent, and once it ended or paused its status,
    finished, failed and waiting branches."""
    g = groups.setdefault(msg.group_id, {"items": 0, "bound": 0, "leases": 0,
                                         "status": "running", "finished": 0, "failed": 0,
                                         "waiting": 0})
    if kind == "GroupStart":
        g["items"], g["bound"] = len(msg.items), msg.max_concurrency
    elif kind == "Branch":
        g["leases"] += 1
    else:
        g["status"] = msg.status
        done = msg.finished or {}
        g["finished"] = max(len(done), len(getattr(msg, "results", []) or []))
        g["failed"] = len(getattr(msg, "failed", []) or [])
        g["waiting"] = len(getattr(msg, "pending", []) or [])


def analyse(path: str | Path) -> RunAnalysis:
    """Read a log and gather what the report shows. Raises OSError / LogCorrupt."""

    chain = read_chain(path)   # a resumed run: every segment, oldest first
    contents = chain[-1]
    meta: dict[str, str] = {}
    for c in chain:
        meta.update(c.header.meta)
    a = RunAnalysis(path=str(path), header=contents.header,
                    records=sum(len(c.records) for c in chain),
                    dropped_tail=sum(c.dropped_tail for c in chain),
                    segments=[str(c.path) for c in chain], learned=learned_from(chain),
                    render=renderer(meta))
    tally = _Tally(a)
    for rec in _timed(chain):
        try:
            msg = decode(rec.body)
        except ValueError:  # a newer or damaged body: counted and shown in the report
            a.undecodable += 1
            continue
        tally.record(rec, msg)
    tally.finish()
    return a


class _Tally:
    """What :func:`analyse` keeps while it reads a chain's records in order."""

    def __init__(self, a: RunAnalysis) -> None:
        self.a = a
        self.open_spans: dict[str, LeaseSpan] = {}
        self.dispatched: set[str] = set()
        self.answered: set[str] = set()
        self.first_seen: dict[str, float] = {}
        self.last_seen: dict[str, float] = {}
        self.workers: set[str] = set()
        self.rollouts_by_round: Counter = Counter()
        self.heldout: frozenset = frozenset()
        self.heldout_evals: dict[str, bool] = {}

    def record(self, rec: Record, msg) -> None:
        a = self.a
        kind = type(msg).__name__
        a.kinds[kind] += 1
        a.duration = max(a.duration, rec.t)
        for name in (rec.sender, rec.receiver):
            self.first_seen.setdefault(name, rec.t)
            self.last_seen[name] = rec.t
        # A worker's own message (the Scheduler forwards LeaseDone to the Merger: that copy
        # names the worker in `worker`, not as its sender).
        from_worker = kind in _FROM_WORKER and getattr(msg, "worker", "") in ("", rec.sender)
        if from_worker:
            self.workers.add(rec.sender)
        elif kind in _TO_WORKER:
            self.workers.add(rec.receiver)
        self._message(kind, msg, rec.t)
        lease_id = getattr(msg, "lease_id", None)
        if lease_id is not None:
            self._lease(kind, msg, rec, lease_id, from_worker)

    def _message(self, kind: str, msg, t: float) -> None:
        a = self.a
        if kind == "Start":
            a.mode = "async" if getattr(msg, "asynchronous", False) else "sync"
        elif kind == "Baseline":
            a.baseline = (t, msg.heldout_reward)
        elif kind == "Open":
            self.heldout = frozenset(msg.heldout_ids)
        elif kind == "EvalRequest":
            # Held-out scoring of a candidate, or (async) a re-verification on other tasks.
            self.heldout_evals[msg.eval_id] = frozenset(msg.task_ids) == self.heldout
        elif kind == "EvalDone":
            if self.heldout_evals.pop(msg.eval_id, True):
                a.candidates.append((t, msg.score))
            else:
                a.other_evals += 1
        elif kind == "Settled":
            self.rollouts_by_round[msg.round] += len(msg.scores)
        elif kind == "SettledBatch":
            for one in msg.settled:
                self.rollouts_by_round[one.round] += len(one.scores)
        elif kind == "RoundClosed":
            a.rounds.append(RoundRow(round=msg.round, t=t, version=msg.version,
                                     committed=msg.committed, heldout=msg.heldout_reward,
                                     proposals=msg.proposals, outcomes=dict(msg.outcomes)))
        elif kind in _GROUP_KINDS:
            track_group(a.groups, kind, msg)
        elif kind == "RunDone":
            a.stop_reason = msg.stop_reason
            a.final_reward = msg.final_reward
            a.initial_reward = msg.initial_reward
            a.rollouts = msg.rollouts
            a.outcomes = dict(msg.outcomes)
            a.stats = dict(getattr(msg, "stats", {}) or {})

    def _lease(self, kind: str, msg, rec: Record, lease_id: str, from_worker: bool) -> None:
        """A lease's span on its worker's timeline: from dispatch to answer (a branch
        that asks a person waits, holding it)."""
        a, spans = self.a, self.open_spans
        if kind in _TO_WORKER:
            lease_kind = getattr(msg, "kind", "branch") if kind == "Lease" else "branch"
            span = LeaseSpan(lease_id, rec.receiver, lease_kind, rec.t,
                             redispatch=lease_id in self.dispatched)
            a.redispatches += span.redispatch
            self.dispatched.add(lease_id)
            previous = spans.get(f"{rec.receiver}\0{lease_id}")
            if previous is not None:  # the same worker got it again: close the old span
                previous.end = rec.t
            spans[f"{rec.receiver}\0{lease_id}"] = span
            a.spans.append(span)
        elif from_worker and kind == "Interaction":
            # The branch stopped to ask a person; the worker holds the lease, waiting.
            key = f"{rec.sender}\0{lease_id}"
            span = spans.get(key)
            if span is not None:
                span.end = rec.t
                waiting = LeaseSpan(lease_id, rec.sender, "waiting", rec.t)
                spans[key] = waiting
                a.spans.append(waiting)
        elif from_worker and kind in _LEASE_END:
            span = spans.pop(f"{rec.sender}\0{lease_id}", None)
            if span is not None:
                span.end = rec.t
            if lease_id in self.answered:
                a.late_answers += 1
            self.answered.add(lease_id)

    def finish(self) -> None:
        a = self.a
        for span in self.open_spans.values():  # never answered (the run stopped): to the end
            span.end = a.duration
        for row in a.rounds:
            row.rollouts = self.rollouts_by_round.get(row.round, 0)
        if not a.outcomes:
            total: Counter = Counter()
            for row in a.rounds:
                total.update(row.outcomes)
            a.outcomes = dict(total)
        a.workers = sorted(self.workers, key=_natural)
        a.lifetimes = {w: (self.first_seen[w], max(self.last_seen[w], self.first_seen[w]))
                       for w in a.workers}
        if a.initial_reward is None and a.baseline is not None:
            a.initial_reward = a.baseline[1]
        if a.final_reward is None and a.rounds:
            a.final_reward = a.rounds[-1].heldout


def _timed(chain) -> Iterator[Record]:
    """The records of a log chain on one clock: each segment's times go on from where
    the one before ended (each log's clock starts at its own run's start)."""
    offset = 0.0
    for contents in chain:
        for rec in contents.records:
            yield Record(rec.seq, rec.t + offset, rec.sender, rec.receiver, rec.body)
        if contents.records:
            offset += contents.records[-1].t


def _natural(name: str) -> tuple:
    head, _, tail = name.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (name, -1)


def worker_states(a: RunAnalysis, worker: str) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
    """The worker's lifetime cut into (state, start, end): busy-<kind>, starved, idle."""
    start, end = a.lifetimes[worker]
    mine = sorted((s for s in a.spans if s.worker == worker), key=lambda s: s.start)
    cover = _cover(a)
    pieces: list[tuple[str, float, float]] = []
    t = start
    for s in mine:
        s_end = s.end if s.end is not None else a.duration
        if s.start > t:
            pieces += _free(t, s.start, cover)
        pieces.append((f"busy-{s.kind}", max(t, s.start), s_end))
        t = max(t, s_end)
    if end > t:
        pieces += _free(t, end, cover)
    totals: dict[str, float] = Counter()
    for state, s0, s1 in pieces:
        if s1 > s0:
            totals["busy" if state.startswith("busy") else state] += s1 - s0
    return pieces, dict(totals)


def _cover(a: RunAnalysis) -> tuple[list[float], list[float]]:
    """When any worker held a lease: the union of every span, as sorted, disjoint
    intervals (their starts, their ends), made once per analysis. A worker's free
    interval meets none of its own spans (it holds none then), so what of it this
    union covers is what other workers' spans cover."""
    key = (len(a.spans), a.duration)
    if a.cover is not None and a.cover[0] == key:
        return a.cover[1]
    starts: list[float] = []
    ends: list[float] = []
    for s, e in sorted((s.start, s.end if s.end is not None else a.duration)
                       for s in a.spans):
        if starts and s <= ends[-1]:
            ends[-1] = max(ends[-1], e)
        else:
            starts.append(s)
            ends.append(e)
    a.cover = (key, (starts, ends))
    return starts, ends


def _free(t0: float, t1: float,
          cover: tuple[list[float], list[float]]) -> list[tuple[str, float, float]]:
    """Split a free interval into starved (someone else busy) and idle (nobody busy)."""
    starts, ends = cover
    out: list[tuple[str, float, float]] = []
    t = t0
    for i in range(bisect.bisect_right(ends, t0), len(starts)):
        s, e = max(t0, starts[i]), min(t1, ends[i])
        if s >= t1:
            break
        if e <= s:
            continue
        if s > t:
            out.append(("idle", t, s))
        out.append(("starved", s, e))
        t = e
    if t1 > t:
        out.append(("idle", t, t1))
    return out
