"""Task samplers: in which order a worker rolls out the tasks of its lease.

A parallel strategy decides *which* tasks a worker gets (a shard, a section, a
cluster); a sampler decides the *order* inside that lease. The Planner calls
``sampler.order(unit.keys, round_index)`` on every unit a strategy planned and
``sampler.record(task_id, score)`` for every scored rollout. The order matters
whenever a lease is not rolled out to the end (a budget runs out, the worker is
lost, the async lag budget forces a refresh), so the most informative tasks
should come first.

Like the parallel strategies, samplers are consulted inside a pure state machine:
no clock, no threads, no unseeded randomness. ``order`` is a function of its
arguments and of the ``record`` calls seen so far, and it changes no state, so
replaying a log reproduces every order exactly.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = [
    "PASS_THRESHOLD",
    "DifficultyWeighted",
    "RoundRobin",
    "TaskSampler",
    "check_score",
    "difficulty_weight",
]

#: A rollout whose reward reaches this counts as a pass (the engine's "solved").
PASS_THRESHOLD = 0.999


def difficulty_weight(pass_rate: float, floor: float = 0.0) -> float:
    """``4*p*(1-p)``, never below ``floor``: how much learning signal is left.

    Peaks at ``p = 0.5`` and vanishes at both ends: something that always passes
    yields no gradient, and neither does something that never passes whatever
    the artifact says (the GRPO zero-advantage argument). The floor keeps such
    items rankable instead of collapsing them all to exactly zero."""
    p = min(1.0, max(0.0, pass_rate))
    return max(floor, 4.0 * p * (1.0 - p))


def check_score(task_id: str, score: float) -> float:
    """Return ``score`` as a float, or raise naming the task when it is not in [0, 1]."""
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise TypeError(f"score for task {task_id!r} must be a number in [0, 1], "
                        f"got {type(score).__name__}")
    value = float(score)
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise ValueError(f"score for task {task_id!r} must be in [0, 1], got {score!r}: "
                         "rescale the reward to [0, 1]")
    return value


def _check_unique(task_ids: Sequence[str], who: str) -> list[str]:
    ids = list(task_ids)
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dupes = sorted({t for t in ids if t in seen or seen.add(t)})
        raise ValueError(f"{who}.order() got duplicate task ids {dupes}: "
                         "a lease names each task once")
    return ids


@runtime_checkable
class TaskSampler(Protocol):
    """Orders the tasks of a lease, and learns from rollout rewards.

    ``order`` returns a permutation of ``task_ids`` (never mutates its argument,
    never drops or repeats a task); ``record`` reports the reward (in [0, 1]) one
    rollout of ``task_id`` achieved."""

    name: str

    def order(self, task_ids: Sequence[str], round_index: int) -> list[str]: ...

    def record(self, task_id: str, score: float) -> None: ...


class RoundRobin:
    """The default: the lease's own order, rotated by one place per round.

    Round 0 keeps the order unchanged; round ``r`` starts at position
    ``r mod len(task_ids)``. When a lease is always rolled out to the end this is
    the same as no reordering; when it is cut short, the rotation makes the cut
    fall on different tasks from round to round. Learns nothing."""

    name = "round-robin"

    def order(self, task_ids: Sequence[str], round_index: int) -> list[str]:
        ids = _check_unique(task_ids, "RoundRobin")
        if not ids:
            return []
        start = round_index % len(ids)
        return ids[start:] + ids[:start]

    def record(self, task_id: str, score: float) -> None:
        check_score(task_id, score)  # a bad reward is a caller mistake even here

    def __repr__(self) -> str:
        return "RoundRobin()"


class DifficultyWeighted:
    """UCB over tasks, preferring tasks that still carry a learning signal.

    Each task scores ``difficulty_weight(p) + c * sqrt(ln(T + 1) / n)`` where ``p``
    is its observed pass rate, ``n`` its number of recorded rollouts and ``T``
    the number of rollouts recorded over all tasks. Tasks never tried come first
    (an infinite bonus); then tasks whose pass rate sits near 0.5, with an
    exploration bonus for the rarely tried ones.

    ``c`` defaults to 0.2, not the textbook 1.4: at task granularity the optimistic
    start (untried tasks first) already explores, and a large ``c`` swamps the
    signal term, which is capped at 1.

    Ties (every untried task, and equal scores) are broken by a hash of
    ``(seed, round_index, task_id)``: deterministic for a seed, independent of the
    order the ids arrive in, and different from round to round so that untried
    tasks are not always tried in the same order. ``order`` itself changes no
    state: only ``record`` does.
    """

    name = "difficulty-weighted"

    def __init__(self, c: float = 0.2, seed: int = 0,
                 pass_threshold: float = PASS_THRESHOLD, floor: float = 1e-3) -> None:
        if not c >= 0.0:
            raise ValueError(f"DifficultyWeighted(c={c!r}): c must be >= 0")
        if not 0.0 < pass_threshold <= 1.0:
            raise ValueError(f"DifficultyWeighted(pass_threshold={pass_threshold!r}): "
                             "it must be in (0, 1]")
        self.c = float(c)
        self.seed = int(seed)
        self.pass_threshold = float(pass_threshold)
        self.floor = float(floor)
        self._passes: dict[str, int] = {}
        self._trials: dict[str, int] = {}
        self._total = 0

    def record(self, task_id: str, score: float) -> None:
        value = check_score(task_id, score)
        self._trials[task_id] = self._trials.get(task_id, 0) + 1
        self._passes[task_id] = (self._passes.get(task_id, 0)
                                 + (1 if value >= self.pass_threshold else 0))
        self._total += 1

    def score(self, task_id: str) -> float:
        """The task's UCB score now (``inf`` while it was never tried)."""
        trials = self._trials.get(task_id, 0)
        if trials == 0:
            return math.inf
        value = difficulty_weight(self._passes[task_id] / trials, self.floor)
        return value + self.c * math.sqrt(math.log(self._total + 1.0) / trials)

    def _tie(self, task_id: str, round_index: int) -> bytes:
        return hashlib.sha256(f"{self.seed}:{round_index}:{task_id}".encode()).digest()

    def order(self, task_ids: Sequence[str], round_index: int) -> list[str]:
        ids = _check_unique(task_ids, "DifficultyWeighted")
        return sorted(ids, key=lambda t: (-self.score(t), self._tie(t, round_index)))

    def stats(self) -> dict[str, tuple[int, int]]:
        """A copy of the per-task ``(passes, trials)`` counters, for inspection."""
        return {t: (self._passes[t], n) for t, n in self._trials.items()}

    def __repr__(self) -> str:
        return f"DifficultyWeighted(c={self.c}, seed={self.seed})"
