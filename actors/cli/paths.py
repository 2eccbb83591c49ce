"""Where a run's log goes (:func:`default_log_path`), and what to say of a path given
as a log that is none (:func:`unreadable_log`): shared by the verbs, light to import."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["RUNS_DIR", "default_log_path", "unreadable_log"]


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


def unreadable_log(path: str | Path, exc: Exception) -> str:
    """Why a file given as a log does not read, naming the file once (a ``LogCorrupt``
    names it already), and pointing at ``evobus resume`` when the file is a parallel
    group's checkpoint rather than a log."""
    if isinstance(exc, OSError):
        text = f"{path}: cannot read the log ({exc.strerror or exc})"
    else:
        text = str(exc)
        if not text.startswith(str(path)):
            text = f"{path}: {text}"

    from actors.groups.checkpoint import load_checkpoint   # only once a log failed to read
    from actors.errors import ResumeRefused
    try:
        load_checkpoint(path)
    except ResumeRefused:   # not a checkpoint either
        return text + _log_fix(path, exc)
    return (f"{text}; it is a parallel group's checkpoint, not a log: "
            f"`evobus resume {path} --show` lists what it waits on")


def _log_fix(path: str | Path, exc: Exception) -> str:
    """The fix for a path that is no log: where logs are (the newest few under runs/),
    or, for a scenario file, the verb that runs it."""
    if isinstance(exc, OSError) and not isinstance(exc, PermissionError):
        newest = sorted(Path(RUNS_DIR).glob("*.evolog"), key=os.path.getmtime)[-3:]
        where = f"; the newest under {RUNS_DIR}/: {', '.join(map(str, reversed(newest)))}" \
            if newest else ""
        return (f"; fix: pass a run's log (the `log:` line of `evobus run`'s summary, "
                f"{RUNS_DIR}/NAME-YYYYmmdd-HHMMSS.evolog by default{where})")
    if str(path).endswith(".toml"):
        return (f"; fix: it is a scenario file: `evobus run {path}` runs it and says where "
                "its log is")
    return ""


# ---------------------------------------------------------------------------
# replay
