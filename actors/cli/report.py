"""``evobus report LOG [-o DIR]``: a self-contained HTML report (and PNGs) of a run."""

from __future__ import annotations

import argparse
import sys
from actors.errors import ConfigError
from bus.log import LogCorrupt
from actors.cli.progress import StepsView
from actors.cli.render import MissingExtra, OutputError, write_report
from actors.cli.paths import unreadable_log


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
