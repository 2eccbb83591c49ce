"""CLI verbs over recorded logs: ``evobus replay LOG [LOG ...]``, ``evobus resume LOG``,
and the table ``evobus inspect LOG --summary`` prints (rounds, commits, re-dispatches,
discards; parallel groups). Plugged in through ``actors.cli.VERB_MODULES``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterable
from actors.errors import ResumeRefused
from actors.groups.checkpoint import load_checkpoint
from actors.replay.verify import replay_many
from actors.errors import BackendFailing, ConfigError, RunFailed
from actors.replay.resume import ResumePoint, next_log_path, resume_scenario_log
from actors.cli.progress import RunProgress, baseline_lines, interrupt_guard, stopped
from actors.replay.engine import META_SCENARIO_TOML
from protocol.scenario import ScenarioError, parse_scenario
from bus.log import LogCorrupt
from actors.cli.analysis import _GROUP_KINDS, track_group
from actors.cli.figures import RunFigures, log_baseline
from actors.cli.fork import cmd_fork
from actors.cli.main import RUNS_DIR

log = logging.getLogger(__name__)

__all__ = ["LogSummary", "cmd_replay", "cmd_resume", "format_summary", "register",
           "summarize"]


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "replay", help="check that the control actors reproduce recorded logs",
        description="Feed each control actor (planner, scheduler, merger) the messages a "
                    "log recorded it receiving and compare what it sends with what the log "
                    "recorded it sending. Exit 0 when every log replays identically, 1 when "
                    "one diverges (the first divergence is reported), 2 when one cannot be "
                    "read or its machines cannot be rebuilt.")
    r.add_argument("logs", nargs="+", metavar="LOG",
                   help="log files, or directories (every *.evolog in them)")
    r.add_argument("--strict", action="store_true",
                   help="a produced message missing from the log is a divergence even when "
                        "its receiver had left or the log ended")
    r.add_argument("--verbose", action="store_true", help="list every unrecorded message")
    r.add_argument("--quiet", action="store_true", help="one line per log")
    r.set_defaults(func=cmd_replay)

    s = sub.add_parser(
        "resume", help="continue a run whose coordinator died, from its log",
        description="Rebuild every control actor from the log (replay without sending), "
                    "start new workers, re-issue the leases that were in flight under "
                    "their original ids and go on. Writes a new log that names the old "
                    "one (LOG.evolog -> LOG.r1.evolog); a torn tail of LOG is cut first. "
                    "The scenario comes from the log header (runs started with `evobus "
                    "run`).")
    s.add_argument("log", metavar="LOG", help="the newest log of the run")
    s.add_argument("--log", dest="new_log", help="write the resumed run's log here")
    s.add_argument("--fsync", choices=("always", "batched", "never"),
                   help="fsync policy of the new log (default $EVOBUS_LOG_FSYNC or batched)")
    s.add_argument("--from-version", type=int, metavar="N",
                   help="fork: start a new run (a new log) from the artifact the run had "
                        "committed as version N, with what it had spent by then counted "
                        "against the budgets (docs/replay.md)")
    s.add_argument("--scenario", metavar="FILE",
                   help="with --from-version: run the fork with this scenario instead of "
                        "the log's")
    s.add_argument("--quiet", action="store_true", help="print only errors")
    s.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    s.set_defaults(func=cmd_resume)


def _err(message: str) -> int:
    print(f"evobus: {message}", file=sys.stderr)
    return 2


def unreadable_log(path: str | Path, exc: Exception) -> str:
    """Why a file given as a log does not read, naming the file once (a ``LogCorrupt``
    names it already), and pointing at ``evobus resume`` when the file is a parallel
    group's checkpoint rather than a log."""
    if isinstance(exc, OSError):
        text = f"{path}: cannot read the log ({exc.strerror or exc})"
    else:
        text = str(exc)
        if not text.startswith(str(path)):
            text = f"{path}: {text}"

    try:
        load_checkpoint(path)
    except ResumeRefused:   # not a checkpoint either
        return text + _log_fix(path, exc)
    return (f"{text}; it is a parallel group's checkpoint, not a log: "
            f"`evobus resume {path} --show` lists what it waits on")


def _log_fix(path: str | Path, exc: Exception) -> str:
    """The fix for a path that is no log: where logs are (the newest few under runs/),
    or, for a scenario file, the verb that runs it."""
    if isinstance(exc, OSError) and not isinstance(exc, PermissionError):
        newest = sorted(Path(RUNS_DIR).glob("*.evolog"), key=os.path.getmtime)[-3:]
        where = f"; the newest under {RUNS_DIR}/: {', '.join(map(str, reversed(newest)))}" \
            if newest else ""
        return (f"; fix: pass a run's log (the `log:` line of `evobus run`'s summary, "
                f"{RUNS_DIR}/NAME-YYYYmmdd-HHMMSS.evolog by default{where})")
    if str(path).endswith(".toml"):
        return (f"; fix: it is a scenario file: `evobus run {path}` runs it and says where "
                "its log is")
    return ""


# ---------------------------------------------------------------------------
# replay


def _expand(paths: Iterable[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.glob("*.evolog")) if p.is_dir() else [p])
    return out


