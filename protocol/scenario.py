"""The scenario schema: a TOML file decoded into msgspec Structs, so every error names
the field path, what was expected and what was found.

    evobus validate scenarios/router.toml
    evobus schema            # the JSON Schema of this file format, for editors
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from protocol.domain import Ref
from protocol.scenario_errors import every_error, explain, explain_syntax, raw_toml


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Scenario tables refuse unknown keys: a typo must not silently become a default."""


Reference = Annotated[str | Ref, msgspec.Meta(
    description="'package.module:attr', or a table {ref=..., args=[...], kwargs={...}}")]


class Domain(_Section, frozen=True):
    """The tasks, the reward and the agent (or run + propose), all as references."""

    tasks: Reference
    reward: Reference
    agent: Reference | None = None
    run: Reference | None = None
    propose: Reference | None = None
    #: The model gives the same output for the same artifact and task: scores are reused.
    deterministic: bool = False


class KeyedRulesSpec(_Section, frozen=True, tag="KeyedRules", tag_field="kind"):
    categories: list[str]
    title: str = "# Config (by category)"


class AppendRulesSpec(_Section, frozen=True, tag="AppendRules", tag_field="kind"):
    title: str = "# Playbook"
    #: Sections the rules are filed under (what a rule is about), the key space tensor
    #: parallelism splits; omitted, none (rules are content-addressed only).
    sections: list[str] = []
    #: ``section_of(rule text) -> section name | None``; omitted, the one declared
    #: section the rule's text names.
    section_of: Reference | None = None


class SingleSlotSpec(_Section, frozen=True, tag="SingleSlot", tag_field="kind"):
    initial_value: str = ""
    key: str = "value"


class DataParallelSpec(_Section, frozen=True, tag="DataParallel", tag_field="kind"):
    #: Tasks each worker rolls out per round (a minibatch of its shard); omitted,
    #: evolve()'s default round (4 a worker up to 4 workers, a round of 16 beyond);
    #: "shard": the whole shard.
    per_worker: Annotated[int, msgspec.Meta(ge=1)] | Literal["shard"] | None = None


class TensorParallelSpec(_Section, frozen=True, tag="TensorParallel", tag_field="kind"):
    n_sections: Annotated[int, msgspec.Meta(ge=1)]
    keys: list[str] | None = None
    route: Reference | None = None
    #: Tasks of its unit each worker rolls out per round; omitted, the whole unit.
    per_worker: Annotated[int, msgspec.Meta(ge=1)] | None = None


class ClusterParallelSpec(_Section, frozen=True, tag="ClusterParallel", tag_field="kind"):
    cluster_of: Reference
    c: Annotated[float, msgspec.Meta(ge=0)] = 1.4
    #: Tasks of its cluster each worker rolls out per round; omitted, the whole cluster.
    per_worker: Annotated[int, msgspec.Meta(ge=1)] | None = None


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
    call_concurrency: Annotated[int, msgspec.Meta(ge=1, le=256)] = 8
    allow: list[str] = []
    # Liveness of workers (docs/remote.md) in other processes, CURVE keys (a
    # directory made by `evobus keys DIR`), and environment variable *names* workers need.
    heartbeat: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    deadline: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    max_tries: Annotated[int, msgspec.Meta(ge=1)] = 3
    keys: str | None = None
    insecure: bool = False
    env: list[str] = []


#: ``[workers]`` keys that only concern workers in other processes (or machines).
_ELSEWHERE_ONLY = ("bind", "wait_seconds", "allow", "heartbeat", "deadline", "max_tries",
                   "keys", "insecure", "env")


class Budgets(_Section, frozen=True):
    max_rollouts: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_calls: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_cost: Annotated[float, msgspec.Meta(gt=0)] | None = None
    prices: dict[str, tuple[Annotated[float, msgspec.Meta(ge=0)],
                            Annotated[float, msgspec.Meta(ge=0)]]] = {}
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
    approvers: list[str] | None = None
    #: The target's output type R when it has no return annotation: a builtin's name
    #: ("int", "str", "dict", "object": any value) or an import path "package.module:Type".
    returns: str | None = None


class Tracking(_Section, frozen=True):
    """An MLflow run per evolve() run (the ``tracking`` extra; docs/scenarios.md)."""

    uri: str
    experiment: str = "evobus"
    run_name: str | None = None


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
    #: Omitted: a tolerance of 3 versions, and workers roll out on the head.
    async_ratio: Annotated[int, msgspec.Meta(ge=1)] | None = None
    staleness: Literal["full", "guarded", "reflective"] = "guarded"
    domain: Domain | None = None
    strategy: Strategy = AppendRulesSpec()
    parallel: Parallel = DataParallelSpec()
    workers: Workers = Workers()
    budgets: Budgets = Budgets()
    groups: list[GroupSpec] = []
    tracking: Tracking | None = None


class ScenarioError(ValueError):
    """A scenario file that does not fit the schema; the message names file and field."""


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; raise :class:`ScenarioError` naming the fix."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read the scenario file ({exc.strerror})") from None
    return parse_scenario(data, str(path))


