"""The cross-check: diffs of one candidate that break each other's evidence. Pure (a
mixin of actors/machines/merger.py). docs/concepts.md describes it.

A diff that passed the screen fixed its own evidence task on top of the head. Fused with
the other diffs of its merge, that task should still pass; when it fails, some other
diff of the candidate breaks it: an edit broad enough to fix its own task while it
changes the answer on tasks it was never about (on a weak head such an edit scores as
well as a right one on the held-out split, and its harm shows only as the artifact
fills, when taking it back out costs a probe of the head). So before the held-out
gate, the fused candidate is scored on its diffs' evidence tasks and on a few of the
committed diffs' that the head still holds (the suite; one call a task). A task it
fails where its diff alone passed is scored on it again (a failure met once may be the
model's noise); on those that fail twice each diff is taken back out of the candidate
alone (leave-one-out), and a diff whose removal repairs a task that few other removals
repair (when most do, it was the noise) is left out of the candidate (``harmful``).
"""

from __future__ import annotations

from actors.addresses import Out
from actors.machines.candidates import apply
from protocol import Diff

#: The cross-check runs on a candidate of at least this many diffs, of which at least
#: one passed the screen on its evidence task.
CROSS_MIN = 2
#: Evidence of committed diffs the head still holds (the suite), at most this many
#: tasks of it a cross-check, in rotation; the suite keeps the latest SUITE_KEEP.
SUITE_CHECK = 8
SUITE_KEEP = 256


class Interference:
    """The cross-check of a fused candidate's diffs (mixed into the Merger)."""

    def _passed_screen(self, diff: Diff, task_id: str, score: float) -> None:
        """``diff`` passed the screen on ``task_id`` (scored ``score`` there on top of
        the head): its evidence, while it is held."""
        if self.cross:
            self._passes[id(diff)] = (task_id, score)

    def _committed_evidence(self, diffs: list[Diff]) -> None:
        """``diffs`` are committed: the evidence tasks they passed the screen on join the
        suite (task -> (the ops that fixed it, the score there))."""
        if not self.cross:
            return
        for d in diffs:
            known = self._passes.get(id(d))
            if known is not None:
                self._suite.pop(known[0], None)
                self._suite[known[0]] = (dict(d.ops), known[1])
                if len(self._suite) > SUITE_KEEP:
                    del self._suite[next(iter(self._suite))]

    def _suite_tasks(self, taken) -> list[str]:
        """Up to SUITE_CHECK suite tasks whose fix the head still holds, in rotation."""
        if not SUITE_CHECK:
            return []
        held = [t for t, (ops, _) in self._suite.items() if t not in taken
                and all(self.state.get(k) == v for k, v in ops.items())]
        if len(held) <= SUITE_CHECK:
            return held
        start = (self._suite_turn * SUITE_CHECK) % len(held)
        self._suite_turn += 1
        return (held + held)[start:start + SUITE_CHECK]

    def _cross(self) -> list[Out] | None:
        """Score the fused candidate (``m.free``) on its diffs' evidence tasks (None: no
        cross-check for this candidate)."""
        m = self.merge
        if not self.cross or m.crossed or len(m.free) < CROSS_MIN:
            return None
        owners: dict[str, list[int]] = {}
        for j, d in enumerate(m.free):
            known = self._passes.get(id(d))
            if known is not None:
                owners.setdefault(known[0], []).append(j)
        if not owners:
            return None
        m.cross_want = {t: min(self._passes[id(m.free[j])][1] for j in js)
                        for t, js in owners.items()}
        for t in self._suite_tasks(owners):
            # A diff that writes a key of the fix behind a suite task replaces that fix:
            # whether it should is the gate's to say, so it is never blamed there.
            fix = self._suite[t][0]
            owners[t] = [j for j, d in enumerate(m.free) if not fix.keys().isdisjoint(d.ops)]
            m.cross_want[t] = self._suite[t][1]
        m.crossed = True
        m.cross_owners = owners
        m.cross_tasks = sorted(owners)
        m.stage = "cross"
        m.waiting = {"cross"}
        self.stats["cross-checked"] = self.stats.get("cross-checked", 0) + 1
        return self._request("cross", apply(self.state, m.free), m.cross_tasks, fresh=True)

    def _broken(self) -> list[str]:
        """The tasks of the last cross eval the candidate did worse on than its owner."""
        m = self.merge
        got = m.per_task.get("cross", {})
        m.cross_tasks = [t for t in m.cross_tasks if got.get(t, 1.0) < m.cross_want[t]]
        return m.cross_tasks

    def _crossed(self) -> list[Out]:
        """The evidence tasks the candidate fails where its owner alone passed are scored
        on it afresh (a failure met once may be the model's noise)."""
        m = self.merge
        broken = self._broken()
        if not broken:
            return self._to_gate()
        if self.noise.variance() == 0.0:   # measured deterministic: it fails them again
            return self._cross_loo(broken)
        m.stage = "cross-control"
        m.waiting = {"cross"}
        return self._request("cross", apply(self.state, m.free), broken, fresh=True)

    def _cross_controlled(self) -> list[Out]:
        """The tasks the candidate failed twice: each diff taken back out of it alone
        on them."""
        broken = self._broken()
        if not broken:
            return self._to_gate()
        return self._cross_loo(broken)

    def _cross_loo(self, broken: list[str]) -> list[Out]:
        """Each diff taken back out of the candidate alone on the broken tasks."""
        m = self.merge
        m.stage = "cross-loo"
        m.waiting = {("xl", j) for j in range(len(m.free))}
        out: list[Out] = []
        for j in range(len(m.free)):
            rest = m.free[:j] + m.free[j + 1:]
            out += self._request(("xl", j), apply(self.state, rest), broken, fresh=True)
        return out

    def _cross_looed(self) -> list[Out]:
        """Flag the diffs whose removal repairs a broken task that few others' removal
        repairs (its owners aside), and leave them out of the candidate."""
        m = self.merge
        n = len(m.free)
        flagged: set[int] = set()
        for t in m.cross_tasks:
            owners, want = m.cross_owners[t], m.cross_want[t]
            others = [j for j in range(n) if j not in owners]
            repairers = [j for j in others
                         if m.per_task.get(("xl", j), {}).get(t, 0.0) >= want]
            if 0 < len(repairers) <= max(1, len(others) // 2):
                flagged.update(repairers)
        if flagged:
            out = [d for j, d in enumerate(m.free) if j in flagged]
            self.stats["cross-flagged"] = self.stats.get("cross-flagged", 0) + len(out)
            self._decide("harmful", out)
            m.free = [d for j, d in enumerate(m.free) if j not in flagged]
            if not m.free:
                return self._no_commit()
        return self._to_gate()
