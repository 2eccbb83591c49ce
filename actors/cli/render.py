"""A run report from a message log: one self-contained HTML page (charts embedded as
PNG data) plus the PNGs themselves. ``evobus report LOG [-o DIR]``.

What it shows, all read back from the log (nothing is sampled or estimated):

- the held-out reward over time: the head's score after every round (or merge),
  commits marked, and every candidate the merger scored as a faint dot;
- a timeline per worker: when it held a lease (a rollout, an eval, a group branch),
  when it was *starved* (free while other workers still held leases: waiting at the
  barrier on stragglers, or held back by ``max_concurrency``) and when it was *idle*
  (free while no lease was out anywhere: the merger or planner was deciding);
  re-dispatched leases are marked;
- outcome counts (committed, conflict, duplicate, below-threshold, ...), late answers
  dropped, re-dispatches, and a table of rounds.

:func:`analyse` is pure (no matplotlib); :func:`charts` needs matplotlib (the
``report`` extra); :func:`write_report` does both and writes the files.
"""

from __future__ import annotations

import base64
import html
import io
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from typing import Iterator

from actors.cli.learned import (SOLVED, Learned, failing_groups, learned_from, read_chain,
                                renderer)
from bus.log import Record
from protocol import decode

__all__ = ["MissingExtra", "OutputError", "RunAnalysis", "analyse", "charts", "render_html", "write_report"]

INSTALL_HINT = 'pip install "evobus[report]"'
#: The timeline draws at most this many workers (the rest are counted in the caption).
MAX_TIMELINE_WORKERS = 48


class MissingExtra(ImportError):
    """matplotlib is not installed; the message names the extra to install."""


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
        return _states(self, worker)[1]


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


def _states(a: RunAnalysis, worker: str) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
    """The worker's lifetime cut into (state, start, end): busy-<kind>, starved, idle."""
    start, end = a.lifetimes[worker]
    mine = sorted((s for s in a.spans if s.worker == worker), key=lambda s: s.start)
    others = [(s.start, s.end or a.duration) for s in a.spans if s.worker != worker]
    pieces: list[tuple[str, float, float]] = []
    t = start
    for s in mine:
        s_end = s.end if s.end is not None else a.duration
        if s.start > t:
            pieces += _free(t, s.start, others)
        pieces.append((f"busy-{s.kind}", max(t, s.start), s_end))
        t = max(t, s_end)
    if end > t:
        pieces += _free(t, end, others)
    totals: dict[str, float] = Counter()
    for state, s0, s1 in pieces:
        if s1 > s0:
            totals["busy" if state.startswith("busy") else state] += s1 - s0
    return pieces, dict(totals)


def _free(t0: float, t1: float,
          others: list[tuple[float, float]]) -> list[tuple[str, float, float]]:
    """Split a free interval into starved (someone else busy) and idle (nobody busy)."""
    cover = sorted((max(t0, s), min(t1, e)) for s, e in others if e > t0 and s < t1)
    merged: list[list[float]] = []
    for s, e in cover:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    out: list[tuple[str, float, float]] = []
    t = t0
    for s, e in merged:
        if s > t:
            out.append(("idle", t, s))
        out.append(("starved", s, e))
        t = e
    if t1 > t:
        out.append(("idle", t, t1))
    return out


# -- charts ---------------------------------------------------------------------------------

COLOURS = {
    "busy-rollout": "#2b7bba", "busy-eval": "#7fb3d5", "busy-branch": "#8e6bbf",
    "busy-waiting": "#d6c4ec",
    "starved": "#f0a04b", "idle": "#e3e3e3", "redispatch": "#d62728",
    "committed": "#2ca02c", "kept": "#9e9e9e", "head": "#1f4e79", "candidate": "#b0b0b0",
}
OUTCOME_COLOURS = {"committed": "#2ca02c", "rollout-error": "#d62728",
                   "section-violation": "#d62728", "conflict": "#f0a04b",
                   "below-threshold": "#9e9e9e", "duplicate": "#c7c7c7",
                   "unchanged": "#c7c7c7"}


