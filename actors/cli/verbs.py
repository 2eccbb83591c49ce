"""The command line itself: every verb, its arguments and its help. A verb's code is
named here, not imported (:class:`Lazy`): `evobus --help` and the first line of a verb
wait only for what that verb needs (docs/performance.md, "CLI start-up";
tests/test_cli_conventions.py checks `evobus --help` imports no verb's code)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

__all__ = ["Lazy", "build_parser"]


class Lazy:
    """A verb's function, ``"module:name"``, imported when the verb runs and called as
    ``function(args, **kwargs)`` (a keyword may be another Lazy)."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        self.target, self.kwargs = target, kwargs

    def __call__(self, args: argparse.Namespace) -> int:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)(args, **self.kwargs)

    def __repr__(self) -> str:
        return f"Lazy({self.target!r})"


class _Version(argparse.Action):
    """``--version``: the package version, read only when asked (importlib.metadata)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from actors.version import PACKAGE_VERSION
        print(f"evobus {PACKAGE_VERSION} (Python {sys.version.split()[0]})")   # stdout
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="evobus",
        description="Evolve text artifacts (prompts, skills, rule sets) with parallel "
                    "workers on a ZeroMQ bus.",
        epilog="Start with `evobus run scenarios/router.toml` (docs/quickstart.md); "
               "`evobus VERB --help` says what each verb does.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug output")
    p.add_argument("-V", "--version", action=_Version,
                   help="show the version of evobus and Python, and exit")
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    for add in (_scenario_verbs, _inspect, _replay, _report, _remote):
        add(sub)
    return p


def _scenario_verbs(sub) -> None:
    """run, validate, schema: actors.cli.run."""
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
    r.set_defaults(func=Lazy("actors.cli.run:cmd_run"))
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
    v.set_defaults(func=Lazy("actors.cli.validate:cmd_validate"))
    s = sub.add_parser("schema", help="print the JSON Schema of scenario files",
                       description="Print the JSON Schema (draft 2020-12) every scenario "
                                   "file is checked against, for an editor's completion "
                                   "and checks; docs/scenarios.md is generated from it.")
    s.set_defaults(func=Lazy("actors.cli.validate:cmd_schema"))


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


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


INSPECT = """\
    evobus inspect LOG [--type T] [--actor A] [--round R] [--limit N]   message lines
    evobus inspect LOG --summary          a table of rounds, totals, parallel groups
    evobus inspect LOG --history          what each commit changed, and on what evidence
    evobus inspect LOG --version N        the artifact at version N
    evobus inspect LOG --follow           message lines as a live run appends them
    ... --json                            the same as JSON, one object a line"""


def _inspect(sub) -> None:
    """inspect and repair: actors.cli.inspect."""
    i = sub.add_parser("inspect", help="print a recorded message log readably",
                       description=INSPECT,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("log", help="a message log (.evolog); a resumed run's newest log reads "
                               "as its whole chain")
    i.add_argument("--actor", action="append", help="only messages from/to this actor")
    i.add_argument("--type", action="append",
                   help="only this message type (e.g. Commit); repeat for several")
    i.add_argument("--round", type=_non_negative, help="only messages of this round")
    i.add_argument("--summary", action="store_true",
                   help="no message lines: a table of rounds (leases, rollouts, proposals, "
                        "commit, discards), totals of commits, re-dispatches and discards, "
                        "a table of parallel groups if the log holds any, and counts per "
                        "type")
    i.add_argument("--history", action="store_true",
                   help="every version: what its commit changed, which worker proposed it "
                        "on which task, the held-out score it beat; then the tasks the head "
                        "still fails")
    i.add_argument("--version", type=_non_negative, metavar="N", dest="at_version",
                   help="print the artifact at version N (0: the initial artifact)")
    i.add_argument("--limit", type=_non_negative, help="print at most this many lines")
    i.add_argument("--json", action="store_true", help="JSON, one object a line")
    i.add_argument("--follow", action="store_true",
                   help="keep printing messages as the log grows, until the run ends "
                        "(its RunDone) or Ctrl-C")
    i.add_argument("--idle", type=float, metavar="S",
                   help="with --follow: also stop after S seconds without a new message")
    i.set_defaults(func=Lazy("actors.cli.inspect:cmd_inspect"))
    r = sub.add_parser("repair", help="cut a torn tail (what a crash leaves) off a log",
                       description="Truncate a log after its last good record, on disk. "
                                   "Damage in the middle of a log is refused, never cut.")
    r.add_argument("log", help="the log a crash left (.evolog)")
    r.set_defaults(func=Lazy("actors.cli.inspect:cmd_repair"))


def _replay(sub) -> None:
    """replay: actors.cli.replay; resume: a log goes to actors.cli.replay (a fork to
    actors.cli.fork), a group's checkpoint to actors.cli.groups, which tells them apart."""
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
    r.set_defaults(func=Lazy("actors.cli.replay:cmd_replay"))

    s = sub.add_parser(
        "resume", help="continue a run whose coordinator died, from its log",
        description="Rebuild every control actor from the log (replay without sending), "
                    "start new workers, re-issue the leases that were in flight under "
                    "their original ids and go on. Writes a new log that names the old "
                    "one (LOG.evolog -> LOG.r1.evolog); a torn tail of LOG is cut first. "
                    "The scenario comes from the log header (runs started with `evobus "
                    "run`). Given a parallel group's checkpoint instead of a log, resumes "
                    "that group (--answers, --as, --show).")
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
    s.add_argument("--answers", metavar="FILE",
                   help="group checkpoints: a JSON file {interaction id: answer} (null: not "
                        "answered yet), or {\"user_inputs\": {...}, \"approvals\": {...}}")
    s.add_argument("--as", dest="principal", metavar="NAME",
                   help="group checkpoints: who resumes (approvals need an approver)")
    s.add_argument("--show", action="store_true",
                   help="group checkpoints: print the pending interactions and stop")
    s.set_defaults(func=Lazy("actors.cli.groups:cmd_resume",
                             previous=Lazy("actors.cli.replay:cmd_resume")))


