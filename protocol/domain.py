"""Domain types that travel inside messages: tasks, work units, diffs, rollout results,
and references to code."""

from __future__ import annotations

from typing import Any

import msgspec


class Task(msgspec.Struct, frozen=True, kw_only=False):
    """One unit of work the artifact is evaluated on. Identity is the ``id``."""

    id: str
    prompt: str
    meta: dict = {}

    # `meta` is a dict, so the generated hash would fail; ids are unique per run.
    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Task) and other.id == self.id


class WorkUnit(msgspec.Struct, frozen=True):
    """What one (logical) worker owns in one round or wave of a parallel plan.

    ``keys`` are task ids; ``section`` is the artifact section a tensor-parallel
    worker may edit; ``stage`` is the pipeline stage (pipeline parallelism only)."""

    worker: int
    keys: tuple[str, ...] | list[str]
    stage: int = 0
    section: int | None = None


#: The text of an op that deletes its key (no artifact holds an empty text).
REMOVE = ""


#: How a section's name ends in a key space: a declared key ``"name/"`` is a folder,
#: owning every key under it (``"name/r0a1b..."``, a rule filed under that section).
FOLDER = "/"


def key_section(sections: dict[str, int], key: str) -> int | None:
    """The section a key belongs to in a tensor-parallel sections map (``Start.sections``:
    declared key -> section): the key's own entry, else its folder's (for
    ``"name/rest"``, the entry ``"name/"``); None when no section owns it."""
    found = sections.get(key)
    if found is None and FOLDER in key:
        found = sections.get(key[:key.index(FOLDER) + 1])
    return found


class Diff(msgspec.Struct, frozen=True):
    """A proposed edit of the artifact: ``ops`` maps artifact keys to new text; an op
    whose text is :data:`REMOVE` (empty) deletes its key."""

    diff_id: str
    author: str
    base_version: int
    ops: dict[str, str]


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    """What one call to run or propose (``phase``) reported through ``actors.usage``,
    summed per ``model``: tokens, the cost when the agent priced it itself, the HTTP
    attempts it took and the seconds it waited throttled (docs/budgets.md)."""

    phase: str = "run"
    model: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float | None = None
    attempts: int = 0
    throttled: float = 0.0
    #: Calls made on the run's behalf inside this one (a parallel group's branches run
    #: from a rollout): they count in ``max_calls`` beside the call itself.
    calls: int = 0


class RolloutResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """One task rolled out by a worker.

    ``score`` is None when the backend failed (``error`` says how); ``diff`` is the
    proposal the worker derived from the rollout, if any. ``calls`` counts backend
    calls (run + propose, and the branches of parallel groups they started:
    ``group_calls`` of them) for the ``max_calls`` budget; ``usage`` is what those calls
    reported (empty when they reported nothing: a tuple, so that a result of scalars
    is not tracked by the garbage collector)."""

    task_id: str
    score: float | None = None
    diff: Diff | None = None
    error: str | None = None
    calls: int = 0
    usage: tuple[Usage, ...] = ()
    group_calls: int = 0


class Ref(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A callable named as data: ``ref = "package.module:attr"`` plus JSON arguments.

    The one reference type: in a scenario file (a table ``{ref=..., args=[...],
    kwargs={...}}``), in Python (``refs={"run": Ref(...)}``) and on the wire (the run's
    ``Spec``). ``call``: None calls it when args/kwargs are given or when the attribute
    is a class. ``Ref("pkg.mod:attr", kwargs={...})``: the reference may be positional.
    Unknown fields are refused: a typo in a scenario must not become a
    default (the registry admits only workers of the same package version, so a newer
    field never reaches an older reader).
    """

    ref: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    call: bool | None = None
