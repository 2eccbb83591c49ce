"""What a run learned, read back from its log (the whole chain of a resumed run): the
artifact at every version, what each commit changed (which edit, proposed by which
worker on which task, in which round), the held-out evidence it was committed on,
and the tasks the head still fails. Used by ``evobus inspect --version/--history``
and by the HTML report (actors.cli.render).

Nothing is re-run or estimated: every figure is a message in the log. A commit's edit
is matched to the proposal whose ``Diff.ops`` wrote the same text at the same key
(the newest such proposal before the commit).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable

from actors.runtime.grouping import TaskGroups, task_groups
from actors.runtime.specs import build_parallel, strategy_from_meta, tasks_of
from bus.log import LogContents
from protocol import scenario as sc
from protocol import (Baseline, Commit, EvalDone, EvalRequest, LeaseDone, Open, Progress,
                      RoundClosed, Start, decode)

__all__ = ["Edit", "FailingGroup", "Learned", "Version", "failing_groups", "groups_from_meta",
           "learned_from", "read_chain", "renderer"]

#: A task scoring below this on the head is listed as still failing.
SOLVED = 0.999


@dataclass
class Edit:
    """One key of the artifact changed by a commit, and who proposed it."""

    key: str
    before: str | None
    after: str | None
    worker: str | None = None   # the worker whose rollout proposed it
    task: str | None = None     # the task that rollout was on
    round: int | None = None    # the round (async: the wave) of that rollout
    diff_id: str | None = None


@dataclass
class _Proposed(Edit):
    unit: int = 0


@dataclass
class Version:
    """The artifact at one version and how it got there."""

    version: int
    state: dict[str, str]
    t: float = 0.0
    round: int | None = None
    edits: list[Edit] = field(default_factory=list)
    heldout: float | None = None            # its held-out score, when it was scored
    previous_heldout: float | None = None   # the head's score it had to beat
    scores: dict[str, float] = field(default_factory=dict)  # per held-out task
    rollouts: int = 0   # rollouts and backend calls the run had spent when it was
    calls: int = 0      # committed (at the close of its round; 0 for v0)


@dataclass
class Learned:
    versions: list[Version] = field(default_factory=list)
    heldout_ids: list[str] = field(default_factory=list)
    #: Per task, the head's latest training rollout score (rollouts at the head version).
    train_scores: dict[str, float] = field(default_factory=dict)
    #: "round" in a synchronous run; "merge" (and waves for proposals) in an async one.
    word: str = "round"
    #: The chain's header meta (the newest segment's keys win): how tasks are grouped.
    meta: dict[str, str] = field(default_factory=dict)

    def at(self, version: int) -> Version | None:
        return next((v for v in self.versions if v.version == version), None)

    @property
    def head(self) -> Version | None:
        return self.versions[-1] if self.versions else None

    def failing(self) -> list[tuple[str, str, float]]:
        """(split, task id, score) of every task the head still fails: its held-out
        scores, then the training tasks it was last rolled out on."""
        head = self.head
        if head is None:
            return []
        out = [("held-out", t, s) for t, s in sorted(head.scores.items()) if s < SOLVED]
        out += [("train", t, s) for t, s in sorted(self.train_scores.items()) if s < SOLVED]
        return out


def learned_from(chain: Iterable[LogContents]) -> Learned:
    """Fold the messages of a log chain into a :class:`Learned`."""
    out = Learned()
    proposals: dict[tuple[str, str], Edit] = {}
    evals: dict[str, tuple] = {}   # eval id -> (state key, whole split?), held-out evals
    scored: dict[frozenset, tuple[float, dict[str, float]]] = {}
    parts: dict[frozenset, dict[str, float]] = {}   # held-out scores met in parts
    heldout: frozenset = frozenset()
    offset = 0.0
    for contents in chain:
        out.meta.update(contents.header.meta)
        for rec in contents.records:
            try:
                msg = decode(rec.body)
            except ValueError:  # a newer or damaged body: the report counts it
                continue
            t = offset + rec.t
            match msg:
                case Start(initial_state=state0) if not out.versions:
                    out.versions.append(Version(0, dict(state0), t))
                    out.word = "merge" if msg.asynchronous else "round"
                case Open(heldout_ids=ids):
                    out.heldout_ids, heldout = list(ids), frozenset(ids)
                case EvalRequest(eval_id=eid, state=state, task_ids=ids) \
                        if rec.sender == "merger" and heldout and frozenset(ids) <= heldout:
                    evals[eid] = (frozenset(state.items()), frozenset(ids) == heldout)
                case EvalDone(eval_id=eid, score=score, scores=scores) \
                        if rec.receiver == "merger" and eid in evals:
                    _scored(scored, parts, *evals.pop(eid), score, scores, heldout)
                case Baseline(heldout_reward=score) if out.versions:
                    out.versions[0].heldout = score
                    out.versions[0].scores = scored.get(_key(out.versions[0].state),
                                                        (score, {}))[1]
                case LeaseDone(kind="rollout") if rec.receiver == "merger":
                    _note_rollout(out, proposals, msg)
                case Commit(version=v, state=state) if rec.sender == "merger":
                    _commit(out, proposals, scored, v, dict(state), t)
                case RoundClosed(round=r, version=v, committed=True):
                    done = out.at(v)
                    if done is not None and done.round is None:
                        done.round = r
                case Progress(record=record, rollouts=rollouts, calls=calls) \
                        if record.committed:
                    done = out.at(record.version)
                    if done is not None:
                        done.rollouts, done.calls = rollouts, calls
                case _:
                    pass
        offset = t if contents.records else offset
    return out


def _scored(scored: dict, parts: dict, key: frozenset, whole: bool, score: float,
            scores: dict[str, float], heldout: frozenset) -> None:
    """A state's held-out score: one eval of the whole split, or the parts that cover it
    (a sequential gate scores a minibatch first, then the rest)."""
    if whole:
        scored[key] = (score, dict(scores))
        return
    mine = parts.setdefault(key, {})
    mine.update(scores)
    if frozenset(mine) == heldout:
        scored[key] = (sum(mine.values()) / len(mine), dict(mine))


def _key(state: dict[str, str]) -> frozenset:
    return frozenset(state.items())


def _note_rollout(out: Learned, proposals: dict, msg: LeaseDone) -> None:
    head = out.head
    for r in msg.results:
        if r.score is not None and head is not None and msg.version == head.version:
            out.train_scores[r.task_id] = r.score
        if r.diff is None:
            continue
        for key, text in r.diff.ops.items():
            seen = proposals.get((key, text))
            # Identical proposals of one round collapse into the first in plan order
            # (the lowest unit), as the merger dedupes them; a later round proposing it
            # again is the one a later commit took.
            if seen is None or seen.round != msg.round or msg.unit < seen.unit:
                proposals[(key, text)] = _Proposed(key, None, text, worker=msg.worker,
                                                   task=r.task_id, round=msg.round,
                                                   diff_id=r.diff.diff_id, unit=msg.unit)


def _commit(out: Learned, proposals: dict, scored: dict, version: int,
            state: dict[str, str], t: float) -> None:
    before = out.head.state if out.head is not None else {}
    previous = out.head.heldout if out.head is not None else None
    edits = []
    for key in sorted(set(before) | set(state)):
        old, new = before.get(key), state.get(key)
        if old == new:
            continue
        found = proposals.get((key, new)) if new is not None else None
        edits.append(Edit(key, old, new, **({} if found is None else dict(
            worker=found.worker, task=found.task, round=found.round,
            diff_id=found.diff_id))))
    score, scores = scored.get(_key(state), (None, {}))
    out.versions.append(Version(version, state, t, edits=edits, heldout=score,
                                previous_heldout=previous, scores=scores))
    out.train_scores = {}   # rollouts of the new head start from nothing


def renderer(meta: dict[str, str]):
    """A function rendering a state as the run's artifact strategy does (the one the
    log's header names); else one ``key: text`` line per key."""
    strategy = strategy_from_meta(meta)
    if strategy is not None:
        return strategy.render
    return lambda state: "\n".join(f"{k}: {v}" for k, v in sorted(state.items())) or "(empty)"