def cmd_replay(args: argparse.Namespace) -> int:

    paths = _expand(args.logs)
    if not paths:
        return _err(f"no logs found in {' '.join(args.logs)} (a directory is searched "
                    "for *.evolog)")
    worst = 0
    for path, result in replay_many(paths, strict=args.strict):
        if isinstance(result, Exception):
            print(f"{'ERROR':<8} {unreadable_log(path, result)}")
            worst = max(worst, 2)
            continue
        if args.quiet:
            print(result.summary_line())
        else:
            print(result.format(verbose=args.verbose))
        if not result.ok:
            worst = max(worst, 1)
    if len(paths) > 1:
        print(f"\n{len(paths)} logs: " + ("all replay identically" if worst == 0 else
                                          "some did not replay (see above)"))
    return worst


# ---------------------------------------------------------------------------
# resume


def cmd_resume(args: argparse.Namespace) -> int:
    if args.from_version is not None:
        return cmd_fork(args)
    if args.scenario is not None:
        return _err("--scenario only applies to a fork (--from-version N): a resumed run "
                    "goes on with the scenario it was started with")

    try:
        point = ResumePoint(args.log)
    except (OSError, LogCorrupt) as exc:
        return _err(unreadable_log(args.log, exc))
    except ConfigError as exc:
        return _err(f"{args.log}: {exc}")
    if not args.quiet and point.dropped_tail:   # with --json, stdout holds only the JSON
        print(f"cut a torn tail off {point.path}: {point.dropped_tail} bytes, about "
              f"{point.dropped_records} record(s)", file=sys.stderr if args.json else sys.stdout)

    if args.new_log is not None and os.path.lexists(args.new_log):
        return _err(f"--log {args.new_log}: a log is already there, and a log is never "
                    "overwritten; fix: pass another --log PATH, or leave --log out (the "
                    f"resumed run then writes {next_log_path(point.path)})")
    new_log = Path(args.new_log) if args.new_log is not None else next_log_path(point.path)
    progress = _progress(point, args, new_log)
    try:
        with progress, interrupt_guard():
            result = resume_scenario_log(point, log=new_log, on_progress=progress,
                                         log_fsync=args.fsync)
    except BackendFailing as exc:  # halted again: the log of this resume is resumable too
        progress.stop()
        _err(f"{args.log}: halted: {exc.error}; once the backend answers, resume it "
             f"with: evobus resume {exc.log_path}")
        return 1
    except (ConfigError, RunFailed) as exc:
        progress.stop()
        if isinstance(exc, ConfigError) and progress.scenario is not None \
                and not new_log.exists():   # refused for its configuration (evolve)
            kept = (f"{point.path} is as it was" if not point.dropped_tail else
                    f"{point.path} only lost its torn tail, as said above")
            return _err(f"{exc}. Nothing was written ({kept}); once that is fixed, resume "
                        f"it with: evobus resume {args.log}")
        return _err(str(exc))
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: actors and log closed
        # What `evobus run` says; before this resume wrote a log, the one it resumes.
        return stopped(progress, exc, str(new_log if new_log.exists() else point.path))
    except Exception as exc:  # the user's code (tasks, agent) or a crashed actor: one line
        progress.stop()
        log.debug("resume failed", exc_info=True)
        _err(f"{args.log}: the resumed run failed: {type(exc).__name__}: {exc} "
             "(evobus -v resume ... shows the traceback)")
        return 1
    already = point.finished is not None
    if args.json:
        print(json.dumps({
            "resumed": str(point.path), "after_seq": point.last_seq,
            "already_finished": already, "reissued": point.reissued,
            "resent": len(point.pending), "stop_reason": result.stop_reason,
            "final_reward": result.final_reward, "initial_reward": result.initial_reward,
            "version": result.version, "rollouts": result.rollouts, "calls": result.calls,
            "elapsed": result.elapsed, "outcomes": result.outcomes(), "error": result.error,
            "log": result.log_path, "state": result.state,
            "budget": getattr(result, "budget", None),
            "baseline": log_baseline(result.log_path)}))
    elif not args.quiet:
        if already:
            print(f"{point.path}: the run had already finished; its result:")
            print(f"held-out reward {result.initial_reward:.3f} -> {result.final_reward:.3f} "
                  f"at version {result.version} ({result.stop_reason}; {result.rollouts} "
                  f"rollouts)\nlog: {result.log_path}\n\n{result.rendered}")
        else:
            print(f"\nresumed {point.path} after seq {point.last_seq}: re-issued "
                  f"{len(point.reissued)} lease(s) that were in flight, re-sent "
                  f"{len(point.pending)} undelivered message(s)")
            progress.summary(result)
    return 1 if result.error and result.rollouts == 0 else 0


def _progress(point: ResumePoint, args: argparse.Namespace, new_log: Path) -> RunProgress:
    """What `evobus run` shows, for the resumed run: its rounds as they close (a live
    panel on a terminal), then the same summary (outcomes, tokens, budget, the log)."""
    meta: dict[str, str] = {}
    for content in point.contents:   # the chain's headers, the newest last
        meta.update(content.header.meta)
    try:
        scenario = parse_scenario(meta.get(META_SCENARIO_TOML, ""), str(point.path))
    except ScenarioError:   # no scenario in the log: resume_scenario_log says so
        scenario = None
    if scenario is None or point.finished is not None:
        return RunProgress(scenario, quiet=True)
    progress = RunProgress(scenario, source=str(point.path), quiet=args.quiet,
                           stream=sys.stderr if args.json else sys.stdout,
                           log_path=str(new_log), doing="resuming")
    progress.carry_on(point.contents)
    return progress


# ---------------------------------------------------------------------------
# inspect --summary


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
