"""Parallelism strategies: for round r with N workers, who works on what.

A strategy is a pure policy the Planner consults: ``plan(n_workers, round_index,
task_ids)`` returns one :class:`~protocol.domain.WorkUnit` per worker. Plans are
deterministic functions of their arguments and of the ``observe`` calls the
strategy received (no clock, no threads, no unseeded randomness), because the
Planner is a state machine that a message log must be able to replay.

==================  =====================================  ==========================
strategy            how a round is split                   how diffs recombine
==================  =====================================  ==========================
DataParallel        disjoint task shards, rotating         merged (fuse)
TensorParallel      one section of the artifact each;      union, conflict-free by
                    with ``route=``, only the tasks whose  construction
                    edits land in that section
ClusterParallel     whole task clusters, leased by UCB     merged (fuse)
PipelineParallel    refused: use :class:`PipelineChain`    --
==================  =====================================  ==========================

``plan`` receives **task ids**; a tensor-parallel section is a set of **artifact
keys**. The two key spaces are unrelated, and ``route(task_id) -> artifact key`` is
the only bridge between them.

The order of tasks *inside* a unit is not the strategy's business: the Planner
calls ``sampler.order(unit.keys, round_index)`` (see :mod:`actors.policies.sampling`) on
every unit a strategy planned.
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from actors.artifacts import declared_keys, round_tasks
from actors.errors import ParallelConfigError, SectionViolation
from protocol.domain import REMOVE, Diff, WorkUnit, key_section
from .sampling import PASS_THRESHOLD, check_score, difficulty_weight


T = TypeVar("T")


_NO_KEY_SPACE = ("TensorParallel needs the artifact's key space: pass keys=[...] or use a "
                 "strategy that declares keys (KeyedRules); AppendRules content-addresses "
                 "its keys unless it declares sections (AppendRules(sections=[...]))")


@runtime_checkable
class ParallelStrategy(Protocol):
    """How one round of work is split across ``n_workers``.

    ``plan`` receives the round's task ids and returns one :class:`WorkUnit` per
    worker (``unit.worker`` is the logical worker index ``0..n_workers-1``).

    Optional: ``observe(unit, task_id, score) -> None``. The Planner calls it after
    every scored rollout, when the strategy defines it, so a strategy can learn
    from the work it dispatched (:class:`ClusterParallel` does). It is left out of
    this protocol on purpose, so that a strategy with ``plan`` alone still passes
    ``isinstance(s, ParallelStrategy)``. Likewise ``chain_leases`` (a bool; True when
    absent): whether a unit's tasks are alike enough that its lease chains by default
    (:func:`uses_chain`).
    """

    name: str

    def plan(self, n_workers: int, round_index: int,
             keys: Sequence[str]) -> list[WorkUnit]: ...


def shard_round_robin(items: Iterable[T], n: int) -> list[list[T]]:
    """Split ``items`` into ``n`` disjoint shards, item ``j`` going to shard ``j mod n``.

    Complete and order-preserving within a shard; shard sizes differ by at most
    one; with fewer items than shards the last shards are empty."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"shard_round_robin needs n >= 1 shards, got {n!r}")
    shards: list[list[T]] = [[] for _ in range(n)]
    for j, item in enumerate(items):
        shards[j % n].append(item)
    return shards


def _plan_args(who: str, n_workers: int, round_index: int,
               task_ids: Sequence[str]) -> list[str]:
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
        raise ParallelConfigError(f"{who}.plan() needs n_workers >= 1, got {n_workers!r}")
    if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
        raise ParallelConfigError(
            f"{who}.plan() needs a round index >= 0, got {round_index!r}")
    ids = list(task_ids)
    for t in ids:
        if not isinstance(t, str):
            raise ParallelConfigError(
                f"{who}.plan() takes task ids (str), got {type(t).__name__} {t!r}")
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dupes = sorted({t for t in ids if t in seen or seen.add(t)})
        raise ParallelConfigError(
            f"{who}.plan() got duplicate task ids {dupes}: each task is planned once "
            "per round; deduplicate the task list")
    return ids


#: How many task sets a deterministic strategy keeps its split of (one per run, usually).
_PLANS_KEPT = 16


def _kept_split(owner: object, who: str, n_workers: int, round_index: int,
                task_ids: Sequence[str], split: Callable[[tuple[str, ...]], Any]) -> Any:
    """``split(ids)`` for the validated task ids, kept on ``owner`` per
    ``(n_workers, task ids)``: a deterministic strategy plans the same task list every
    round (only the rotation changes), so the checks and the split run once per task
    set instead of once per round. Anything not seen before goes through
    :func:`_plan_args` and raises as it always did."""
    ids = tuple(task_ids)
    if type(round_index) is not int or round_index < 0:
        return split(tuple(_plan_args(who, n_workers, round_index, ids)))  # raises
    kept: dict | None = owner.__dict__.get("_kept_splits")
    if kept is None:
        kept = owner.__dict__["_kept_splits"] = {}  # frozen dataclasses too: not a field
    try:
        key = (n_workers, ids) if type(n_workers) is int else None
        found = kept.get(key) if key is not None else None
    except TypeError:  # an unhashable id: _plan_args names it
        key = found = None
    if found is None:
        found = split(tuple(_plan_args(who, n_workers, round_index, ids)))
        if key is not None:
            if len(kept) >= _PLANS_KEPT:
                kept.clear()
            kept[key] = found
    return found


