"""The Merger: owns the artifact's version history and the acceptance statistics.
A pure state machine.

The merge of one round (every decision is counted in ``outcomes``):

1. identical diffs collapse (``duplicate``); diffs that change nothing are dropped
   (``unchanged``); with tensor parallelism, a diff touching a key outside its
   proposer's section is rejected on arrival (``section-violation``);
2. diffs that write the same key with different values conflict: each is scored on
   the held-out tasks on top of the head, the best one stays in, the rest are
   ``conflict`` (the first proposer wins an exact tie);
3. the survivors are fused into one candidate and scored; it is committed only if it
   strictly beats the head (an exact tie is never accepted);
4. if the fused candidate does not beat the head and it held several diffs, its two
   halves (in plan order) are scored; the better half is committed if it strictly
   beats the head, else the search goes on inside the better half, at most
   ``MAX_BISECT_DEPTH`` levels (two evals a level, so a bad round costs a bounded
   number of held-out evaluations however many diffs it held); everything not
   committed is ``below-threshold``.

Scoring is work: an ``EvalRequest`` to the Scheduler, answered by ``EvalDone``. Scores
are cached per candidate state, so a candidate is never scored twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from actors.addresses import DRIVER, PLANNER, SCHEDULER
from protocol import (Baseline, Barrier, Commit, Diff, EvalDone, EvalRequest, Finish,
                      LeaseDone, Message, Open, RoundClosed, RunDone)

log = logging.getLogger(__name__)

Out = tuple[str, Message]

#: When the fused candidate fails, halves are tried this many levels deep at most
#: (2 evals a level): a bounded search for the part of a round worth keeping.
MAX_BISECT_DEPTH = 4


def apply(state: dict[str, str], diffs: list[Diff]) -> dict[str, str]:
    new = dict(state)
    for d in diffs:
        new.update(d.ops)
    return new


def _state_key(state: dict[str, str]) -> tuple:
    return tuple(sorted(state.items()))


def conflict_groups(diffs: list[Diff]) -> tuple[list[Diff], list[list[Diff]]]:
    """Split diffs into (free, groups): a group is a connected set of diffs that write
    some key with different values. Order is preserved inside each list."""
    parent = list(range(len(diffs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    writers: dict[str, list[int]] = {}
    for i, d in enumerate(diffs):
        for key in d.ops:
            writers.setdefault(key, []).append(i)
    conflicted: set[int] = set()
    for key, idx in writers.items():
        if len({diffs[i].ops[key] for i in idx}) > 1:
            conflicted.update(idx)
            for i in idx[1:]:
                parent[find(i)] = find(idx[0])
    free = [d for i, d in enumerate(diffs) if i not in conflicted]
    groups: dict[int, list[Diff]] = {}
    for i in sorted(conflicted):
        groups.setdefault(find(i), []).append(diffs[i])
    return free, list(groups.values())


@dataclass
class _Merge:
    round: int
    stage: str
    proposals: int
    free: list[Diff]
    groups: list[list[Diff]]
    outcomes: dict[str, int]
    candidates: dict[int, dict[str, str]] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)
    fused: list[Diff] = field(default_factory=list)
    halves: list[list[Diff]] = field(default_factory=list)
    depth: int = 0


class Merger:
    name = "merger"

    def __init__(self) -> None:
        self.version = 0
        self.state: dict[str, str] = {}
        self.score = 0.0
        self.initial_score = 0.0
        self.heldout: list[str] = []
        self.sections: dict[str, int] | None = None
        self.pending: dict[int, list[tuple[int, int, Diff]]] = {}
        self.early: dict[int, dict[str, int]] = {}
        self.outcomes: dict[str, int] = {}
        self.cache: dict[tuple, float] = {}
        self.by_eval: dict[str, tuple] = {}
        self.merge: _Merge | None = None
        self.n_evals = 0
        self.opened = False
        self.queued_barriers: list[int] = []

    # -- the machine ------------------------------------------------------------------

    def handle(self, msg: Message) -> list[Out]:
        match msg:
            case Open():
                self.heldout = list(msg.heldout_ids)
                self.state = dict(msg.initial_state)
                self.sections = dict(msg.sections) if msg.sections is not None else None
                return self._request("baseline", self.state)
            case LeaseDone():
                self._on_proposals(msg)
                return []
            case Barrier(round=r):
                if self.merge is not None:
                    self.queued_barriers.append(r)
                    return []
                return self._start(r)
            case EvalDone():
                return self._on_eval(msg)
            case Finish():
                return self._finish(msg)
            case _:
                log.warning("merger: unexpected %s", type(msg).__name__)
                return []

    def _count(self, outcomes: dict[str, int], what: str, n: int = 1) -> None:
        if n:
            outcomes[what] = outcomes.get(what, 0) + n
            self.outcomes[what] = self.outcomes.get(what, 0) + n

    def _on_proposals(self, msg: LeaseDone) -> None:
        early = self.early.setdefault(msg.round, {})
        for position, result in enumerate(msg.results):
            diff = result.diff
            if diff is None:
                continue
            if self.sections is not None and msg.section is not None:
                outside = [k for k in diff.ops if self.sections.get(k) != msg.section]
                if outside:
                    self._count(early, "section-violation")
                    continue
            self.pending.setdefault(msg.round, []).append((msg.unit, position, diff))

    # -- evals ----------------------------------------------------------------------------

    def _request(self, tag: str, state: dict[str, str]) -> list[Out]:
        key = _state_key(state)
        self.n_evals += 1
        eval_id = f"e{self.n_evals}"
        self.by_eval[eval_id] = (tag, key)
        if key in self.cache:
            # Known score: answer ourselves without asking anyone (no message needed).
            return self._on_eval(EvalDone(eval_id=eval_id, score=self.cache[key]))
        return [(SCHEDULER, EvalRequest(eval_id=eval_id, state=state, task_ids=self.heldout))]

    def _on_eval(self, msg: EvalDone) -> list[Out]:
        tag, key = self.by_eval.pop(msg.eval_id, (None, None))
        if tag is None:
            return []
        self.cache[key] = msg.score
        if tag == "baseline":
            self.score = self.initial_score = msg.score
            self.opened = True
            return [(PLANNER, Baseline(version=self.version, heldout_reward=msg.score))]
        m = self.merge
        if m is None:
            return []
        m.waiting.discard(tag)
        if m.waiting:
            return []
        return self._advance()

    # -- one round's merge -------------------------------------------------------------

    def _start(self, r: int) -> list[Out]:
        outcomes = self.early.pop(r, {})
        # Arrival order depends on thread timing; the plan's order does not.
        raw = [d for _, _, d in sorted(self.pending.pop(r, []), key=lambda p: p[:2])]
        proposals = len(raw) + outcomes.get("section-violation", 0)
        seen: set[tuple] = set()
        diffs: list[Diff] = []
        for d in raw:
            k = _state_key(d.ops)
            if k in seen:
                self._count(outcomes, "duplicate")
                continue
            seen.add(k)
            if all(self.state.get(key) == value for key, value in d.ops.items()):
                self._count(outcomes, "unchanged")
                continue
            diffs.append(d)
        free, groups = conflict_groups(diffs)
        self.merge = _Merge(round=r, stage="variants", proposals=proposals, free=free,
                            groups=groups, outcomes=outcomes)
        if not diffs:
            return self._close(committed=False)
        if groups:
            return self._score_each([d for g in groups for d in g])
        return self._to_fused()

    def _score_each(self, diffs: list[Diff]) -> list[Out]:
        """Score each diff alone on top of the head (tagged by identity: diff ids are
        the proposer's business and need not be unique)."""
        m = self.merge
        out: list[Out] = []
        m.candidates = {id(d): apply(self.state, [d]) for d in diffs}
        m.waiting.update(f"c{id(d)}" for d in diffs)
        for d in diffs:
            out += self._request(f"c{id(d)}", m.candidates[id(d)])
        return out

    def _cached(self, state: dict[str, str]) -> float:
        return self.cache[_state_key(state)]

    def _advance(self) -> list[Out]:
        m = self.merge
        if m.stage == "variants":
            winners = []
            for group in m.groups:
                best = max(group, key=lambda d: self._cached(m.candidates[id(d)]))
                best_score = self._cached(m.candidates[id(best)])
                # max() returns the first of equal scores: the first proposer wins ties.
                self._count(m.outcomes, "conflict", len(group) - 1)
                if best_score > self.score:
                    winners.append(best)
                else:
                    self._count(m.outcomes, "below-threshold")
            m.free = m.free + winners
            if not m.free:
                return self._close(committed=False)
            return self._to_fused()
        if m.stage == "fused":
            fused_state = apply(self.state, m.fused)
            score = self._cached(fused_state)
            if score > self.score:
                self._count(m.outcomes, "committed", len(m.fused))
                return self._commit(fused_state, score)
            if len(m.fused) == 1:
                self._count(m.outcomes, "below-threshold")
                return self._close(committed=False)
            return self._bisect(m.fused)
        if m.stage == "bisect":
            scored = [(self._cached(apply(self.state, half)), i, half)
                      for i, half in enumerate(m.halves)]
            # Highest score first; the first half wins an exact tie.
            score, _, best = max(scored, key=lambda t: (t[0], -t[1]))
            if score > self.score:
                self._count(m.outcomes, "committed", len(best))
                self._count(m.outcomes, "below-threshold", len(m.fused) - len(best))
                return self._commit(apply(self.state, best), score)
            if len(best) == 1 or m.depth >= MAX_BISECT_DEPTH:
                self._count(m.outcomes, "below-threshold", len(m.fused))
                return self._close(committed=False)
            return self._bisect(best)
        raise AssertionError(f"merger in unknown stage {m.stage!r}")

    def _bisect(self, diffs: list[Diff]) -> list[Out]:
        """Score both halves of ``diffs`` (in plan order) on top of the head."""
        m = self.merge
        m.stage = "bisect"
        m.depth += 1
        mid = (len(diffs) + 1) // 2
        m.halves = [diffs[:mid], diffs[mid:]]
        m.waiting = {"h0", "h1"}
        return (self._request("h0", apply(self.state, m.halves[0]))
                + self._request("h1", apply(self.state, m.halves[1])))

    def _to_fused(self) -> list[Out]:
        m = self.merge
        m.stage = "fused"
        m.fused = list(m.free)
        m.waiting = {"fused"}
        return self._request("fused", apply(self.state, m.fused))

    def _commit(self, state: dict[str, str], score: float) -> list[Out]:
        self.version += 1
        self.state = state
        self.score = score
        return [(SCHEDULER, Commit(version=self.version, state=state))] + self._close(True)

    def _close(self, committed: bool) -> list[Out]:
        m = self.merge
        self.merge = None
        out: list[Out] = [(PLANNER, RoundClosed(round=m.round, version=self.version,
                                                committed=committed, heldout_reward=self.score,
                                                proposals=m.proposals, outcomes=m.outcomes))]
        if self.queued_barriers:
            out += self._start(self.queued_barriers.pop(0))
        return out

    def _finish(self, msg: Finish) -> list[Out]:
        outcomes = dict(self.outcomes)
        if msg.backend_errors:
            outcomes["rollout-error"] = msg.backend_errors
        return [(DRIVER, RunDone(stop_reason=msg.stop_reason, version=self.version,
                                 state=self.state, final_reward=self.score,
                                 initial_reward=self.initial_score, history=msg.history,
                                 outcomes=outcomes, rollouts=msg.rollouts, calls=msg.calls,
                                 error=msg.error, fatal=msg.fatal))]