@dataclass
class FailingGroup:
    """The tasks of one group the head still fails, of those it was scored on."""

    group: str
    failing: list[tuple[str, str, float]]   # (split, task id, score)
    scored: int


def groups_from_meta(meta: dict[str, str]) -> TaskGroups | None:
    """The run's task groups: the header's ``task_groups`` (recorded by evolve()), else
    the ones its scenario's tasks and ``cluster_of`` give (a log written before that
    key); None when the domain gives none or its code cannot be imported here."""
    if meta.get("task_groups"):
        try:
            return TaskGroups.from_json(meta["task_groups"])
        except (ValueError, KeyError, AttributeError, TypeError):  # damaged: said as none
            return None
    if not meta.get("scenario_toml"):
        return None
    try:
        with warnings.catch_warnings():   # said when the run started, not again here
            warnings.simplefilter("ignore")
            scenario = sc.parse_scenario(meta["scenario_toml"], "the log's scenario")
            plan_with = build_parallel(scenario.parallel) \
                if isinstance(scenario.parallel, sc.ClusterParallelSpec) else None
            return task_groups(tasks_of(scenario), plan_with)
    # The domain's code, as it is here, cannot give them (not importable, changed, or
    # failing: it is the user's code): the failing tasks are listed ungrouped.
    except Exception:  # noqa: BLE001
        return None


def failing_groups(learned: Learned) -> tuple[str | None, list[FailingGroup]]:
    """What the tasks are grouped by (None: the domain gives no grouping) and the head's
    failing tasks per group, most failing first, with how many of each group's tasks it
    was scored on."""
    failing = learned.failing()
    groups = groups_from_meta(learned.meta) if failing else None
    if groups is None:
        return None, []
        return []
    head = learned.head
    scored: dict[str, int] = {}
    for task in [*head.scores, *learned.train_scores]:
        g = groups.of(task) or "(no group)"
        scored[g] = scored.get(g, 0) + 1
    by: dict[str, list[tuple[str, str, float]]] = {}
    for split, task, score in failing:
        by.setdefault(groups.of(task) or "(no group)", []).append((split, task, score))
    return groups.by, sorted((FailingGroup(g, f, scored.get(g, len(f)))
                              for g, f in by.items()),
                             key=lambda fg: (-len(fg.failing), fg.group))