def _rotated_split(items: Sequence[str], holders: Sequence[int], round_index: int,
                   section: int | None = None) -> list[WorkUnit]:
    """Split ``items`` round-robin among ``holders``; holder j takes shard (j + r) mod k."""
    k = len(holders)
    shards = shard_round_robin(items, k)
    return [WorkUnit(worker=w, keys=tuple(shards[(j + round_index) % k]), section=section)
            for j, w in enumerate(holders)]


def minibatch(unit: WorkUnit, per_worker: int | None, round_index: int) -> WorkUnit:
    """``per_worker`` tasks of ``unit``, walking through it over the rounds (the whole
    unit when it holds ``per_worker`` or fewer, or ``per_worker`` is None)."""
    keys = unit.keys
    if per_worker is None or len(keys) <= per_worker:
        return unit
    start = round_index * per_worker
    return WorkUnit(worker=unit.worker, stage=unit.stage, section=unit.section,
                    keys=tuple(keys[(start + i) % len(keys)] for i in range(per_worker)))


def _check_count(who: str, name: str, value: Any, takes: str, none_means: str) -> None:
    """Refuse an option that must be None or an integer >= 1 (a bool is not one)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ParallelConfigError(
            f"{who}({name}=...) takes {takes}, an integer >= 1, got {value!r}; {none_means}")


def _check_per_worker(who: str, per_worker: Any,
                      none_means: str = "None rolls out each worker's whole unit") -> None:
    _check_count(who, "per_worker", per_worker, "tasks per worker per round", none_means)


def _identity(key: str) -> str:
    return key


def _describe_keys(keys: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    more = f", ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return f"[{shown}{more}]"


class DataParallel:
    """DP: every worker holds the same artifact; the task ids are sharded.

    The task ids are split once, round-robin, into ``n_workers`` shards (item ``j``
    to shard ``j mod n_workers``); at round ``r`` worker ``i`` takes shard
    ``(i + r) mod n_workers``. So each round the units are disjoint and together
    cover every task exactly once, and a worker sees a different shard every round.

    ``per_worker=k`` makes the round a minibatch: worker ``i`` rolls out only ``k``
    tasks of its shard, the ``(r*k + j) mod len(shard)``-th for ``j < k`` (the whole
    shard when it holds ``k`` or fewer). Each round is still disjoint; every shard is
    walked through in ``ceil(len(shard) / k)`` rounds. Smaller rounds mean more
    merges (and held-out gates) per rollout: ``per_worker=1`` is agentdescent's
    synchronous round, task for task; ``per_worker=4`` is what ``evolve()`` plans
    with when no ``parallel`` is given and there are at most 4 workers, a round of 16
    tasks shared by more (:func:`default_parallel`; with conflicting edits settled by
    their first proposer it needs the fewest model calls on the benchmarks,
    docs/parallelism.md).
    ``DataParallel()`` (``per_worker=None``) rolls out the whole shard: it gates least
    often and spends the fewest messages a rollout.

    With more workers than tasks, the surplus shards are empty: those workers get
    a unit with no tasks (which worker idles rotates with the round). An empty
    task list gives every worker an empty unit.

    ``busy=b`` plans each round on ``b`` workers only (at most ``n_workers``): the
    task ids are sharded ``b`` ways and workers ``0..b-1`` roll them out as above;
    the others get empty units, and every worker still shares the held-out gates
    (the Scheduler spreads an evaluation over all of them). A round of 16 rollouts is
    then four chained leases of four on 16 workers as on 4, rather than sixteen
    leases of one that chain nothing (:func:`default_parallel`)."""

    name = "DP"
    #: A lease is a mixed shard: chaining its tasks pays little, unchained they go at
    #: once when calls are slow (:func:`uses_chain`; a single slot chains all the same).
    chain_leases: ClassVar[bool] = False

    def __init__(self, per_worker: int | None = None, busy: int | None = None) -> None:
        _check_per_worker("DataParallel", per_worker,
                          "None rolls out each worker's whole shard")
        _check_count("DataParallel", "busy", busy, "how many workers roll out a round",
                     "None rolls out on every worker")
        self.per_worker = per_worker
        self.busy = busy

    def plan(self, n_workers: int, round_index: int,
             keys: Sequence[str]) -> list[WorkUnit]:
        b = n_workers if self.busy is None or n_workers < 1 else min(self.busy, n_workers)
        shards = _kept_split(self, "DataParallel", b, round_index, keys,
                             lambda ids: [tuple(s) for s in shard_round_robin(ids, b)])
        k = self.per_worker
        units = []
        for j in range(b):
            shard = shards[(j + round_index) % b]
            if k is not None and len(shard) > k:
                start = round_index * k
                shard = tuple(shard[(start + i) % len(shard)] for i in range(k))
            units.append(WorkUnit(worker=j, keys=shard))
        return units + [WorkUnit(worker=j, keys=()) for j in range(b, n_workers)]

    def __repr__(self) -> str:
        args = [f"per_worker={self.per_worker}"] if self.per_worker is not None else []
        args += [f"busy={self.busy}"] if self.busy is not None else []
        return f"DataParallel({', '.join(args)})"

    def __eq__(self, other: object) -> bool:
        return (type(other) is DataParallel and other.per_worker == self.per_worker
                and other.busy == self.busy)

    def __hash__(self) -> int:
        return hash((DataParallel, self.per_worker, self.busy))


#: Tasks per worker per round when no ``parallel`` is given, at most (docs/parallelism.md
#: has the measurements that chose it).
DEFAULT_PER_WORKER = 4
#: Rollouts a default round holds, whatever the worker count: more workers share it
#: (one gate per this many rollouts; a round of 64 fused more wrong edits per gate).
DEFAULT_ROUND = 16


def round_per_worker(n_workers: int, units: int | None = None) -> int:
    """Tasks per worker (or per non-empty unit, ``units``) for a round of about
    :data:`DEFAULT_ROUND` rollouts: 4 with 1-4 workers, 2 with 8, 1 with 16 or more."""
    share = max(1, DEFAULT_ROUND // max(1, units if units is not None else n_workers))
    return min(DEFAULT_PER_WORKER, share)


def cluster_round(n_workers: int, n_clusters: int,
                  strategy: object = None) -> dict[str, int | None]:
    """The ``per_worker`` and ``busy`` of a :class:`ClusterParallel` round of the default
    size, as DataParallel's (:func:`default_parallel`): about :data:`DEFAULT_ROUND`
    rollouts in leases of :data:`DEFAULT_PER_WORKER` tasks, on at most four workers (one
    cluster each; ``busy`` when more could take one); for a strategy that declares
    its round (``round_tasks``, gated once per that many rollouts, its chains carried
    between), few enough tasks a lease that each chain meets every cluster within one
    gate (the rotation deals each busy worker a new cluster every round)."""
    cap = DEFAULT_ROUND // DEFAULT_PER_WORKER
    busy = max(1, min(n_workers, n_clusters, cap))
    total = round_tasks(strategy)
    if total is not None:
        per_worker = max(1, total // (busy * max(1, n_clusters)))
    else:
        per_worker = round_per_worker(busy)
    return {"per_worker": per_worker,
            "busy": busy if min(n_workers, n_clusters) > busy else None}


def default_parallel(n_workers: int = 4, strategy: object = None) -> DataParallel:
    """The parallelism strategy of a run that names none (or names DataParallel without
    ``per_worker``): a round of the strategy's own size when it declares
    ``round_tasks`` (tasks a round over all workers: a single slot's 64), else of
    :data:`DEFAULT_ROUND` rollouts in leases of :data:`DEFAULT_PER_WORKER` tasks;
    either on every worker up to four, on four of them with more (``busy``; the others
    share the gates), so each lease chains as many edits as at four workers (sixteen
    leases of one task at 16 workers chained nothing, and sixteen chains of eight
    carried less into a single slot's gate than four of sixteen: both reached less
    per call, docs/performance.md)."""
    busy = DEFAULT_ROUND // DEFAULT_PER_WORKER
    total = round_tasks(strategy)
    per_worker = DEFAULT_PER_WORKER if total is None \
        else -(-total // max(1, min(n_workers, busy)))
    return DataParallel(per_worker=per_worker, busy=busy if n_workers > busy else None)


def uses_chain(chain: bool | None, strategy: object, parallel: object = None) -> bool:
    """Whether a worker chains a rollout lease's proposals (``Lease.chain``,
    actors/workers/chain.py): as asked; else (``None``) always for a strategy of one
    declared key (a single slot: every diff writes the one key, so only a chain puts
    several edits in one candidate), and otherwise as the parallelism's ``chain_leases``
    says (on when it says nothing). A lease of alike tasks (a cluster, a section) chains:
    its tasks fail for the same reasons, and each rolled out on the edits before it
    proposes the fix once, not once a task. A :class:`DataParallel` lease is a mixed
    shard: unchained, its tasks are independent calls a worker makes at once when they
    are slow (actors/workers/core.py), at the same quality per call on the noisy domains
    of bench/curves.py (docs/performance.md, ninth pass)."""
    if chain is not None:
        return bool(chain)
    keys = declared_keys(strategy)
    if keys is not None and len(keys) == 1:
        return True
    return bool(getattr(parallel, "chain_leases", True))


def uses_branches(branches: bool | None, strategy: object, *, chain: bool,
                  conflicts: str) -> bool:
    """Whether the Merger carries a chain that lost a conflict on as its unit's branch
    (actors/machines/branches.py): as asked, else (``None``) for a strategy of one
    declared key (a single slot: every diff conflicts, so all but one chain a round
    would be lost); only with chained leases and ``conflicts="first"``."""
    if not chain or conflicts != "first":
        return False
    if branches is not None:
        return bool(branches)
    keys = declared_keys(strategy)
    return keys is not None and len(keys) == 1


#: Asynchronous waves planned and not yet merged, at most (1: a wave once the last
#: merge closed; 2: the next wave rolls out while the last one is merged and gated).
ASYNC_WAVES = 1


def async_pacing(n_workers: int, async_ratio: int, waves: int | None = None, *,
                 lag: int | None = None) -> dict[str, dict[str, Any]]:
    """The Planner's and the Merger's asynchronous arguments: waves paced by merges (a
    wave is planned once the one before has settled, at most ``waves`` unmerged), the
    Merger merging a settled wave at once (or before the Scheduler's backpressure,
    ``async_ratio * n_workers`` proposals, would stop rollouts), and a stale diff none
    of whose keys changed since kept as fresh (``rebase``), and a wave's merge left
    with too few diffs for a gate holding them for the next wave's (``hold_waves``,
    with the Merger's ``hold``, as a synchronous round's merge does)."""
    waves = ASYNC_WAVES if waves is None else waves
    if waves is None:   # unpaced: a wave on every ask, a merge on every proposal
        return {"planner": {}, "scheduler": {}, "merger": {}}
    return {"planner": {"waves": waves}, "scheduler": {"lag": 0 if lag is None else lag},
            "merger": {"rebase": True, "waves": True, "hold_waves": True,
                       "backlog": max(1, async_ratio * n_workers)}}


def data_parallel_from_repr(text: str) -> DataParallel | None:
    """The :class:`DataParallel` whose ``repr`` is ``text`` (as a log header records
    it), or None when ``text`` names something else."""
    if text == "DataParallel()":
        return DataParallel()
    match = re.fullmatch(r"DataParallel\((?:per_worker=([1-9][0-9]*))?(?:, )?"
                         r"(?:busy=([1-9][0-9]*))?\)", text)
    if match is None:
        return None
    per_worker, busy = (None if g is None else int(g) for g in match.groups())
    found = DataParallel(per_worker=per_worker, busy=busy)
    return found if repr(found) == text else None


def assign_key_sections(keys: Iterable[str], n: int) -> dict[str, int]:
    """Partition a declared key space into ``n`` balanced, disjoint sections.

    The keys are deduplicated and sorted, then dealt round-robin: the result does
    not depend on the input order, section sizes differ by at most one, and every
    section owns at least one key whenever ``n <= len(set(keys))`` (with more
    sections than keys, the surplus sections own nothing)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"assign_key_sections needs n >= 1 sections, got {n!r}")
    return {key: i % n for i, key in enumerate(sorted(set(keys)))}


