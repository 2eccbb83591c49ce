"""From a scenario file to a running topology: build the strategy objects the file
names (actors.runtime.specs) and call :func:`actors.evolve` (or run its parallel
groups)."""

from __future__ import annotations

from typing import Any, Callable

from actors.runtime.evolve import EvolveResult, evolve
from actors.runtime.runtime import make_log_directory
from actors.runtime.specs import resolve, build_parallel, build_strategy, n_workers_of, tasks_of
from actors.tracking import MlflowTracking
from actors.workers import code as refs
from protocol import scenario as sc


def evolve_kwargs(scenario: sc.Scenario, source: str = "") -> dict[str, Any]:
    """The keyword arguments of :func:`evolve` a scenario describes."""
    d = scenario.domain
    strategy, n_workers = build_strategy(scenario.strategy), n_workers_of(scenario.workers)
    kwargs: dict[str, Any] = dict(
        tasks=tasks_of(scenario), reward=resolve(d.reward, "$.domain.reward"),
        strategy=strategy, parallel=build_parallel(scenario.parallel, n_workers, strategy),
        n_workers=n_workers,
        max_concurrency=scenario.workers.max_concurrency,
        call_concurrency=scenario.workers.call_concurrency, held_out_frac=scenario.held_out_frac,
        seed=scenario.seed, log=scenario.log, deterministic=d.deterministic,
        log_meta={"scenario": source or scenario.name},
    )
    if d.agent is not None:
        agent = resolve(d.agent, "$.domain.agent")
        kwargs["agent"] = agent
    else:
        kwargs["run"] = resolve(d.run, "$.domain.run")
        kwargs["propose"] = resolve(d.propose, "$.domain.propose")
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
