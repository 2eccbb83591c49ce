"""The Merger: owns the artifact's version history and the acceptance statistics.
A pure state machine.

The merge of one round (every decision is counted in ``outcomes``):

1. identical diffs collapse (``duplicate``); diffs that change nothing are dropped
   (``unchanged``); with tensor parallelism, a diff touching a key outside its
   proposer's section is rejected on arrival (``section-violation``);
2. diffs that write the same key with different values conflict: with
   ``conflicts="score"`` (this class's default, what a log header without the field
   ran with) each is scored on the held-out tasks on top of the head, the best one
   stays in, the rest are ``conflict`` (the first proposer wins an exact tie); with
   ``conflicts="first"`` (evolve()'s default) the first proposer's stays in unscored,
   so the merge pays one held-out gate;
3. the survivors are fused into one candidate and scored; it is committed only if it
   strictly beats the head (an exact tie is never accepted);
4. if the fused candidate does not beat the head and it held several diffs, with
   ``attribute`` the diffs behind its regressions are looked for (probing.py), else its
   two halves (in plan order) are scored; the better half is committed if it strictly
   beats the head, else the search goes on inside the better half, at most
   ``MAX_BISECT_DEPTH`` levels (two evals a level, so a bad round costs a bounded
   number of held-out evaluations however many diffs it held); everything not
   committed is ``below-threshold``.

Rules for noisy models and wrong proposals (docs/concepts.md; off in this class by
default, on in evolve()), each in a module of its own mixed into the Merger: ``screen``
(actors/machines/screening.py) scores each diff on its own evidence task before the
gate, and conflicting variants on a held-out minibatch; ``attribute`` and ``retire``
(actors/machines/probing.py, with the group testing of actors/machines/attribution.py)
look for the diffs behind a fused candidate's regressions (``harmful``) and for the
head's keys that block edits on the train tasks it is stuck on (``retired``);
``recheck`` (probing.py) scores a close call a second time, the head too;
``sequential`` (screening.py) scores a gate's candidate on a held-out minibatch first
and stops there when it is behind the head task for task; ``vouch`` (screening.py)
commits a candidate level with the head when each of its diffs fixed that many distinct
train tasks in the screen (a retirement level there, probing.py, likewise); ``noise_z``
(actors/machines/scoring.py) makes every gate decision a test against the reward noise
measured from repeated samples of the same (state, task). An op of text ``REMOVE``
deletes its key.

Scoring is work: an ``EvalRequest`` to the Scheduler, answered by ``EvalDone``. Scores
are cached per (candidate state, task set) (actors/machines/scoring.py), so a
candidate is not scored twice.

Asynchronous mode: there is no barrier. Whenever the Merger is idle and holds
proposals, it merges all of them (the batch trigger); with ``waves`` (evolve()'s
asynchronous runs) it waits for the Planner's ``WaveSettled``, or for ``backlog``
proposals. A proposal made ``eta`` versions behind the head meets the staleness
policy first (tolerance ``alpha``; with ``rebase`` only the commits that wrote one of
its keys count, actors/machines/staleness.py):

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
import operator

from actors.addresses import DRIVER, PLANNER, SCHEDULER, Out
from actors.machines import branches as branching
from actors.machines.branches import Branches, Duel
from actors.machines.candidates import Merge, apply, changes, conflict_groups, state_key
from actors.machines.probing import PROBE_EVALS, PROBE_TASKS, Probing
from actors.machines.reuse import PairScores
from actors.machines.scoring import SCORE_CACHE_STATES, NoiseMeter, ScoreTables
from actors.machines.gatesize import gate_tasks as sized_gate
from actors.machines.interference import Interference
from actors.machines.screening import SEQUENTIAL_FIRST, SEQUENTIAL_SLACK, Screening
from actors.machines.staleness import KeyHistory, merge_ready
from protocol.domain import key_section
from protocol import (
    Barrier,
    Baseline,
    Branched,
    Commit,
    Diff,
    EvalDone,
    Finish,
    Flush,
    LeaseDone,
    Merged,
    Message,
    Open,
    Refresh,
    RoundClosed,
    RunDone,
    WaveSettled,
)

__all__ = ["MAX_BISECT_DEPTH", "STALENESS", "Merger", "apply", "conflict_groups", "state_key"]

log = logging.getLogger(__name__)


STALENESS = ("full", "guarded", "reflective")
#: How conflicting diffs are settled: each scored on top of the head, the best kept
#: (``score``), or the first proposer's kept unscored (``first``: one gate a merge).
CONFLICTS = ("score", "first")
#: Async bucket for proposals (sync mode buckets them by round).
_ASYNC = -1

#: Proposals are merged in plan order: (unit, position in its lease).
_PLAN_ORDER = operator.itemgetter(0, 1)

#: When the fused candidate fails, halves are tried this many levels deep at most
#: (2 evals a level): a bounded search for the part of a round worth keeping.
MAX_BISECT_DEPTH = 4

#: With ``hold`` (sync), a merge left with fewer than ``HOLD_MIN`` diffs after the
#: screen pays no gate: its diffs join the next merge's, ``HOLD_MERGES`` merges in a
#: row at most (a held-out gate costs a call per held-out task, whatever it holds).
HOLD_MIN = 2
HOLD_MERGES = 1



class Merger(ScoreTables, Screening, Probing, Interference, Duel):
    name = "merger"

    def __init__(self, *, asynchronous: bool = False, alpha: int = 3,
                 staleness: str = "guarded", stall_merges: int = 3,
                 cache_states: int = SCORE_CACHE_STATES, screen: bool = False,
                 attribute: bool = False, retire: bool = False,
                 probe_tasks: int = PROBE_TASKS, probe_evals: int = PROBE_EVALS,
                 recheck: bool = False, sequential: bool = False,
                 sequential_first: int = SEQUENTIAL_FIRST,
                 sequential_slack: float = SEQUENTIAL_SLACK,
                 conflicts: str = "score", rebase: bool = False, waves: bool = False,
                 backlog: int | None = None, reuse: bool = False,
                 noise_z: float = 0.0, gate_tasks: int | None = None,
                 branches: bool = False, hold: bool = False,
                 gate_rollouts: int | None = None, rescore: int = 1,
                 level: bool = False, vouch: int = 0,
                 hold_waves: bool = False, cross: bool = False,
                 sequential_retire: bool = False) -> None:
        if conflicts not in CONFLICTS:
            raise ValueError(f"conflicts={conflicts!r}: choose one of {', '.join(CONFLICTS)}")
        self.conflicts = conflicts
        self.noise_z = float(noise_z)
        self.noise = NoiseMeter()
        self.head_samples = 1     # held-out samples the head's score is the mean of
        # A stalled head on a noisy model is scored afresh, up to this many samples
        # (probing.py; 1: never, unless the noise test is on).
        if isinstance(rescore, bool) or not isinstance(rescore, int) or rescore < 1:
            raise ValueError(f"rescore={rescore!r}: give the most held-out samples a "
                             "head's score is the mean of, an integer >= 1 (1: off)")
        self.rescore = rescore
        # ``level`` (screening.py): a gate candidate level with the head on the held-out
        # split is judged on the train tasks seen failing at the head (most recent last).
        self.level = level
        self._failed: dict[str, None] = {}
        # ``vouch`` (screening.py): a candidate level with the head is committed when
        # each of its diffs passed the screen on that many distinct train tasks (0: off).
        if isinstance(vouch, bool) or not isinstance(vouch, int) or vouch < 0:
            raise ValueError(f"vouch={vouch!r}: give the distinct train tasks a diff must "
                             "have passed the screen on, an integer >= 0 (0: off)")
        self.vouch = vouch
        self._vouch: dict[frozenset, set[str]] = {}
        # ``cross`` (interference.py): id(diff) -> (the evidence task it passed the
        # screen on, its score there), while it is held.
        self.cross = cross
        self._passes: dict[int, tuple[str, float]] = {}
        self._suite: dict[str, tuple[dict[str, str], float]] = {}
        self._suite_turn = 0
        self.without_gain = 0     # merges in a row that committed nothing
        # Async (actors/machines/staleness.py): a diff none of whose keys a later commit
        # wrote is kept as fresh (``rebase``); with ``waves`` an idle Merger merges when
        # the Planner says a wave has settled (WaveSettled), or it holds ``backlog``
        # proposals.
        self.rebase = rebase
        self.waves = waves
        self.backlog = backlog
        self._keys = KeyHistory()
        # The chains that lost a conflict, carried on as their units' branches
        # (actors/machines/branches.py).
        self.branches = Branches(gate_rollouts=gate_rollouts) if branches else None
        self._due = False
        # A model declared deterministic: (state, task) scores are reused (reuse.py).
        self.pairs = PairScores() if reuse else None
        self._known: dict[str, dict[str, float]] = {}
        if staleness not in STALENESS:
            raise ValueError(f"staleness={staleness!r}: choose one of {', '.join(STALENESS)}")
        if isinstance(cache_states, bool) or not isinstance(cache_states, int) \
                or cache_states < 1:
            raise ValueError(f"cache_states must be an integer >= 1, got {cache_states!r}")
        self.cache_states = cache_states
        self.screen = screen
        # The screen's own record (screening.py): diffs met, looked at, screened out.
        self.screen_seen = self.screen_looked = self.screen_out = 0
        self.attribute = attribute
        # ``hold``: the diffs of a merge too small for a gate, kept for the next one
        # (asynchronous runs too with ``hold_waves``: a wave's merge, not on the last).
        self.hold = hold
        self.hold_waves = hold_waves
        self._held: list[Diff] = []
        self._held_merges = 0
        # The held diffs a merge gates (ids), and its decisions about them: a diff's
        # outcome is counted in the round that proposed it ("held" there), so these go
        # to the run's totals and RoundClosed.carried, not to the merge's outcomes.
        self._carried: set[int] = set()
        self._carried_out: dict[str, int] = {}
        self.retire = retire
        self.recheck = recheck
        self.sequential = sequential
        # A retirement's held-out confirmation through the sequential gate too (a log
        # header without the field scored it on the whole split).
        self.sequential_retire = sequential and sequential_retire
        # Held-out tasks a gate scores (None: the whole split; gatesize.py).
        self.gate_size = gate_tasks
        self.sequential_first = sequential_first
        self.sequential_slack = sequential_slack
        self.gates_opened = 0
        self._rechecked_at = -1
        self.probe_tasks = probe_tasks
        self.probe_evals = probe_evals
        # id(diff) -> (its evidence task, the rollout's score there) while it is held.
        self._evidence: dict[int, tuple[str, float | None]] = {}
        # Held-out per-task scores of the states scored lately: state key -> scores.
        self._detail: dict[frozenset, dict[str, float]] = {}
        # Train tasks the head is stuck on (a failed rollout that brought no new edit).
        self._stuck: set[str] = set()
        self._blocked: dict[str, Diff] = {}   # a stuck task -> its screened-out diff
        self._probes = 0
        self.merges_scored = 0
        self.asynchronous = asynchronous
        self.alpha = alpha
        self.staleness = staleness
        self.stall_merges = stall_merges
        self.merges = 0
        self.without_commit = 0
        self.flushing = False
        # The final RoundClosed is sent (async): the Planner stops the run on it, so no
        # merge starts after it (see _start_async).
        self.closed_final = False
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
        self.merge: Merge | None = None
        self.n_evals = 0
        self.lease_key = ""  # Open.lease_key: eval ids a peer cannot guess (machines/ids.py)
        self.opened = False
        self.queued_barriers: list[int] = []

    # -- the machine ------------------------------------------------------------------

    def handle(self, msg: Message) -> list[Out]:
        match msg:
            case Open():
                self.heldout = sized_gate(list(msg.heldout_ids), self.gate_size)
                self.state = dict(msg.initial_state)
                self.sections = dict(msg.sections) if msg.sections is not None else None
                self.lease_key = msg.lease_key
                return self._request("baseline", self.state)
            case LeaseDone():
                self._on_proposals(msg)
                if self.asynchronous and self.merge is None and self._ready():
                    return self._start_async()
                return []
            case Flush(merge=merge):
                self.flushing = True
                if not merge:
                    self._drop_unmerged()
                if self.merge is None:
                    return self._start_async()
                return []
            case Branched(round=r, merge=merge):
                if self.branches is not None:
                    self.branches.branched(r, merge)
                return []
            case WaveSettled():
                self._due = True   # a wave settled: merge what it proposed (even nothing)
                return self._start_async() if self.merge is None else []
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

    def _decide(self, what: str, diffs: list[Diff]) -> None:
        """Count a decision about ``diffs`` of the current merge: a diff held from an
        earlier round in ``_carried_out`` (its round counted it as ``held``), the others
        in the merge's outcomes; each in the run's totals."""
        if what == "committed":
            self._committed_evidence(diffs)
        carried = sum(1 for d in diffs if id(d) in self._carried)
        self._count(self.merge.outcomes, what, len(diffs) - carried)
        self._count(self._carried_out, what, carried)

    def _redecide(self, diffs: list[Diff], was: str, now: str) -> None:
        """``diffs``, counted ``was`` when they were decided, are ``now`` after all (a
        screened-out edit a retirement takes in): this merge's outcomes change for its own
        diffs, ``_carried_out`` says it for an earlier round's, and the run's totals count
        each diff once."""
        own = {id(d) for d in self.merge.screened}
        for d in diffs:
            for counts in ((self.merge.outcomes, self.outcomes) if id(d) in own
                           else (self.outcomes,)):
                if counts.get(was):
                    counts[was] -= 1
                    if not counts[was]:
                        del counts[was]
            if id(d) in own:
                self._count(self.merge.outcomes, now)
            else:
                self._count(self._carried_out, now)

    def _on_proposals(self, msg: LeaseDone) -> None:
        if self.branches is not None and msg.kind == "rollout":
            msg = self.branches.lease(msg, self.state)
        bucket = _ASYNC if self.asynchronous else msg.round
        early = self.early.setdefault(bucket, {})
        sections = self.sections if msg.section is not None else None
        held = None
        unit = msg.unit
        at_head = msg.version == self.version and msg.kind == "rollout"
        if at_head:
            key = ("train", self.version)
            for result in msg.results:
                if result.score is not None:
                    self.noise.add(key, result.task_id, result.score)
                    self._failed_at_head(result.task_id, result.score)
        for position, result in enumerate(msg.results):
            diff = result.diff
            if diff is None:
                if self.retire and result.score is not None and result.score < 1.0 \
                        and at_head:
                    self._stuck.add(result.task_id)
                continue
            if sections is not None:
                outside = [k for k in diff.ops if key_section(sections, k) != msg.section]
                if outside:
                    self._count(early, "section-violation")
                    continue
            if held is None:
                held = self.pending.setdefault(bucket, [])
            held.append((unit, position, diff, result.task_id))
            unscreened = self.branches is not None and id(diff) in self.branches.unscreened
            self._evidence[id(diff)] = (result.task_id, None if unscreened else result.score)

    def _unscored(self, tag) -> list[Out]:
        """A budget was spent before a candidate of this merge could be scored: nothing
        more of it is decided. Once the scores already asked for are back (their calls
        are counted), its undecided diffs are ``unscored-at-budget``."""
        m = self.merge
        if m is None:
            return []
        if isinstance(tag, tuple) and tag[0] in ("first", "rest"):
            tag = tag[1]   # a part of a sequential gate: the gate itself is unscored
        m.unscored = True
        m.waiting.discard(tag)
        return [] if m.waiting else self._close_unscored()

    def _close_unscored(self) -> list[Out]:
        m = self.merge
        # Whatever stage the budget stopped, every proposal not yet given an outcome is
        # one left unscored: counting by stage missed the screen's and the probes'.
        undecided = max(0, m.proposals - sum(m.outcomes.values()))
        self._count(m.outcomes, "unscored-at-budget", undecided)
        carried = max(0, len(self._carried) - sum(self._carried_out.values()))
        self._count(self._carried_out, "unscored-at-budget", carried)
        return self._close(committed=False)

    def _scored(self, tag: str, score: float) -> list[Out]:
        if tag == "baseline":
            self.score = self.initial_score = score
            self.opened = True
            return [(PLANNER, Baseline(version=self.version, heldout_reward=score))]
        m = self.merge
        if m is None:
            return []
        if isinstance(tag, tuple) and tag[0] in ("first", "rest"):
            return self._gate_step(tag, score)
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

    def _ready(self) -> bool:
        held = len(self.pending.get(_ASYNC, ())) + sum(self.early.get(_ASYNC, {}).values())
        return merge_ready(held, waves=self.waves, due=self._due or self.flushing,
                           backlog=self.backlog)

    def _start_async(self) -> list[Out]:
        """Take every proposal held (in arrival order: the log's order) and merge it;
        nothing once the final RoundClosed is out. The Planner's WaveSettled for the last
        wave may arrive after it (the Scheduler's Flush comes from another sender): the
        Planner stops the run on that close, so an eval asked for now would run on the
        workers after the Scheduler stopped, its calls made and never counted."""
        if self.closed_final:
            return []
        self._due = False
        outcomes = self.early.pop(_ASYNC, {})
        held = self.pending.pop(_ASYNC, [])
        proposals = len(held) + outcomes.get("section-violation", 0)
        r = self.merges
        self.merges += 1
        out: list[Out] = [(SCHEDULER, Merged(consumed=proposals, version=self.version))] \
            if proposals else []
        keep, verify = [], []
        for _, _, diff, task_id in held:
            eta = self._eta(diff)
            if eta <= 0 < self.version - diff.base_version:
                self.stats["rebased"] = self.stats.get("rebased", 0) + 1
            if eta <= 0 or self.staleness == "full":
                keep.append(diff)
                self.stats["max_eta_kept"] = max(self.stats["max_eta_kept"], eta)
            elif self.staleness == "guarded" and eta > self.alpha:
                self._count(outcomes, "stale")
            else:
                verify.append((diff, task_id))
        self.merge = Merge(round=r, stage="verify", proposals=proposals, free=[], groups=[],
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

    def _eta(self, diff: Diff) -> int:
        """Versions a diff is behind: with ``rebase``, only the commits that wrote one of
        its keys count (actors/machines/staleness.py)."""
        if self.rebase:
            return self._keys.eta(diff, self.version)
        return self.version - diff.base_version

    def _merge_kept(self) -> list[Out]:
        m = self.merge
        self.merge = None
        return self._merge(m.round, m.fused, m.outcomes, m.proposals)

    def _merge(self, r: int, raw: list[Diff], outcomes: dict[str, int],
               proposals: int) -> list[Out]:
        seen = {frozenset(h.ops.items()) for h in self._held}   # held: not again
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
                if changes(state, d.ops):
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
        self._carried, self._carried_out = set(), {}
        self.merge = Merge(round=r, stage="screen", proposals=proposals, free=[],
                            groups=[], outcomes=outcomes, opkeys=opkeys)
        if self.branches is not None and self.branches.carries(self.flushing):
            return self._carry(diffs)
        if not diffs and not self._held:
            return self._no_commit()
        if self.screen:
            return self._screen(diffs, evidence)
        return self._variants(diffs)

    def _variants(self, diffs: list[Diff]) -> list[Out]:
        m = self.merge
        if self.hold and (not self.asynchronous or self.hold_waves):
            diffs = self._with_held(diffs)
            last = self.asynchronous and self.flushing   # no merge after this one
            if len(diffs) < HOLD_MIN and self._held_merges < HOLD_MERGES and not last:
                # Too few to pay a held-out gate for: held for the next merge, the
                # round's outcome for them ("held"; their fate is the run's).
                self._held, self._held_merges = diffs, self._held_merges + 1
                self.stats["held"] = self.stats.get("held", 0) + len(diffs)
                own = sum(1 for d in diffs if id(d) not in self._carried)
                if own:
                    m.outcomes["held"] = m.outcomes.get("held", 0) + own
                if len(diffs) > own:
                    self._carried_out["held"] = len(diffs) - own
                return self._no_commit()
            self._held, self._held_merges = [], 0
            if not diffs:
                return self._no_commit()
        m.free, m.groups = conflict_groups(diffs)
        m.stage = "variants"
        if m.groups and self.conflicts == "first":
            # One gate a merge: the first proposer of each group (plan order) goes on
            # to the fused candidate unscored, the others are ``conflict`` (with
            # branches, the one with the best train evidence: branches.py).
            if self.branches is not None and 1 < branching.DUEL < max(map(len, m.groups)):
                return self._duel(m.groups)
            picked = [g[0] if self.branches is None else self.branches.pick(g, self.score)
                      for g in m.groups]
            return self._picked(m.groups, picked)
        if m.groups:
            return self._score_each([d for g in m.groups for d in g])
        return self._to_fused()

    def _picked(self, groups: list[list[Diff]], picked: list[Diff]) -> list[Out]:
        """One diff of each conflict group goes on to the fused candidate; the others
        lost (with branches, they are carried on)."""
        m = self.merge
        m.lost = [d for g, p in zip(groups, picked) for d in g if d is not p]
        self._decide("conflict", m.lost)
        m.free = m.free + picked
        return self._to_fused()

    def _with_held(self, diffs: list[Diff]) -> list[Diff]:
        """This merge's diffs, then those held by the one before (those that still
        change the head; not screened again: a diff met again is a ``duplicate`` in
        _merge). Behind this merge's, a held diff loses a conflict to a fresh one (the
        first proposer's is kept)."""
        held = [h for h in self._held if changes(self.state, h.ops)]
        self._carried = {id(h) for h in self._held}
        self._decide("unchanged", [h for h in self._held if not changes(self.state, h.ops)])
        return diffs + held

    def _advance(self) -> list[Out]:
        m = self.merge
        if m.stage == "screen":
            return self._screen_done()
        if m.stage == "screen-head":
            return self._screen_head_done()
        if m.stage == "cross":
            return self._crossed()
        if m.stage == "cross-control":
            return self._cross_controlled()
        if m.stage == "cross-loo":
            return self._cross_looed()
        if m.stage == "probe":
            return self._probe_scored()
        if m.stage == "control":
            return self._controlled()
        if m.stage == "rescore":
            return self._rescored()
        if m.stage == "regress":
            return self._regressed()
        if m.stage == "loo":
            return self._looed()
        if m.stage == "reg-confirm":
            return self._reg_confirmed()
        if m.stage == "confirm":
            return self._confirmed()
        if m.stage == "unblock":
            return self._unblocked()
        if m.stage == "recheck":
            return self._rechecked()
        if m.stage == "duel":
            return self._dueled()
        if m.stage == "train-check":
            return self._train_checked()
        if m.stage == "level-confirm":
            return self._level_confirmed()
        if m.stage == "verify":
            for diff, task_id in m.verify:
                scores = self.cache[(task_id,)]
                with_diff = scores[state_key(apply(self.state, [diff]))]
                without = scores[state_key(self.state)]
                if with_diff > without:
                    m.fused.append(diff)
                    self.stats["reverified"] += 1
                    eta = self._eta(diff)
                    self.stats["max_eta_kept"] = max(self.stats["max_eta_kept"], eta)
                else:
                    self._count(m.outcomes, "stale-rejected")
            return self._merge_kept()
        if m.stage == "variants":
            winners = []
            scores, keys = self._scores(m.variant_tasks), m.keys
            bar = self.score if m.variant_tasks is None else scores[state_key(self.state)]
            losers, below = [], []
            for group in m.groups:
                best = group[0]
                best_score = scores[keys[id(best)]]
                for d in group[1:]:  # strictly better only: the first proposer wins ties
                    score = scores[keys[id(d)]]
                    if score > best_score:
                        best, best_score = d, score
                losers += [d for d in group if d is not best]
                if best_score > bar:
                    winners.append(best)
                else:
                    below.append(best)
            # Counted once each; a group has two diffs or more, so "conflict" is met first.
            self._decide("conflict", losers)
            self._decide("below-threshold", below)
            m.free = m.free + winners
            if not m.free:
                return self._no_commit()
            return self._to_fused()
        if m.stage == "fused":
            score = self._gate_score(m.fused_key)
            if self._beats(score):
                return self._accept(m.fused, m.fused_state, m.fused_key, score)
            if len(m.fused) == 1:
                return self._level_or_below(m.fused, m.fused_state, m.fused_key, score)
            if self.attribute:
                return self._attribute_failed()
            return self._bisect(m.fused)
        if m.stage == "bisect":
            scored = [(self._gate_score(m.half_keys[i]), i, half)
                      for i, half in enumerate(m.halves)]
            scored = [(-1.0 if s is None else s, i, half) for s, i, half in scored]
            # Highest score first; the first half wins an exact tie.
            score, i, best = max(scored, key=lambda t: (t[0], -t[1]))
            if self._beats(score):
                kept = {id(d) for d in best}
                return self._accept(best, m.half_states[i], m.half_keys[i], score,
                                    below=[d for d in m.fused if id(d) not in kept])
            if len(best) == 1 or m.depth >= MAX_BISECT_DEPTH:
                self._decide("below-threshold", m.fused)
                return self._no_commit()
            return self._bisect(best)
        raise AssertionError(f"merger in unknown stage {m.stage!r}")

    def _bisect(self, diffs: list[Diff]) -> list[Out]:
        """Score both halves of ``diffs`` (in plan order) on top of the head."""
        m = self.merge
        m.stage = "bisect"
        m.depth += 1
        mid = (len(diffs) + 1) // 2
        m.halves = [diffs[:mid], diffs[mid:]]
        m.half_states = [apply(self.state, half) for half in m.halves]
        m.half_keys = [state_key(s) for s in m.half_states]
        m.waiting = {"h0", "h1"}
        return (self._held_out("h0", m.half_states[0], m.half_keys[0])
                + self._held_out("h1", m.half_states[1], m.half_keys[1]))

    def _to_fused(self) -> list[Out]:
        """The candidate of ``m.free`` goes to the held-out gate (with ``cross``, its
        diffs' evidence tasks checked first: interference.py)."""
        crossing = self._cross()
        return crossing if crossing is not None else self._to_gate()

    def _to_gate(self) -> list[Out]:
        m = self.merge
        m.stage = "fused"
        m.fused = list(m.free)
        m.fused_state = apply(self.state, m.fused)
        m.fused_key = state_key(m.fused_state)
        m.waiting = {"fused"}
        return self._held_out("fused", m.fused_state, m.fused_key)

    def _commit(self, state: dict[str, str], score: float) -> list[Out]:
        self._stuck, self._blocked = set(), {}
        self.head_samples = 1
        self.without_gain = 0
        self.version += 1
        if self.rebase:
            self._keys.commit(self.state, state)
        self.state = state
        self.score = score
        return [(SCHEDULER, Commit(version=self.version, state=state))] + self._close(True)

    def _close(self, committed: bool) -> list[Out]:
        m = self.merge
        self.merge = None
        self._trim_cache()
        pending = {id(p[2]) for bucket in self.pending.values() for p in bucket}
        if self._evidence:   # only the diffs still held keep theirs (stale ones go)
            self._evidence = {k: v for k, v in self._evidence.items() if k in pending}
        if self._passes:
            held = pending | {id(d) for d in self._held}
            self._passes = {k: v for k, v in self._passes.items() if k in held}
        bases = {}
        if self.branches is not None:
            bases = self.branches.settle(m.round, m.lost, self.state, gated=not m.carried)
            self.branches.prune(pending)
        if not self.asynchronous:
            out: list[Out] = [(PLANNER, RoundClosed(
                round=m.round, version=self.version, committed=committed,
                heldout_reward=self.score, proposals=m.proposals, outcomes=m.outcomes,
                bases=bases, carried=self._carried_out))]
            if self.queued_barriers:
                out += self._start(self.queued_barriers.pop(0))
            return out
        out = []
        if m.proposals and not committed and not m.carried:
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
        self.closed_final = self.closed_final or final
        out.append((PLANNER, RoundClosed(round=m.round, version=self.version, committed=committed,
                                         heldout_reward=self.score, proposals=m.proposals,
                                         outcomes=m.outcomes, final=final, bases=bases,
                                         carried=self._carried_out)))
        if (self._due and not final) or (more and self._ready()):
            out += self._start_async()
        return out

    def _finish(self, msg: Finish) -> list[Out]:
        outcomes = dict(self.outcomes)
        if self._held:
            outcomes["held-at-stop"] = len(self._held)
        if msg.backend_errors:
            outcomes["rollout-error"] = msg.backend_errors
        return [(DRIVER, RunDone(stop_reason=msg.stop_reason, version=self.version,
                                 state=self.state, final_reward=self.score,
                                 initial_reward=self.initial_score, history=msg.history,
                                 outcomes=outcomes, rollouts=msg.rollouts, calls=msg.calls,
                                 error=msg.error, fatal=msg.fatal, stats=self._stats()))]

    def _stats(self) -> dict[str, float]:
        if self.pairs is None:
            return dict(self.stats)
        return {**self.stats, "reused_scores": self.pairs.reused}
