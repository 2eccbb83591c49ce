"""How many held-out tasks a gate scores: the held-out evidence sized to the budget.

A gate (the baseline, each merge's fused candidate, a bisected half, attribution's and
retiring's candidates) scores a state on the held-out tasks, one call each. With a
call budget, a run of ``max_calls`` calls scores on ``max(GATE_MIN, max_calls //
GATE_SHARE)`` of them (never more than the split): the first decisions of a run are
about large gains, which few tasks tell apart, and a run that spends its whole budget
on a few gates of the whole split makes few decisions. From ``GATE_SHARE`` times the
split's size on, a gate scores the whole split, as it does without a call budget.

The tasks are a fixed sample of the split for the whole run (the head and every
candidate are compared on the same tasks, task for task), chosen by a hash of each
task id: independent of the order the tasks were given in, the same on every replay.
Pure. docs/concepts.md describes it; docs/performance.md has the measurements.
"""

from __future__ import annotations

import hashlib

#: A gate costs at most about this fraction (1 / GATE_SHARE) of a call budget...
GATE_SHARE = 10
#: ...and scores at least this many held-out tasks (fewer decide too noisily).
GATE_MIN = 48


def gate_size(n_heldout: int, max_calls: int | None) -> int | None:
    """The number of held-out tasks a gate scores for a run of ``max_calls`` calls
    (None: the whole split, as without a call budget)."""
    if max_calls is None:
        return None
    size = max(GATE_MIN, max_calls // GATE_SHARE)
    return None if size >= n_heldout else size


def gate_tasks(heldout: list[str], size: int | None) -> list[str]:
    """The ``size`` held-out tasks the gates score (all of ``heldout`` for None or a
    size of the split or more), in the split's order."""
    if size is None:
        return list(heldout)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"gate_tasks={size!r}: give a number of held-out tasks >= 1, or "
                         "None for the whole split")
    if size >= len(heldout):
        return list(heldout)
    chosen = set(sorted(heldout, key=_rank)[:size])
    return [t for t in heldout if t in chosen]


def _rank(task_id: str) -> bytes:
    return hashlib.blake2b(task_id.encode(), digest_size=8).digest()
