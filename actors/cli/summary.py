"""The table ``evobus inspect LOG --summary`` prints: rounds (async: merges), commits,
re-dispatches, discards, parallel groups."""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

from actors.cli.analysis import _GROUP_KINDS, track_group
from actors.cli.figures import RunFigures, baseline_lines

__all__ = ["LogSummary", "format_summary", "summarize"]


class LogSummary:
    """Per-round figures and totals of a log (or of the messages a filter selected):
    the rounds (async: merges) and counts come from :class:`RunFigures`, the fold the
    live panel of ``evobus run`` reads, over the same messages."""

    def __init__(self) -> None:
        self.figures = RunFigures()
        self.groups: dict[str, dict[str, Any]] = {}   # parallel groups (actors.cli.analysis)

    def add(self, sender: str, receiver: str, msg: Any, t: float = 0.0) -> None:
        kind = type(msg).__name__
        if kind in _GROUP_KINDS:
            track_group(self.groups, kind, msg)
            return
        self.figures.add(sender, receiver, msg, t)

    @property
    def word(self) -> str:
        return self.figures.word

    @property
    def commits(self) -> int:
        return self.figures.commits

    @property
    def redispatches(self) -> int:
        return self.figures.redispatches

    @property
    def late_answers(self) -> int:
        return self.figures.late_answers

    @property
    def discards(self) -> Counter:
        """Every proposal not committed, by reason, as the run's outcomes count them: a
        diff ``held`` for the next merge is not one; that merge's decision is."""
        out: Counter[str] = Counter()
        for c in self.figures.closed:
            out.update(_discarded(c))
        return out

    @property
    def rounds(self) -> dict[int, dict[str, Any]]:
        """Round (async: merge) -> its row; an open last row when rollouts settled
        after the last recorded close (keyed one past it)."""
        out = {c.round: {"leases": c.leases, "rollouts": c.rollouts,
                         "proposals": c.proposals,
                         "result": "committed" if c.committed else "kept",
                         "version": c.version, "heldout": f"{c.heldout:.3f}",
                         "discards": _discarded(c), "held": c.outcomes.get("held", 0)}
               for c in self.figures.closed}
        f = self.figures
        if f.open_rollouts or (f.round is not None and not f.closed):
            key = max(out, default=-1) + 1
            out[key] = {"leases": f._pending[1], "rollouts": f.open_rollouts,
                        "proposals": 0, "result": "", "version": "", "heldout": "",
                        "discards": Counter()}
        return out


def _discarded(c) -> Counter:
    """A close's proposals not committed, by reason: its own (but ``held``: deferred to
    the next merge) and its decisions about the diffs earlier rounds held for it."""
    out = Counter({k: v for k, v in c.outcomes.items() if k not in ("committed", "held")})
    out.update({k: v for k, v in c.carried.items() if k != "committed"})
    return out


def summarize(items: Iterable[tuple[Any, Any]]) -> LogSummary:
    """``items``: (record, decoded message) pairs, as `evobus inspect` reads them."""
    s = LogSummary()
    for rec, msg in items:
        s.add(rec.sender, rec.receiver, msg, rec.t)
    return s


def _per_second(n: float, seconds: float) -> str:
    return f"{n / seconds:,.1f}/s" if seconds > 0 else "-"


def _columns(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return lines


def format_summary(s: LogSummary) -> str:
    group_lines = _columns(
        ("group", "items", "bound", "leases", "finished", "failed", "waiting", "status"),
        [(gid, g["items"], g["bound"], g["leases"], g["finished"], g["failed"], g["waiting"],
          g["status"]) for gid, g in s.groups.items()]) if s.groups else []
    if s.groups and not s.rounds:   # a log of parallel groups alone
        return "\n".join(group_lines)
    rows = []
    for r in sorted(s.rounds):
        row = s.rounds[r]
        parts = [", ".join(f"{k} {v}" for k, v in sorted(row["discards"].items()))]
        if row.get("held"):   # deferred, not discarded: the next merge decides
            parts.append(f"held {row['held']} for the next merge")
        discards = "; ".join(p for p in parts if p) or "-"
        rows.append((r, row["leases"], row["rollouts"], row["proposals"],
                     row["result"] or "open", row["version"], row["heldout"], discards))
    lines = _columns((s.word, "leases", "rollouts", "proposals", "result", "version",
                      "held-out", "discards"), rows)
    closed = sum(1 for row in s.rounds.values() if row["result"])
    total = sum(s.discards.values())
    by_reason = ", ".join(f"{k} {v}" for k, v in sorted(s.discards.items()))
    lines.append("")
    per = s.figures.rollouts_per_close
    lines.append(f"{s.word}s {closed} closed ({len(s.rounds)} seen), commits {s.commits}, "
                 f"re-dispatches {s.redispatches}, discards {total}"
                 + (f" ({by_reason})" if by_reason else "")
                 + f", late answers {s.late_answers}")
    if s.figures.rollouts:
        lines.append(f"rollouts {s.figures.rollouts:,} in {s.figures.working():.2f} s of work "
                     f"({_per_second(s.figures.rollouts, s.figures.working())})"
                     + (f", {per:.1f} per {s.word}" if per is not None else "")
                     + f"; calls {s.figures.usage()['calls']['total']:,}")
    lines += baseline_lines(s.figures)
    if group_lines:
        lines += [""] + group_lines
    return "\n".join(lines)
