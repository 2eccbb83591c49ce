"""``evobus run SCENARIO``: check it as validate does, run it with live progress, say
how it ended (its arguments: actors.cli.verbs). Every run writes a message log
(actors.cli.paths.default_log_path when neither the scenario nor --log names one)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings

from actors.cli.figures import log_baseline
from actors.cli.groups import run_groups
from actors.cli.paths import default_log_path
from actors.cli.progress import RunProgress, interrupt_guard, stopped
from actors.cli.validate import load_checked
from actors.errors import BackendFailing, ConfigError
from actors.runtime.launch import run_scenario

log = logging.getLogger(__name__)


def _err(message: str) -> int:
    print(f"evobus: {message}", file=sys.stderr)
    return 2


def _log_path(args: argparse.Namespace, scenario) -> str:
    """Every run leaves a log: --log, else the scenario's ``log``, else a default under
    runs/ (the summary says which)."""
    if args.log is not None:
        return args.log
    if scenario.log is not None:
        return scenario.log
    args.default_log = True
    return default_log_path(scenario.name)


def cmd_run(args: argparse.Namespace) -> int:

    scenario = load_checked(args)
    if isinstance(scenario, int):
        return scenario
    log_path = _log_path(args, scenario)
    if scenario.domain is None:  # only [[groups]]: actors.cli.groups runs them

        if args.insecure:
            warnings.warn(f"{args.scenario} has no [domain], only groups (threads of this "
                          "process): --insecure concerns remote workers and is ignored",
                          RuntimeWarning, stacklevel=1)
        with interrupt_guard():  # SIGTERM and SIGHUP stop groups as Ctrl-C does
            return run_groups(scenario, args.scenario, quiet=args.quiet,
                              json_out=args.json, log_path=log_path,
                              overwrite=args.overwrite)
    # Live progress on a terminal, plain lines otherwise; with --json on stderr, so
    # stdout holds only the JSON summary.
    progress = RunProgress(scenario, source=args.scenario, quiet=args.quiet,
                           stream=sys.stderr if args.json else sys.stdout, log_path=log_path)
    try:
        with progress, interrupt_guard():
            result = run_scenario(scenario, source=args.scenario, log=log_path,
                                  on_progress=progress, insecure=args.insecure,
                                  overwrite=args.overwrite)
    except ConfigError as exc:
        return _err(f"{args.scenario}: {exc}")
    except BackendFailing as exc:  # the run halted itself; its log is closed, resumable
        progress.stop()
        where = (f"; once the backend answers, resume it with: evobus resume {exc.log_path}"
                 if exc.log_path else " (no log was written, so it cannot be resumed)")
        _err(f"{args.scenario}: halted: {exc.error}{where}")
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: actors and log closed
        return stopped(progress, exc, log_path)
    except Exception as exc:  # the user's code (tasks, agent) or a crashed actor: one line
        log.debug("run failed", exc_info=True)
        _err(f"{args.scenario}: the run failed: {type(exc).__name__}: {exc} "
             "(evobus -v run ... shows the traceback)")
        return 1
    if args.json:
        print(json.dumps({
            "scenario": args.scenario, "stop_reason": result.stop_reason,
            "final_reward": result.final_reward, "initial_reward": result.initial_reward,
            "version": result.version, "rollouts": result.rollouts, "calls": result.calls,
            "elapsed": result.elapsed, "outcomes": result.outcomes(), "error": result.error,
            "log": result.log_path, "state": result.state, "bus": result.bus,
            "budget": result.budget, "baseline": log_baseline(result.log_path)}))
    else:
        progress.summary(result, default_log=getattr(args, "default_log", False))
    code = 1 if result.error and result.rollouts == 0 else 0
    if scenario.groups:  # a domain and [[groups]]: the groups run after evolve

        with interrupt_guard():
            group_code = run_groups(scenario, args.scenario, quiet=args.quiet,
                                    json_out=args.json, log_path=log_path,
                                    overwrite=args.overwrite)
        code = code or group_code
    return code


