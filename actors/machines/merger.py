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

Optional rules for noisy models and wrong proposals, off by default (docs/concepts.md):
``screen`` scores each diff on its own evidence task before the gate, and conflicting
variants on a held-out minibatch; ``attribute`` looks for the diffs that hold a fused
commit back (actors/machines/attribution.py) and commits without them when that scores
higher (``harmful``); ``retire`` probes the head's own keys when a merge commits
nothing and deletes those whose removal scores higher (``retired``); ``recheck``
scores a close call a second time, the head too. An op of text ``REMOVE`` deletes its
key.

Scoring is work: an ``EvalRequest`` to the Scheduler, answered by ``EvalDone``. Scores
are cached per (candidate state, task set), so a candidate is not scored twice. The
cache is keyed by the candidate's content (a frozenset of its items, hashed once per
candidate), never by how it was reached: a state met again is answered from the cache.
Each task set's table keeps the ``cache_states`` states used most recently (trimmed
when a merge closes, never during one): memory follows the work in flight, not the
run's length, and a state met again after it was dropped is scored again.

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

import itertools
import logging
import operator
from dataclasses import dataclass, field

from actors.addresses import DRIVER, PLANNER, SCHEDULER, Out
from actors.machines.attribution import DELETE, Probe, without
from actors.machines.ids import tagged
from protocol import (REMOVE, Baseline, Barrier, Commit, Diff, EvalDone, EvalRequest, Finish, Flush,
                      LeaseDone, Merged, Message, Open, Refresh, RoundClosed, RunDone)

log = logging.getLogger(__name__)


STALENESS = ("full", "guarded", "reflective")
#: Async bucket for proposals (sync mode buckets them by round).
_ASYNC = -1

#: Proposals are merged in plan order: (unit, position in its lease).
_PLAN_ORDER = operator.itemgetter(0, 1)

#: When the fused candidate fails, halves are tried this many levels deep at most
#: (2 evals a level): a bounded search for the part of a round worth keeping.
MAX_BISECT_DEPTH = 4

#: A probe (attribution, retiring) scores on at most this many failing held-out tasks,
#: and makes at most this many evals of them (a control eval included).
PROBE_TASKS = 12
PROBE_EVALS = 24
#: With ``recheck``, a gain of at most this many held-out tasks is scored again.
RECHECK_TASKS = 3
#: The first element of the cache tables of second samples (``recheck``).
AGAIN = "#again"
#: With ``screen``, conflicting variants are compared on this many held-out tasks.
MINIBATCH = 16
#: Per-task held-out scores are kept for this many states (the most recent).
DETAIL_STATES = 256


def apply(state: dict[str, str], diffs: list[Diff]) -> dict[str, str]:
    """``state`` with ``diffs`` applied in order (an op of text ``REMOVE`` deletes)."""
    new = dict(state)
    for d in diffs:
        new.update(d.ops)
    if any(REMOVE in d.ops.values() for d in diffs):
        for key in [k for k, v in new.items() if v == REMOVE]:
            del new[key]
    return new


def _state_key(state: dict[str, str]) -> frozenset:
    """A state's identity for the score cache and duplicate detection: its items, in any
    order (a frozenset caches its hash, so a key is hashed once however often it is
    looked up)."""
    return frozenset(state.items())


#: The score cache keeps this many states per task set (held-out, or one evidence task),
#: the least recently used dropped first. A held-out table of 4,096 states of a 50-key
#: artifact is ~21 MB (measured with tracemalloc); a round scores a few dozen.
SCORE_CACHE_STATES = 4096

#: A cache miss (scores are floats; None is never stored, but this is explicit).
_MISSING = object()


def _changes(state: dict[str, str], ops: dict[str, str]) -> bool:
    """Whether applying ``ops`` to ``state`` changes anything (deleting a key the state
    does not hold changes nothing)."""
    for key, value in ops.items():
        if state.get(key, REMOVE) != value:
            return True
    return False


