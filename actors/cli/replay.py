"""CLI verbs over recorded logs: ``evobus replay LOG [LOG ...]``, ``evobus resume LOG``
(a fork: actors.cli.fork). Their arguments: actors.cli.verbs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Iterable
from actors.replay.verify import replay_many
from actors.errors import BackendFailing, ConfigError, RunFailed
from actors.replay.resume import ResumePoint, next_log_path, resume_scenario_log
from actors.cli.progress import RunProgress, interrupt_guard, stopped
from actors.replay.engine import META_SCENARIO_TOML
from protocol.scenario import ScenarioError, parse_scenario
from bus.log import LogCorrupt
from actors.cli.figures import log_baseline
from actors.cli.fork import cmd_fork
from actors.cli.paths import unreadable_log

log = logging.getLogger(__name__)

__all__ = ["cmd_replay", "cmd_resume"]


def _err(message: str) -> int:
    print(f"evobus: {message}", file=sys.stderr)
    return 2


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
