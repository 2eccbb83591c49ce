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
are cached per (candidate state, task set), so a candidate is never scored twice.

Asynchronous mode: there is no barrier. Whenever the Merger is idle and holds
proposals, it merges all of them (the batch trigger). A proposal made ``eta``
versions behind the head meets the staleness policy first (tolerance ``alpha``):

| policy | eta = 0 | 0 < eta <= alpha | eta > alpha |
|---|---|---|---|
| ``full`` | keep | keep | keep |
| ``guarded`` | keep | re-verify | discard (``stale``) |
| ``reflective`` | keep | re-verify | re-verify |

Re-verifying scores the head with and without the diff on the diff's own evidence
task (work sent to workers); a diff that does not strictly help there is discarded
(``stale-rejected``). After ``stall_merges`` merges in a row that commit nothing, the
Merger asks the Scheduler to refresh every worker (``Refresh``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from actors.addresses import DRIVER, PLANNER, SCHEDULER
from protocol import (Baseline, Barrier, Commit, Diff, EvalDone, EvalRequest, Finish, Flush,
                      LeaseDone, Merged, Message, Open, Refresh, RoundClosed, RunDone)

log = logging.getLogger(__name__)

Out = tuple[str, Message]

STALENESS = ("full", "guarded", "reflective")
#: Async bucket for proposals (sync mode buckets them by round).
_ASYNC = -1

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
    verify: list[tuple[Diff, str]] = field(default_factory=list)


class Merger:
    name = "merger"

    def __init__(self, *, asynchronous: bool = False, alpha: int = 3,
                 staleness: str = "guarded", stall_merges: int = 3) -> None:
        if staleness not in STALENESS:
            raise ValueError(f"staleness={staleness!r}: choose one of {', '.join(STALENESS)}")
        self.asynchronous = asynchronous
        self.alpha = alpha
        self.staleness = staleness
        self.stall_merges = stall_merges
        self.merges = 0
        self.without_commit = 0
        self.flushing = False
        self.stats: dict[str, float] = {"reverified": 0, "stall_refreshes": 0,
                                        "max_eta_kept": 0}
        self.version = 0
        self.state: dict[str, str] = {}
        self.score = 0.0
        self.initial_score = 0.0
        self.heldout: list[str] = []
        self.sections: dict[str, int] | None = None
        self.pending: dict[int, list[tuple[int, int, Diff, str]]] = {}
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
                if self.asynchronous and self.merge is None and (
                        self.pending.get(_ASYNC) or self.early.get(_ASYNC)):
                    return self._start_async()
                return []
            case Flush(merge=merge):
                self.flushing = True
                if not merge:
                    self._drop_unmerged()
                if self.merge is None:
                    return self._start_async()
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
        bucket = _ASYNC if self.asynchronous else msg.round
        early = self.early.setdefault(bucket, {})
        for position, result in enumerate(msg.results):
            diff = result.diff
            if diff is None:
                continue
            if self.sections is not None and msg.section is not None:
                outside = [k for k in diff.ops if self.sections.get(k) != msg.section]
                if outside:
                    self._count(early, "section-violation")
                    continue
            self.pending.setdefault(bucket, []).append((msg.unit, position, diff, result.task_id))

    # -- evals ----------------------------------------------------------------------------

    def _request(self, tag: str, state: dict[str, str],
                 task_ids: list[str] | None = None) -> list[Out]:
        task_ids = self.heldout if task_ids is None else task_ids
        key = (_state_key(state), tuple(task_ids))
        self.n_evals += 1
        eval_id = f"e{self.n_evals}"
        self.by_eval[eval_id] = (tag, key)
        if key in self.cache:
            # Known score: answer ourselves without asking anyone (no message needed).
            return self._on_eval(EvalDone(eval_id=eval_id, score=self.cache[key]))
        return [(SCHEDULER, EvalRequest(eval_id=eval_id, state=state, task_ids=task_ids))]

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
        raw = [p[2] for p in sorted(self.pending.pop(r, []), key=lambda p: p[:2])]
        return self._merge(r, raw, outcomes, len(raw) + outcomes.get("section-violation", 0))

    def _drop_unmerged(self) -> None:
        """Out of time: what is still held is counted, not merged."""
        held = self.pending.pop(_ASYNC, [])
        early = self.early.pop(_ASYNC, {})
        for what, n in early.items():
            self._count({}, what, n)
        self._count({}, "unmerged-at-stop", len(held))

    def _start_async(self) -> list[Out]:
        """Take every proposal held (in arrival order: the log's order) and merge it."""
        outcomes = self.early.pop(_ASYNC, {})
        held = self.pending.pop(_ASYNC, [])
        proposals = len(held) + outcomes.get("section-violation", 0)
        r = self.merges
        self.merges += 1
        out: list[Out] = [(SCHEDULER, Merged(consumed=proposals, version=self.version))] \
            if proposals else []
        keep, verify = [], []
        for _, _, diff, task_id in held:
            eta = self.version - diff.base_version
            if eta <= 0 or self.staleness == "full":
                keep.append(diff)
                self.stats["max_eta_kept"] = max(self.stats["max_eta_kept"], eta)
            elif self.staleness == "guarded" and eta > self.alpha:
                self._count(outcomes, "stale")
            else:
                verify.append((diff, task_id))
        self.merge = _Merge(round=r, stage="verify", proposals=proposals, free=[], groups=[],
                            outcomes=outcomes)
        self.merge.fused = keep
        if not verify:
            return out + self._merge_kept()
        self.merge.verify = verify
        self.merge.waiting = set()
        requests: list[Out] = []
        for diff, task_id in verify:
            self.merge.waiting.update({f"v{id(diff)}", f"b{id(diff)}"})
        for diff, task_id in verify:
            requests += self._request(f"v{id(diff)}", apply(self.state, [diff]), [task_id])
            requests += self._request(f"b{id(diff)}", self.state, [task_id])
        return out + requests

    def _merge_kept(self) -> list[Out]:
        m = self.merge
        self.merge = None
        return self._merge(m.round, m.fused, m.outcomes, m.proposals)

    def _merge(self, r: int, raw: list[Diff], outcomes: dict[str, int],
               proposals: int) -> list[Out]:
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
        return self.cache[(_state_key(state), tuple(self.heldout))]

    def _advance(self) -> list[Out]:
        m = self.merge
        if m.stage == "verify":
            for diff, task_id in m.verify:
                with_diff = self.cache[(_state_key(apply(self.state, [diff])), (task_id,))]
                without = self.cache[(_state_key(self.state), (task_id,))]
                if with_diff > without:
                    m.fused.append(diff)
                    self.stats["reverified"] += 1
                    eta = self.version - diff.base_version
                    self.stats["max_eta_kept"] = max(self.stats["max_eta_kept"], eta)
                else:
                    self._count(m.outcomes, "stale-rejected")
            return self._merge_kept()
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
        if not self.asynchronous:
            out: list[Out] = [(PLANNER, RoundClosed(
                round=m.round, version=self.version, committed=committed,
                heldout_reward=self.score, proposals=m.proposals, outcomes=m.outcomes))]
            if self.queued_barriers:
                out += self._start(self.queued_barriers.pop(0))
            return out
        out = []
        if m.proposals and not committed:
            self.without_commit += 1
            if self.without_commit >= self.stall_merges:
                # Stall guard: merges keep committing nothing while proposals arrive.
                self.without_commit = 0
                self.stats["stall_refreshes"] += 1
                out.append((SCHEDULER, Refresh(reason="stall")))
        elif committed:
            self.without_commit = 0
        more = bool(self.pending.get(_ASYNC) or self.early.get(_ASYNC))
        final = self.flushing and not more
        out.append((PLANNER, RoundClosed(round=m.round, version=self.version, committed=committed,
                                         heldout_reward=self.score, proposals=m.proposals,
                                         outcomes=m.outcomes, final=final)))
        if more:
            out += self._start_async()
        return out

    def _finish(self, msg: Finish) -> list[Out]:
        outcomes = dict(self.outcomes)
        if msg.backend_errors:
            outcomes["rollout-error"] = msg.backend_errors
        return [(DRIVER, RunDone(stop_reason=msg.stop_reason, version=self.version,
                                 state=self.state, final_reward=self.score,
                                 initial_reward=self.initial_score, history=msg.history,
                                 outcomes=outcomes, rollouts=msg.rollouts, calls=msg.calls,
                                 error=msg.error, fatal=msg.fatal, stats=dict(self.stats)))]
