"""The scenario schema: a TOML file decoded into msgspec Structs, so every error names
the field path, what was expected and what was found.

    evobus validate scenarios/router.toml
    evobus schema            # the JSON Schema of this file format, for editors
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Scenario tables refuse unknown keys: a typo must not silently become a default."""


class RefSpec(_Section, frozen=True):
    """A callable named as data: ``ref = "package.module:attr"`` plus JSON arguments."""

    ref: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    call: bool | None = None


Reference = Annotated[str | RefSpec, msgspec.Meta(
    description="'package.module:attr', or a table {ref=..., args=[...], kwargs={...}}")]


class Domain(_Section, frozen=True):
    """The tasks, the reward and the agent (or run + propose), all as references."""

    tasks: Reference
    reward: Reference
    agent: Reference | None = None
    run: Reference | None = None
    propose: Reference | None = None


class KeyedRulesSpec(_Section, frozen=True, tag="KeyedRules", tag_field="kind"):
    categories: list[str]
    title: str = "# Config (by category)"


class AppendRulesSpec(_Section, frozen=True, tag="AppendRules", tag_field="kind"):
    title: str = "# Playbook"


class SingleSlotSpec(_Section, frozen=True, tag="SingleSlot", tag_field="kind"):
    initial_value: str = ""
    key: str = "value"


class DataParallelSpec(_Section, frozen=True, tag="DataParallel", tag_field="kind"):
    pass


class TensorParallelSpec(_Section, frozen=True, tag="TensorParallel", tag_field="kind"):
    n_sections: Annotated[int, msgspec.Meta(ge=1)]
    keys: list[str] | None = None
    route: Reference | None = None


class ClusterParallelSpec(_Section, frozen=True, tag="ClusterParallel", tag_field="kind"):
    cluster_of: Reference
    c: Annotated[float, msgspec.Meta(ge=0)] = 1.4


class CustomParallelSpec(_Section, frozen=True, tag="Custom", tag_field="kind"):
    """Your own strategy: a reference to an object with ``plan()``."""

    ref: Reference


class Workers(_Section, frozen=True):
    """Where rollouts run. ``local``: worker threads in this process."""

    local: Annotated[int, msgspec.Meta(ge=0)] = 4
    processes: Annotated[int, msgspec.Meta(ge=0)] = 0
    remote: Annotated[int, msgspec.Meta(ge=0)] = 0
    bind: str | None = None
    wait_seconds: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    max_concurrency: Annotated[int, msgspec.Meta(ge=1)] | None = None
    allow: list[str] = []


class Budgets(_Section, frozen=True):
    max_rollouts: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_calls: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_seconds: Annotated[float, msgspec.Meta(gt=0)] | None = None
    target_reward: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    patience: Annotated[int, msgspec.Meta(ge=1)] | None = None


class GroupSpec(_Section, frozen=True):
    """A bounded parallel group: ``target`` fanned out over ``items``."""

    name: str
    target: Reference
    items: Reference | list[Any]
    max_concurrency: Annotated[int, msgspec.Meta(ge=1)]
    max_items: Annotated[int, msgspec.Meta(ge=1)]
    checkpoint: str | None = None


Strategy = KeyedRulesSpec | AppendRulesSpec | SingleSlotSpec
Parallel = DataParallelSpec | TensorParallelSpec | ClusterParallelSpec | CustomParallelSpec


class Scenario(_Section, frozen=True):
    """One runnable topology: mode, rounds, workers, strategy, parallelism, domain."""

    name: str = "scenario"
    mode: Literal["sync", "async"] = "sync"
    rounds: Annotated[int, msgspec.Meta(ge=1)] = 15
    seed: int = 0
    held_out_frac: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.4
    log: str | None = None
    async_ratio: Annotated[int, msgspec.Meta(ge=1)] = 3
    staleness: Literal["full", "guarded", "reflective"] = "guarded"
    domain: Domain | None = None
    strategy: Strategy = AppendRulesSpec()
    parallel: Parallel = DataParallelSpec()
    workers: Workers = Workers()
    budgets: Budgets = Budgets()
    groups: list[GroupSpec] = []