def _matplotlib():
    try:  # an optional extra (evobus[report]): imported only when a chart is drawn
        import matplotlib
    except ImportError:
        raise MissingExtra(f"the report draws its charts with matplotlib, which is not "
                           f"installed: {INSTALL_HINT}") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def charts(a: RunAnalysis) -> dict[str, bytes]:
    """PNG bytes per chart: ``timeline``, and for an evolve run ``reward`` and
    ``outcomes`` (a log of parallel groups alone has neither)."""
    plt = _matplotlib()
    out: dict[str, bytes] = {}
    plt.rcParams.update({"font.size": 9, "axes.spines.top": False,
                         "axes.spines.right": False})
    try:
        if a.evolves:
            out["reward"] = _reward_chart(plt, a)
        out["timeline"] = _timeline_chart(plt, a)
        if a.evolves:
            out["outcomes"] = _outcome_chart(plt, a)
    finally:
        plt.close("all")
    return out


def _reward_chart(plt, a: RunAnalysis) -> bytes:
    fig, ax = plt.subplots(figsize=(9, 3.4))
    word = "merge" if a.mode == "async" else "round"
    if a.candidates:
        ax.scatter([t for t, _ in a.candidates], [s for _, s in a.candidates], s=9,
                   color=COLOURS["candidate"], alpha=0.6, label="candidate scored", zorder=1)
    xs, ys = [], []
    if a.baseline is not None:
        xs.append(a.baseline[0])
        ys.append(a.baseline[1])
    for r in a.rounds:
        xs.append(r.t)
        ys.append(r.heldout)
    if xs:
        xs.append(max(a.duration, xs[-1]))
        ys.append(ys[-1])
        ax.step(xs, ys, where="post", color=COLOURS["head"], lw=2, label="head (held-out)",
                zorder=2)
    if a.baseline is not None:
        ax.scatter([a.baseline[0]], [a.baseline[1]], marker="s", color=COLOURS["head"],
                   s=28, zorder=3, label="version 0")
    committed = [r for r in a.rounds if r.committed]
    kept = [r for r in a.rounds if not r.committed]
    if committed:
        ax.scatter([r.t for r in committed], [r.heldout for r in committed],
                   color=COLOURS["committed"], s=36, zorder=4, label=f"{word} committed")
    if kept:
        ax.scatter([r.t for r in kept], [r.heldout for r in kept], facecolors="white",
                   edgecolors=COLOURS["kept"], s=30, zorder=4, label=f"{word} kept head")
    if len(a.rounds) <= 20:
        for r in a.rounds:
            ax.annotate(f"{'v' + str(r.version) if r.committed else ''}", (r.t, r.heldout),
                        textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7,
                        color=COLOURS["committed"])
    ax.set_ylim(-0.04, 1.08)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("held-out reward")
    ax.grid(axis="y", color="#eeeeee")
    if xs or a.candidates:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, frameon=False,
                  ncol=5)
    else:
        ax.text(0.5, 0.5, "no held-out score in this log", ha="center", va="center",
                transform=ax.transAxes, color="#777777")
    fig.tight_layout()
    return _png(fig)


