"""From a scenario file to a running topology: build the strategy objects the file
names and call :func:`actors.evolve` (or run its parallel groups)."""

from __future__ import annotations

import json
import warnings
from typing import Any, Callable

import msgspec

from actors.artifacts import AppendRules, KeyedRules, SingleSlot
from actors.policies.parallelism import (ClusterParallel, DataParallel, TensorParallel,
                                         default_parallel)
from actors.runtime.evolve import EvolveResult, evolve
from actors.runtime.runtime import make_log_directory
from actors.tracking import MlflowTracking
from actors.workers import code as refs
from protocol import scenario as sc


def _resolve(spec, what: str, allow: list[str] | None = None) -> Any:
    return refs.resolve(spec, allow, what=what)


def build_strategy(spec: sc.Strategy):
    match spec:
        case sc.KeyedRulesSpec(categories=categories, title=title):
            return KeyedRules(categories=list(categories), title=title)
        case sc.AppendRulesSpec(title=title, sections=sections, section_of=section_of):
            return AppendRules(title=title, sections=tuple(sections), section_of=_resolve(
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
                                  route=_resolve(route, "$.parallel.route") if route else None,
                                  per_worker=per_worker)
        case sc.ClusterParallelSpec(cluster_of=cluster_of, c=c, per_worker=per_worker):
            return ClusterParallel(_resolve(cluster_of, "$.parallel.cluster_of"), c=c,
                                   per_worker=per_worker)
        case sc.CustomParallelSpec(ref=ref):
            return _resolve(ref, "$.parallel.ref")
    raise AssertionError(f"unknown parallel spec {spec!r}")


def tasks_of(scenario: sc.Scenario) -> list:
    """The scenario's tasks: ``[domain] tasks`` resolved (a list, or a function called)."""
    tasks = _resolve(scenario.domain.tasks, "$.domain.tasks")
    return list(tasks() if callable(tasks) else tasks)


def evolve_kwargs(scenario: sc.Scenario, source: str = "") -> dict[str, Any]:
    """The keyword arguments of :func:`evolve` a scenario describes."""
    d = scenario.domain
    strategy, n_workers = build_strategy(scenario.strategy), n_workers_of(scenario.workers)
    kwargs: dict[str, Any] = dict(
        tasks=tasks_of(scenario), reward=_resolve(d.reward, "$.domain.reward"),
        strategy=strategy, parallel=build_parallel(scenario.parallel, n_workers, strategy),
        n_workers=n_workers,
        max_concurrency=scenario.workers.max_concurrency, held_out_frac=scenario.held_out_frac,
        seed=scenario.seed, log=scenario.log, deterministic=d.deterministic,
        log_meta={"scenario": source or scenario.name},
    )
    if d.agent is not None:
        agent = _resolve(d.agent, "$.domain.agent")
        kwargs["agent"] = agent
    else:
        kwargs["run"] = _resolve(d.run, "$.domain.run")
        kwargs["propose"] = _resolve(d.propose, "$.domain.propose")
    w = scenario.workers
    if w.processes or w.remote:
        # Workers in other processes get the code as the scenario names it.
        kwargs["workers"] = w
        kwargs["refs"] = {k: v for k, v in (("tasks", d.tasks), ("reward", d.reward),
                                            ("agent", d.agent), ("run", d.run),
                                            ("propose", d.propose)) if v is not None}
    if scenario.mode == "async":
        kwargs.update(asynchronous=True, async_ratio=scenario.async_ratio,
                      staleness=scenario.staleness)
    else:
        kwargs["rounds"] = scenario.rounds
    if scenario.tracking is not None:
        t = scenario.tracking
        kwargs["tracking"] = MlflowTracking(t.uri, experiment=t.experiment,
                                            run_name=t.run_name or scenario.name)
    b = scenario.budgets
    kwargs.update(max_rollouts=b.max_rollouts, max_calls=b.max_calls,
                  max_tokens=b.max_tokens, max_cost=b.max_cost,
                  prices={k: tuple(v) for k, v in b.prices.items()} or None,
                  max_seconds=b.max_seconds, target_reward=b.target_reward,
                  patience=b.patience)
    return kwargs


def n_workers_of(w: sc.Workers) -> int:
    """One logical worker per worker, wherever it runs (threads, processes, remote)."""
    return w.local + w.processes + w.remote


def run_scenario(scenario: sc.Scenario, *, source: str = "", log: str | None = None,
                 on_progress: Callable | None = None, insecure: bool = False,
                 overwrite: bool = False) -> EvolveResult:
    """Run a scenario's domain. ``log`` overrides the scenario's; a log path that exists
    is refused unless ``overwrite``."""
    kwargs = evolve_kwargs(scenario, source)
    if insecure:  # `evobus run --insecure`
        kwargs["insecure"] = True
    if log is not None:
        kwargs["log"] = log
    if kwargs["log"]:
        make_log_directory(kwargs["log"], "--log" if log is not None else "$.log")
    return evolve(**kwargs, on_progress=on_progress, log_overwrite=overwrite)


def group_log_path(log_path: str, name: str) -> str:
    """Where ``evobus run`` writes the log of the group ``name`` beside the run's log."""
    base = log_path[:-len(".evolog")] if log_path.endswith(".evolog") else log_path
    return f"{base}.{name}.evolog"