def section_of(key: str, n: int) -> int:
    """A stable hash bucket for ``key`` in ``0..n-1`` (CRC-32 of its UTF-8 bytes).

    Stable across processes and Python versions, unlike ``hash()``. It is a bucket,
    not a partition: with ``n`` close to the number of keys some sections collect
    several keys and others **none**, and a worker owning an empty section can
    never commit. Use it only when there is no declared key space; otherwise use
    :func:`assign_key_sections`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"section_of needs n >= 1 sections, got {n!r}")
    return zlib.crc32(key.encode("utf-8")) % n


def _check_n_sections(who: str, n_sections: Any) -> None:
    if isinstance(n_sections, bool) or not isinstance(n_sections, int) or n_sections < 1:
        raise ParallelConfigError(
            f"{who}(n_sections={n_sections!r}): n_sections must be an integer >= 1")


@dataclass(frozen=True)
class TensorParallelMerge:
    """Recombine tensor-parallel diffs: a union, checked section by section.

    **The owner rule** (shared with :meth:`TensorParallel.owner_of`): with a
    declared key space ``keys``, a key's owner is its section in
    ``assign_key_sections(keys, n_sections)`` after ``normalise``; a key outside
    that space has **no** owner, so writing it is always a violation (whatever
    section the diff came from). A declared key ending in ``/`` is a folder: it owns
    every key under it (``"billing/"`` owns ``"billing/r0a1b..."``, a sectioned
    ``AppendRules`` rule), the rule the Merger applies too (``protocol.domain.key_section``).
    Without ``keys`` the owner is ``section_of(key, n_sections)``, a hash bucket (see
    its caveat).
    """

    n_sections: int
    keys: tuple[str, ...] | None = None
    normalise: Callable[[str], str] | None = field(default=None, kw_only=True)
    _sections: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_n_sections("TensorParallelMerge", self.n_sections)
        norm = self.normalise or _identity
        keys = None if self.keys is None else tuple(self.keys)
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "_sections",
                           assign_key_sections((norm(k) for k in keys or ()),
                                               self.n_sections))

    def owner_of(self, key: str) -> int | None:
        """The section that may write ``key``; None when no section may."""
        norm = (self.normalise or _identity)(key)
        if self.keys:
            return key_section(self._sections, norm)
        return section_of(norm, self.n_sections)

    def validate(self, diff: Diff, section: int) -> None:
        """Raise :class:`SectionViolation` if ``diff`` writes outside ``section``."""
        if not isinstance(section, int) or not 0 <= section < self.n_sections:
            raise ValueError(f"diff {diff.diff_id!r} was proposed from section {section!r}, "
                             f"but there are sections 0..{self.n_sections - 1}")
        owners = [(key, self.owner_of(key)) for key in diff.ops]
        outside = [(key, owner) for key, owner in owners if owner != section]
        if not outside:
            return
        key, owner = outside[0]
        where = (f"which section {owner} owns" if owner is not None
                 else "which no section owns (it is outside the declared key space)")
        more = (f" (and {len(outside) - 1} more out-of-section keys: "
                f"{[k for k, _ in outside[1:]]})" if len(outside) > 1 else "")
        raise SectionViolation(
            f"diff {diff.diff_id!r} by {diff.author!r} was proposed from section {section} "
            f"but writes key {key!r}, {where}{more}: a tensor-parallel worker may only "
            "edit keys of its own section",
            diff_id=diff.diff_id, key=key, section=section, owner=owner)

    def merge(self, base_state: Mapping[str, str],
              section_diffs: Sequence[tuple[int, Diff]]) -> tuple[dict[str, str], bool]:
        """Union ``section_diffs`` into a copy of ``base_state``: ``(state, consistent)``.

        Every diff is validated first, so a :class:`SectionViolation` leaves nothing
        half-merged. Sections are disjoint, so two sections can never write the same
        key; when several workers share a section, two of their diffs can still
        write the same key with *different* text, the union would depend on
        arrival order, and the merge reports it: ``(copy of base_state, False)``.
        ``base_state`` is never mutated."""
        for section, diff in section_diffs:
            self.validate(diff, section)
        merged = dict(base_state)
        written: dict[str, str] = {}
        for _section, diff in section_diffs:
            for key, text in diff.ops.items():
                if key in written and written[key] != text:
                    return dict(base_state), False
                written[key] = text
        merged.update(written)
        for key in [k for k, text in written.items() if text == REMOVE]:
            del merged[key]   # a deletion (protocol.REMOVE)
        return merged, True


@dataclass(frozen=True)
class TensorParallel:
    """TP: one artifact split into ``n_sections`` disjoint sections of its key space.

    Worker ``i`` owns section ``i mod n_sections`` and may only edit keys of that
    section, so the merge is a conflict-free union (:class:`TensorParallelMerge`).

    * ``keys``: the **artifact's** key space, which the sections partition
      (:func:`assign_key_sections`). The runtime fills it from the artifact
      strategy with :meth:`with_keys`, so it is rarely passed by hand.
    * ``route``: ``task_id -> artifact key``, the key a task's edits will land on.
      With it, each worker is handed only the tasks routed to its own section;
      workers sharing a section split its tasks disjointly (round-robin among
      them, rotating by round), so no task is planned twice in a round. Without
      it, tasks are sharded exactly as :class:`DataParallel` shards them and the
      section is attached, so proposals that miss the worker's section are
      rejected (and counted) by the Merger.
    * ``per_worker=k``: a minibatch round, as for :class:`DataParallel`: each worker
      rolls out ``k`` tasks of its unit a round, walking through it over the rounds
      (None, the default: the whole unit).
    * ``busy=b``: each round is planned on ``b`` workers only (at least
      ``n_sections``), as for :class:`DataParallel`: the others hold no lease and
      share the gates, so more workers do not cut a round into leases too short to chain.
    * ``normalise``: how the artifact spells a key (``KeyedRules`` lower-cases).
      It is applied to ``keys``, to every ``route`` result and in
      :meth:`owner_of`, so ``"Billing"`` and ``"billing"`` are one key.

    ``plan`` refuses, rather than drops: a task routed to a key no section owns,
    and fewer workers than sections (a section nobody owns is part of the
    artifact nobody may edit, and with ``route`` its tasks would never run).
    """

    n_sections: int
    keys: tuple[str, ...] | None = None
    route: Callable[[str], str] | None = None
    normalise: Callable[[str], str] | None = field(default=None, kw_only=True)
    per_worker: int | None = field(default=None, kw_only=True)
    busy: int | None = field(default=None, kw_only=True)
    _merge: TensorParallelMerge = field(init=False, repr=False, compare=False)

    name: ClassVar[str] = "TP"

    def __post_init__(self) -> None:
        _check_n_sections("TensorParallel", self.n_sections)
        _check_per_worker("TensorParallel", self.per_worker)
        _check_count("TensorParallel", "busy", self.busy, "how many workers roll out a round",
                     "None rolls out on every worker")
        if isinstance(self.keys, str):
            raise ParallelConfigError(
                f"TensorParallel(keys={self.keys!r}): keys is a list of artifact keys, "
                "not one string")
        keys = None if self.keys is None else tuple(self.keys)
        for k in keys or ():
            if not isinstance(k, str):
                raise ParallelConfigError(
                    f"TensorParallel(keys=...): artifact keys are str, got "
                    f"{type(k).__name__} {k!r}")
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "_merge", TensorParallelMerge(
            self.n_sections, keys, normalise=self.normalise))

    # -- configuration --------------------------------------------------------------

    def with_keys(self, keys: Iterable[str] | None,
                  normalise: Callable[[str], str] | None = None) -> TensorParallel:
        """A copy completed from the artifact strategy's declared key space.

        ``keys`` are the artifact's declared keys (None when it declares none) and
        ``normalise`` its key normaliser. Keys passed to the constructor win, but
        each must be a key the artifact declares (normalised the same way): a
        section built on a key the artifact cannot write would never commit.
        ``normalise`` replaces this strategy's normaliser when given."""
        norm = normalise or self.normalise
        declared = None if keys is None else tuple(keys)
        if self.keys is None:
            return dataclasses.replace(self, keys=declared, normalise=norm)
        if declared is not None:
            n = norm or _identity
            known = {n(k) for k in declared}
            unknown = sorted({n(k) for k in self.keys} - known)
            if unknown:
                raise ParallelConfigError(
                    f"TensorParallel(keys=...) names {unknown}, which the artifact "
                    f"strategy does not declare (it declares {_describe_keys(sorted(known))}): "
                    "drop keys= to use the artifact's own key space, or fix the names")
        return dataclasses.replace(self, normalise=norm)

    def _norm(self, normalise: Callable[[str], str] | None = None) -> Callable[[str], str]:
        return normalise or self.normalise or _identity

    def section_map(self) -> dict[str, int]:
        """``normalised artifact key -> section``; empty when there is no key space."""
        return dict(self._merge._sections) if self.keys else {}

    def owner_of(self, key: str) -> int | None:
        """The section whose worker may edit ``key``, or None: a key outside the
        declared key space (or any key, with no key space) has **no** owner, so an
        edit to it is always a section violation. Same rule as
        :meth:`TensorParallelMerge.owner_of`."""
        if not self.keys:
            return None
        return self._merge.owner_of(key)

    def merger(self) -> TensorParallelMerge:
        """The :class:`TensorParallelMerge` that enforces this strategy's partition."""
        self._check_key_space(self.normalise)
        return self._merge

    def validate(self, task_ids: Iterable[str] | None = None,
                 normalise: Callable[[str], str] | None = None, *,
                 n_workers: int | None = None) -> None:
        """Refuse a configuration TP cannot honour, before the first rollout.

        Checks ``n_sections``, that there is a key space and enough keys for every
        section to own one, that ``n_workers`` (when given) covers every section,
        and, with ``route`` and ``task_ids``, that every task routes to an owned
        key. ``normalise`` overrides this strategy's normaliser for the check."""
        sections = self._check_key_space(normalise)
        if n_workers is not None:
            self._check_workers(n_workers)
        if task_ids is not None and self.route is not None:
            self._route_all(list(task_ids), sections, self._norm(normalise))

    def _check_key_space(self, normalise: Callable[[str], str] | None) -> dict[str, int]:
        _check_n_sections("TensorParallel", self.n_sections)
        if not self.keys:
            raise ParallelConfigError(_NO_KEY_SPACE)
        norm = self._norm(normalise)
        distinct = sorted({norm(k) for k in self.keys})
        if self.n_sections > len(distinct):
            n = len(distinct)
            single = ("; SingleSlot has exactly one key, so it cannot be "
                      "tensor-parallelised" if n == 1 else "")
            raise ParallelConfigError(
                f"TensorParallel(n_sections={self.n_sections}) but the key space has "
                f"{n} key{'s' if n != 1 else ''}: lower n_sections to at most {n}, "
                f"or use DataParallel{single}")
        return assign_key_sections(distinct, self.n_sections)

    def _busy(self, n_workers: int) -> int:
        """The workers a round is planned on: ``busy`` of them (at most all)."""
        return n_workers if self.busy is None or n_workers < 1 else min(self.busy, n_workers)

    def _check_workers(self, n_workers: int) -> None:
        if self.busy is not None and self._busy(n_workers) < self.n_sections:
            raise ParallelConfigError(
                f"TensorParallel(n_sections={self.n_sections}, busy={self.busy}): a round "
                f"rolls out on {self._busy(n_workers)} worker(s), fewer than the sections, "
                f"so some section's keys could never be edited: use busy >= "
                f"{self.n_sections}, or lower n_sections")
        if n_workers < self.n_sections:
            orphans = list(range(n_workers, self.n_sections))
            raise ParallelConfigError(
                f"TensorParallel(n_sections={self.n_sections}) with {n_workers} "
                f"worker{'s' if n_workers != 1 else ''}: section"
                f"{'s' if len(orphans) > 1 else ''} {orphans} would have no owner, so "
                "no worker could ever edit their keys: use at least "
                f"{self.n_sections} workers, or lower n_sections to {n_workers}")

    def _route_all(self, task_ids: list[str], sections: Mapping[str, int],
                   norm: Callable[[str], str]) -> dict[int, list[str]]:
        assert self.route is not None
        by_section: dict[int, list[str]] = {s: [] for s in range(self.n_sections)}
        unrouted: list[str] = []
        for task_id in task_ids:
            key = self.route(task_id)
            if not isinstance(key, str):
                raise ParallelConfigError(
                    f"TensorParallel route({task_id!r}) returned {type(key).__name__} "
                    f"{key!r}; route must return the artifact key (str) the task edits")
            owner = sections.get(norm(key))
            if owner is None:
                unrouted.append(f"task {task_id!r} -> key {norm(key)!r}")
            else:
                by_section[owner].append(task_id)
        if unrouted:
            raise ParallelConfigError(
                f"TensorParallel route sends {'; '.join(unrouted)}, which no section "
                f"owns (the key space is {_describe_keys(sorted(sections))}): route every "
                "task to a declared key, or add the key to keys=")
        return by_section

    # -- the protocol ---------------------------------------------------------------

    def plan(self, n_workers: int, round_index: int,
             keys: Sequence[str]) -> list[WorkUnit]:
        """Plan one round; ``keys`` are the round's **task ids**. The checks, the split
        and ``route`` run once per task list (a pure function of it), not every round."""
        n = self.n_sections
        self._check_workers(n_workers)
        b = self._busy(n_workers)
        idle = [WorkUnit(worker=j, keys=()) for j in range(b, n_workers)]

        def split(ids: tuple[str, ...]):
            sections = self._check_key_space(None)
            if self.route is None:
                return [tuple(s) for s in shard_round_robin(ids, b)]
            return self._route_all(list(ids), sections, self._norm())

        if self.route is None:
            shards = _kept_split(self, "TensorParallel", b, round_index, keys, split)
            return [minibatch(WorkUnit(worker=i, keys=shards[(i + round_index) % b],
                                       section=i % n), self.per_worker, round_index)
                    for i in range(b)] + idle
        by_section = _kept_split(self, "TensorParallel", b, round_index, keys, split)
        units: list[WorkUnit] = []
        for s in range(n):
            units.extend(_rotated_split(by_section[s], range(s, b, n), round_index, section=s))
        return [minibatch(u, self.per_worker, round_index)
                for u in sorted(units, key=lambda u: u.worker)] + idle

    def __repr__(self) -> str:
        parts = [str(self.n_sections)]
        if self.keys is not None:
            parts.append("keys=...")
        if self.route is not None:
            parts.append("route=...")
        if self.per_worker is not None:
            parts.append(f"per_worker={self.per_worker}")
        if self.busy is not None:
            parts.append(f"busy={self.busy}")
        return f"TensorParallel({', '.join(parts)})"


