"""The Merger's score tables: what a candidate state scored on a task set, asked for
once and answered from the table when the same state is met again. Pure (a mixin of
actors/machines/merger.py; it reads and writes the Merger's fields).

Scores are cached per (candidate state, task set): a frozenset of the state's items,
hashed once per candidate, so a state met again is answered from the table however it
was reached. Each task set's table keeps the ``cache_states`` states used most
recently (trimmed when a merge closes, never during one). Per-task held-out scores are
kept for the ``DETAIL_STATES`` states scored last (the probes and the sequential gate
read them).
"""

from __future__ import annotations

import itertools
import math

from actors.addresses import PLANNER, SCHEDULER, Out
from actors.machines.candidates import state_key
from actors.machines.ids import tagged
from actors.machines.reuse import mean_in_id_order
from protocol import REMOVE, Baseline, EvalDone, EvalRequest

#: The score cache keeps this many states per task set (held-out, or one evidence task),
#: the least recently used dropped first. A held-out table of 4,096 states of a 50-key
#: artifact is ~21 MB (measured with tracemalloc); a round scores a few dozen.
SCORE_CACHE_STATES = 4096

#: A cache miss (scores are floats; None is never stored, but this is explicit).
_MISSING = object()


#: The first element of the cache tables of second samples (``recheck``).
AGAIN = "#again"
#: Per-task held-out scores are kept for this many states (the most recent).
DETAIL_STATES = 256


#: The noise test trusts its estimate of the reward noise once it rests on this many
#: repeated samples (degrees of freedom); before, a candidate needs only beat the head.
NOISE_MIN_DF = 20
#: With the noise test on, the head is scored afresh after this many merges in a row
#: that committed nothing (its one score may be a lucky one).
RESCORE_AFTER = 2


class NoiseMeter:
    """The reward noise of the model, from repeated samples of the same (state, task):
    the pooled within-pair variance (each (state, task) sampled ``k`` times adds
    ``k - 1`` degrees of freedom). Only samples drawn whatever their outcome count (a
    task probed because it failed once would overstate the noise). Pure."""

    def __init__(self, max_keys: int = 4096) -> None:
        self.max_keys = max_keys
        self.sum_sq = 0.0     # the sum of squared deviations from each pair's mean
        self.df = 0
        self._seen: dict[tuple, tuple[int, float]] = {}   # (state, task) -> (n, mean)

    def add(self, key, task: str, score: float) -> None:
        n, mean = self._seen.pop((key, task), (0, 0.0))
        if n:
            new_mean = mean + (score - mean) / (n + 1)
            self.sum_sq += (score - mean) * (score - new_mean)
            self.df += 1
            mean = new_mean
        else:
            mean = score
        self._seen[(key, task)] = (n + 1, mean)
        if len(self._seen) > self.max_keys:
            del self._seen[next(iter(self._seen))]

    def noisy(self) -> bool:
        """Whether some (state, task) was seen to score differently twice (the model is
        noisy, however few repeats there are yet)."""
        return self.sum_sq > 0

    def variance(self) -> float | None:
        """The variance of one sample of a (state, task) (None: too few repeats yet)."""
        if self.df < NOISE_MIN_DF:
            return None
        return self.sum_sq / self.df


