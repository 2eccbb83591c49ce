"""Branches: the chains that lost a conflict, carried on to the next round. Pure (read
by actors/machines/merger.py; the Planner leases from ``RoundClosed.bases``).

With ``conflicts="first"`` a merge gates one diff of each conflict group; with a
single slot every chained lease's rewrite writes the one key, so at 16 workers
fifteen chains of sixteen are ``conflict`` each round and their work is lost. With
``branches`` the Merger keeps each such chain's final state as its plan unit's
*branch*: the unit's next rollout lease rolls out on it (``Lease.state``) and chains
on top, so a chain grows over several rounds. A lease on a branch comes back as one
diff against the head (the branch with the lease's edits, or the branch alone when
the lease proposed nothing), and of a conflict group the Merger gates the diff with
the best train evidence: the mean score of the last ``WINDOW`` rollouts made on the
chain's edited states, shrunk towards the head's held-out score by ``PRIOR`` rollouts
(a chain with no such rollout scores the head's); the first in plan order on a tie.

A commit rebases every branch onto the new head by its keys (the keys the branch
changed keep its text; a single slot's branch is its own text whatever the head);
a branch gated and not committed, or carried ``BRANCH_ROUNDS`` rounds, is dropped
and its unit starts again from the head. Every decision is taken from the messages
(a unit's branch is what its own leases reported; the Planner says which merge's
bases a round's leases were given, ``Branched``), so a synchronous run stays the same
run whatever the thread timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from actors.addresses import Out
from actors.machines.candidates import apply, named_diff, ops_between
from protocol import Diff, LeaseDone, RolloutResult

#: A branch is carried this many rounds at most (then its unit starts from the head).
BRANCH_ROUNDS = 6
#: A chain's evidence: its last WINDOW rollouts on edited states, shrunk towards the
#: head's held-out score by PRIOR rollouts' worth.
WINDOW = 4
PRIOR = 2.0
#: The outcome of a chain carried on by a merge that was not gated (``gate_rollouts``).
UNGATED = "ungated"
#: Merges whose bases are remembered (a round's leases name the merge they came from).
GENERATIONS = 4
#: The duel: of a conflict group of more than ``DUEL`` chains, the ``DUEL`` with the
#: best train evidence are scored on ``DUEL_TASKS`` held-out tasks (the ones after the
#: next gate's first minibatch) and the best there is gated.
DUEL = 4
DUEL_TASKS = 8


@dataclass(frozen=True)
class Branch:
    """A unit's candidate: its state, the train scores of the rollouts made on its
    edited states (in order) and the rounds it has been carried."""

    state: dict[str, str]
    scores: tuple[float, ...] = ()
    age: int = 1

    def evidence(self, prior: float) -> float:
        recent = self.scores[-WINDOW:]
        return (sum(recent) + PRIOR * prior) / (len(recent) + PRIOR)


class Branches:
    """The branches the Merger keeps: issued to the plan units, and what this round's
    leases made of them."""

    def __init__(self, rounds: int = BRANCH_ROUNDS, gate_rollouts: int | None = None) -> None:
        self.rounds = rounds
        #: A merge is gated once this many rollouts were made since the last gate; a
        #: merge before that carries every chain on (None: every merge is gated).
        self.gate_rollouts = gate_rollouts
        self.since_gate = 0
        #: The branches of each recent merge (merge -> unit -> branch), and the round ->
        #: merge whose branches that round's leases were given (``Branched``).
        self.generations: dict[int, dict[int, Branch]] = {}
        self.rounds_of: dict[int, int] = {}
        #: The head the branches kept last are against.
        self.head: dict[str, str] | None = None
        #: id(diff) -> (unit, the branch it would become): the diffs held.
        self.grown: dict[int, tuple[int, Branch]] = {}
        #: ids of the branches held again though their lease proposed nothing (no
        #: evidence task of their own to screen them on).
        self.unscreened: set[int] = set()

    def branched(self, round_: int, merge: int) -> None:
        """The Planner gave ``round_``'s leases the bases of ``merge``."""
        self.rounds_of[round_] = merge
        for old in [r for r in self.rounds_of if r < round_ - GENERATIONS]:
            del self.rounds_of[old]

    def lease(self, msg: LeaseDone, head: dict[str, str]) -> LeaseDone:
        """A rollout lease's results, recorded: each diff's evidence and the branch it
        would become. A lease that rolled out on a branch reports one diff against the
        head, on its first proposal's position (or its first rollout's)."""
        self.since_gate += len(msg.results)
        merge = self.rounds_of.get(msg.round)
        base = self.generations.get(merge, {}).get(msg.unit) if merge is not None else None
        results = msg.results
        if self.head is None:
            self.head = head
        if base is None:
            state = apply(head, [r.diff for r in results if r.diff is not None])
            for position, result in enumerate(results):
                if result.diff is not None:
                    self.grown[id(result.diff)] = (msg.unit, Branch(
                        state, _scores(results[position + 1:])))
            return msg
        state = apply(base.state, [r.diff for r in results if r.diff is not None])
        ops = ops_between(head, state)
        if not results or not ops:
            return msg
        at = next((i for i, r in enumerate(results) if r.diff is not None), 0)
        first = results[at].diff
        author = first.author if first is not None else msg.worker
        diff = named_diff(author, f"branch{msg.unit}", msg.version, ops)
        self.grown[id(diff)] = (msg.unit, Branch(state, base.scores + _scores(results),
                                                 base.age + 1))
        if first is None:
            self.unscreened.add(id(diff))
        out = [r if r.diff is None else msgspec.structs.replace(r, diff=None)
               for r in results]
        out[at] = msgspec.structs.replace(results[at], diff=diff)
        return msgspec.structs.replace(msg, results=out)

    def pick(self, group: list[Diff], head_score: float) -> Diff:
        """Of a conflict group (plan order), the diff with the best train evidence; the
        first on a tie."""
        return max(group, key=lambda d: self._evidence(d, head_score))   # max: the first

    def ranked(self, group: list[Diff], head_score: float) -> list[Diff]:
        """A conflict group by train evidence, best first (plan order on a tie)."""
        return sorted(group, key=lambda d: -self._evidence(d, head_score))

    def _evidence(self, diff: Diff, prior: float) -> float:
        known = self.grown.get(id(diff))
        return known[1].evidence(prior) if known is not None else prior

    def carries(self, flushing: bool) -> bool:
        """Whether this merge carries every chain on without a gate: fewer than
        ``gate_rollouts`` rollouts were made since the last gate (and the run is not
        flushing). A merge that does not carry is a gate: the count starts again."""
        if self.gate_rollouts is not None and self.since_gate < self.gate_rollouts \
                and not flushing:
            return True
        self.since_gate = 0
        return False

    def settle(self, merge: int, lost: list[Diff], head: dict[str, str],
               gated: bool = True) -> dict[int, dict[str, str]]:
        """Merge ``merge`` closed at ``head``: the units whose diffs lost a conflict
        (``lost``, in plan order) keep their branch for the next round, rebased onto
        ``head`` if the merge committed; a merge that carried its chains on without a
        gate (``gated`` false) does not age them. Returns the bases of the next round's
        leases (unit -> state)."""
        before = head if self.head is None else self.head
        kept: dict[int, Branch] = {}
        for d in lost:
            known = self.grown.get(id(d))
            if known is None or known[1].age >= self.rounds or known[0] in kept:
                continue
            b = known[1]
            if not gated:
                b = Branch(b.state, b.scores, b.age - 1)
            if head != before:   # rebased by its keys
                b = Branch(apply(head, [Diff("", "", 0, ops_between(before, b.state))]),
                           b.scores, b.age)
            if b.state != head:
                kept[known[0]] = b
        self.head = head
        self.generations[merge] = kept
        for old in [g for g in self.generations if g <= merge - GENERATIONS]:
            del self.generations[old]
        return {unit: b.state for unit, b in kept.items()}

    def prune(self, held: set[int]) -> None:
        """Forget the diffs no longer held (merged, or dropped as stale)."""
        self.grown = {k: v for k, v in self.grown.items() if k in held}
        self.unscreened &= held


