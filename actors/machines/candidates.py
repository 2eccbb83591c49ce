"""A merge's candidates: diffs applied to a state, a state's identity, conflicts, and
the state of one merge in progress. Pure helpers of the Merger (actors/machines/merger.py)
and of its rules (scoring.py, screening.py, probing.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.artifacts import rule_id
from actors.machines.attribution import Probe
from protocol import REMOVE, Diff


def apply(state: dict[str, str], diffs: list[Diff]) -> dict[str, str]:
    """``state`` with ``diffs`` applied in order (an op of text ``REMOVE`` deletes)."""
    new = dict(state)
    for d in diffs:
        new.update(d.ops)
    if any(REMOVE in d.ops.values() for d in diffs):
        for key in [k for k, v in new.items() if v == REMOVE]:
            del new[key]
    return new


def ops_between(before: dict[str, str], after: dict[str, str],
                keys=None) -> dict[str, str]:
    """The ops that turn ``before`` into ``after`` (a key ``after`` lacks is removed),
    over ``keys`` in their order (by default every key of either, sorted)."""
    if keys is None:
        keys = sorted(before.keys() | after.keys())
    return {k: after.get(k, REMOVE) for k in keys
            if after.get(k, REMOVE) != before.get(k, REMOVE)}


def named_diff(author: str, tag: str, version: int, ops: dict[str, str]) -> Diff:
    """A diff made of several (a chain's folded links, a branch), named by its ops so
    the same edits get the same id on every run."""
    return Diff(f"{author}:{tag}:{version}:{rule_id(repr(sorted(ops.items())))}",
                author, version, ops)


def state_key(state: dict[str, str]) -> frozenset:
    """A state's identity for the score cache and duplicate detection: its items, in any
    order (a frozenset caches its hash, so a key is hashed once however often it is
    looked up)."""
    return frozenset(state.items())


def changes(state: dict[str, str], ops: dict[str, str]) -> bool:
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
    conflicted = sorted({i for _, idx in clashes for i in idx})
    groups = components(conflicted, (idx for _, idx in clashes))
    taken = set(conflicted)
    return ([d for i, d in enumerate(diffs) if i not in taken],
            [[diffs[i] for i in g] for g in groups])


def components(members: list[int], links) -> list[list[int]]:
    """``members`` (ascending) grouped into the connected sets ``links`` (lists of members
    that belong together) make: each group ascending, the groups in the order of their
    first member."""
    parent = {i: i for i in members}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for link in links:
        for i in link[1:]:
            parent[find(i)] = find(link[0])
    groups: dict[int, list[int]] = {}
    for i in members:
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


@dataclass
class Merge:
    """One merge in progress (the Merger's and its rules' working state)."""

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
    screen_keys: dict[int, tuple[tuple[str, ...], float]] = field(default_factory=dict)
    noise_failed: set[int] = field(default_factory=set)   # evidence the head passes
    # A probe (attribution of a commit's diffs, or retiring the head's keys).
    probe: Probe | None = None
    probe_kind: str = ""
    probe_keys: dict[int, frozenset] = field(default_factory=dict)
    cand: list[Diff] = field(default_factory=list)
    cand_state: dict[str, str] = field(default_factory=dict)
    cand_score: float = 0.0
    below: list[Diff] = field(default_factory=list)   # diffs of a candidate left out
    variant_tasks: list[str] | None = None
    recheck: tuple | None = None
    confirm_state: dict[str, str] = field(default_factory=dict)
    # Retiring: the stuck tasks the head is scored on afresh, and its per-task scores.
    control_tasks: list[str] = field(default_factory=list)
    # Retiring: the screened-out edits probed with the head (task, diff), the head
    # without the flagged keys, and the blocked edits that then fix their task.
    blocked: list[tuple[str, Diff]] = field(default_factory=list)
    retired_state: dict[str, str] = field(default_factory=dict)
    unblocked: list[Diff] = field(default_factory=list)
    # Attribution: the candidate passed its gate (or not), its key, the regressions
    # that held on a second look, the diffs flagged (indices into ``cand``).
    cand_passed: bool = False
    cand_key: frozenset = frozenset()
    loo_tasks: list[str] = field(default_factory=list)
    flagged: list[int] = field(default_factory=list)
    # Per-task scores of the evals that need them (tag -> task -> score).
    per_task: dict[str, dict[str, float]] = field(default_factory=dict)
    confirm_key: frozenset = frozenset()
    # The sequential gate: tag -> (state, key, first tasks, head's sum there, then
    # the candidate's mean there), and the candidates stopped on their first tasks.
    gates: dict = field(default_factory=dict)
    stopped: set = field(default_factory=set)
    unscored: bool = False   # a budget refused some of its scoring (see _unscored)
    lost: list[Diff] = field(default_factory=list)   # conflict losers, unscored ("first")
    ranked: list[list[Diff]] = field(default_factory=list)   # groups by evidence (duel)
    carried: bool = False   # every chain carried on, ungated (branches.py)
    # The cross-check (interference.py): done once a merge; evidence task -> the
    # indices into ``free`` of the diffs that passed the screen on it; the tasks scored.
    crossed: bool = False
    cross_owners: dict[str, list[int]] = field(default_factory=dict)
    cross_tasks: list[str] = field(default_factory=list)
    cross_want: dict[str, float] = field(default_factory=dict)


