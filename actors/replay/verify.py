"""Replay: feed the control machines the inputs a log recorded and check that they
produce, message for message, the outputs it recorded (DESIGN section 3).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable

from actors.errors import ConfigError
from bus.log import LogContents, read_log
from actors.replay.chain import log_chain
from actors.replay.engine import MachineSpec, rebuild
from actors.replay.report import ReplayReport
from bus.log import LogCorrupt


def replay_log(path: str | Path, *, strict: bool = False, planner: MachineSpec = None,
               scheduler: MachineSpec = None, merger: MachineSpec = None,
               collector: MachineSpec = None,
               parallel: Any = None, strategy: Any = None, task_sampler: Any = None,
               machines: dict[str, Any] | None = None, chain: bool = True) -> ReplayReport:
    """Replay every control actor of the log at ``path`` (and of the logs it resumes).

    Returns a :class:`ReplayReport`; raises ``bus.log.LogCorrupt`` for a damaged log
    and :class:`~actors.errors.ConfigError` when the machines cannot be rebuilt.
    ``machines`` replaces the built machines entirely (name -> machine); the
    Collectors of the log's parallel groups are still found and built (``collector``:
    a class or a callable taking the Collector's name, default
    :class:`~actors.machines.collector.Collector`)."""
    t0 = time.perf_counter()
    path = Path(path)
    paths = log_chain(path) if chain else [path]
    contents = [read_log(p) for p in paths]
    report, _ = rebuild(paths, contents, strict=strict, machines=machines,
                     specs=dict(planner=planner, scheduler=scheduler, merger=merger,
                                collector=collector, parallel=parallel, strategy=strategy,
                                task_sampler=task_sampler))
    report.elapsed = time.perf_counter() - t0
    return report


def replay_contents(contents: list[LogContents], *, strict: bool = False,
                    machines: dict[str, Any] | None = None, **specs: Any) -> ReplayReport:
    """:func:`replay_log` on logs already read (a chain, oldest first): no file I/O."""
    t0 = time.perf_counter()
    report, _ = rebuild([c.path for c in contents], contents, strict=strict, machines=machines,
                     specs=specs)
    report.elapsed = time.perf_counter() - t0
    return report


def replay_many(paths: Iterable[str | Path], **kwargs: Any) -> list[tuple[Path, ReplayReport | Exception]]:
    """Batch mode: replay each log; a log that cannot be replayed gives its error."""

    out: list[tuple[Path, ReplayReport | Exception]] = []
    for p in paths:
        p = Path(p)
        try:
            out.append((p, replay_log(p, **kwargs)))
        except (OSError, LogCorrupt, ConfigError) as exc:  # reported per log by the caller
            out.append((p, exc))
    return out
