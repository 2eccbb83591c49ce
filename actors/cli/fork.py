"""``evobus resume LOG --from-version N [--scenario FILE]``: fork a run.

A new run (a new run id and a new log) starts from the artifact the old run had
committed as version N, with what the old run had spent by then counted against its
budgets: the rounds up to N's, and the rollouts and backend calls at N's commit. The
scenario is the old run's (from the log header) unless ``--scenario`` names another,
so a fork can change workers, strategy or budgets. The new log's header names the log
and version it forked from; it is a run of its own (``evobus replay`` replays it alone),
not a segment of the old run's chain. Its versions count from 0 again: its v0 is the
old run's vN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import msgspec

from actors.cli.figures import log_baseline
from actors.cli.learned import learned_from
from actors.replay.chain import read_chain
from actors.cli.progress import RunProgress, interrupt_guard, stopped
from actors.errors import ConfigError
from actors.runtime.evolve import evolve
from actors.runtime.launch import evolve_kwargs
from bus.log import LogCorrupt
from protocol.scenario import ScenarioError, load_scenario, parse_scenario

__all__ = ["cmd_fork", "fork_log_path"]

META_FORKED_FROM = "forked_from"
META_FORKED_VERSION = "forked_from_version"


def _err(message: str) -> int:
    print(f"evobus: {message}", file=sys.stderr)
    return 2


def fork_log_path(log: str | Path, version: int) -> Path:
    """``run.evolog`` at v3 -> ``run.fork-v3.evolog`` (``-2``, ``-3``... if taken)."""
    log = Path(log)
    base = log.stem.split(".fork-v")[0]
    path = log.with_name(f"{base}.fork-v{version}.evolog")
    n = 2
    while path.exists():
        path = log.with_name(f"{base}.fork-v{version}-{n}.evolog")
        n += 1
    return path


def _scenario(args, meta: dict[str, str]):
    """(scenario, its source, its TOML text), or an error message."""
    if args.scenario:
        try:
            text = Path(args.scenario).read_text(encoding="utf-8-sig")
        except OSError as exc:
            return f"--scenario {args.scenario}: cannot read it ({exc.strerror or exc})"
        try:
            return load_scenario(args.scenario), args.scenario, text
        except ScenarioError as exc:
            return str(exc)
    text = meta.get("scenario_toml")
    if not text:
        return (f"{args.log}: the log carries no scenario (the run was started from Python):"
                " pass --scenario FILE")
    source = meta.get("scenario", "") or "the log's scenario"
    try:
        return parse_scenario(text, source), source, text
    except ScenarioError as exc:
        return f"{exc} (pass --scenario FILE)"


def _budgets(scenario, version) -> tuple[dict, list[str]] | str:
    """What is left of the scenario's budgets after what the old run had spent at
    ``version``: evolve() keyword arguments and how they were reduced (in words)."""
    b = scenario.budgets
    out: dict = {}
    said: list[str] = []
    spent_rounds = 0 if version.round is None else version.round + 1
    if scenario.mode == "sync":
        out["rounds"] = scenario.rounds - spent_rounds
        said.append(f"{spent_rounds} of {scenario.rounds} rounds")
        if out["rounds"] < 1:
            return (f"the scenario's {scenario.rounds} rounds were all spent by v"
                    f"{version.version}: pass --scenario with more rounds")
    for name, spent in (("max_rollouts", version.rollouts), ("max_calls", version.calls)):
        cap = getattr(b, name)
        if cap is None:
            continue
        out[name] = cap - spent
        said.append(f"{spent:,} of {cap:,} {name[4:]}")
        if out[name] < 1:
            return (f"{name} = {cap} was spent by v{version.version} ({spent:,}): pass "
                    f"--scenario with a larger {name}")
    return out, said


def cmd_fork(args: argparse.Namespace) -> int:
    try:
        chain = read_chain(args.log)
    except (OSError, LogCorrupt, ConfigError) as exc:
        return _err(f"{args.log}: {exc}" if not str(exc).startswith(str(args.log)) else str(exc))
    meta: dict[str, str] = {}
    for c in chain:
        meta.update(c.header.meta)
    learned = learned_from(chain)
    version = learned.at(args.from_version)
    if version is None:
        known = ", ".join(str(v.version) for v in learned.versions) or "none"
        return _err(f"--from-version {args.from_version}: {args.log} has no such version; "
                    f"its versions: {known}")
    found = _scenario(args, meta)
    if isinstance(found, str):
        return _err(found)
    scenario, source, text = found
    budgets = _budgets(scenario, version)
    if isinstance(budgets, str):
        return _err(budgets)
    left, spent = budgets
    new_log = Path(args.new_log) if args.new_log else fork_log_path(args.log, version.version)
    new_log.parent.mkdir(parents=True, exist_ok=True)
    kwargs = evolve_kwargs(scenario, source)
    kwargs.update(left, initial_state=dict(version.state), log=str(new_log))
    if args.fsync is not None:
        kwargs["log_fsync"] = args.fsync
    kwargs["log_meta"] = {
        "scenario": source, "scenario_toml": text,
        META_FORKED_FROM: os.path.relpath(Path(args.log).resolve(), new_log.resolve().parent),
        META_FORKED_VERSION: str(version.version)}
    out = sys.stderr if args.json else sys.stdout
    if not args.quiet:
        print(f"forking {args.log} at v{version.version} (spent then: {', '.join(spent)}) "
              f"into {new_log}, a run of its own: its versions count from v0, the old "
              f"run's v{version.version}", file=out, flush=True)
    # The panel and the lines count against what is left, as the run does.
    shown = msgspec.structs.replace(
        scenario, rounds=left.get("rounds", scenario.rounds),
        budgets=msgspec.structs.replace(scenario.budgets, **{
            k: v for k, v in left.items() if k in ("max_rollouts", "max_calls")}))
    progress = RunProgress(shown, source=source, quiet=args.quiet, stream=out,
                           log_path=str(new_log))
    try:
        with progress, interrupt_guard():
            result = evolve(**kwargs, on_progress=progress)
    except ConfigError as exc:
        return _err(f"{source}: {exc}")
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: actors and log closed
        return stopped(progress, exc, str(new_log))
    if args.json:
        print(json.dumps({
            "forked": str(args.log), "from_version": version.version,
            "spent": {"rounds": 0 if version.round is None else version.round + 1,
                      "rollouts": version.rollouts, "calls": version.calls},
            "stop_reason": result.stop_reason, "final_reward": result.final_reward,
            "initial_reward": result.initial_reward, "version": result.version,
            "rollouts": result.rollouts, "calls": result.calls, "log": result.log_path,
            "state": result.state, "outcomes": result.outcomes(), "error": result.error,
            "baseline": log_baseline(result.log_path)},
            default=msgspec.to_builtins))
    else:
        progress.summary(result)
    return 1 if result.error and result.rollouts == 0 else 0