def conflict_groups(diffs: list[Diff]) -> tuple[list[Diff], list[list[Diff]]]:
    """Split diffs into (free, groups): a group is a connected set of diffs that write
    some key with different values. Order is preserved inside each list; groups come
    in the order of their first diff."""
    writers: dict[str, list[int]] = {}  # in order of each key's first writer
    single = True
    for i, d in enumerate(diffs):
        if len(d.ops) != 1:
            single = False
        for key in d.ops:
            idx = writers.get(key)
            if idx is None:
                writers[key] = [i]
            else:
                idx.append(i)
    clashes = [(key, idx) for key, idx in writers.items()
               if len(idx) > 1 and len({diffs[i].ops[key] for i in idx}) > 1]
    if not clashes:
        return list(diffs), []
    if single:
        # Every diff writes one key: a group is the writers of one key (no two groups
        # share a diff), already ordered by first writer and in order inside.
        taken = {i for _, idx in clashes for i in idx}
        return ([d for i, d in enumerate(diffs) if i not in taken],
                [[diffs[i] for i in idx] for _, idx in clashes])
    parent = list(range(len(diffs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    conflicted: set[int] = set()
    for _, idx in clashes:
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
    opkeys: dict[int, frozenset] = field(default_factory=dict)  # id(diff) -> its ops' key
    keys: dict[int, frozenset] = field(default_factory=dict)  # id(diff) -> head + diff's key
    waiting: set[str] = field(default_factory=set)
    fused: list[Diff] = field(default_factory=list)
    fused_state: dict[str, str] = field(default_factory=dict)
    fused_key: frozenset = frozenset()
    halves: list[list[Diff]] = field(default_factory=list)
    half_states: list[dict[str, str]] = field(default_factory=list)
    half_keys: list[frozenset] = field(default_factory=list)
    depth: int = 0
    verify: list[tuple[Diff, str]] = field(default_factory=list)
    screened: list[Diff] = field(default_factory=list)
    screen_keys: dict[int, tuple[tuple[str, ...], frozenset]] = field(default_factory=dict)
    # A probe (attribution of a commit's diffs, or retiring the head's keys).
    probe: Probe | None = None
    probe_kind: str = ""
    probe_keys: dict[int, frozenset] = field(default_factory=dict)
    cand: list[Diff] = field(default_factory=list)
    cand_state: dict[str, str] = field(default_factory=dict)
    cand_score: float = 0.0
    below: int = 0
    variant_tasks: list[str] | None = None
    recheck: tuple | None = None
    confirm_state: dict[str, str] = field(default_factory=dict)
    confirm_key: frozenset = frozenset()
    unscored: bool = False   # a budget refused some of its scoring (see _unscored)


class Merger:
    name = "merger"

    def __init__(self, *, asynchronous: bool = False, alpha: int = 3,
                 staleness: str = "guarded", stall_merges: int = 3,
                 cache_states: int = SCORE_CACHE_STATES, screen: bool = False,
                 attribute: bool = False, retire: bool = False,
                 probe_tasks: int = PROBE_TASKS, probe_evals: int = PROBE_EVALS,
                 recheck: bool = False) -> None:
        if staleness not in STALENESS:
            raise ValueError(f"staleness={staleness!r}: choose one of {', '.join(STALENESS)}")
        if isinstance(cache_states, bool) or not isinstance(cache_states, int) \
                or cache_states < 1:
            raise ValueError(f"cache_states must be an integer >= 1, got {cache_states!r}")
        self.cache_states = cache_states
        self.screen = screen
        self.attribute = attribute
        self.retire = retire
        self.recheck = recheck
        self._rechecked_at = -1
        self.probe_tasks = probe_tasks
        self.probe_evals = probe_evals
        # id(diff) -> (its evidence task, the rollout's score there) while it is held.
        self._evidence: dict[int, tuple[str, float | None]] = {}
        # Held-out per-task scores of the states scored lately: state key -> scores.
        self._detail: dict[frozenset, dict[str, float]] = {}
        self._retired_at = -1   # the head version a retire probe last ran on
        self._probes = 0
        self.merges_scored = 0
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
        # Scores: task ids -> state key -> score (the held-out table is looked up once).
        self.cache: dict[tuple[str, ...], dict[frozenset, float]] = {}
        self._over_cap: list[dict[frozenset, float]] = []   # tables to trim (_trim_cache)
        self._heldout_of: list[str] | None = None
        self._heldout_scores: dict[frozenset, float] = {}
        # The cache key of head + ops, per ops key, for the current head only.
        self._applied_to: dict[str, str] | None = None
        self._applied: dict[frozenset, frozenset] = {}
        self.by_eval: dict[str, tuple] = {}
        self.merge: _Merge | None = None
        self.n_evals = 0
        self.lease_key = ""  # Open.lease_key: eval ids a peer cannot guess (machines/ids.py)
        self.opened = False
        self.queued_barriers: list[int] = []

    # -- the machine ------------------------------------------------------------------

    def handle(self, msg: Message) -> list[Out]:
        match msg:
            case Open():
                self.heldout = list(msg.heldout_ids)
                self.state = dict(msg.initial_state)
                self.sections = dict(msg.sections) if msg.sections is not None else None
                self.lease_key = msg.lease_key
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
        sections = self.sections if msg.section is not None else None
        held = None
        unit = msg.unit
        for position, result in enumerate(msg.results):
            diff = result.diff
            if diff is None:
                continue
            if sections is not None:
                outside = [k for k in diff.ops if sections.get(k) != msg.section]
                if outside:
                    self._count(early, "section-violation")
                    continue
            if held is None:
                held = self.pending.setdefault(bucket, [])
            held.append((unit, position, diff, result.task_id))
            self._evidence[id(diff)] = (result.task_id, result.score)

    # -- evals ----------------------------------------------------------------------------

    def _scores(self, task_ids: list[str] | None) -> dict[frozenset, float]:
        """The score table of a task set: state key -> score (None: the held-out set)."""
        if task_ids is None:
            if self._heldout_of is not self.heldout:
                self._heldout_of = self.heldout
                self._heldout_scores = self.cache.setdefault(tuple(self.heldout), {})
            return self._heldout_scores
        return self.cache.setdefault(tuple(task_ids), {})

    def _request(self, tag: str, state: dict[str, str], task_ids: list[str] | None = None,
                 key: frozenset | None = None, again: bool = False) -> list[Out]:
        """Score ``state`` on ``task_ids`` (the held-out set by default); ``key`` is its
        :func:`_state_key` when the caller has it already. ``again``: a second sample,
        kept in a table of its own (the first score of the state is not reused)."""
        if again:
            scores = self.cache.setdefault((AGAIN,) + tuple(task_ids or self.heldout), {})
        else:
            scores = self._scores(task_ids)
        if task_ids is None:
            task_ids = self.heldout
        if key is None:
            key = _state_key(state)
        self.n_evals += 1  # a known score still takes an eval id (ids are in messages)
        score = scores.pop(key, _MISSING)
        if score is not _MISSING:
            scores[key] = score   # used again: last in line to be dropped (_trim_cache)
            # Known score: answer ourselves without asking anyone (no message needed).
            return self._scored(tag, score)
        eval_id = tagged(self.lease_key, f"e{self.n_evals}")
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
        if msg.unscored is not None:  # (the baseline: 0.0, not remembered as its score)
            return self._unscored(tag) if tag != "baseline" else self._scored(tag, 0.0)
        scores[key] = msg.score   # the only place a table grows
        if msg.scores and scores is self._scores(None):
            self._detail[key] = dict(msg.scores)
            if len(self._detail) > DETAIL_STATES:
                del self._detail[next(iter(self._detail))]
        if len(scores) > self.cache_states:
            self._over_cap.append(scores)
        return self._scored(tag, msg.score)

    def _unscored(self, tag) -> list[Out]:
        """A budget was spent before a candidate of this merge could be scored: nothing
        more of it is decided. Once the scores already asked for are back (their calls
        are counted), its undecided diffs are ``unscored-at-budget``."""
        m = self.merge
        if m is None:
            return []
        m.unscored = True
        m.waiting.discard(tag)
        return [] if m.waiting else self._close_unscored()

    def _close_unscored(self) -> list[Out]:
        m = self.merge
        undecided = {"variants": len(m.free) + sum(len(g) for g in m.groups),
                     "verify": len(m.verify) + len(m.fused)}.get(m.stage, len(m.fused))
        self._count(m.outcomes, "unscored-at-budget", undecided)
        return self._close(committed=False)

    def _scored(self, tag: str, score: float) -> list[Out]:
        if tag == "baseline":
            self.score = self.initial_score = score
            self.opened = True
            return [(PLANNER, Baseline(version=self.version, heldout_reward=score))]
        m = self.merge
        if m is None:
            return []
        m.waiting.discard(tag)
        if m.waiting:
            return []
        return self._close_unscored() if m.unscored else self._advance()

    # -- one round's merge -------------------------------------------------------------

    def _start(self, r: int) -> list[Out]:
        outcomes = self.early.pop(r, {})
        # Arrival order depends on thread timing; the plan's order does not.
        raw = [p[2] for p in sorted(self.pending.pop(r, []), key=_PLAN_ORDER)]
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
        seen: set[frozenset] = set()
        diffs: list[Diff] = []
        opkeys: dict[int, frozenset] = {}
        state = self.state
        # Counted once each after the loop, in the order each was first met (the order
        # of the keys of ``outcomes`` is part of the messages that carry it).
        dropped = {"duplicate": 0, "unchanged": 0}
        met: list[str] = []
        for d in raw:
            k = frozenset(d.ops.items())
            if k in seen:
                what = "duplicate"
            else:
                seen.add(k)
                if _changes(state, d.ops):
                    diffs.append(d)
                    opkeys[id(d)] = k
                    continue
                what = "unchanged"
            if not dropped[what]:
                met.append(what)
            dropped[what] += 1
        for what in met:
            self._count(outcomes, what, dropped[what])
        evidence = {id(d): self._evidence.pop(id(d), None) for d in raw}
        self.merge = _Merge(round=r, stage="screen", proposals=proposals, free=[],
                            groups=[], outcomes=outcomes, opkeys=opkeys)
        if not diffs:
            return self._no_commit()
        if self.screen:
            return self._screen(diffs, evidence)
        return self._variants(diffs)

    def _variants(self, diffs: list[Diff]) -> list[Out]:
        m = self.merge
        m.free, m.groups = conflict_groups(diffs)
        m.stage = "variants"
        if m.groups:
            return self._score_each([d for g in m.groups for d in g])
        return self._to_fused()

    def _screen(self, diffs: list[Diff],
                evidence: dict[int, tuple[str, float | None] | None]) -> list[Out]:
        """The cheap gate: each diff scored on its own evidence task (one call) on top of
        the head; only those that do better there than the rollout that proposed them go
        on to the held-out gate (the rest are ``screened-out``). A diff whose evidence
        is unknown goes on unscreened."""
        m = self.merge
        m.screened = diffs
        requests = []
        for d in diffs:
            ev = evidence.get(id(d))
            if ev is None or ev[1] is None:
                continue
            task_ids = (ev[0],)
            m.screen_keys[id(d)] = (task_ids, ev[1])
            requests.append((("s", id(d)), apply(self.state, [d]), list(task_ids)))
        m.waiting = {tag for tag, _, _ in requests}
        if not requests:
            return self._variants(diffs)
        out: list[Out] = []
        for tag, state, task_ids in requests:
            out += self._request(tag, state, task_ids)
        return out

    def _screen_done(self) -> list[Out]:
        m = self.merge
        keep = []
        for d in m.screened:
            known = m.screen_keys.get(id(d))
            if known is None:
                keep.append(d)
                continue
            task_ids, before = known
            after = self.cache[task_ids][_state_key(apply(self.state, [d]))]
            if after > before:
                keep.append(d)
            else:
                self._count(m.outcomes, "screened-out")
        if not keep:
            return self._no_commit()
        return self._variants(keep)

    def _score_each(self, diffs: list[Diff]) -> list[Out]:
        """Score each diff alone on top of the head (tagged by identity: diff ids are
        the proposer's business and need not be unique): on the held-out split, or with
        ``screen`` on a minibatch of it (the head scored there too), the winner of each
        group going on to the held-out gate inside the fused candidate."""
        m = self.merge
        out: list[Out] = []
        tasks = self._variant_tasks()
        m.variant_tasks = tasks
        scores = self._scores(tasks)
        task_ids = self.heldout if tasks is None else tasks
        # What _request does for each, inline: a known score needs no message; only the
        # unknown ones are waited for (the tag is the diff's id), and once every score is
        # known the merge goes on.
        for d in diffs:
            key = m.keys[id(d)] = self._candidate_key(d.ops, m.opkeys.get(id(d)))
            self.n_evals += 1  # a known score still takes an eval id (ids are in messages)
            if key in scores:
                continue
            eval_id = tagged(self.lease_key, f"e{self.n_evals}")
            m.waiting.add(id(d))
            self.by_eval[eval_id] = (id(d), scores, key)
            out.append((SCHEDULER, EvalRequest(eval_id=eval_id, state=apply(self.state, [d]),
                                               task_ids=task_ids)))
        if tasks is not None:
            m.waiting.add("head")
            return out + self._request("head", self.state, tasks)
        if not m.waiting:
            return out + self._advance()
        return out

    def _variant_tasks(self) -> list[str] | None:
        """The minibatch conflicting variants are compared on (None: the held-out split):
        ``MINIBATCH`` held-out tasks, a window that moves on each merge."""
        n = len(self.heldout)
        if not self.screen or n <= MINIBATCH:
            return None
        start = (self.merges_scored * MINIBATCH) % n
        self.merges_scored += 1
        window = (self.heldout + self.heldout)[start:start + MINIBATCH]
        return sorted(window)

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
            key = self._applied[ops_key] = _state_key(candidate)
        return key

    def _advance(self) -> list[Out]:
        m = self.merge
        if m.stage == "screen":
            return self._screen_done()
        if m.stage == "probe":
            return self._probe_scored()
        if m.stage == "confirm":
            return self._confirmed()
        if m.stage == "recheck":
            return self._rechecked()
        if m.stage == "verify":
            for diff, task_id in m.verify:
                scores = self.cache[(task_id,)]
                with_diff = scores[_state_key(apply(self.state, [diff]))]
                without = scores[_state_key(self.state)]
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
            scores, keys = self._scores(m.variant_tasks), m.keys
            bar = self.score if m.variant_tasks is None else scores[_state_key(self.state)]
            losers = below = 0
            for group in m.groups:
                best = group[0]
                best_score = scores[keys[id(best)]]
                for d in group[1:]:  # strictly better only: the first proposer wins ties
                    score = scores[keys[id(d)]]
                    if score > best_score:
                        best, best_score = d, score
                losers += len(group) - 1
                if best_score > bar:
                    winners.append(best)
                else:
                    below += 1
            # Counted once each; a group has two diffs or more, so "conflict" is met first.
            self._count(m.outcomes, "conflict", losers)
            self._count(m.outcomes, "below-threshold", below)
            m.free = m.free + winners
            if not m.free:
                return self._no_commit()
            return self._to_fused()
        if m.stage == "fused":
            score = self._scores(None)[m.fused_key]
            if score > self.score:
                return self._accept(m.fused, m.fused_state, m.fused_key, score)
            if len(m.fused) == 1:
                self._count(m.outcomes, "below-threshold")
                return self._no_commit()
            return self._bisect(m.fused)
        if m.stage == "bisect":
            scores = self._scores(None)
            scored = [(scores[m.half_keys[i]], i, half) for i, half in enumerate(m.halves)]
            # Highest score first; the first half wins an exact tie.
            score, i, best = max(scored, key=lambda t: (t[0], -t[1]))
            if score > self.score:
                return self._accept(best, m.half_states[i], m.half_keys[i], score,
                                    below=len(m.fused) - len(best))
            if len(best) == 1 or m.depth >= MAX_BISECT_DEPTH:
                self._count(m.outcomes, "below-threshold", len(m.fused))
                return self._no_commit()
            return self._bisect(best)
        raise AssertionError(f"merger in unknown stage {m.stage!r}")

    # -- attribution and retiring (actors/machines/attribution.py) ------------------------

    def _accept(self, diffs: list[Diff], state: dict[str, str], key: frozenset,
                score: float, below: int = 0) -> list[Out]:
        """``diffs`` fused into ``state`` beat the head: commit, or first look inside for
        diffs that hold it back (attribution) when there are several. With ``recheck``,
        a close call (a gain of ``RECHECK_TASKS`` held-out tasks or less) is scored
        once more, the head too, and decided on the means of the two samples."""
        m = self.merge
        if self.recheck and m.recheck is None and \
                score - self.score <= RECHECK_TASKS / max(1, len(self.heldout)):
            m.recheck = (diffs, state, key, score, below)
            m.stage = "recheck"
            m.waiting = {"again-c", "again-h"}
            return (self._request("again-c", state, key=key, again=True)
                    + self._request("again-h", self.state, again=True))
        units = []
        for d in diffs:
            units.append({k: self.state.get(k, DELETE) for k in d.ops})
        probe = self._probe(state, key, units) if self.attribute and len(diffs) > 1 else None
        if probe is None:
            self._count(m.outcomes, "committed", len(diffs))
            self._count(m.outcomes, "below-threshold", below)
            return self._commit(state, score)
        m.probe, m.probe_kind = probe, "attribute"
        m.cand, m.cand_state, m.cand_score = diffs, state, score
        m.below = below   # counted when the probe ends
        return self._probe_next()

    def _rechecked(self) -> list[Out]:
        m = self.merge
        diffs, state, key, score, below = m.recheck
        table = self.cache[(AGAIN,) + tuple(self.heldout)]
        cand = (score + table[key]) / 2
        if self._rechecked_at != self.version:   # the head's two samples, once a version
            self._rechecked_at = self.version
            self.score = (self.score + table[_state_key(self.state)]) / 2
        if cand > self.score:
            return self._accept(diffs, state, key, cand, below)
        self._count(m.outcomes, "rechecked-out", len(diffs))
        self._count(m.outcomes, "below-threshold", below)
        return self._no_commit()

    def _no_commit(self) -> list[Out]:
        """Nothing of this merge beats the head: close, or first try retiring the head's
        keys (once per head version)."""
        m = self.merge
        if not (self.retire and m is not None and m.probe is None
                and self._retired_at != self.version and self.state):
            return self._close(committed=False)
        self._retired_at = self.version
        key = _state_key(self.state)
        units = [{k: DELETE} for k in sorted(self.state)]
        probe = self._probe(self.state, key, units)
        if probe is None:
            return self._close(committed=False)
        m.probe, m.probe_kind = probe, "retire"
        m.cand_state, m.cand_score = self.state, self.score
        return self._probe_next()

    def _probe(self, base: dict[str, str], key: frozenset,
               units: list[dict[str, str | None]]) -> Probe | None:
        """A probe of ``base`` on its failing held-out tasks (None: its per-task scores
        are not known, or it fails none)."""
        detail = self._detail.get(key)
        if not detail:
            return None
        # Regressions first (tasks the head does better on), then the other failing
        # tasks, rotated from one probe to the next so that probes look at new ones.
        head = self._detail.get(_state_key(self.state), {})
        failing = sorted((score - head.get(task, score), task)
                         for task, score in detail.items() if score < 1.0)
        regressions = [task for gap, task in failing if gap < 0]
        rest = [task for gap, task in failing if gap >= 0]
        if rest:
            turn = (self._probes * self.probe_tasks) % len(rest)
            rest = rest[turn:] + rest[:turn]
        self._probes += 1
        tasks = (regressions + rest)[:self.probe_tasks]
        if not tasks:
            return None
        margin = 0.5 / len(tasks)
        return Probe(base=base, units=units, tasks=sorted(tasks), base_score=-1.0,
                     margin=margin, max_evals=self.probe_evals)

    def _probe_next(self) -> list[Out]:
        m = self.merge
        probe = m.probe
        m.stage = "probe"
        batch = probe.batch()
        if probe.base_score < 0 and batch:
            batch = [(-1, probe.base)] + batch   # a control: the base itself, fresh
        if not batch:
            return self._probe_done()
        m.probe_keys = {i: _state_key(state) for i, state in batch}
        m.waiting = {("p", i) for i, _ in batch}
        out: list[Out] = []
        for i, state in batch:
            out += self._request(("p", i), state, probe.tasks, key=m.probe_keys[i])
        return out

    def _probe_scored(self) -> list[Out]:
        m = self.merge
        probe = m.probe
        scores = self._scores(probe.tasks)
        for i, key in m.probe_keys.items():
            if i < 0:
                probe.base_score = scores[key]
                probe.evals += 1
            else:
                probe.scored(i, scores[key])
        probe.step()
        return self._probe_next()

    def _probe_done(self) -> list[Out]:
        m = self.merge
        probe = m.probe
        if not probe.flagged:
            return self._probe_end(None)
        m.confirm_state = without(probe.base, [probe.units[i] for i in probe.flagged])
        m.confirm_key = _state_key(m.confirm_state)
        m.stage = "confirm"
        m.waiting = {"confirm"}
        return self._request("confirm", m.confirm_state, key=m.confirm_key)

    def _confirmed(self) -> list[Out]:
        m = self.merge
        score = self._scores(None)[m.confirm_key]
        return self._probe_end(score if score > m.cand_score else None)

    def _probe_end(self, better: float | None) -> list[Out]:
        """Keep the probed candidate, or its version without the flagged units when
        that scored higher on the held-out split."""
        m = self.merge
        flagged = m.probe.flagged if better is not None else []
        if m.probe_kind == "retire":
            if not flagged:
                return self._close(committed=False)
            self._count(m.outcomes, "retired", len(flagged))
            return self._commit(m.confirm_state, better)
        self._count(m.outcomes, "committed", len(m.cand) - len(flagged))
        self._count(m.outcomes, "harmful", len(flagged))
        self._count(m.outcomes, "below-threshold", m.below)
        if flagged:
            return self._commit(m.confirm_state, better)
        return self._commit(m.cand_state, m.cand_score)

    def _bisect(self, diffs: list[Diff]) -> list[Out]:
        """Score both halves of ``diffs`` (in plan order) on top of the head."""
        m = self.merge
        m.stage = "bisect"
        m.depth += 1
        mid = (len(diffs) + 1) // 2
        m.halves = [diffs[:mid], diffs[mid:]]
        m.half_states = [apply(self.state, half) for half in m.halves]
        m.half_keys = [_state_key(s) for s in m.half_states]
        m.waiting = {"h0", "h1"}
        return (self._request("h0", m.half_states[0], key=m.half_keys[0])
                + self._request("h1", m.half_states[1], key=m.half_keys[1]))

    def _to_fused(self) -> list[Out]:
        m = self.merge
        m.stage = "fused"
        m.fused = list(m.free)
        m.fused_state = apply(self.state, m.fused)
        m.fused_key = _state_key(m.fused_state)
        m.waiting = {"fused"}
        return self._request("fused", m.fused_state, key=m.fused_key)

    def _commit(self, state: dict[str, str], score: float) -> list[Out]:
        self.version += 1
        self.state = state
        self.score = score
        return [(SCHEDULER, Commit(version=self.version, state=state))] + self._close(True)

    def _close(self, committed: bool) -> list[Out]:
        m = self.merge
        self.merge = None
        self._trim_cache()
        if self._evidence:   # only the diffs still held keep theirs (stale ones go)
            held = {id(p[2]) for bucket in self.pending.values() for p in bucket}
            self._evidence = {k: v for k, v in self._evidence.items() if k in held}
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
