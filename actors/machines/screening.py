"""The Merger's cheap gates: a screen of each diff on its own evidence task, and
conflicting variants compared on a held-out minibatch before the whole split (GEPA's
rule). Pure (a mixin of actors/machines/merger.py). docs/concepts.md describes them.
"""

from __future__ import annotations

from actors.addresses import SCHEDULER, Out
from actors.machines.candidates import apply, state_key
from actors.machines.ids import tagged
from protocol import Diff, EvalRequest

#: With ``screen``, conflicting variants are compared on this many held-out tasks.
MINIBATCH = 16
#: With ``sequential``, a gate candidate is scored on this many held-out tasks first,
#: and stops there when it is behind the head by more than ``SEQUENTIAL_SLACK`` tasks.
SEQUENTIAL_FIRST = 24
SEQUENTIAL_SLACK = 1.0
#: The screen looks at every diff while it earns its keep: until it has decided
#: ``SCREEN_TRIAL`` diffs, then every diff while at least ``SCREEN_KEEP`` of those it
#: decided were screened out, else one diff in ``SCREEN_SAMPLE`` (to notice proposals
#: going wrong). Its record counts decided diffs only, so every diff of a merge is
#: judged on what earlier merges showed (a first merge is screened whole).
SCREEN_TRIAL = 4
SCREEN_KEEP = 0.1
SCREEN_SAMPLE = 4
#: With ``level``, a gate candidate that does not beat the head but is behind it by at
#: most ``LEVEL_TASKS`` held-out tasks is scored, with the head afresh, on at most
#: ``LEVEL_TRAIN`` train tasks seen failing at the head; it is committed when it passes
#: more than ``LEVEL_MARGIN`` tasks more than the head there.
LEVEL_TASKS = 1.0
LEVEL_TRAIN = 24
LEVEL_MARGIN = 1.0
#: Train tasks remembered as failing at the head (the most recent).
FAILED_KEEP = 256
#: With ``vouch``, a gate candidate that does not beat the head but is behind it by at
#: most ``VOUCH_TASKS`` held-out tasks is committed when each of its diffs passed the
#: screen on ``vouch`` distinct train tasks or more (edits the held-out split holds no
#: task for score level there). The record keeps the last ``VOUCH_KEEP`` diffs.
VOUCH_TASKS = 1.0
VOUCH_KEEP = 4096


