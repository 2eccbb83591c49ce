"""GEPA (``pip install gepa``, the bench environment only; never a dependency of
evobus) on the noisy domains of ``bench/noisy_domains.py``, for ``bench/learning.py``.

GEPA evolves a ``dict[str, str]`` candidate. Here it has one component, the artifact
state as JSON, rendered by the same strategy the other two libraries use, so the model
reads the same text. Its adapter's ``propose_new_texts`` is handed the shared proposer:
for each failed example of the reflective minibatch the proposer is called once on
the candidate as it stands, and its edit is applied with the strategy's ``to_diff``
(a whole rewrite for ``SingleSlot``), exactly as evobus's workers apply it. Every
model call goes through the same counting wrapper as the other two libraries.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

COMPONENT = "artifact"
NOT_INSTALLED = "gepa not installed (pip install gepa==0.1.4)"


class NotInstalled(RuntimeError):
    """gepa is not importable in this environment."""


def _lib():
    try:
        import gepa
    except ImportError as exc:
        raise NotInstalled(NOT_INSTALLED) from exc
    return gepa


def available() -> bool:
    try:
        _lib()
    except NotInstalled:
        return False
    return True


#: Threads an evaluation batch runs on when calls are latency-bound (the other
#: libraries' worker count).
THREADS = 4


class Adapter:
    """A GEPA adapter over a domain, its counting model wrapper and an evobus strategy
    (used only to render the state and to turn a proposal into an edit)."""

    def __init__(self, calls, strategy) -> None:
        self.calls = calls
        self.strategy = strategy

    def render(self, candidate: dict[str, str]) -> str:
        return self.strategy.render(json.loads(candidate[COMPONENT]))

    def evaluate(self, batch, candidate, capture_traces: bool = False):
        from gepa.core.adapter import EvaluationBatch

        rendered = self.render(candidate)
        if getattr(self.calls, "latency_ms", 0) > 0:
            # Latency-bound runs: the batch is evaluated on THREADS threads, as the
            # other libraries run their workers.
            with ThreadPoolExecutor(THREADS) as pool:
                outputs = list(pool.map(lambda t: self.calls.run(rendered, t), batch))
        else:
            outputs = [self.calls.run(rendered, task) for task in batch]
        scores = [self.calls.reward(task, out) for task, out in zip(batch, outputs)]
        traces = [{"task": t, "output": o, "score": s}
                  for t, o, s in zip(batch, outputs, scores)] if capture_traces else None
        return EvaluationBatch(outputs=outputs, scores=scores, trajectories=traces)

    def make_reflective_dataset(self, candidate, eval_batch, components_to_update):
        return {c: list(eval_batch.trajectories or []) for c in components_to_update}

    def propose_new_texts(self, candidate, reflective_dataset, components_to_update):
        state = json.loads(candidate[COMPONENT])
        for record in reflective_dataset.get(COMPONENT, []):
            if record["score"] >= 1.0:
                continue
            rendered = self.strategy.render(state)
            proposal = self.calls.propose(rendered, record["task"], record["output"],
                                          record["score"])
            diff = self.strategy.to_diff(state, proposal, "gepa", 0) if proposal else None
            if diff is not None:
                state = {**state, **diff.ops}
        return {COMPONENT: json.dumps(state, sort_keys=True)}


def optimize(calls, strategy, train, val, *, budget: int, seed: int) -> str:
    """One GEPA run of at most ``budget`` metric calls; the best candidate, rendered."""
    gepa = _lib()
    logging.getLogger("gepa").setLevel(logging.WARNING)
    adapter = Adapter(calls, strategy)
    seed_candidate = {COMPONENT: json.dumps(strategy.initial(), sort_keys=True)}
    result = gepa.optimize(seed_candidate=seed_candidate, trainset=list(train),
                           valset=list(val), adapter=adapter, max_metric_calls=budget,
                           seed=seed, display_progress_bar=False,
                           logger=_Quiet(), raise_on_exception=True)
    return adapter.render(result.best_candidate)


class _Quiet:
    """GEPA's logger protocol, silenced (its per-iteration lines are not the bench's)."""

    def log(self, *args, **kwargs) -> None:
        return None
