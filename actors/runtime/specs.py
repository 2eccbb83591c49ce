"""What a scenario file's specs build, without starting anything: the artifact
strategy, the parallelism strategy, the tasks, the worker count. Light to import (no
pykka, no ZeroMQ): the CLI reads logs with it (actors.cli.learned) as launch runs
scenarios with it."""

from __future__ import annotations

import json
import warnings
from typing import Any

import msgspec

from actors.artifacts import AppendRules, KeyedRules, SingleSlot
from actors.policies.parallelism import (ClusterParallel, DataParallel, TensorParallel,
                                         default_parallel)
from actors.workers import code as refs
from protocol import scenario as sc

__all__ = ["build_parallel", "build_strategy", "n_workers_of", "resolve", "strategy_from_meta",
           "tasks_of"]


def resolve(spec, what: str, allow: list[str] | None = None) -> Any:
    return refs.resolve(spec, allow, what=what)


def build_strategy(spec: sc.Strategy):
    match spec:
        case sc.KeyedRulesSpec(categories=categories, title=title):
            return KeyedRules(categories=list(categories), title=title)
        case sc.AppendRulesSpec(title=title, sections=sections, section_of=section_of):
            return AppendRules(title=title, sections=tuple(sections), section_of=resolve(
                section_of, "$.strategy.section_of") if section_of else None)
        case sc.SingleSlotSpec(initial_value=value, key=key):
            return SingleSlot(initial_value=value, key=key)
    raise AssertionError(f"unknown strategy spec {spec!r}")


def strategy_from_meta(meta: dict[str, str]):
    """The artifact strategy a log's header names: the scenario's ``[strategy]``, or
    the built-in strategy evolve() recorded (``strategy``, :func:`strategy_spec`);
    None when it names none (a custom strategy, or a log older than that key)."""
    try:
        with warnings.catch_warnings():   # said when the run started, not again here
            warnings.simplefilter("ignore")
            if meta.get("scenario_toml"):
                return build_strategy(sc.parse_scenario(meta["scenario_toml"],
                                                        "the log's scenario").strategy)
            if meta.get("strategy"):
                return build_strategy(msgspec.convert(json.loads(meta["strategy"]),
                                                      sc.Strategy))
    except (ValueError, msgspec.ValidationError):   # an older schema: the caller decides
        return None
    return None


def build_parallel(spec: sc.Parallel, n_workers: int = 4, strategy: object = None):
    """The parallelism strategy ``[parallel]`` names; a DataParallel without
    ``per_worker`` is evolve()'s default round for ``n_workers`` and ``strategy``."""
    match spec:
        case sc.DataParallelSpec(per_worker=None):
            return default_parallel(n_workers, strategy)
        case sc.DataParallelSpec(per_worker=per_worker):
            return DataParallel(per_worker=None if per_worker == "shard" else per_worker)
        case sc.TensorParallelSpec(n_sections=n, keys=keys, route=route, per_worker=per_worker):
            return TensorParallel(n, keys=keys,
                                  route=resolve(route, "$.parallel.route") if route else None,
                                  per_worker=per_worker)
        case sc.ClusterParallelSpec(cluster_of=cluster_of, c=c, per_worker=per_worker):
            return ClusterParallel(resolve(cluster_of, "$.parallel.cluster_of"), c=c,
                                   per_worker=per_worker)
        case sc.CustomParallelSpec(ref=ref):
            return resolve(ref, "$.parallel.ref")
    raise AssertionError(f"unknown parallel spec {spec!r}")


def tasks_of(scenario: sc.Scenario) -> list:
    """The scenario's tasks: ``[domain] tasks`` resolved (a list, or a function called)."""
    tasks = resolve(scenario.domain.tasks, "$.domain.tasks")
    return list(tasks() if callable(tasks) else tasks)


def n_workers_of(w: sc.Workers) -> int:
    """One logical worker per worker, wherever it runs (threads, processes, remote)."""
    return w.local + w.processes + w.remote