_BOM = "\ufeff"


def parse_scenario(data: bytes | str, source: str = "<scenario>") -> Scenario:
    # A UTF-8 byte order mark (Windows editors write one) is not TOML syntax: drop it.
    if isinstance(data, bytes) and data.startswith(_BOM.encode()):
        data = data[len(_BOM.encode()):]
    elif isinstance(data, str) and data.startswith(_BOM):
        data = data[len(_BOM):]
    try:
        scenario = msgspec.toml.decode(data, type=Scenario)
    except msgspec.ValidationError as exc:  # name the path, expected vs found, the fix
        raise ScenarioError(_schema_errors(str(exc), data, source)) from None
    except msgspec.DecodeError as exc:
        raise ScenarioError(f"{source}: {explain_syntax(str(exc), data)}") from None
    if scenario.domain is None and not scenario.groups:
        raise ScenarioError(f"{source}: nothing to run - at `$.domain`: expected a [domain] "
                            "table (tasks, reward, agent or run + propose) or at least one "
                            "[[groups]] entry, found neither; fix: add a [domain] table")
    d = scenario.domain
    if d is not None and d.agent is None and (d.run is None or d.propose is None):
        raise ScenarioError(f"{source}: at `$.domain`: expected `agent` or both `run` and "
                            "`propose`; found neither; fix: add agent = \"module:Class\" or "
                            "both run and propose")
    if d is not None and d.agent is not None and (d.run is not None or d.propose is not None):
        raise ScenarioError(f"{source}: at `$.domain`: expected `agent` or `run`/`propose`, "
                            "found both; fix: keep one of them")
    raw = raw_toml(data)   # which keys the file sets itself (not their defaults)
    if scenario.mode == "async" and d is not None:
        b = scenario.budgets
        if all(v is None for v in (b.max_rollouts, b.max_calls, b.max_seconds,
                                   b.target_reward, b.patience, b.max_tokens, b.max_cost)):
            raise ScenarioError(f"{source}: at `$.budgets`: expected a stop condition for "
                                "mode = \"async\", found none; fix: set max_rollouts, "
                                "max_calls, max_tokens, max_cost, max_seconds, target_reward or patience under "
                                "[budgets] (async mode has no rounds and no default time limit)")
        if "rounds" in raw:
            warnings.warn(f"{source}: `rounds` has no meaning in async mode and is ignored; "
                          "stop with a [budgets] entry", RuntimeWarning, stacklevel=2)
    if scenario.mode == "sync" and d is not None:
        given = [k for k in ("async_ratio", "staleness") if k in raw]
        if given:
            warnings.warn(f"{source}: {' and '.join(f'`{k}`' for k in given)} only "
                          f"shape{'s' if len(given) == 1 else ''} mode = \"async\" and "
                          f"{'is' if len(given) == 1 else 'are'} ignored in sync mode; set "
                          "mode = \"async\" to use "
                          f"{'it' if len(given) == 1 else 'them'}", RuntimeWarning,
                          stacklevel=2)
    w = scenario.workers
    raw_workers = raw.get("workers")
    if not w.processes and not w.remote and isinstance(raw_workers, dict):
        unused = [k for k in _ELSEWHERE_ONLY if k in raw_workers]
        if unused:
            warnings.warn(f"{source}: {', '.join(f'`workers.{k}`' for k in unused)} only "
                          f"concern{'s' if len(unused) == 1 else ''} workers in other "
                          "processes, and every worker here is local (processes = remote = "
                          f"0): {'it is' if len(unused) == 1 else 'they are'} ignored",
                          RuntimeWarning, stacklevel=2)
    if w.local + w.processes + w.remote < 1 and scenario.domain is not None:
        raise ScenarioError(f"{source}: at `$.workers`: expected at least one worker, found "
                            "local = processes = remote = 0; fix: set local = 4 under [workers]")
    for i, g in enumerate(scenario.groups):
        if g.max_concurrency > g.max_items:
            raise ScenarioError(
                f"{source}: at `$.groups[{i}].max_concurrency`: expected at most max_items "
                f"({g.max_items}), found {g.max_concurrency}; fix: lower max_concurrency or "
                "raise max_items")
    return scenario


def _schema_errors(first: str, data: bytes | str, source: str) -> str:
    """The message for a file that does not fit the schema: every error of the file,
    one per line, when there are several (msgspec itself stops at the first)."""
    raw = raw_toml(data)
    errors = every_error(raw, Scenario) if raw is not None else []
    if len(errors) <= 1:
        return f"{source}: {explain(first, raw, Scenario)}"
    lines = "\n".join(f"  {explain(e, raw, Scenario)}" for e in errors)
    return f"{source}: {len(errors)} errors:\n{lines}"


def json_schema() -> dict:
    """The JSON Schema of scenario files (for editors and `evobus schema`): msgspec's,
    with a one-line description per field (protocol/scenario_notes.py)."""
    from protocol.scenario_notes import annotate

    return annotate(msgspec.json.schema(Scenario))
