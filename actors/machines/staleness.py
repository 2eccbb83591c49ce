"""How stale an asynchronous proposal really is, and when an idle Merger should merge.
Pure (read by actors/machines/merger.py).

A proposal made on version ``b`` of the artifact and merged at head ``v`` is ``v - b``
versions behind. What matters to the diff is narrower: only the commits that wrote a
key the diff writes. When none did, the diff applies to the head exactly as it would
have to its base (it is *rebased* for free), so the staleness policy can treat it as
fresh; a diff one of whose keys a later commit rewrote is as stale as before (a
``SingleSlot`` rewrite always is: every commit rewrites its one key).

:class:`KeyHistory` keeps, for each commit, the keys it changed (a frozenset per
commit: a run of a few hundred commits keeps a few hundred small sets).
:func:`merge_ready` is the async merge trigger: with waves, an idle Merger merges
when the Planner says a wave of rollouts has settled (or it is flushing, or what it
holds could stall the Scheduler's backpressure), rather than on the first proposal.
"""

from __future__ import annotations

from collections.abc import Mapping

from protocol import Diff


class KeyHistory:
    """The keys each commit changed, in commit order (commit ``v`` at index ``v - 1``)."""

    def __init__(self) -> None:
        self._changed: list[frozenset[str]] = []

    def commit(self, before: Mapping[str, str], after: Mapping[str, str]) -> None:
        """Record the commit that turned ``before`` into ``after``."""
        self._changed.append(frozenset(
            k for k in before.keys() | after.keys() if before.get(k) != after.get(k)))

    @property
    def version(self) -> int:
        return len(self._changed)

    def eta(self, diff: Diff, head_version: int) -> int:
        """How many commits after ``diff.base_version`` (up to ``head_version``) wrote
        a key ``diff`` writes: 0 when the diff rebases onto the head unchanged."""
        keys = diff.ops.keys()
        first = max(0, diff.base_version)
        return sum(1 for changed in self._changed[first:head_version]
                   if not changed.isdisjoint(keys))


def merge_ready(held: int, *, waves: bool, due: bool, backlog: int | None = None) -> bool:
    """Whether an idle asynchronous Merger holding ``held`` proposals merges now. Without
    ``waves``, on the first proposal (the Merger's historical trigger); with ``waves``,
    when a wave has settled or the run is flushing (``due``), or when it holds
    ``backlog`` proposals (so the Scheduler's backpressure never waits on it)."""
    if held <= 0:
        return False
    if not waves or due:
        return True
    return backlog is not None and held >= backlog
