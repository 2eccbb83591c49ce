"""What a group reports: progress while it runs, the outcome once it has ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol import PendingInteraction
from actors.errors import GroupFailed, GroupPaused
from actors.groups.limits import Consumed


@dataclass(frozen=True)
class GroupProgress:
    """What ``on_progress`` receives: about once a second while a group runs
    (``PROGRESS_S``), and once more when it has ended (``done``), on the caller's thread.

    ``total``: the group's items; ``finished``: branches that returned a value, those a
    resumed group had finished before (``finished_before``) included; ``failed``:
    branches that raised (the group stops at the first); ``elapsed``: seconds since this
    call started."""

    group_id: str
    total: int
    finished: int
    failed: int
    elapsed: float
    done: bool = False
    finished_before: int = 0


@dataclass
class GroupOutcome:
    """What :func:`run_group` and :func:`resume_group` return.

    ``status``: ``completed`` (``results`` in input order), ``failed`` (``error`` is the
    first error), ``user_input_pending`` or ``approval_pending`` (``pending_interactions``
    to answer, ``checkpoint`` the file to resume from)."""

    status: str
    group_id: str
    results: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    error_branch: int | None = None
    pending_interactions: list[PendingInteraction] = field(default_factory=list)
    checkpoint: Path | None = None
    finished: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    never_started: list[int] = field(default_factory=list)
    abandoned: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    effects: list[tuple[int, str]] = field(default_factory=list)
    consumed: Consumed = field(default_factory=Consumed)
    store: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    trace: list[tuple[str, int]] | None = None
    partial: dict[int, Any] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "completed"


def results_of(outcome: GroupOutcome) -> list[Any]:
    """The results of a completed group; a failed one raises :class:`GroupFailed` (with the
    first error as its cause), a paused one :class:`GroupPaused`."""
    if outcome.status == "completed":
        return outcome.results
    if outcome.status == "failed":
        raise GroupFailed(outcome) from outcome.error
    raise GroupPaused(outcome)
