"""The Merger's probes and second looks: attribution of a fused commit's diffs,
retiring the head's own keys, and a second sample of a close call (``recheck``). Pure
(a mixin of actors/machines/merger.py; the group testing itself is
actors/machines/attribution.py). docs/concepts.md describes them.
"""

from __future__ import annotations

from actors.addresses import Out
from actors.machines.attribution import DELETE, Probe, without
from actors.machines.candidates import state_key
from actors.machines.scoring import AGAIN, RESCORE_AFTER
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
            self.score = (self.score + table[state_key(self.state)]) / 2
        if self._beats(cand):
            return self._accept(diffs, state, key, cand, below)
        self._count(m.outcomes, "rechecked-out", len(diffs))
        self._count(m.outcomes, "below-threshold", below)
        return self._no_commit()

    def _no_commit(self) -> list[Out]:
        """Nothing of this merge beats the head: close, or first try retiring the head's
        keys, on the train tasks the head is stuck on (tasks whose failed rollout at
        this head brought no new edit: the proposer's fix is in already, or was
        screened out), when ``RETIRE_MIN`` new ones were met since the last probe."""
        m = self.merge
        if m is not None and m.probe is None and m.stage not in ("rescore", "screen"):
            self.without_gain += 1
            if self.noise_z > 0 and self.without_gain >= RESCORE_AFTER \
                    and self.noise.variance() != 0.0:
                return self._rescore()
        return self._retire_stuck()

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
        first = self._detail.get(key, {}) if self.head_samples == 1 else {}
        for task, score in m.per_task.get("rescore", {}).items():
            if task in first:
                self.noise.add(("heldout", key), task, first[task])
        for task, score in m.per_task.get("rescore", {}).items():
            self.noise.add(("heldout", key), task, score)
        self.score = (self.score * self.head_samples + fresh) / (self.head_samples + 1)
        self.head_samples += 1
        return self._retire_stuck()

    def _retire_stuck(self) -> list[Out]:
        m = self.merge
        stuck = sorted(self._stuck)
        if not (self.retire and m is not None and m.probe is None and self.state
                and len(stuck) >= RETIRE_MIN):
            return self._close(committed=False)
        self._stuck = set()
        tasks = stuck[-self.probe_tasks:] if len(stuck) > self.probe_tasks else stuck
        if len(stuck) > self.probe_tasks:   # rotate which ones a probe looks at
            turn = (self._probes * self.probe_tasks) % len(stuck)
            tasks = sorted((stuck[turn:] + stuck[:turn])[:self.probe_tasks])
        self._probes += 1
        m.stage = "control"
        m.control_tasks = tasks
        m.waiting = {"control"}
        return self._request("control", self.state, tasks, again=True)

    def _controlled(self) -> list[Out]:
        """The head scored afresh on its stuck tasks: those it fails again are probed
        (a failure met once may be the model's noise)."""
        m = self.merge
        control = m.per_task.get("control", {})
        failing = [t for t in m.control_tasks if control.get(t, 0.0) < 1.0]
        if control and not failing:
            return self._close(committed=False)
        tasks = failing or m.control_tasks
        units = [{k: DELETE} for k in sorted(self.state)]
        # Without per-task scores (a score met before), the probe takes a control first.
        probe = Probe(base=self.state, units=units, tasks=sorted(tasks),
                      base_score=0.0 if control else -1.0,
                      margin=0.5 / len(tasks), max_evals=self.probe_evals)
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
        head = self._detail.get(state_key(self.state), {})
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
        m = self.merge
        probe = m.probe
        if not probe.flagged:
            return self._probe_end(None)
        m.confirm_state = without(probe.base, [probe.units[i] for i in probe.flagged])
        m.confirm_key = state_key(m.confirm_state)
        m.stage = "confirm"
        m.waiting = {"confirm"}
        return self._request("confirm", m.confirm_state, key=m.confirm_key)

    def _confirmed(self) -> list[Out]:
        m = self.merge
        score = self._scores(None)[m.confirm_key]
        if m.probe_kind == "retire":
            return self._probe_end(score if self._beats(score) else None)
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
