"""Score reuse for a model the user declares deterministic (``evolve(deterministic=True)``,
``[domain] deterministic = true``). Pure (read by actors/machines/scoring.py).

A deterministic model gives the same output, so the same score, for the same rendered
artifact and task. The Merger's score tables already answer a candidate state met
again on the *same task set*; :class:`PairScores` remembers each (state, task) score,
so a request for a state on any task set (the whole held-out split, a screen's
minibatch, one evidence task) is sent only for the tasks that state was never scored
on, and answered locally when it was scored on all of them. The mean is taken in
task-id order, as the Scheduler takes it, so a reused score is the score a full
evaluation would have returned, bit for bit.

Scores of an evaluation in which some call failed are not remembered (the Scheduler
scores a failed call 0.0, and a retry may well succeed). With a model that is not in
fact deterministic, reuse keeps the first sample of each pair: the declaration is the
user's, and a noisy model's repeated scores are what noise-aware rules rely on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from protocol import EvalDone

#: States whose per-task scores are kept, the least recently used dropped first.
PAIR_STATES = 4096


def mean_in_id_order(scores: Mapping[str, float]) -> float:
    """The mean of ``scores`` summed in task-id order (the Scheduler's order)."""
    ordered = [scores[k] for k in sorted(scores)]
    return sum(ordered) / len(ordered) if ordered else 0.0


class PairScores:
    """(state key, task id) -> score, for a deterministic model."""

    def __init__(self, states: int = PAIR_STATES) -> None:
        if isinstance(states, bool) or not isinstance(states, int) or states < 1:
            raise ValueError(f"PairScores(states=...) takes an integer >= 1, got {states!r}")
        self.states = states
        self._scores: dict[frozenset, dict[str, float]] = {}
        self.reused = 0      # (state, task) scores answered from here, not asked for

    def split(self, key: frozenset,
              task_ids: Sequence[str]) -> tuple[dict[str, float], list[str]]:
        """The scores of ``key`` already known on ``task_ids``, and the tasks still to
        score (in the order asked)."""
        table = self._scores.pop(key, None)
        if table is None:
            return {}, list(task_ids)
        self._scores[key] = table    # used again: last in line to be dropped
        known = {t: table[t] for t in task_ids if t in table}
        self.reused += len(known)
        return known, [t for t in task_ids if t not in known]

    def record(self, key: frozenset, scores: Mapping[str, float]) -> None:
        table = self._scores.pop(key, None) or {}
        table.update(scores)
        self._scores[key] = table
        if len(self._scores) > self.states:
            del self._scores[next(iter(self._scores))]

    def answer(self, key: frozenset, msg: EvalDone,
               known: Mapping[str, float] | None) -> EvalDone:
        """``msg`` (the scores of the tasks that were asked for) completed with the
        ``known`` ones: the EvalDone a full evaluation would have been. What it
        scored is remembered unless a call failed."""
        if msg.unscored is not None:
            return msg
        if not msg.errors:
            self.record(key, msg.scores)
        if not known:
            return msg
        scores = {**known, **msg.scores}
        return EvalDone(eval_id=msg.eval_id, score=mean_in_id_order(scores),
                        scores={k: scores[k] for k in sorted(scores)}, errors=msg.errors)