def _scores(results: list[RolloutResult]) -> tuple[float, ...]:
    return tuple(r.score for r in results if r.score is not None)


class Duel:
    """The duel of conflicting chains on a held-out minibatch, and the merges that
    carry their chains on ungated (mixed into the Merger: it reads ``merge``,
    ``branches``, ``state`` and the score tables)."""

    def _carry(self, diffs: list[Diff]) -> list[Out]:
        """Too few rollouts since the last gate: every chain of this merge is carried
        on as its unit's branch (``ungated``), at no call."""
        m = self.merge
        m.lost, m.carried = list(diffs), True
        self._decide(UNGATED, diffs)
        return self._close(committed=False)

    def _duel(self, groups: list[list[Diff]]) -> list[Out]:
        """Score the ``DUEL`` best chains (by train evidence) of each group on the
        duel's held-out tasks; :meth:`_dueled` picks."""
        m = self.merge
        m.ranked = [self.branches.ranked(g, self.score) for g in groups]
        m.variant_tasks = self._duel_tasks()
        contenders = [d for r in m.ranked for d in r[:DUEL]]
        m.stage = "duel"
        m.waiting = {("duel", id(d)) for d in contenders}
        out: list[Out] = []
        for d in contenders:
            key = m.keys[id(d)] = self._candidate_key(d.ops, m.opkeys.get(id(d)))
            out += self._request(("duel", id(d)), apply(self.state, [d]), m.variant_tasks,
                                 key=key)
        return out

    def _duel_tasks(self) -> list[str]:
        """``DUEL_TASKS`` held-out tasks: those after the next sequential gate's first
        minibatch (the gate's tasks are not the ones its candidate was picked on)."""
        n = len(self.heldout)
        start = ((self.gates_opened + 1) * self.sequential_first) % n
        return sorted((self.heldout * 2)[start:start + min(DUEL_TASKS, n)])

    def _dueled(self) -> list[Out]:
        """Each group's chain best on the duel's tasks (the better evidence on a tie)
        goes on to the gate; the others lost."""
        m = self.merge
        scores = self._scores(m.variant_tasks)
        picked = [max(r[:DUEL], key=lambda d: scores[m.keys[id(d)]]) for r in m.ranked]
        return self._picked(m.groups, picked)