def _report(sub) -> None:
    """report: actors.cli.report."""
    p = sub.add_parser(
        "report", help="write an HTML report (with PNG charts) of a recorded run",
        description="Write a self-contained HTML report of a run from its message log: "
                    "held-out reward over time, a per-worker timeline of leases (busy, "
                    "starved, idle), outcome counts, re-dispatches and discards. Needs "
                    'matplotlib: pip install "evobus[report]".')
    p.add_argument("log", help="the run's message log (e.g. runs/router.evolog)")
    p.add_argument("-o", "--output", metavar="DIR",
                   help="write index.html and the PNGs here (default: LOG's name + -report, "
                        "beside the log)")
    p.add_argument("--quiet", action="store_true",
                   help="print only errors (not what it is doing, nor where the page is)")
    p.set_defaults(func=Lazy("actors.cli.report:cmd_report"))


def _remote(sub) -> None:
    """worker and keys: actors.cli.remote."""
    w = sub.add_parser("worker", help="serve a coordinator's run from this process/machine",
                       description="Connect to a coordinator started with `evobus run` "
                                   "([workers] remote = N, bind = ...) and take leases. "
                                   "Exit codes: 0 the coordinator stopped it (the run "
                                   "ended); 1 the broker could not be reached, or stayed "
                                   "silent, for --give-up seconds (one line says what it "
                                   "saw and the fix); 2 it refused the run (a module "
                                   "outside --allow, a missing environment variable, "
                                   "other code) or a flag is wrong; 130, 143, 129 stopped "
                                   "by Ctrl-C, SIGTERM, SIGHUP (the calls its slots are "
                                   "in finish first, up to 3 s; the coordinator "
                                   "re-dispatches the rest).")
    w.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                   help="the coordinator's [workers] bind address")
    w.add_argument("--slots", type=int, default=1,
                   help="leases run at once (threads; default: %(default)s)")
    w.add_argument("--key", metavar="FILE", help="this worker's secret key (NAME.key_secret)")
    w.add_argument("--server-key", metavar="FILE", help="the broker's public key (server.key)")
    w.add_argument("--allow", action="append", metavar="MODULE",
                   help="a module (prefix) the coordinator may name; checked before import; "
                        "repeat for several")
    w.add_argument("--id", help="this worker's name (default: HOST-PID-XXXX)")
    w.add_argument("--broker-timeout", type=float, default=5.0, metavar="S",
                   help="reconnect after this long without a word from the broker; "
                        "more than 1 s (default: %(default)s s)")
    w.add_argument("--give-up", type=float, default=120.0, metavar="S",
                   help="exit (status 1) after this long without the broker, from the "
                        "start too: a coordinator not up yet (default: %(default)s s)")
    w.set_defaults(func=Lazy("actors.cli.remote:cmd_worker"))
    k = sub.add_parser("keys", help="write CURVE key pairs for the broker and workers",
                       description="Write the broker's key pair (server.key, "
                                   "server.key_secret) and one pair per worker (NAME.key, "
                                   "NAME.key_secret) into DIR, and authorise each worker "
                                   "(DIR/authorized/NAME.key); pairs already there are kept, "
                                   "never replaced. Prints the [workers] keys line and the "
                                   "`evobus worker` command to use them (docs/remote.md).")
    k.add_argument("dir", help="directory for the key files (created)")
    k.add_argument("--client", action="append", metavar="NAME",
                   help="a worker key pair to create and authorise (default: client)")
    k.set_defaults(func=Lazy("actors.cli.remote:cmd_keys"))
