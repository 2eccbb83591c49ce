"""Which group each task belongs to, where the domain gives one: the ``cluster_of`` of a
ClusterParallel run, else a field every task's ``meta`` holds (``cluster``,
``category``, ``group``, ``topic``, ``type`` or ``kind``, the first one found).

evolve() records the groups in the log header (``task_groups``), so `evobus report` and
`evobus inspect` can count the tasks still failing per group without re-running anything.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable

from protocol import Task

__all__ = ["GROUP_KEYS", "TaskGroups", "task_groups"]

#: The ``Task.meta`` fields read as a grouping, in this order.
GROUP_KEYS = ("cluster", "category", "group", "topic", "type", "kind")


class TaskGroups:
    """Task id -> group, and what the grouping is (``by``: "cluster_of" or a meta key)."""

    def __init__(self, by: str, groups: dict[str, list[str]]):
        self.by = by
        self.groups = groups
        self._of = {t: g for g, ids in groups.items() for t in ids}

    def of(self, task_id: str) -> str | None:
        return self._of.get(task_id)

    def to_json(self) -> str:
        return json.dumps({"by": self.by, "groups": self.groups}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TaskGroups":
        data = json.loads(text)
        return cls(str(data["by"]), {str(g): [str(t) for t in ids]
                                     for g, ids in data["groups"].items()})


def task_groups(tasks: Iterable[Task], plan_with: Any = None) -> TaskGroups | None:
    """The grouping of ``tasks`` (see the module's note), or None when the domain gives
    none. A candidate that puts every task in one group, or each in its own (an id, not
    a grouping), is passed over."""
    tasks = list(tasks)
    cluster_of = getattr(plan_with, "cluster_of", None)
    candidates = [("cluster_of", lambda t: cluster_of(t.id))] if callable(cluster_of) else []
    candidates += [(k, lambda t, k=k: t.meta[k]) for k in GROUP_KEYS
                   if tasks and all(k in (t.meta or {}) for t in tasks)]
    for name, by in candidates:
        found = _grouped(tasks, by, name)
        if found is not None and 1 < len(found.groups) < len(tasks):
            return found
    return None


def _grouped(tasks: list[Task], by: Callable[[Task], Any], name: str) -> TaskGroups | None:
    groups: dict[str, list[str]] = {}
    for t in tasks:
        try:
            group = str(by(t))
        except Exception:   # noqa: BLE001 - a cluster_of that fails on a task: the
            return None     # run's own call of it raises where it plans; no grouping here
        groups.setdefault(group, []).append(t.id)
    return TaskGroups(name, groups)