class Screening:
    """The screen and the minibatch of conflicting variants (mixed into the Merger)."""

    def _screen(self, diffs: list[Diff],
                evidence: dict[int, tuple[str, float | None] | None]) -> list[Out]:
        """The cheap gate: each diff scored on its own evidence task (one call) on top of
        the head; only those that do better there than the rollout that proposed them go
        on to the held-out gate (the rest are ``screened-out``). A diff whose evidence
        is unknown goes on unscreened. When the model is measured to be noisy, the head
        is first scored again on the evidence tasks (one call each): a task it passes
        then failed by the model's noise, and the diffs it brought are screened out
        without a call of their own."""
        m = self.merge
        m.screened = diffs
        for d in diffs:
            ev = evidence.get(id(d))
            if ev is not None and ev[1] is not None and self._screen_this():
                m.screen_keys[id(d)] = ((ev[0],), ev[1])
        if self.noise.variance() and m.screen_keys:
            tasks = sorted({task_ids[0] for task_ids, _ in m.screen_keys.values()})
            m.stage = "screen-head"
            m.waiting = {("sh", t) for t in tasks}
            out: list[Out] = []
            for t in tasks:
                out += self._request(("sh", t), self.state, [t], fresh=True)
            return out
        return self._screen_diffs()

    def _screen_this(self) -> bool:
        """Whether the screen looks at the next diff (``SCREEN_TRIAL``, ``SCREEN_KEEP``,
        ``SCREEN_SAMPLE``), on the record of the diffs it decided so far."""
        self.screen_seen += 1
        decided = self.screen_looked
        return decided < SCREEN_TRIAL or self.screen_out >= SCREEN_KEEP * decided \
            or self.screen_seen % SCREEN_SAMPLE == 0

    def _screen_head_done(self) -> list[Out]:
        m = self.merge
        key = state_key(self.state)
        for d in m.screened:
            known = m.screen_keys.get(id(d))
            if known is not None and self.cache[known[0]][key] > known[1]:
                del m.screen_keys[id(d)]
                m.noise_failed.add(id(d))
                self.screen_looked += 1   # decided, and screened out: it earns its keep
                self.screen_out += 1
        return self._screen_diffs()

    def _screen_diffs(self) -> list[Out]:
        m = self.merge
        m.stage = "screen"
        requests = [(("s", id(d)), apply(self.state, [d]), list(m.screen_keys[id(d)][0]))
                    for d in m.screened if id(d) in m.screen_keys]
        m.waiting = {tag for tag, _, _ in requests}
        if not requests:
            return self._screen_done()
        out: list[Out] = []
        for tag, state, task_ids in requests:
            out += self._request(tag, state, task_ids)
        return out

    def _screen_done(self) -> list[Out]:
        m = self.merge
        keep = []
        for d in m.screened:
            if id(d) in m.noise_failed:
                self._count(m.outcomes, "screened-out")
                continue
            known = m.screen_keys.get(id(d))
            if known is None:
                keep.append(d)
                continue
            task_ids, before = known
            self.screen_looked += 1
            after = self.cache[task_ids][state_key(apply(self.state, [d]))]
            if after > before:
                keep.append(d)
                self._vouched_on(d, task_ids[0])
                self._passed_screen(d, task_ids[0], after)
            else:
                self._count(m.outcomes, "screened-out")
                self.screen_out += 1
                if self.retire:   # the head is stuck on this task (probing.py)
                    self._stuck.add(task_ids[0])
                    self._blocked[task_ids[0]] = d
        if not keep and not self._held:
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

    # -- the sequential gate ------------------------------------------------------------

    def _held_out(self, tag: str, state: dict[str, str], key: frozenset) -> list[Out]:
        """Score a candidate of the gate on the held-out split. With ``sequential``
        (and the head's per-task held-out scores known), a minibatch of
        ``sequential_first`` held-out tasks first: a candidate behind the head there,
        task for task, by more than ``sequential_slack`` tasks stops (``gate-stopped``
        in the stats) without the rest of the split; otherwise the rest is scored and
        the two parts make the candidate's held-out score."""
        first = self._gate_first(key)
        if first is None:
            return self._request(tag, state, key=key)
        tasks, head_sum = first
        self.merge.gates[tag] = (state, key, tasks, head_sum)
        return self._request(("first", tag), state, tasks, key=key)

    def _gate_first(self, key: frozenset) -> tuple[list[str], float] | None:
        """The first minibatch of the sequential gate and the head's sum on it (None:
        no sequential gate for this candidate)."""
        n, size = len(self.heldout), self.sequential_first
        if not self.sequential or n <= size or key in self._scores(None):
            return None
        head = self._detail.get(state_key(self.state))
        if head is None or len(head) < n:
            return None
        start = (self.gates_opened * size) % n
        self.gates_opened += 1
        tasks = sorted((self.heldout + self.heldout)[start:start + size])
        return tasks, sum(head[t] for t in tasks)

    def _gate_step(self, tag: tuple, score: float) -> list[Out]:
        """A part of a sequential gate is scored: stop, score the rest, or (both parts
        in) record the candidate's held-out score and answer the gate's own tag."""
        m = self.merge
        part, inner = tag
        state, key, tasks, head_sum = m.gates[inner]
        if part == "first":
            if score * len(tasks) < head_sum - self.sequential_slack:
                m.stopped.add(key)
                self.stats["gate-stopped"] = self.stats.get("gate-stopped", 0) + 1
                return self._scored(inner, score)
            rest = sorted(set(self.heldout) - set(tasks))
            m.gates[inner] = (state, key, tasks, score)
            return self._request(("rest", inner), state, rest, key=key)
        n = len(self.heldout)
        whole = (head_sum * len(tasks) + score * (n - len(tasks))) / n
        table = self._scores(None)
        table[key] = whole
        if len(table) > self.cache_states:
            self._over_cap.append(table)
        return self._scored(inner, whole)

    def _gate_score(self, key: frozenset) -> float | None:
        """A gate candidate's held-out score (None: stopped on its first minibatch)."""
        if key in self.merge.stopped:
            return None
        return self._scores(None)[key]

    # -- a candidate level with the head: the train tasks the head fails -------------

    def _failed_at_head(self, task_id: str, score: float) -> None:
        """A rollout at the head: remember the train tasks it failed (most recent last),
        forget those it passed."""
        self._failed.pop(task_id, None)
        if score < 1.0:
            self._failed[task_id] = None
            if len(self._failed) > FAILED_KEEP:
                del self._failed[next(iter(self._failed))]

    def _level_or_below(self, diffs: list[Diff], state: dict[str, str], key: frozenset,
                        score: float | None) -> list[Out]:
        """The gate's candidate did not beat the head. With ``level``, one behind it by at
        most ``LEVEL_TASKS`` held-out tasks (an edit the held-out split holds no task for
        scores level, give or take the noise) has each of its diffs scored on top of the
        head on the train tasks seen failing at the head, the head there afresh (a
        failure met once may be the noise); else (and without ``level``) its diffs are
        ``below-threshold``. Each diff is judged alone: a fused candidate level with
        the head may be a good diff and a harmful one cancelling out."""
        m = self.merge
        n = max(1, len(self.heldout))
        if self._vouched_for(diffs) and score is not None \
                and score * n >= self.score * n - VOUCH_TASKS:
            self.stats["vouched"] = self.stats.get("vouched", 0) + len(diffs)
            self._decide("committed", diffs)
            return self._commit(state, score)
        tasks = sorted(list(self._failed)[-LEVEL_TRAIN:])
        if not (self.level and score is not None and tasks
                and score * n >= self.score * n - LEVEL_TASKS):
            self._decide("below-threshold", diffs)
            return self._no_commit()
        m.cand, m.cand_state, m.cand_key, m.cand_score = diffs, state, key, score
        m.stage = "train-check"
        m.control_tasks = tasks
        m.probe_keys = {j: self._candidate_key(d.ops, None) for j, d in enumerate(diffs)}
        m.waiting = {("tc", j) for j in range(len(diffs))} | {("tc", "head")}
        if self.noise.variance() == 0.0:   # measured deterministic: it fails them again
            self._scores(tasks)[state_key(self.state)] = 0.0
            m.waiting.discard(("tc", "head"))
        out: list[Out] = []
        for j, d in enumerate(diffs):
            out += self._request(("tc", j), apply(self.state, [d]), tasks, key=m.probe_keys[j])
        if ("tc", "head") not in m.waiting:
            return out
        return out + self._request(("tc", "head"), self.state, tasks, fresh=True)

    def _vouched_on(self, diff: Diff, task_id: str) -> None:
        """``diff`` passed the screen on its evidence task: one more train task it fixed
        (with ``vouch``; a diff proposed again from the same task adds nothing)."""
        if not self.vouch:
            return
        key = frozenset(diff.ops.items())
        tasks = self._vouch.pop(key, set())
        tasks.add(task_id)
        self._vouch[key] = tasks   # the most recent last
        if len(self._vouch) > VOUCH_KEEP:
            del self._vouch[next(iter(self._vouch))]

    def _vouched_for(self, diffs: list[Diff]) -> bool:
        """Whether every diff passed the screen on ``vouch`` distinct train tasks."""
        return bool(self.vouch and diffs) and all(
            len(self._vouch.get(frozenset(d.ops.items()), ())) >= self.vouch for d in diffs)

    def _train_checked(self) -> list[Out]:
        """The diffs that pass more than ``LEVEL_MARGIN`` train tasks more than the head
        are committed: all of the candidate at its held-out score, or those alone once
        their own candidate is level on the held-out split too (``level-confirm``)."""
        m = self.merge
        scores, k = self._scores(m.control_tasks), len(m.control_tasks)
        head = scores[state_key(self.state)]
        m.flagged = [j for j in range(len(m.cand))
                     if (scores[m.probe_keys[j]] - head) * k > LEVEL_MARGIN]
        self.stats["level-checked"] = self.stats.get("level-checked", 0) + 1
        if len(m.flagged) == len(m.cand):
            return self._level_commit(m.cand, m.cand_state, m.cand_score)
        if not m.flagged:
            self._decide("below-threshold", m.cand)
            return self._no_commit()
        m.confirm_state = apply(self.state, [m.cand[j] for j in m.flagged])
        m.confirm_key = state_key(m.confirm_state)
        m.stage = "level-confirm"
        m.waiting = {"level"}
        return self._held_out("level", m.confirm_state, m.confirm_key)

    def _level_confirmed(self) -> list[Out]:
        m = self.merge
        score = self._gate_score(m.confirm_key)
        n = max(1, len(self.heldout))
        if score is None or score * n < self.score * n - LEVEL_TASKS:
            self._decide("below-threshold", m.cand)
            return self._no_commit()
        kept = [m.cand[j] for j in m.flagged]
        self._decide("below-threshold", [d for j, d in enumerate(m.cand) if j not in m.flagged])
        return self._level_commit(kept, m.confirm_state, score)

    def _level_commit(self, diffs: list[Diff], state: dict[str, str],
                      score: float) -> list[Out]:
        self.stats["level-committed"] = self.stats.get("level-committed", 0) + len(diffs)
        self._decide("committed", diffs)
        return self._commit(state, score)
