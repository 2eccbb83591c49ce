"""Attribution by group testing: which parts of a candidate hold it back. Pure.

A candidate state ``base`` failed some held-out tasks. Each *unit* is a set of edits
that can be taken back out of it (a diff fused into a commit: its keys revert to the
head's values; an accepted key of the head: it is deleted). A :class:`Probe` scores
``base`` with a group of units removed on those failing tasks only, and narrows down
to the single units whose removal repairs tasks: first every unit in groups of
``group`` (one eval each; by default single units while half the evals cover them),
then each group that repaired something split in halves, down to single units. A
first eval of ``base`` itself on the same tasks is the control the groups are
compared with (the failing tasks were picked on one noisy eval). Every eval is on the few failing tasks, never the whole
held-out split, and there are at most ``max_evals`` of them: a bounded cost per probe,
whatever the number of units. A group is "repairing" when it raises the score on
those tasks by more than ``margin`` (set by the caller to more than one task's worth
when the model is noisy, so that one lucky answer does not flag a unit).

The Merger acts on what is flagged: it scores ``base`` without the flagged units on
the whole held-out split and keeps whichever scores higher.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Removing a key: the unit's value for a key the state should not hold.
DELETE = None
#: A repairing group of at most this many units whose halves both repair nothing is
#: looked into for units that repair only together.
JOINT_MAX = 4


def without(base: dict[str, str], removals: list[dict[str, str | None]]) -> dict[str, str]:
    """``base`` with each unit's removal applied (a value: restore it; None: delete)."""
    state = dict(base)
    for removal in removals:
        for key, value in removal.items():
            if value is DELETE:
                state.pop(key, None)
            else:
                state[key] = value
    return state


@dataclass
class Probe:
    """Group testing over ``units`` (removals) of ``base`` on ``tasks``."""

    base: dict[str, str]
    units: list[dict[str, str | None]]
    tasks: list[str]
    base_score: float
    margin: float
    max_evals: int = 24
    group: int = 0
    evals: int = 0
    flagged: list[int] = field(default_factory=list)
    frontier: list[list[int]] = field(default_factory=list)
    # Per frontier entry: None, ("half", parent) or ("keep", parent, unit kept in).
    roles: list[tuple | None] = field(default_factory=list)
    parents: list[tuple[list[int], bool]] = field(default_factory=list)
    level: int = 0
    scores: dict[int, float] = field(default_factory=dict)
    #: A unit flagged alone -> what its removal repaired (the score above the base's).
    repaired: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.units)
        if not self.group:
            # Single units (leave-one-out) while half the evals cover them all; larger
            # groups only beyond (a group that holds a needed unit can hide a harmful
            # one, so groups are kept as small as the budget allows).
            self.group = max(1, -(-n // max(1, self.max_evals // 2)))
        self.frontier = [list(range(i, min(n, i + self.group))) for i in range(0, n, self.group)]

    def batch(self) -> list[tuple[int, dict[str, str]]]:
        """The next evals: (index into the frontier, state to score on ``tasks``); empty
        when the probe is done (nothing left to narrow, or out of evals)."""
        room = self.max_evals - self.evals
        if room <= 0:
            self.frontier = []
        self.frontier = self.frontier[:max(0, room)]
        self.roles = self.roles[:len(self.frontier)]
        self.scores = {}
        return [(i, without(self.base, [self.units[u] for u in g]))
                for i, g in enumerate(self.frontier)]

    def scored(self, index: int, score: float) -> None:
        self.scores[index] = score
        self.evals += 1

    def step(self) -> None:
        """Every eval of the frontier is in: keep the repairing groups, split them. A
        repairing group (of at most ``JOINT_MAX`` units) whose halves both repair
        nothing holds units that repair only together (two edits that each shadow the
        same task): two units are flagged together when a larger group holding both
        repaired as well; of more, each is kept in alone (the rest of the group
        removed), and when some of those removals still repair, the units without which
        they do not are flagged (a repair that none of them repeats was the noise)."""
        nxt: list[list[int]] = []
        roles: list[tuple | None] = []
        halves: dict[int, list[bool]] = {}
        kept: dict[int, dict[int, bool]] = {}
        for i, g in enumerate(self.frontier):
            repairs = self.scores.get(i, self.base_score) > self.base_score + self.margin
            role = self.roles[i] if i < len(self.roles) else None
            if role is not None and role[0] == "keep":
                kept.setdefault(role[1], {})[role[2]] = repairs
                continue
            if role is not None:
                halves.setdefault(role[1], []).append(repairs)
            if not repairs:
                continue
            if len(g) == 1:
                self.flagged.append(g[0])
                self.repaired[g[0]] = self.scores.get(i, self.base_score) - self.base_score
                continue
            mid = (len(g) + 1) // 2
            parent = None
            if len(g) <= JOINT_MAX:
                parent = len(self.parents)
                self.parents.append((g, self.level > 0))
            nxt += [g[:mid], g[mid:]]
            roles += [None, None] if parent is None else [("half", parent), ("half", parent)]
        for parent, got in halves.items():
            if len(got) == 2 and not any(got):
                g, confirmed = self.parents[parent]
                if len(g) == 2:
                    if confirmed:   # a larger group holding both repaired too
                        self.flagged += g
                    continue
                for u in g:
                    nxt.append([v for v in g if v != u])
                    roles.append(("keep", parent, u))
        for parent, got in kept.items():
            if any(got.values()):   # the repair holds without some unit: not the noise
                self.flagged += [u for u, repairs in got.items() if not repairs]
        self.frontier, self.roles = nxt, roles
        self.level += 1
