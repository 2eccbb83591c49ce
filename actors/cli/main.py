"""The ``evobus`` command line. Every verb returns an exit code; a caller's mistake is
one line on stderr naming the fix, never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

from actors.cli.figures import log_baseline
from actors.cli.groups import check_groups, run_groups
from actors.cli.progress import RunProgress, exit_code, interrupt_guard, stopped
from actors.errors import BackendFailing, ConfigError
from actors.openai_agent import OpenAIAgent
from protocol import Ref
from actors.runtime.checks import scenario_problems
from actors.runtime.launch import build_parallel, build_strategy, n_workers_of, run_scenario
from actors.version import PACKAGE_VERSION
from bus.log import REPAIR_HINT, TornTailWarning
from protocol.scenario import ScenarioError, json_schema, load_scenario

log = logging.getLogger(__name__)

#: Modules adding verbs (replay, resume, worker, keys, report, ...): each defines
#: ``register(subparsers)`` which adds its parser and sets ``func``.
VERB_MODULES: list[str] = ["actors.cli.inspect", "actors.cli.replay", "actors.cli.report",
                           "actors.cli.groups"]
VERB_MODULES.append("actors.cli.remote")  # `evobus worker`, `evobus keys`


def _err(message: str) -> int:
    print(f"evobus: {message}", file=sys.stderr)
    return 2


def _load_checked(args: argparse.Namespace):
    """The scenario ``args.scenario`` names, with every refusal `evobus run` would make
    before its first rollout checked (actors.runtime.checks.scenario_problems: nothing is
    called, no tasks built, no agent constructed); or the exit code after saying why."""

    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        return _err(str(exc) + _scenario_fix(args.scenario))
    problems = scenario_problems(scenario, args.scenario, log=args.log,
                                 overwrite=args.overwrite, insecure=args.insecure)
    if not problems and scenario.groups:   # their targets import: do they declare R?
        problems = [p for p in [check_groups(scenario, args.scenario,
                                             overwrite=args.overwrite)] if p is not None]
    if not problems:
        problems = [p for p in [_unpriced(scenario, args.scenario),
                                _unset_key(scenario, args.scenario)] if p is not None]
    for problem in problems:
        _err(problem)
    return 2 if problems else scenario


def _unpriced(scenario, source: str) -> str | None:
    """``max_cost`` with an OpenAIAgent whose model has no price (neither the agent's
    ``prices`` nor ``[budgets] prices``): the run would refuse at its first call, after
    writing a log; say it before, as validate. Other agents may price their own calls."""
    b, agent = scenario.budgets, _openai_agent(scenario)
    model = agent[1].get("model") if agent is not None else None
    if b.max_cost is None or not model:
        return None
    if model in (agent[1].get("prices") or {}) or model in (b.prices or {}):
        return None
    return (f"{source}: at `$.budgets.max_cost`: expected a price for the model "
            f"{model!r} (max_cost = {b.max_cost} counts the cost of every call), found none "
            f"in [budgets] prices nor the agent's prices; fix: add under [budgets] prices = "
            f'{{"{model}" = [INPUT, OUTPUT]}} (the price of 1M tokens each), or drop max_cost')


def _scenario_fix(path: str) -> str:
    """The fix for a scenario path that is no file: the scenario files of a directory
    given in its place, or what a scenario file is."""
    if os.path.isfile(path):
        return ""   # the file's own problem: the message names it and its fix
    if os.path.isfile(path + ".toml"):   # the name without its suffix
        return f"; fix: did you mean {path}.toml?"
    found = sorted(str(p) for p in Path(path).glob("*.toml")) if os.path.isdir(path) else []
    if found:
        return f"; fix: pass one of its scenario files: {', '.join(found)}"
    return ("; fix: pass the path of a scenario file (TOML: `evobus schema` prints its "
            "JSON Schema, docs/scenarios.md lists its keys)")


def _openai_agent(scenario) -> tuple[type, dict] | None:
    """(class, kwargs) of the scenario's agent when it is an OpenAIAgent (checked
    importable by scenario_problems), else None."""
    d = scenario.domain
    if d is None or not isinstance(d.agent, Ref):
        return None
    module, _, name = d.agent.ref.partition(":")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, OpenAIAgent)):
        return None
    return cls, dict(d.agent.kwargs or {})


def _unset_key(scenario, source: str) -> str | None:
    """An OpenAIAgent built here (local threads; process workers inherit this
    environment) whose ``api_key_env`` names a variable that is not set: the run would
    refuse as it builds the agent; say it as validate. Remote workers need the key on
    their side, and say so themselves."""
    agent, w = _openai_agent(scenario), scenario.workers
    if agent is None or not (w.local or w.processes):
        return None
    name = agent[1].get("api_key_env", inspect.signature(agent[0]).parameters[
        "api_key_env"].default)
    if not name or name in os.environ:
        return None
    return (f"{source}: at `$.domain.agent`: OpenAIAgent: the environment variable {name} "
            f"is not set; export {name}=<your key>, or set api_key_env to the variable "
            "that holds it (api_key_env = \"\" for an endpoint that needs no key)")


#: Where a run writes its log when neither the scenario's ``log`` nor --log names one.
RUNS_DIR = "runs"


def default_log_path(name: str, now: float | None = None) -> str:
    """``runs/NAME-YYYYmmdd-HHMMSS.evolog`` (``-2``, ``-3``... if taken: a log is never
    overwritten), relative to the current directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "run"
    stem, n = f"{safe}-{stamp}", 2
    # Taken: the log, or a log named after it (a group's `STEM.GROUP.evolog`).
    while any(Path(RUNS_DIR).glob(f"{stem}.*")):
        stem, n = f"{safe}-{stamp}-{n}", n + 1
    return str(Path(RUNS_DIR) / f"{stem}.evolog")


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

    scenario = _load_checked(args)
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