class ScoreTables:
    """Asking for scores and remembering them (mixed into the Merger)."""

    def _scores(self, task_ids: list[str] | None) -> dict[frozenset, float]:
        """The score table of a task set: state key -> score (None: the held-out set)."""
        if task_ids is None:
            if self._heldout_of is not self.heldout:
                self._heldout_of = self.heldout
                self._heldout_scores = self.cache.setdefault(tuple(self.heldout), {})
            return self._heldout_scores
        return self.cache.setdefault(tuple(task_ids), {})

    def _request(self, tag: str, state: dict[str, str], task_ids: list[str] | None = None,
                 key: frozenset | None = None, again: bool = False,
                 fresh: bool = False) -> list[Out]:
        """Score ``state`` on ``task_ids`` (the held-out set by default); ``key`` is its
        :func:`~actors.machines.candidates.state_key` when the caller has it already. ``again``: a second sample,
        kept in a table of its own (the first score of the state is not reused).
        ``fresh``: asked for even when the table knows it (a new sample, per task)."""
        if again:
            scores = self.cache.setdefault((AGAIN,) + tuple(task_ids or self.heldout), {})
        else:
            scores = self._scores(task_ids)
        if task_ids is None:
            task_ids = self.heldout
        if key is None:
            key = state_key(state)
        self.n_evals += 1  # a known score still takes an eval id (ids are in messages)
        score = _MISSING if fresh else scores.pop(key, _MISSING)
        if score is not _MISSING:
            scores[key] = score   # used again: last in line to be dropped (_trim_cache)
            # Known score: answer ourselves without asking anyone (no message needed).
            return self._scored(tag, score)
        eval_id = tagged(self.lease_key, f"e{self.n_evals}")
        if self.pairs is not None:   # a deterministic model (actors/machines/reuse.py)
            known, task_ids = self.pairs.split(key, task_ids)
            if not task_ids:
                scores[key] = score = mean_in_id_order(known)
                return self._scored(tag, score)
            if known:
                self._known[eval_id] = known
        self.by_eval[eval_id] = (tag, scores, key)
        return [(SCHEDULER, EvalRequest(eval_id=eval_id, state=state, task_ids=task_ids))]

    def _trim_cache(self) -> None:
        """Drop the least recently used states of each task set's table beyond
        ``cache_states``. Only between merges: a merge reads back the scores it asked for.
        Only the tables that went over since the last trim are looked at (there is one
        per evidence task in async mode)."""
        cap = self.cache_states
        for scores in self._over_cap:
            excess = len(scores) - cap
            if excess > 0:   # (a table listed twice is trimmed once)
                for key in list(itertools.islice(scores, excess)):
                    del scores[key]
        self._over_cap.clear()

    def _on_eval(self, msg: EvalDone) -> list[Out]:
        pending = self.by_eval.pop(msg.eval_id, None)
        if pending is None:
            return []
        tag, scores, key = pending
        if self.pairs is not None:
            msg = self.pairs.answer(key, msg, self._known.pop(msg.eval_id, None))
        if msg.unscored is not None:  # (the baseline: 0.0, not remembered as its score)
            return self._unscored(tag) if tag != "baseline" else self._scored(tag, 0.0)
        if tag == "baseline" and msg.failed is not None:
            # Every call failed: no score to remember; the Planner halts the run, and a
            # resume opens the Merger again (the baseline is asked for anew).
            return [(PLANNER, Baseline(version=self.version, heldout_reward=0.0,
                                       failed=msg.failed, errors=msg.errors))]
        scores[key] = msg.score   # the only place a table grows
        if self.merge is not None and (tag in ("control", "rescore", "cross") or (
                isinstance(tag, tuple) and tag[0] in ("loo", "ub", "xl"))):
            self.merge.per_task[tag] = dict(msg.scores)
        if msg.scores and scores is self._scores(None):
            self._detail[key] = dict(msg.scores)
        elif msg.scores and isinstance(tag, tuple) and tag[0] in ("first", "rest"):
            self._detail.setdefault(key, {}).update(msg.scores)   # a sequential gate's part
        if len(self._detail) > DETAIL_STATES:
            del self._detail[next(iter(self._detail))]
        if len(scores) > self.cache_states:
            self._over_cap.append(scores)
        return self._scored(tag, msg.score)

    def _scores_again(self) -> dict[frozenset, float]:
        """The table of second samples on the held-out split (``recheck``, rescoring)."""
        return self.cache.setdefault((AGAIN,) + tuple(self.heldout), {})

    def _beats(self, score: float | None) -> bool:
        """Whether a candidate's held-out score beats the head's: strictly, and with the
        noise test (``noise_z`` > 0) by more than ``noise_z`` standard errors of the
        difference, the noise estimated from repeated samples (:class:`NoiseMeter`;
        until there are enough of them, strictly is enough). The head's score is the
        mean of its ``head_samples``."""
        if score is None or score <= self.score:
            return False
        var = self.noise.variance() if self.noise_z > 0 else None
        if not var:
            return True
        n = max(1, len(self.heldout))
        se = math.sqrt(var / n * (1.0 + 1.0 / self.head_samples))
        return score - self.score > self.noise_z * se

    def _candidate_key(self, ops: dict[str, str], ops_key: frozenset | None) -> frozenset:
        """The cache key of the head with ``ops`` applied, remembered per ``ops`` until
        the head changes (the same diffs come back round after round)."""
        if self._applied_to is not self.state or len(self._applied) > 4096:
            self._applied_to = self.state  # a new head (Open, a commit): never mutated
            self._applied = {}
        if ops_key is None:
            ops_key = frozenset(ops.items())
        key = self._applied.get(ops_key)
        if key is None:
            candidate = dict(self.state)
            candidate.update(ops)
            if REMOVE in ops.values():
                for k in [k for k, v in ops.items() if v == REMOVE]:
                    del candidate[k]
            key = self._applied[ops_key] = state_key(candidate)
        return key