class ScenarioError(ValueError):
    """A scenario file that does not fit the schema; the message names file and field."""


_HINTS = {
    "Expected `int` >=": "use a number at least as large as the bound shown",
    "Expected `float` >=": "use a number at least as large as the bound shown",
    "Expected `float` <=": "use a number no larger than the bound shown",
    "Expected `float` >": "use a number above the bound shown",
    "Expected `float` <": "use a number below the bound shown",
    "Object contains unknown field": "remove it or fix its spelling (evobus schema lists "
                                     "every field)",
    "Expected `int`": "write a whole number without quotes",
    "Expected `float`": "write a number without quotes",
    "Expected `str`": "quote the value",
    "Expected `array`": "write a list, e.g. [\"a\", \"b\"]",
    "Expected `object`": "write a table, e.g. [section] with key = value lines",
    "Invalid enum value": "use one of the listed values",
    "Object missing required field": "add the field",
    "Invalid value": "use one of the listed values",
}


_KINDS = {
    "$.strategy.kind": "KeyedRules, AppendRules, SingleSlot",
    "$.parallel.kind": "DataParallel, TensorParallel, ClusterParallel, Custom",
    "$.mode": "sync, async",
    "$.staleness": "full, guarded, reflective",
}


def _hint(message: str) -> str:
    for where, choices in _KINDS.items():
        if message.endswith(f"`{where}`") and ("Invalid" in message or "missing" in message):
            return f"use one of: {choices}"
    for needle, hint in _HINTS.items():
        if needle in message:
            return hint
    if "must be" in message:
        return "change the value to satisfy the constraint"
    return "see `evobus schema` for the expected shape"


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; raise :class:`ScenarioError` naming the fix."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read the scenario file ({exc.strerror})") from None
    return parse_scenario(data, str(path))


def parse_scenario(data: bytes | str, source: str = "<scenario>") -> Scenario:
    try:
        scenario = msgspec.toml.decode(data, type=Scenario)
    except msgspec.ValidationError as exc:
        message = str(exc)
        raise ScenarioError(f"{source}: {message}; fix: {_hint(message)}") from None
    except msgspec.DecodeError as exc:
        raise ScenarioError(f"{source}: not valid TOML ({exc}); fix the syntax at the "
                            "position shown") from None
    if scenario.domain is None and not scenario.groups:
        raise ScenarioError(f"{source}: nothing to run - at `$.domain`: expected a [domain] "
                            "table (tasks, reward, agent or run + propose) or at least one "
                            "[[groups]] entry; add one")
    d = scenario.domain
    if d is not None and d.agent is None and (d.run is None or d.propose is None):
        raise ScenarioError(f"{source}: at `$.domain`: expected `agent` or both `run` and "
                            "`propose`; found neither; add agent = \"module:Class\" or run/propose")
    if d is not None and d.agent is not None and (d.run is not None or d.propose is not None):
        raise ScenarioError(f"{source}: at `$.domain`: `agent` and `run`/`propose` both "
                            "given; keep one of them")
    w = scenario.workers
    if w.local + w.processes + w.remote < 1 and scenario.domain is not None:
        raise ScenarioError(f"{source}: at `$.workers`: expected at least one worker, found "
                            "local = processes = remote = 0; set local = 4")
    for i, g in enumerate(scenario.groups):
        if g.max_concurrency > g.max_items:
            raise ScenarioError(
                f"{source}: at `$.groups[{i}]`: max_concurrency ({g.max_concurrency}) must be "
                f"<= max_items ({g.max_items}); lower max_concurrency or raise max_items")
    return scenario


def json_schema() -> dict:
    """The JSON Schema of scenario files (for editors and `evobus schema`)."""
    return msgspec.json.schema(Scenario)
