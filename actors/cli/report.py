"""``evobus report LOG [-o DIR]``: a self-contained HTML report (and PNGs) of a run."""

from __future__ import annotations

import argparse
import sys
from actors.errors import ConfigError
from bus.log import LogCorrupt
from actors.cli.progress import StepsView
from actors.cli.render import MissingExtra, OutputError, write_report
from actors.cli.replay import unreadable_log


def cmd_report(args: argparse.Namespace) -> int:

    try:
        # What it does as it goes, on stderr: a status line on a terminal, plain lines
        # elsewhere (a big log takes seconds to read and draw).
        with StepsView("report", quiet=args.quiet) as steps:
            page = write_report(args.log, args.output, step=steps.step)
    except MissingExtra as exc:
        print(f"evobus: {exc}", file=sys.stderr)
        return 2
    except OutputError as exc:   # -o DIR, not the log
        print(f"evobus: -o {args.output or '(default)'}: {exc.strerror}; fix: pass -o a "
              "directory you can write", file=sys.stderr)
        return 2
    except (OSError, LogCorrupt) as exc:

        print(f"evobus: {unreadable_log(args.log, exc)}", file=sys.stderr)
        return 2
    except ConfigError as exc:   # a resumed log whose older segment is missing
        print(f"evobus: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"report: {page}  (open it in a browser; the charts are also in "
              f"{page.parent}/)")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
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
    p.set_defaults(func=cmd_report)
