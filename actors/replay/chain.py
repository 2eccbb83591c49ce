"""The logs of one run: a resumed run's newest log names the one it resumed, back to
the first (every segment carries the run's id). Reads only logs: `evobus inspect`
and the reports import it without the machines or the runtime."""

from __future__ import annotations

import warnings
from pathlib import Path

from actors.errors import ConfigError
from bus.log import LogContents, read_header, read_log

__all__ = ["META_RESUMED_FROM", "log_chain", "read_chain"]

#: The header key of a resumed log naming the log it resumed (relative to its own).
META_RESUMED_FROM = "resumed_from"


def log_chain(path: str | Path) -> list[Path]:
    """The logs a (possibly resumed) log continues, oldest first, ending with ``path``.

    Every segment must carry the run id of the newest one: a segment of another run (a
    log replaced by a later run under the same name) is refused, naming it."""

    chain = [Path(path)]
    seen = {chain[0].resolve()}
    run_id = read_header(chain[0]).run_id
    while True:
        header = read_header(chain[0])
        if header.run_id != run_id:
            raise ConfigError(
                f"{chain[0]} belongs to run {header.run_id or '(none)'}, but {chain[1]} "
                f"resumes run {run_id or '(none)'} from it: it is not the log that run "
                "continued (was it replaced by another run under the same name?); a chain "
                "replays and resumes only with its own segments: restore the log that run "
                "wrote")
        previous = header.meta.get(META_RESUMED_FROM)
        if not previous:
            return chain
        prev = Path(previous)
        if not prev.is_absolute():
            prev = chain[0].parent / prev
        if not prev.exists():
            raise ConfigError(f"{chain[0]}: it resumes {previous!r}, which does not exist "
                              f"(looked at {prev}); keep the logs of a resumed run together")
        if prev.resolve() in seen:
            raise ConfigError(f"{chain[0]}: the resume chain loops back to {prev}")
        seen.add(prev.resolve())
        chain.insert(0, prev)


def read_chain(path: str | Path) -> list[LogContents]:
    """Every log of the run ``path`` ends (oldest first), read without warnings: a
    torn tail is reported by the caller from ``dropped_tail``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [read_log(p) for p in log_chain(path)]