def _timeline_chart(plt, a: RunAnalysis) -> bytes:
    from matplotlib.patches import Patch

    workers = a.workers[:MAX_TIMELINE_WORKERS]
    n = max(1, len(workers))
    fig, ax = plt.subplots(figsize=(9, 1.1 + 0.32 * n))
    used: set[str] = set()
    for i, w in enumerate(workers):
        pieces, _ = _states(a, w)
        by_state: dict[str, list[tuple[float, float]]] = {}
        for state, s0, s1 in pieces:
            if s1 > s0:
                by_state.setdefault(state, []).append((s0, s1 - s0))
        for state, bars in by_state.items():
            busy = state.startswith("busy")  # a thin edge shows where one lease ends
            ax.broken_barh(bars, (i - 0.38, 0.76), facecolors=COLOURS.get(state, "#555555"),
                           edgecolor="white" if busy else "none", linewidth=0.4 if busy else 0)
            used.add(state)
        redo = [s.start for s in a.spans if s.worker == w and s.redispatch]
        if redo:
            ax.scatter(redo, [i] * len(redo), marker="v", color=COLOURS["redispatch"],
                       s=30, zorder=3)
            used.add("redispatch")
    ax.set_yticks(range(len(workers)))
    ax.set_yticklabels(workers)
    ax.set_ylim(n - 0.5, -0.5)
    start = min((a.lifetimes[w][0] for w in workers), default=0.0)
    span = max(a.duration - start, 1e-6)
    ax.set_xlim(max(0.0, start - 0.02 * span), start + 1.01 * span)
    ax.set_xlabel("seconds since the run started")
    if not workers:
        ax.text(0.5, 0.5, "no worker held a lease in this log", ha="center", va="center",
                transform=ax.transAxes, color="#777777")
    for r in a.rounds if len(a.rounds) <= 60 else []:
        ax.axvline(r.t, color="#333333", lw=0.8, ls=":", alpha=0.7, zorder=2)
    labels = {"busy-rollout": "busy: rollout", "busy-eval": "busy: held-out eval",
              "busy-branch": "busy: group branch",
              "busy-waiting": "holding a branch, waiting on a person",
              "starved": "starved (others busy)",
              "idle": "idle (no lease out)", "redispatch": "re-dispatched lease"}
    handles = [Patch(color=COLOURS[k], label=v) for k, v in labels.items() if k in used]
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / n - 0.18),
                  ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    return _png(fig)


