"""The Merger's probes and second looks: attribution of a fused commit's diffs,
retiring the head's own keys, and a second sample of a close call (``recheck``). Pure
(a mixin of actors/machines/merger.py; the group testing itself is
actors/machines/attribution.py). docs/concepts.md describes them.
"""

from __future__ import annotations

from actors.addresses import Out
from actors.machines.attribution import DELETE, Probe, without
from actors.machines.candidates import apply, state_key
from actors.machines.scoring import AGAIN, RESCORE_AFTER
from actors.machines.screening import VOUCH_TASKS
from protocol import Diff

#: A probe (attribution, retiring) scores on at most this many failing held-out tasks,
#: and makes at most this many evals of them (a control eval included).
PROBE_TASKS = 12
PROBE_EVALS = 24
#: Retiring probes the head once this many train tasks are stuck at it.
RETIRE_MIN = 2
#: With ``recheck``, a gain of at most this many held-out tasks is scored again.
RECHECK_TASKS = 3


class Probing:
    """Attribution, retiring and recheck (mixed into the Merger)."""

    def _accept(self, diffs: list[Diff], state: dict[str, str], key: frozenset,
                score: float, below: list[Diff] | None = None) -> list[Out]:
        """``diffs`` fused into ``state`` beat the head: commit, or first look inside for
        diffs that hold it back (attribution) when there are several. With ``recheck``,
        a close call (a gain of ``RECHECK_TASKS`` held-out tasks or less) is scored
        once more, the head too, and decided on the means of the two samples."""
        m = self.merge
        below = below or []
        if self.recheck and m.recheck is None and \
                score - self.score <= RECHECK_TASKS / max(1, len(self.heldout)):
            m.recheck = (diffs, state, key, score, below)
            m.stage = "recheck"
            m.waiting = {"again-c", "again-h"}
            return (self._request("again-c", state, key=key, again=True)
                    + self._request("again-h", self.state, again=True))
        if self.attribute and len(diffs) > 1:
            tasks = self._regressions(key)
            if tasks:
                return self._attribute(diffs, state, key, score, below, passed=True)
        self._decide("committed", diffs)
        self._decide("below-threshold", below)
        return self._commit(state, score)

    # -- attribution: the diffs behind a candidate's regressions -----------------------

    def _regressions(self, key: frozenset) -> list[str]:
        """The held-out tasks a candidate does worse on than the head (at most
        ``probe_tasks``; none when either's per-task scores are unknown)."""
        cand, head = self._detail.get(key), self._detail.get(state_key(self.state))
        if not cand or not head:
            return []
        return sorted(t for t, s in cand.items() if s < head.get(t, s))[:self.probe_tasks]

    def _attribute(self, diffs: list[Diff], state: dict[str, str], key: frozenset,
                   score: float, below: list[Diff], passed: bool) -> list[Out]:
        """Look for the diffs behind the candidate's regressions: first the candidate
        scored afresh on them (a regression met once may be the model's noise)."""
        m = self.merge
        m.cand, m.cand_state, m.cand_key, m.cand_score = diffs, state, key, score
        m.below, m.cand_passed = below, passed
        m.stage = "regress"
        m.control_tasks = self._regressions(key)
        m.waiting = {"control"}
        return self._request("control", state, m.control_tasks, fresh=True)

    def _attribute_failed(self) -> list[Out]:
        """A fused candidate of several diffs did not beat the head: if it regressed,
        attribute the regressions (instead of bisecting), else nothing of it is kept."""
        m = self.merge
        score = self._gate_score(m.fused_key)
        if score is None or not self._regressions(m.fused_key):
            return self._level_or_below(m.fused, m.fused_state, m.fused_key, score)
        return self._attribute(m.fused, m.fused_state, m.fused_key, score, [], passed=False)

    def _regressed(self) -> list[Out]:
        """The regressions that held on a second look: each diff taken back out of the
        candidate alone (leave-one-out) on those tasks."""
        m = self.merge
        head = self._detail.get(state_key(self.state), {})
        control = m.per_task.get("control", {})
        m.loo_tasks = [t for t in m.control_tasks
                       if t in control and control[t] < head.get(t, 0.0)]
        if not m.loo_tasks:
            return self._attributed([])
        m.stage = "loo"
        m.waiting = {("loo", j) for j in range(len(m.cand))}
        out: list[Out] = []
        for j, d in enumerate(m.cand):
            state = without(m.cand_state, [{k: self.state.get(k, DELETE) for k in d.ops}])
            out += self._request(("loo", j), state, m.loo_tasks, fresh=True)
        return out

    def _looed(self) -> list[Out]:
        """A diff is flagged when taking it out repairs a regression that few others'
        removal repairs (when most removals repair a task, it was the noise)."""
        m = self.merge
        head = self._detail.get(state_key(self.state), {})
        n = len(m.cand)
        flagged: set[int] = set()
        for t in m.loo_tasks:
            repairers = [j for j in range(n)
                         if m.per_task.get(("loo", j), {}).get(t, 0.0) >= head.get(t, 1.0)]
            if 0 < len(repairers) <= max(1, n // 2):
                flagged.update(repairers)
        return self._attributed(sorted(flagged))

    def _attributed(self, flagged: list[int]) -> list[Out]:
        m = self.merge
        if not flagged:
            return self._attribution_end(None, [])
        keep = [d for j, d in enumerate(m.cand) if j not in flagged]
        m.confirm_state = apply(self.state, keep)
        m.confirm_key = state_key(m.confirm_state)
        m.flagged = flagged
        m.stage = "reg-confirm"
        m.waiting = {"confirm"}
        return self._held_out("confirm", m.confirm_state, m.confirm_key)

    def _reg_confirmed(self) -> list[Out]:
        m = self.merge
        return self._attribution_end(self._gate_score(m.confirm_key), m.flagged)

    def _attribution_end(self, score: float | None, flagged: list[int]) -> list[Out]:
        """Commit the candidate without the flagged diffs when that scores higher (than
        the candidate that passed, or than the head); else the candidate if it passed."""
        m = self.merge
        better = score is not None and flagged and (
            score > m.cand_score if m.cand_passed else self._beats(score))
        if better:
            self._decide("committed", [d for j, d in enumerate(m.cand) if j not in flagged])
            self._decide("harmful", [m.cand[j] for j in flagged])
            self._decide("below-threshold", m.below)
            return self._commit(m.confirm_state, score)
        if m.cand_passed:
            self._decide("committed", m.cand)
            self._decide("below-threshold", m.below)
            return self._commit(m.cand_state, m.cand_score)
        return self._level_or_below(m.cand, m.cand_state, m.cand_key, m.cand_score)

    def _retire_vouched(self, score: float) -> bool:
        """With ``vouch``, a removal level with the head on the held-out split (behind
        by at most ``VOUCH_TASKS``) retires its keys when each was flagged alone and its
        removal repaired ``vouch`` of the stuck train tasks or more."""
        probe, n = self.merge.probe, max(1, len(self.heldout))
        if not self.vouch or score * n < self.score * n - VOUCH_TASKS:
            return False
        k = len(probe.tasks)
        if not all(probe.repaired.get(u, 0.0) * k >= self.vouch - 1e-9
                   for u in probe.flagged):
            return False
        self.stats["vouched-retired"] = self.stats.get("vouched-retired", 0) + len(probe.flagged)
        return True

    def _rechecked(self) -> list[Out]:
        m = self.merge
        diffs, state, key, score, below = m.recheck
        table = self.cache[(AGAIN,) + tuple(self.heldout)]
        cand = (score + table[key]) / 2
        if self._rechecked_at != self.version:   # the head's two samples, once a version
            self._rechecked_at = self.version
            self.score = (self.score + table[state_key(self.state)]) / 2
        if self._beats(cand):
            return self._accept(diffs, state, key, cand, below)
        self._decide("rechecked-out", diffs)
        self._decide("below-threshold", below)
        return self._no_commit()

    def _no_commit(self) -> list[Out]:
        """Nothing of this merge beats the head: close, or first try retiring the head's
        keys, on the train tasks the head is stuck on (tasks whose failed rollout at
        this head brought no new edit: the proposer's fix is in already, or was
        screened out), when ``RETIRE_MIN`` new ones were met since the last probe."""
        m = self.merge
        if m is not None and m.probe is None and m.stage not in ("rescore", "screen"):
            self.without_gain += 1
            if self.without_gain >= RESCORE_AFTER and self._rescore_due():
                return self._rescore()
        return self._retire_stuck()

    def _rescore_due(self) -> bool:
        """Whether a stalled head is scored afresh: while its score is the mean of fewer
        than ``rescore`` samples and the model was seen to be noisy (a state scored
        differently twice on a task; with the noise test on, 2 samples unless the model
        is measured deterministic). A head was committed for
        beating the one before on one noisy sample, so that sample is biased upward (the
        winner's curse) and every candidate after it is gated against a lucky score."""
        if self.noise_z > 0 and self.head_samples < max(2, self.rescore):
            return self.noise.variance() != 0.0
        return self.head_samples < self.rescore and self.noise.noisy()

    def _rescore(self) -> list[Out]:
        """Score the head afresh on the held-out split: its score becomes the mean of
        its samples, and each task scored twice is a repeated sample for the noise."""
        m = self.merge
        self.without_gain = 0
        m.stage = "rescore"
        m.waiting = {"rescore"}
        again = self._scores_again()
        again.pop(state_key(self.state), None)   # a fresh sample, never the table's
        return self._request("rescore", self.state, again=True)

    def _rescored(self) -> list[Out]:
        m = self.merge
        key = state_key(self.state)
        fresh = self._scores_again()[key]
        n = self.head_samples
        detail = self._detail.get(key, {})
        again = m.per_task.get("rescore", {})
        if n == 1:
            for task in again:
                if task in detail:
                    self.noise.add(("heldout", key), task, detail[task])
        for task, score in again.items():
            self.noise.add(("heldout", key), task, score)
        if self.rescore > 1 and detail:   # the head's per-task scores: means too
            self._detail[key] = {t: (v * n + again.get(t, v)) / (n + 1)
                                 for t, v in detail.items()}
        self.score = (self.score * n + fresh) / (n + 1)
        self.head_samples = n + 1
        return self._retire_stuck()

    def _retire_stuck(self) -> list[Out]:
        """Probe the head's keys on the train tasks it is stuck on. A task whose edit
        was screened out is probed with that edit in (the head + the blocked edits is
        the probe's base): what blocks an edit is often an earlier one that shadows it,
        and taking that out alone fixes nothing while the edit is not in."""
        m = self.merge
        stuck = sorted(self._stuck)
        if not (self.retire and m is not None and m.probe is None and self.state
                and len(stuck) >= RETIRE_MIN):
            return self._close(committed=False)
        tasks = stuck
        if len(stuck) > self.probe_tasks:   # rotate which ones a probe looks at
            turn = (self._probes * self.probe_tasks) % len(stuck)
            tasks = sorted((stuck[turn:] + stuck[:turn])[:self.probe_tasks])
        self._probes += 1
        m.blocked = [(t, self._blocked[t]) for t in tasks if t in self._blocked]
        self._stuck, self._blocked = set(), {}
        m.cand_state = apply(self.state, [d for _, d in m.blocked])
        m.stage = "control"
        m.control_tasks = tasks
        m.waiting = {"control"}
        return self._request("control", m.cand_state, tasks, fresh=True)

    def _controlled(self) -> list[Out]:
        """The base scored afresh on the stuck tasks: those it fails again are probed
        (a failure met once may be the model's noise)."""
        m = self.merge
        control = m.per_task.get("control", {})
        failing = [t for t in m.control_tasks if control.get(t, 0.0) < 1.0]
        if control and not failing:
            return self._close(committed=False)
        tasks = failing or m.control_tasks
        written = {k for _, d in m.blocked for k in d.ops}
        units = [{k: DELETE} for k in sorted(self.state) if k not in written]
        if not units:
            return self._close(committed=False)
        # Without per-task scores (a score met before), the probe takes a control first.
        probe = Probe(base=m.cand_state, units=units, tasks=sorted(tasks),
                      base_score=0.0 if control else -1.0,
                      margin=0.5 / len(tasks), max_evals=self.probe_evals)
        m.probe, m.probe_kind = probe, "retire"
        m.cand_score = self.score
        return self._probe_next()

    def _probe_next(self) -> list[Out]:
        m = self.merge
        probe = m.probe
        m.stage = "probe"
        batch = probe.batch()
        if probe.base_score < 0 and batch:
            batch = [(-1, probe.base)] + batch   # a control: the base itself, fresh
        if not batch:
            return self._probe_done()
        m.probe_keys = {i: state_key(state) for i, state in batch}
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
        """Flagged keys: each blocked edit is tried on its own task with them taken out
        of the head (one call each), and the head without them, with the edits that
        then fix their task, is scored on the whole split."""
        m = self.merge
        probe = m.probe
        if not probe.flagged:
            return self._close(committed=False)
        m.retired_state = without(self.state, [probe.units[i] for i in probe.flagged])
        if not m.blocked:
            return self._confirm(m.retired_state)
        m.stage = "unblock"
        m.waiting = {("ub", i) for i in range(len(m.blocked))}
        out: list[Out] = []
        for i, (t, d) in enumerate(m.blocked):
            out += self._request(("ub", i), apply(m.retired_state, [d]), [t], fresh=True)
        return out

    def _unblocked(self) -> list[Out]:
        m = self.merge
        m.unblocked = [d for i, (t, d) in enumerate(m.blocked)
                       if m.per_task.get(("ub", i), {}).get(t, 0.0) >= 1.0]
        return self._confirm(apply(m.retired_state, m.unblocked))

    def _confirm(self, state: dict[str, str]) -> list[Out]:
        m = self.merge
        m.confirm_state = state
        m.confirm_key = state_key(state)
        m.stage = "confirm"
        m.waiting = {"confirm"}
        if self.sequential_retire:   # stops early when the removal is behind the head
            return self._held_out("confirm", m.confirm_state, m.confirm_key)
        return self._request("confirm", m.confirm_state, key=m.confirm_key)

    def _confirmed(self) -> list[Out]:
        """Retire the flagged keys of the head (and take in the edits they blocked) when
        that scores higher on the held-out split (by the noise test when it is on)."""
        m = self.merge
        score = self._gate_score(m.confirm_key)
        if score is None or not self._beats(score) and not self._retire_vouched(score):
            return self._close(committed=False)
        # "retired" counts the head's keys taken out (no proposal of this round's); the
        # edits they blocked were screened out, and are committed after all.
        self._count(m.outcomes, "retired", len(m.probe.flagged))
        self._redecide(m.unblocked, "screened-out", "committed")
        return self._commit(m.confirm_state, score)
