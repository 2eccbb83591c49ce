"""Drive a pure Merger as the Scheduler would, for the Merger's tests: answer every
EvalRequest it sends with per-task scores from a function, until it sends none."""

from __future__ import annotations

from typing import Callable

from actors.machines.merger import Merger
from protocol import EvalDone, EvalRequest


def _mean(scores: dict[str, float]) -> float:
    return sum(scores.values()) / len(scores)


def answer_evals(m: Merger, out: list, solves: Callable[[dict, str], float],
                 log: list | None = None,
                 mean: Callable[[dict[str, float]], float] = _mean) -> list:
    """What ``out`` and the answers' answers send to anyone but the scorer; the requests
    are kept in ``log`` when given."""
    result, pending = [], list(out)
    while pending:
        to, msg = pending.pop(0)
        if isinstance(msg, EvalRequest):
            if log is not None:
                log.append(msg)
            scores = {t: solves(msg.state, t) for t in msg.task_ids}
            pending += m.handle(EvalDone(eval_id=msg.eval_id, score=mean(scores),
                                         scores=scores))
        else:
            result.append((to, msg))
    return result