@dataclass(frozen=True)
class ClusterStats:
    """What a cluster's rollouts have shown so far."""

    observations: int = 0
    room: float = 0.0      # sum of (1 - score): how much the cluster can still gain
    passes: int = 0

    @property
    def pass_rate(self) -> float:
        return self.passes / self.observations if self.observations else 0.0

    @property
    def mean_room(self) -> float:
        return self.room / self.observations if self.observations else 0.0


class ClusterParallel:
    """CP: lease whole task clusters to workers, ordered by UCB.

    ``cluster_of(task_id)`` names a task's cluster (by source, topic, difficulty
    band; the result is converted with ``str``). Every round the clusters of the
    round's tasks are ranked and worker ``i`` gets the ``i``-th ranked cluster,
    whole, in the tasks' input order:

    1. clusters never observed come first, in order of first appearance in the
       task list, so every cluster is tried before any is repeated;
    2. the others by ``mean_room * max(floor, 4p(1-p)) + c * sqrt(ln T / n)``
       where ``mean_room`` is the mean of ``1 - score`` (the room the cluster
       still has), ``p`` its pass rate (a rollout passes at ``pass_threshold``),
       ``n`` its observations and ``T`` all observations. The difficulty weight
       down-weights all-pass and all-fail clusters, which carry no learning
       signal; the bonus keeps exploring clusters with little evidence. Equal
       scores are ordered by cluster id.

    With more workers than clusters the extra workers get **empty** units: a
    cluster is never leased twice in a round, so no work is duplicated. With
    ``spread=True`` they are dealt to the ranked clusters instead (worker ``i``
    to cluster ``i mod k``) and the workers holding one cluster split its tasks
    disjointly, rotating by round.

    ``per_worker=k`` makes the round a minibatch, as for :class:`DataParallel`: a
    worker rolls out ``k`` tasks of its cluster (the ``(r*k + j) mod len``-th for
    ``j < k``), so the artifact is merged and gated after ``k`` rollouts a worker
    instead of a whole cluster each; the ``k`` ranked clusters are then dealt in a
    rotation (in round ``r`` busy worker ``i`` gets the ``(i + r) mod k``-th), so a
    worker's chain carried over rounds (a branch, actors/machines/branches.py)
    meets every cluster rather than one, and with fewer workers than clusters every
    cluster rather than only the top-ranked ones (:func:`cluster_round` sizes such a
    round). ``busy=b``: at most ``b`` workers lease a cluster a round (the others
    share the gates), as for :class:`DataParallel`.

    :meth:`observe` learns per rollout. ``plan`` changes no state, so the plan is
    a function of the task ids and of the observations received.
    """

    name = "CP"

    def __init__(self, cluster_of: Callable[[str], Any], c: float = 1.4,
                 pass_threshold: float = PASS_THRESHOLD, *, floor: float = 0.1,
                 spread: bool = False, per_worker: int | None = None,
                 busy: int | None = None) -> None:
        _check_count("ClusterParallel", "busy", busy, "how many workers lease a cluster a round",
                     "None: one a cluster, up to all")
        self.busy = busy
        _check_per_worker("ClusterParallel", per_worker, "None leases each cluster whole")
        if not callable(cluster_of):
            raise ParallelConfigError(
                f"ClusterParallel(cluster_of={cluster_of!r}): cluster_of must be a "
                "callable task_id -> cluster id")
        if not c >= 0.0:
            raise ParallelConfigError(f"ClusterParallel(c={c!r}): c must be >= 0")
        if not 0.0 < pass_threshold <= 1.0:
            raise ParallelConfigError(
                f"ClusterParallel(pass_threshold={pass_threshold!r}): it must be in (0, 1]")
        self.cluster_of = cluster_of
        self.c = float(c)
        self.pass_threshold = float(pass_threshold)
        self.floor = float(floor)
        self.spread = bool(spread)
        self.per_worker = per_worker
        self._stats: dict[str, ClusterStats] = {}
        self._total = 0

    def clusters(self, task_ids: Sequence[str]) -> dict[str, list[str]]:
        """``cluster id -> task ids``, clusters in order of first appearance."""
        grouped: dict[str, list[str]] = {}
        for task_id in task_ids:
            grouped.setdefault(str(self.cluster_of(task_id)), []).append(task_id)
        return grouped

    def score(self, cluster_id: str) -> float:
        """The cluster's UCB score now (``inf`` while it was never observed)."""
        st = self._stats.get(cluster_id)
        if st is None or st.observations == 0:
            return math.inf
        value = st.mean_room * difficulty_weight(st.pass_rate, self.floor)
        bonus = self.c * math.sqrt(math.log(self._total) / st.observations)
        return value + bonus

    def ranking(self, task_ids: Sequence[str]) -> list[str]:
        """The clusters of ``task_ids``, best lease first."""
        return self._rank(list(self.clusters(task_ids)))

    def _rank(self, ids: list[str]) -> list[str]:
        fresh = [cid for cid in ids if self.score(cid) == math.inf]
        seen = sorted((cid for cid in ids if self.score(cid) != math.inf),
                      key=lambda cid: (-self.score(cid), cid))
        return fresh + seen

    def plan(self, n_workers: int, round_index: int,
             keys: Sequence[str]) -> list[WorkUnit]:
        ids = _plan_args("ClusterParallel", n_workers, round_index, keys)
        grouped = self.clusters(ids)
        ranked = self._rank(list(grouped))
        k = len(ranked)
        if not self.spread or n_workers <= k:
            busy = min(n_workers, k, self.busy or k)
            # A minibatch round deals the ranked clusters to the busy workers in a
            # rotation over all of them: a worker's chain carried over rounds (a
            # branch) meets each cluster, not only the top-ranked ones.
            turn = round_index % k if self.per_worker is not None else 0
            units = [WorkUnit(worker=i, keys=tuple(grouped[ranked[(i + turn) % k]])
                              if i < busy else ())
                     for i in range(n_workers)]
        else:
            units = []
            for j, cid in enumerate(ranked):
                units.extend(_rotated_split(grouped[cid], range(j, n_workers, k),
                                            round_index))
            units.sort(key=lambda u: u.worker)
        return [self._minibatch(u, round_index) for u in units]

    def _minibatch(self, unit: WorkUnit, round_index: int) -> WorkUnit:
        """``per_worker`` tasks of the unit, walking through it over the rounds."""
        return minibatch(unit, self.per_worker, round_index)

    def observe(self, unit: WorkUnit, task_id: str, score: float) -> None:
        """Feed one rollout's reward into its cluster's estimate.

        ``unit`` is the unit the rollout belonged to (informational); the cluster is
        ``cluster_of(task_id)``. ``score`` must be in [0, 1]."""
        value = check_score(task_id, score)
        cid = str(self.cluster_of(task_id))
        st = self._stats.get(cid, ClusterStats())
        self._stats[cid] = ClusterStats(
            observations=st.observations + 1,
            room=st.room + (1.0 - value),
            passes=st.passes + (1 if value >= self.pass_threshold else 0))
        self._total += 1

    def stats(self) -> dict[str, ClusterStats]:
        """A copy of the per-cluster statistics, for inspection."""
        return dict(self._stats)

    def __repr__(self) -> str:
        return (f"ClusterParallel(c={self.c}, pass_threshold={self.pass_threshold}"
                + (f", per_worker={self.per_worker}" if self.per_worker else "")
                + (f", busy={self.busy}" if self.busy else "") + ")")
