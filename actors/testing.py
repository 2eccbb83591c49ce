"""Helpers for tests, the project's and yours: replay a recorded log as an assertion.

    from actors.testing import replay

    def test_my_run_replays(tmp_path):
        evolve(..., log=str(tmp_path / "run.evolog"))
        replay(tmp_path / "run.evolog")          # AssertionError with the report if not

``replay`` takes the same arguments as :func:`actors.replay.replay_log`: machines or
strategies for a log written by ``evolve()`` from Python (``parallel=``,
``strategy=``, ``task_sampler=``, or ``planner=``/``scheduler=``/``merger=`` as an
instance, a class, or a callable taking the ``Start`` message; ``collector=`` as a
class or a callable taking the Collector's name, for the log's parallel groups). Pass *fresh*
strategy objects: a stateful one (``ClusterParallel`` learns from ``observe``) that
already ran would plan differently the second time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.replay.report import ReplayReport
from actors.replay.verify import replay_log

__all__ = ["recorded_logs", "replay"]


def replay(path: str | Path, *, strict: bool = False, **kwargs: Any) -> ReplayReport:
    """Replay the log at ``path``; raise ``AssertionError`` with the report (first
    divergence: seq, actor, expected, actual, field-level difference) unless every
    control actor reproduces it. Returns the report when it does."""
    report = replay_log(path, strict=strict, **kwargs)
    if not report.ok:
        raise AssertionError(f"replay of {path} diverged:\n{report.format()}")
    return report


def recorded_logs(directory: str | Path) -> list[Path]:
    """Every ``*.evolog`` under ``directory``, sorted (for ``pytest.mark.parametrize``)."""
    return sorted(Path(directory).glob("*.evolog"))