def cmd_validate(args: argparse.Namespace) -> int:
    scenario = _load_checked(args)
    if isinstance(scenario, int):
        return scenario
    parts = []
    if scenario.domain is not None:
        parallel = type(scenario.parallel).__name__[:-4]
        per_worker = getattr(scenario.parallel, "per_worker", None)
        if per_worker is None and parallel == "DataParallel":   # the default round it runs
            per_worker = build_parallel(scenario.parallel, n_workers_of(scenario.workers),
                                        build_strategy(scenario.strategy)).per_worker
        if per_worker is not None:
            parallel += f"(per_worker={per_worker})"
        parts = [scenario.mode] + ([f"{scenario.rounds} rounds"] if scenario.mode == "sync"
                                   else []) + [type(scenario.strategy).__name__[:-4], parallel]
    if scenario.groups:
        names = ", ".join(g.name for g in scenario.groups)
        parts.append(f"{len(scenario.groups)} parallel group"
                     f"{'s' if len(scenario.groups) > 1 else ''}: {names}")
    print(f"{args.scenario}: ok ({', '.join(parts)})")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:

    print(json.dumps(json_schema(), indent=2, sort_keys=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="evobus",
        description="Evolve text artifacts (prompts, skills, rule sets) with parallel "
                    "workers on a ZeroMQ bus.",
        epilog="Start with `evobus run scenarios/router.toml` (docs/quickstart.md); "
               "`evobus VERB --help` says what each verb does.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug output")
    p.add_argument("-V", "--version", action="version",
                   version=f"evobus {PACKAGE_VERSION} (Python {sys.version.split()[0]})")
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    r = sub.add_parser(
        "run", help="run a scenario file (TOML)",
        description="Check the scenario as `evobus validate` does, then run it: one line "
                    "per round (a live panel on a terminal), then a summary (the reward "
                    "before and after, why it stopped, outcomes, tokens, budget) and the "
                    "artifact. Every run writes a message log: the scenario's `log`, "
                    "--log, or runs/NAME-YYYYmmdd-HHMMSS.evolog; it is never overwritten. "
                    "Exit codes: 0 done; 1 the run failed, or halted because the backend "
                    "failed every call (of the baseline, or of 3 rounds; resumable: "
                    "`evobus resume LOG`); 2 the scenario or a flag is wrong (one line "
                    "says what and the fix; a run refused so leaves no log); 130, 143, "
                    "129 stopped by Ctrl-C, "
                    "SIGTERM, SIGHUP (the log is closed and resumable). Keys: "
                    "docs/scenarios.md.")
    r.add_argument("scenario", help="the scenario file (TOML; `evobus schema` prints "
                                    "its JSON Schema)")
    _add_run_flags(r)
    r.add_argument("--quiet", action="store_true", help="print only errors")
    r.add_argument("--json", action="store_true",
                   help="print a JSON summary at the end, alone on stdout (progress goes to "
                        "stderr)")
    r.set_defaults(func=cmd_run)
    v = sub.add_parser("validate", help="check a scenario file as `evobus run` would, "
                                        "without running anything",
                       description="Make every check `evobus run` makes before its first "
                                   "rollout that calls none of your code: the schema, the "
                                   "references, the log path, the parallelism against the "
                                   "artifact, the workers. Give it the flags you give run. "
                                   "Exit 0 when it would run, 2 (one line a problem, each "
                                   "naming the fix) when not.")
    v.add_argument("scenario", help="the scenario file (TOML)")
    _add_run_flags(v)
    v.set_defaults(func=cmd_validate)
    s = sub.add_parser("schema", help="print the JSON Schema of scenario files",
                       description="Print the JSON Schema (draft 2020-12) every scenario "
                                   "file is checked against, for an editor's completion "
                                   "and checks; docs/scenarios.md is generated from it.")
    s.set_defaults(func=cmd_schema)
    # Verbs that live in modules of their own: each has register(subparsers).
    for module in VERB_MODULES:
        importlib.import_module(module).register(sub)
    return p


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `evobus run` that change what it checks (validate takes them too)."""
    p.add_argument("--log", help="write the message log here (overrides the scenario's)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a log already at the log path, and the checkpoint of a "
                        "paused group at a group's checkpoint path (else the run refuses: "
                        "neither is overwritten by accident)")
    p.add_argument("--insecure", action="store_true",  # docs/remote.md
                   help="let [workers] bind a non-loopback address without CURVE keys: "
                        "unauthenticated, unencrypted peers")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # What evobus says on stderr reads as its other messages do (`evobus: warning: ...`,
    # `evobus: worker w0 joined ...` for what the user watches for); with -v, the level
    # and the logger that said it, for a bug report. To sys.stderr as it is at each
    # line: the live panel redirects it, and a line then lands above the panel.
    handler = _Stderr()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s" if args.verbose
                        else "evobus: %(level_prefix)s%(message)s", handlers=[handler])
    said = [] if args.verbose or getattr(args, "quiet", False) else SAID_LOGGERS
    if not args.verbose:
        handler.addFilter(_level_prefix)
    if not args.verbose:
        # bus.log logs each torn tail and also raises it as a TornTailWarning, which
        # _show_warning prints (once, with the CLI's fix): the log line would repeat it.
        logging.getLogger("bus.log").setLevel(logging.ERROR)
    if not getattr(args, "func", None):   # no verb: usage on stderr, as argparse does
        parser.print_usage(sys.stderr)
        print("evobus: a verb is required (evobus --help lists them)", file=sys.stderr)
        return 2
    with warnings.catch_warnings(), _info_from(said):
        if not args.verbose:   # one line each, not Python's file:line and source line
            warnings.showwarning = _show_warning
        try:
            return args.func(args)
        except KeyboardInterrupt as exc:
            print("evobus: interrupted", file=sys.stderr)
            return exit_code(exc)
        except BrokenPipeError:
            return _closed_pipe()


@contextlib.contextmanager
def _info_from(names):
    """INFO lines of the loggers ``names`` are shown while a verb runs (their levels
    as they were afterwards: main() may run in a process that goes on, a test's)."""
    loggers = [logging.getLogger(name) for name in names]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, before):
            logger.setLevel(level)


#: Loggers whose INFO lines are for the user watching a run (not only with -v): a wait
#: for workers in other processes says who joined, from where, how many of how many.
#: Shown unless --quiet.
SAID_LOGGERS = ("actors.runtime.pools", "actors.groups.fleet")


class _Stderr(logging.StreamHandler):
    """A handler writing to ``sys.stderr`` as it is when a line is written, not as it
    was when logging was set up (logging's own last-resort handler does the same)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:   # StreamHandler sets it; sys.stderr is used instead
        pass


def _level_prefix(record: logging.LogRecord) -> bool:
    """``warning: `` before a warning or an error for the one-line format, nothing
    before an INFO line (a filter: it never drops)."""
    record.level_prefix = "" if record.levelno <= logging.INFO else \
        f"{record.levelname.lower()}: "
    return True


def _closed_pipe() -> int:
    """The reader of stdout went away (``evobus inspect LOG | head``): exit quietly with
    the shell's status for SIGPIPE. stdout is pointed at /dev/null so the interpreter's
    final flush does not raise again (the recipe of Python's signal docs)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning (an option that does not apply, say) as one line on stderr; with
    ``evobus -v`` Python's own format says where it came from. A torn log tail names the
    CLI's fix, not the Python call."""
    text = str(message)
    if issubclass(category, TornTailWarning):
        path = text.split(": torn or corrupt tail", 1)[0]   # the message opens with it
        text = text.replace(REPAIR_HINT, f"`evobus repair {path}` truncates the file there")
    print(f"evobus: warning: {text}", file=file or sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