def _outcome_chart(plt, a: RunAnalysis) -> bytes:
    items = sorted(a.outcomes.items(), key=lambda kv: (-kv[1], kv[0]))
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.32 * max(1, len(items))))
    if items:
        names = [k for k, _ in items]
        values = [v for _, v in items]
        bars = ax.barh(names, values, color=[OUTCOME_COLOURS.get(k, "#7f7f7f") for k in names])
        ax.bar_label(bars, padding=3, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("count")
        ax.set_xlim(0, max(values) * 1.12)
    else:
        ax.set_yticks([])
        ax.text(0.5, 0.5, "no proposal was merged in this log", ha="center", va="center",
                transform=ax.transAxes, color="#777777")
    fig.tight_layout()
    return _png(fig)


# -- the page -------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;
 max-width:1000px;margin:24px auto;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #ddd;
 padding-bottom:3px}.sub{color:#666;margin:0 0 14px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:120px}
.card b{display:block;font-size:19px}.card span{color:#666;font-size:12px}
.good b{color:#2ca02c}.warn b{color:#d62728}
img{max-width:100%;border:1px solid #eee}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border-bottom:1px solid #eee;padding:3px 10px;text-align:right}
th{background:#fafafa}td:first-child,th:first-child{text-align:left}
td.l,th.l{text-align:left}.note{color:#666;font-size:12.5px}
code{background:#f4f4f4;padding:1px 4px;border-radius:3px}
pre{background:#f7f7f7;border:1px solid #e5e5e5;padding:8px 10px;white-space:pre-wrap;
 overflow-wrap:anywhere;font-size:12.5px}
td.old{color:#a33;text-decoration:line-through}td.new{color:#176b1f}
details summary{cursor:pointer;margin:4px 0}
"""


def _secs(v: float) -> str:
    if v >= 10:
        return f"{v:,.1f} s"
    if v >= 0.1 or v == 0:
        return f"{v:.2f} s"
    return f"{v * 1000:.1f} ms"


def _number(v: Any) -> str:
    if isinstance(v, (int, float)) and float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.3f}" if isinstance(v, float) else html.escape(str(v))


def _card(value: str, label: str, cls: str = "") -> str:
    return (f'<div class="card {cls}"><b>{html.escape(value)}</b>'
            f'<span>{html.escape(label)}</span></div>')


def _img(pngs: dict[str, bytes], name: str, alt: str) -> str:
    if name not in pngs:
        return ""
    data = base64.b64encode(pngs[name]).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def render_html(a: RunAnalysis, pngs: dict[str, bytes]) -> str:
    """The report page: everything inline (CSS, images), no script, no network."""
    word = "merge" if a.mode == "async" else "round"
    parts = (_head_html(a) + _warnings_html(a)
             + (_learned_html(a) if a.evolves and a.learned is not None else [])
             + _reward_html(a, pngs, word) + _groups_html(a) + _workers_html(a, pngs, word)
             + _outcomes_html(a, pngs) + _stats_html(a) + _rounds_html(a, word)
             + _footer_html(a))
    return "\n".join(p for p in parts if p)


def _cards_html(a: RunAnalysis, word: str) -> list[str]:
    reward = "-"
    if a.initial_reward is not None and a.final_reward is not None:
        reward = f"{a.initial_reward:.3f} → {a.final_reward:.3f}"
    commits = sum(r.committed for r in a.rounds)
    cards = []
    if a.evolves:
        rollouts = a.rollouts if a.rollouts is not None else sum(r.rollouts for r in a.rounds)
        cards += [
            _card(reward, "held-out reward", "good" if (a.final_reward or 0) >
                  (a.initial_reward or 0) else ""),
            _card(f"{commits} / {len(a.rounds)}", f"{word}s committed"),
            _card(f"{rollouts:,}", "rollouts")]
    if a.groups:
        items = sum(g["items"] for g in a.groups.values())
        finished = sum(g["finished"] for g in a.groups.values())
        waiting = sum(g["waiting"] for g in a.groups.values())
        cards += [_card(f"{finished} / {items}", "group items finished"),
                  _card(str(waiting), "waiting on a person", "warn" if waiting else "")]
    stop = a.stop_reason or ", ".join(sorted({g["status"] for g in a.groups.values()}))
    cards += [
        _card(_secs(a.duration), "duration"),
        _card(str(len(a.workers)), "workers"),
        _card(str(a.redispatches), "re-dispatches", "warn" if a.redispatches else ""),
        _card(str(a.late_answers), "late answers dropped", "warn" if a.late_answers else ""),
        _card(stop if a.complete else "did not finish",
              "group status" if a.groups and not a.evolves else "stop reason",
              "" if a.complete else "warn"),
    ]
    return cards


def _head_html(a: RunAnalysis) -> list[str]:
    h = a.header
    e = html.escape
    word = "merge" if a.mode == "async" else "round"
    title = f"evobus run report: {h.scenario or Path(a.path).name}"
    cards = _cards_html(a, word)
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8>"
             f"<meta name=viewport content='width=device-width,initial-scale=1'>"
             f"<title>{e(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{e(title)}</h1>",
             f"<p class=sub>log <code>{e(a.path)}</code> · run {e(h.run_id or '-')} · seed "
             f"{h.seed} · started {e(h.started_at or '-')} · evobus {e(h.package_version or '?')}"
             f" · {a.records:,} messages · {a.mode} mode</p>",
             f"<div class=cards>{''.join(cards)}</div>"]
    return parts


def _warnings_html(a: RunAnalysis) -> list[str]:
    e = html.escape
    parts: list[str] = []
    warn = []
    if not a.complete:
        warn.append("The log ends before the run's result (interrupted or crashed): what is "
                    "shown is the run up to its last message.")
    if a.dropped_tail:
        warn.append(f"A torn tail of {a.dropped_tail} bytes was cut off when reading the log.")
    if a.undecodable:
        warn.append(f"{a.undecodable} message(s) could not be decoded (written by a newer "
                    "evobus?) and are left out.")
    for w in warn:
        parts.append(f"<p class=note>⚠ {e(w)}</p>")
    if len(a.segments) > 1:
        parts.append(f"<p class=note>A resumed run: {len(a.segments)} logs, shown as one "
                     "run (" + " → ".join(f"<code>{e(p)}</code>" for p in a.segments)
                     + ").</p>")
    return parts


def _reward_html(a: RunAnalysis, pngs: dict[str, bytes], word: str) -> list[str]:
    if not a.evolves:
        return []
    return ["<h2>Held-out reward over time</h2>",
              "<p class=note>The head's held-out score after each "
              f"{word}; green: a new version was committed; grey dots: every candidate "
              "the merger scored on the held-out tasks"
              + (f" ({a.other_evals} re-verifications on a proposal's own task are not "
                 "drawn)" if a.other_evals else "") + ".</p>",
              _img(pngs, "reward", "held-out reward over time")]


def _groups_html(a: RunAnalysis) -> list[str]:
    e = html.escape
    parts: list[str] = []
    if a.groups:
        parts.append("<h2>Parallel groups</h2><table><tr><th>group</th><th>items</th>"
                     "<th>at most at once</th><th>leases</th><th class=l>status</th>"
                     "<th>finished</th><th>failed</th><th>waiting on a person</th></tr>")
        for gid, g in a.groups.items():
            parts.append(f"<tr><td>{e(gid)}</td><td>{g['items']}</td><td>{g['bound']}</td>"
                         f"<td>{g['leases']}</td><td class=l>{e(g['status'])}</td>"
                         f"<td>{g['finished']}</td><td>{g['failed']}</td>"
                         f"<td>{g['waiting']}</td></tr>")
        parts.append("</table>")
    return parts


def _workers_html(a: RunAnalysis, pngs: dict[str, bytes], word: str) -> list[str]:
    e = html.escape
    parts: list[str] = []
    if a.mode == "async":
        starved = "no work for it: the wave ran dry, or backpressure held new leases back"
    elif a.evolves:
        starved = "waiting at the barrier on stragglers, or held back by max_concurrency"
    else:
        starved = "the group's bound was reached, or no item was left to start"
    parts += ["<h2>Workers over time</h2>",
              "<p class=note><b>busy</b>: holding a lease (rollouts, held-out evals, group "
              f"branches). <b>starved</b>: free while other workers still held leases "
              f"({starved}). <b>idle</b>: free while no lease was out anywhere (the "
              "control actors deciding)." + (f" Dotted lines: {word} closes." if a.rounds
                                             else "")
              + " Red marks: a lease dispatched again.</p>",
              _img(pngs, "timeline", "per-worker timeline")]
    if len(a.workers) > MAX_TIMELINE_WORKERS:
        parts.append(f"<p class=note>The chart shows the first {MAX_TIMELINE_WORKERS} of "
                     f"{len(a.workers)} workers; the table below lists all of them.</p>")
    parts.append("<table><tr><th>worker</th><th>leases</th><th>re-dispatched to it</th>"
                 "<th>busy</th><th>starved</th><th>idle</th></tr>")
    for w in a.workers:
        t = a.worker_time(w)
        life = max(1e-9, sum(t.values()))
        leases = len({s.lease_id for s in a.spans if s.worker == w})
        redo = sum(1 for s in a.spans if s.worker == w and s.redispatch)
        parts.append(f"<tr><td>{e(w)}</td><td>{leases}</td><td>{redo}</td>" + "".join(
            f"<td>{_secs(t.get(k, 0.0))} ({100 * t.get(k, 0.0) / life:.0f}%)</td>"
            for k in ("busy", "starved", "idle")) + "</tr>")
    parts.append("</table>")
    return parts


def _outcomes_html(a: RunAnalysis, pngs: dict[str, bytes]) -> list[str]:
    e = html.escape
    parts: list[str] = []
    if a.evolves:
        parts += ["<h2>Outcomes</h2>",
                  "<p class=note>What became of every proposal: committed, or discarded as "
                  "a duplicate, unchanged, the loser of a conflict, below the held-out "
                  "threshold, outside its section; rollout-error counts failed rollouts.</p>",
                  _img(pngs, "outcomes", "outcome counts")]
    else:
        parts.append("<h2>Leases</h2>")
    parts.append("<table><tr><th>outcome</th><th>count</th></tr>" + "".join(
        f"<tr><td>{e(k)}</td><td>{v:,}</td></tr>"
        for k, v in sorted(a.outcomes.items(), key=lambda kv: (-kv[1], kv[0])))
        + f"<tr><td>re-dispatched leases</td><td>{a.redispatches}</td></tr>"
        f"<tr><td>late answers dropped</td><td>{a.late_answers}</td></tr></table>")
    return parts


def _stats_html(a: RunAnalysis) -> list[str]:
    e = html.escape
    parts: list[str] = []
    if a.stats:
        parts.append("<h2>Run statistics</h2><table><tr><th class=l>statistic</th>"
                     "<th>value</th></tr>" + "".join(
                         f"<tr><td class=l>{e(STAT_NAMES.get(k, k))} <span class=note>"
                         f"({e(k)})</span></td><td>{_number(v)}</td></tr>"
                         for k, v in sorted(a.stats.items())) + "</table>")
    return parts


def _rounds_html(a: RunAnalysis, word: str) -> list[str]:
    e = html.escape
    parts: list[str] = []
    if a.rounds:
        parts.append(f"<h2>{word.capitalize()}s</h2><table><tr><th>{word}</th>"
                     "<th>closed at</th><th>version</th><th>committed</th><th>held-out</th>"
                     "<th>rollouts</th><th>proposals</th><th class=l>outcomes</th></tr>")
        for r in a.rounds:
            outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r.outcomes.items())) or "-"
            parts.append(f"<tr><td>{r.round}</td><td>{r.t:.2f} s</td><td>v{r.version}</td>"
                         f"<td>{'yes' if r.committed else 'no'}</td><td>{r.heldout:.3f}</td>"
                         f"<td>{r.rollouts}</td><td>{r.proposals}</td>"
                         f"<td class=l>{e(outcomes)}</td></tr>")
        parts.append("</table>")
    return parts


def _footer_html(a: RunAnalysis) -> list[str]:
    e = html.escape
    parts: list[str] = []
    parts.append("<h2>Messages</h2><p class=note>" + e(", ".join(
        f"{k} {v:,}" for k, v in a.kinds.most_common())) + "</p>")
    parts.append(f"<p class=note>Made by <code>evobus report {e(a.path)}</code>. Inspect "
                 f"the messages with <code>evobus inspect {e(a.path)}</code>.</p></body></html>")
    return parts


#: Run statistics (RunDone.stats, EvolveResult.stats) in plain words.
STAT_NAMES = {
    "reverified": "stale proposals re-scored on their own task before merging",
    "stall_refreshes": "times every worker was refreshed after merges without a commit",
    "max_eta_kept": "most versions behind the head a merged proposal was",
    "starved_seconds": "worker-seconds held back by backpressure",
    "held_back": "leases held back by backpressure",
    "refreshes": "worker snapshot refreshes",
    "cancelled_leases": "leases cancelled",
    "scoring_calls": "backend calls spent scoring candidates on held-out tasks",
}


def _pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def _short(text: str | None, n: int = 160) -> str:
    if text is None:
        return "—"
    return text if len(text) <= n else text[: n - 1] + "…"


def _learned_html(a: RunAnalysis) -> list[str]:
    """The artifact, what each commit changed (and on what evidence), the tasks the head
    still fails, and the artifact at every version."""
    e = html.escape
    learned, render = a.learned, a.render
    head = learned.head
    if head is None:
        return []
    out = [f"<h2>The artifact (v{head.version})</h2>", _pre(render(head.state))]
    commits = [v for v in learned.versions if v.version > 0]
    out.append("<h2>What each commit changed</h2>")
    if not commits:
        out.append("<p class=note>No commit: the artifact is still the initial one.</p>")
    else:
        out.append("<p class=note>Each key a commit changed, the worker whose rollout "
                   "proposed it and on which task, and the held-out score the new version "
                   "had to beat (before) and reached (after).</p><table class=commits><tr>"
                   "<th>version</th><th class=l>when</th><th>held-out before → after</th>"
                   "<th class=l>key</th><th class=l>before</th><th class=l>after</th>"
                   "<th class=l>proposed by</th></tr>")
    for v in commits:
        when = f"{learned.word} {v.round}" if v.round is not None else f"{v.t:.2f} s"
        wave = "wave" if learned.word == "merge" else "round"
        evidence = f"{_score(v.previous_heldout)} → {_score(v.heldout)}"
        for i, edit in enumerate(v.edits or [None]):
            lead = (f"<td>v{v.version}</td><td class=l>{e(when)}</td><td>{evidence}</td>"
                    if i == 0 else "<td></td><td></td><td></td>")
            if edit is None:
                out.append(f"<tr>{lead}<td class=l colspan=4>(no key changed)</td></tr>")
                continue
            who = (f"{edit.worker} on <code>{e(edit.task or '?')}</code> ({wave} {edit.round})"
                   if edit.worker else "not found in the log")
            out.append(f"<tr>{lead}<td class=l><code>{e(edit.key)}</code></td>"
                       f"<td class='l old'>{e(_short(edit.before))}</td>"
                       f"<td class='l new'>{e(_short(edit.after))}</td>"
                       f"<td class=l>{who}</td></tr>")
    if commits:
        out.append("</table>")
    out += _failing_html(learned)
    out.append("<h2>The artifact at every version</h2>")
    for v in reversed(learned.versions):
        label = f"v{v.version}" + (f" ({learned.word} {v.round})" if v.round is not None
                                   else "") \
            + f", held-out {_score(v.heldout)}"
        out.append(f"<details{' open' if v is head else ''}><summary>{e(label)}</summary>"
                   f"{_pre(render(v.state))}</details>")
    return out


def _score(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _failing_html(learned: Learned) -> list[str]:
    """The tasks the head still fails: counted per group with examples where the domain
    groups its tasks, then every one of them."""
    e = html.escape
    head, failing = learned.head, learned.failing()
    out = [f"<h2>Tasks the head still fails ({len(failing)})</h2>"]
    if not failing:
        return out + [f"<p class=note>None: v{head.version} scores at least {SOLVED} on "
                      "every held-out task it was scored on and every training task it "
                      "was rolled out on.</p>"]
    by, groups = failing_groups(learned)
    rows = "".join(f"<tr><td class=l><code>{e(t)}</code></td><td class=l>{e(split)}</td>"
                   f"<td>{score:.3f}</td></tr>" for split, t, score in failing)
    table = ("<table class=failing><tr><th class=l>task</th><th class=l>split</th>"
             f"<th>score</th></tr>{rows}</table>")
    if by is None:
        return out + [table]
    out.append(f"<p class=note>Grouped by the tasks' <code>{e(by)}</code>: per group, the "
               "tasks v{0} fails of those it was scored on (held-out, and training tasks "
               "rolled out at this version), and a few of them.</p>".format(head.version))
    out.append("<table class=failing-groups><tr><th class=l>group</th><th>failing</th>"
               "<th>of scored</th><th class=l>for example</th></tr>" + "".join(
                   f"<tr><td class=l>{e(g.group)}</td><td>{len(g.failing)}</td>"
                   f"<td>{g.scored}</td><td class=l>" + ", ".join(
                       f"<code>{e(t)}</code> ({e(split)} {score:.2f})"
                       for split, t, score in g.failing[:3]) + "</td></tr>"
                   for g in groups) + "</table>")
    return out + [f"<details><summary>every failing task ({len(failing)})</summary>"
                  f"{table}</details>"]


def default_dir(log: str | Path) -> Path:
    """``runs/router.evolog`` -> ``runs/router-report``."""
    log = Path(log)
    return log.with_name(f"{log.stem}-report")


class OutputError(OSError):
    """The report's directory or files cannot be written (the log is not to blame)."""


def write_report(log: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write ``index.html`` and the PNGs into ``out_dir``; return the HTML's path.
    Raises :class:`MissingExtra` before reading anything when matplotlib is missing,
    :class:`OutputError` when ``out_dir`` cannot be written (checked before the log is
    read), OSError / LogCorrupt when the log cannot be read."""
    _matplotlib()
    out = Path(out_dir) if out_dir is not None else default_dir(log)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(exc.errno, f"cannot create the report directory {out} "
                          f"({exc.strerror or exc})") from None
    a = analyse(log)
    pngs = charts(a)
    page = out / "index.html"
    try:
        for name, data in pngs.items():
            (out / f"{name}.png").write_bytes(data)
        page.write_text(render_html(a, pngs), encoding="utf-8")
    except OSError as exc:
        raise OutputError(exc.errno, f"cannot write the report into {out} "
                          f"({exc.strerror or exc})") from None
    return page
