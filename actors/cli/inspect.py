"""``evobus inspect LOG``: a recorded log, readably (what each flag prints:
actors.cli.verbs.INSPECT), and ``evobus repair LOG``.

Bad filter values are refused with the valid ones listed; a torn tail is one warning
line on stderr naming ``evobus repair``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
import warnings
from collections import Counter
from typing import TYPE_CHECKING, Any, get_args

import msgspec

from actors.replay.chain import read_chain
from actors.cli.paths import unreadable_log
from actors.cli.summary import format_summary, summarize
from actors.errors import ConfigError
from bus.log import LogCorrupt, follow_log, read_log
from protocol import Message, decode

if TYPE_CHECKING:
    from actors.cli.learned import Learned

__all__ = ["MESSAGE_TYPES", "cmd_inspect", "cmd_repair"]

#: Every message type a log can hold (the wire union), for ``--type``.
MESSAGE_TYPES = tuple(sorted(t.__name__ for t in get_args(Message)))


def _err(message: str) -> int:
    print(f"evobus: {message}", file=sys.stderr)
    return 2


def _summary_of(msg) -> str:
    """A message's fields, ``key=value``, lists by their length; an optional field left
    unset (None, or empty, by default) is left out, as the wire leaves out defaults."""
    parts = []
    for field in msgspec.structs.fields(msg):
        key, value = field.name, getattr(msg, field.name)
        if not field.required and (value is None or value in ((), [], {}, "")):
            continue
        if isinstance(value, (list, dict)) and key in (
                "results", "scores", "task_ids", "leases", "history", "state",
                "initial_state", "heldout_ids"):
            parts.append(f"{key}=[{len(value)}]")
            continue
        text = repr(value)
        parts.append(f"{key}={text if len(text) <= 40 else text[:37] + '...'}")
    return " ".join(parts)


def _line(rec, msg, as_json: bool) -> str:
    kind = type(msg).__name__
    if as_json:
        # Who the sending process authenticated as, and whether it was handed over.
        stamp = {**({"peer": rec.peer} if rec.peer else {}),
                 **({"undelivered": True} if rec.status else {})}
        return json.dumps({"seq": rec.seq, "t": rec.t, "sender": rec.sender,
                           "receiver": rec.receiver, "type": kind, **stamp,
                           "message": msgspec.to_builtins(msg)}, default=str)
    stamp = (f" [from {rec.peer}]" if rec.peer else "") + \
        (" (undelivered)" if rec.status else "")
    return (f"{rec.seq:>7} {rec.t:9.4f}s {rec.sender:>11} -> {rec.receiver:<11} "
            f"{kind:<12} {_summary_of(msg)}{stamp}")


def _check_filters(args, actors: set[str], rounds: set[int]) -> str | None:
    """Why a filter value cannot match anything in this log, naming the valid ones."""
    bad = [t for t in args.type or [] if t not in MESSAGE_TYPES]
    if bad:
        return (f"--type {', '.join(bad)}: no such message type{_did_you_mean(bad, MESSAGE_TYPES)}"
                f"; valid types: {', '.join(MESSAGE_TYPES)}")
    if args.round is not None and args.round not in rounds:
        return (f"--round {args.round}: {args.log} has no such round; its rounds: "
                f"{', '.join(map(str, sorted(rounds))) or 'none'}")
    bad = [a for a in args.actor or [] if a not in actors]
    if bad:
        return (f"--actor {', '.join(bad)}: no such actor in {args.log}"
                f"{_did_you_mean(bad, sorted(actors), cutoff=1.0)}; its actors: {', '.join(sorted(actors))}")
    return None


def _did_you_mean(bad: list[str], valid: list[str], cutoff: float = 0.75) -> str:
    """`` (did you mean Commit?)`` for values a letter or two off a valid one (case
    aside; ``cutoff=1.0``: only case differs, as worker-9 is not worker-0), else
    nothing."""
    folded = {v.lower(): v for v in valid}
    close = [folded[m[0]] for b in bad
             if (m := difflib.get_close_matches(b.lower(), list(folded), n=1, cutoff=cutoff))]
    return f" (did you mean {', '.join(close)}?)" if close else ""


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.idle is not None and not args.follow:
        return _err("--idle only bounds --follow: add --follow, or drop --idle")
    try:
        chain = read_chain(args.log)
    except (OSError, LogCorrupt) as exc:
        return _err(unreadable_log(args.log, exc))
    except ConfigError as exc:   # a resumed log whose older segment is missing
        return _err(str(exc))
    contents = chain[-1]
    # A followed log is being written: its last record may be half there.
    torn = [c for c in chain if c.dropped_tail and not (args.follow and c is chain[-1])]
    for c in torn:
        print(f"evobus: warning: {c.path}: a torn tail was cut back when reading: "
              f"{c.dropped_tail} bytes (about {c.dropped_records} record(s)) after the "
              f"last good record; the file is unchanged; `evobus repair {c.path}` "
              "truncates it there", file=sys.stderr)
    if args.at_version is not None or args.history:
        return _learned(args, chain)
    actors = {name for rec in contents.records for name in (rec.sender, rec.receiver)}
    rounds = {r.round for r in map(decode, (rec.body for rec in contents.records))
              if getattr(r, "round", -1) >= 0} if args.round is not None else set()
    problem = _check_filters(args, actors, rounds)
    if problem and not args.follow:   # a live log may not have met every actor yet
        return _err(problem)
    if not args.json:
        h = contents.header
        print(f"log {args.log}: format {h.format_version}, evobus {h.package_version}, "
              f"scenario {h.scenario or '-'}, seed {h.seed}, run {h.run_id or '-'}, "
              f"started {h.started_at or '-'}", flush=True)
    if args.follow:
        return _follow(args)
    return _lines(args, contents.records)


def _selected(args, rec, msg) -> bool:
    if args.type and type(msg).__name__ not in args.type:
        return False
    if args.actor and rec.sender not in args.actor and rec.receiver not in args.actor:
        return False
    return args.round is None or getattr(msg, "round", None) == args.round


def _lines(args, records) -> int:
    counts: Counter[str] = Counter()
    shown = 0
    selected = []  # (record, message) pairs for --summary
    for rec in records:
        msg = decode(rec.body)
        if not _selected(args, rec, msg):
            continue
        counts[type(msg).__name__] += 1
        if args.summary:
            selected.append((rec, msg))
        elif args.limit is None or shown < args.limit:
            print(_line(rec, msg, args.json))
            shown += 1
    if args.summary:
        summary = summarize(selected)
        if args.json:
            print(json.dumps({"rounds": summary.rounds, "commits": summary.commits,
                              "redispatches": summary.redispatches,
                              "discards": dict(summary.discards),
                              "late_answers": summary.late_answers,
                              "rollouts": summary.figures.rollouts,
                              "working_seconds": round(summary.figures.working(), 6),
                              f"rollouts_per_{summary.word}":
                                  summary.figures.rollouts_per_close,
                              "budget": summary.figures.usage(),
                              "baseline": summary.figures.baseline(),
                              "groups": summary.groups, "messages": dict(counts)},
                             default=dict))
            return 0
        print("\n" + format_summary(summary))
    if not args.json:
        total = sum(counts.values())
        print(f"\n{total} messages: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return 0


def _follow(args) -> int:
    """Print selected messages as they are appended, until RunDone (or --idle)."""
    state = {"done": False, "last": time.monotonic()}

    def stop() -> bool:
        idle = args.idle is not None and time.monotonic() - state["last"] > args.idle
        return state["done"] or idle

    shown = 0
    for rec in follow_log(args.log, stop=stop):
        state["last"] = time.monotonic()
        msg = decode(rec.body)
        if type(msg).__name__ == "RunDone":
            state["done"] = True
        if _selected(args, rec, msg) and (args.limit is None or shown < args.limit):
            print(_line(rec, msg, args.json), flush=True)
            shown += 1
    return 0


def _learned(args, chain) -> int:
    # --history and --version fold the whole log: the first line of plain inspect
    # does not wait for these imports (docs/performance.md, "CLI start-up").
    from actors.cli.learned import failing_groups, learned_from, renderer
    learned = learned_from(chain)
    meta: dict[str, str] = {}
    for c in chain:
        meta.update(c.header.meta)
    render = renderer(meta)
    if args.at_version is not None:
        v = learned.at(args.at_version)
        if v is None:
            known = ", ".join(str(x.version) for x in learned.versions) or "none"
            return _err(f"--version {args.at_version}: {args.log} has no such version; "
                        f"its versions: {known}")
        if args.json:
            print(json.dumps({"version": v.version, "round": v.round, "heldout": v.heldout,
                              "state": v.state, "rendered": render(v.state)}))
        else:
            print(render(v.state))
        return 0
    if args.json:
        for v in learned.versions:
            print(json.dumps(_version_json(v)))
        by, groups = failing_groups(learned)
        group_of = {t: g.group for g in groups for _, t, _ in g.failing}
        print(json.dumps({"failing": [{"split": s, "task": t, "score": x,
                                       **({"group": group_of[t]} if by else {})}
                                      for s, t, x in learned.failing()],
                          **({"grouped_by": by, "groups": {
                              g.group: {"failing": len(g.failing), "scored": g.scored}
                              for g in groups}} if by else {})}))
        return 0
    print("\n".join(history_lines(learned)))
    return 0


def _version_json(v) -> dict[str, Any]:
    return {"version": v.version, "round": v.round, "t": v.t, "heldout": v.heldout,
            "previous_heldout": v.previous_heldout, "state": v.state,
            "edits": [{"key": e.key, "before": e.before, "after": e.after,
                       "worker": e.worker, "task": e.task, "round": e.round}
                      for e in v.edits]}


def _score(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def history_lines(learned: Learned) -> list[str]:
    """What ``inspect --history`` prints: a block per version, then the failing tasks."""
    lines: list[str] = []
    for v in learned.versions:
        if v.version == 0:
            lines.append(f"v0  the initial artifact, held-out {_score(v.heldout)}")
            continue
        where = f"{learned.word} {v.round}" if v.round is not None else f"at {v.t:.2f}s"
        wave = "wave" if learned.word == "merge" else "round"
        lines.append(f"v{v.version}  {where}: held-out {_score(v.previous_heldout)} -> "
                     f"{_score(v.heldout)}, {len(v.edits)} key(s) changed")
        for e in v.edits:
            what = "added" if e.before is None else ("removed" if e.after is None
                                                     else "changed")
            who = (f"proposed by {e.worker} on task {e.task} ({wave} {e.round})"
                   if e.worker else "proposer not found in the log")
            lines.append(f"    {what} {e.key}: {_quote(e.before)} -> {_quote(e.after)}  "
                         f"[{who}]")
    failing = learned.failing()
    head = learned.head
    lines.append("")
    if head is None:
        lines.append("no artifact evolves in this log (no Start message: a log of parallel "
                     "groups, or a run that never began); `evobus inspect LOG --summary` "
                     "tabulates what it holds")
    elif not failing:
        lines.append(f"the head (v{head.version}) fails no task it was scored on")
    else:
        lines += _failing_lines(learned, failing)
    return lines


#: Failing tasks named per group by ``inspect --history`` (--json lists them all).
EXAMPLES = 3


def _failing_lines(learned: Learned, failing: list) -> list[str]:
    from actors.cli.learned import failing_groups   # as _learned
    head = learned.head
    by, groups = failing_groups(learned)
    if by is None:
        return [f"tasks the head (v{head.version}) still fails ({len(failing)}):"] + [
            f"    {split:<8} {task}  {score:.3f}" for split, task, score in failing]
    width = max(len(g.group) for g in groups)
    lines = [f"tasks the head (v{head.version}) still fails ({len(failing)}), by {by}:"]
    for g in groups:
        names = ", ".join(f"{task} ({split} {score:.2f})"
                          for split, task, score in g.failing[:EXAMPLES])
        more = f", and {len(g.failing) - EXAMPLES} more" if len(g.failing) > EXAMPLES else ""
        lines.append(f"    {g.group:<{width}}  {len(g.failing)} of {g.scored} scored: "
                     f"{names}{more}")
    return lines


def _quote(text: str | None) -> str:
    if text is None:
        return "-"
    text = text.replace("\n", "\\n")
    return repr(text if len(text) <= 60 else text[:57] + "...")


def cmd_repair(args: argparse.Namespace) -> int:
    """Cut a torn or corrupt tail off a log, on disk (what a crash leaves)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            contents = read_log(args.log, repair=True)
        except (OSError, LogCorrupt) as exc:
            return _err(unreadable_log(args.log, exc))
    if not contents.dropped_tail:
        print(f"{args.log}: whole, nothing to repair ({len(contents.records)} records)")
        return 0
    del caught   # the same facts, said once below
    print(f"{args.log}: cut a torn tail of {contents.dropped_tail} bytes (about "
          f"{contents.dropped_records} record(s)); {len(contents.records)} records kept")
    return 0
