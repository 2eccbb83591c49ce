"""The ``evobus`` command line. Every verb returns an exit code; a caller's mistake is
one line on stderr naming the fix, never a traceback. The verbs and their arguments:
actors.cli.verbs (each verb's code is imported only when it runs)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

from actors.cli.verbs import build_parser

__all__ = ["build_parser", "main"]


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
            from actors.cli.progress import exit_code
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
    from bus.log import REPAIR_HINT, TornTailWarning   # imported by whatever warned
    text = str(message)
    if issubclass(category, TornTailWarning):
        path = text.split(": torn or corrupt tail", 1)[0]   # the message opens with it
        text = text.replace(REPAIR_HINT, f"`evobus repair {path}` truncates the file there")
    print(f"evobus: warning: {text}", file=file or sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
