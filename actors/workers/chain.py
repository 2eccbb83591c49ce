"""A worker's chained edits (``Lease.chain``): inside one rollout lease, each proposal
is applied to the worker's own copy of the artifact, and the lease's next tasks roll
out on the edited state and propose on top of it, so one candidate can hold a sequence
of edits no single one of which beats the head (drop a phrase that breaks some tasks,
then add the phrase they need). Pure: no bus, no threads.

At the end of the lease the links are folded into diffs against the lease's base: the
links that write a common key (directly or through other links) become one diff, the
key's final text in the chain (the later link was written over the earlier); a link
whose keys no other link writes stays the diff it was. Every artifact strategy works
unchanged (a chain needs only ``render`` and ``to_diff``): a ``SingleSlot`` chain is
one rewrite, an ``AppendRules`` chain stays one diff per rule.
"""

from __future__ import annotations

import msgspec

from actors.machines.candidates import apply, components, named_diff, ops_between
from protocol import Diff, RolloutResult


class Chain:
    """The edits of one lease so far, and the state the next task rolls out on."""

    __slots__ = ("strategy", "base", "state", "rendered", "links")

    def __init__(self, strategy, state: dict[str, str], rendered: str) -> None:
        self.strategy = strategy
        self.base = state
        self.state = state
        self.rendered = rendered
        #: (position of the result in the lease, the diff it proposed on ``state``).
        self.links: list[tuple[int, Diff]] = []

    def add(self, position: int, diff: Diff) -> None:
        """The result at ``position`` proposed ``diff`` (on the chain's state): apply it."""
        self.links.append((position, diff))
        self.state = apply(self.state, [diff])
        self.rendered = self.strategy.render(self.state)

    def fold(self) -> dict[int, Diff | None]:
        """Each link's position -> the diff reported there against the base: one diff per
        group of links that share a key, on its first link's position (the rollout
        that began it); the group's other positions report none. A group whose edits
        cancel out (a key added, then removed) reports none at all."""
        out: dict[int, Diff | None] = {}
        for group in _groups([d for _, d in self.links]):
            positions = [self.links[i][0] for i in group]
            out.update(dict.fromkeys(positions))
            if len(group) == 1:
                out[positions[0]] = self.links[group[0]][1]
                continue
            keys = {k: None for i in group for k in self.links[i][1].ops}
            ops = ops_between(self.base, self.state, keys)
            if ops:
                first = self.links[group[0]][1]
                out[positions[0]] = named_diff(first.author, f"chain{len(group)}",
                                               first.base_version, ops)
        return out

    def report(self, results: list[RolloutResult]) -> list[RolloutResult]:
        """``results`` with each link's diff replaced by the folded one (or none)."""
        if len(self.links) < 2:
            return results
        folded = self.fold()
        out = list(results)
        for position, diff in folded.items():
            if out[position].diff is not diff:
                out[position] = msgspec.structs.replace(out[position], diff=diff)
        return out


def _groups(diffs: list[Diff]) -> list[list[int]]:
    """The indices of ``diffs`` grouped by shared keys (connected components), each
    group in order, the groups in the order of their first diff."""
    writers: dict[str, list[int]] = {}
    for i, d in enumerate(diffs):
        for key in d.ops:
            writers.setdefault(key, []).append(i)
    return components(list(range(len(diffs))), writers.values())
