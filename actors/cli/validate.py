"""``evobus validate SCENARIO``: every check ``evobus run`` makes before its first
rollout, none calling the user's code (:func:`load_checked`, which run uses too); and
``evobus schema``. Their arguments: actors.cli.verbs."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

from actors.openai_agent import OpenAIAgent
from actors.runtime.checks import scenario_problems
from actors.runtime.specs import build_parallel, build_strategy, n_workers_of
from protocol import Ref
from protocol.scenario import ScenarioError, json_schema, load_scenario


def _err(message: str) -> int:
    print(f"evobus: {message}", file=sys.stderr)
    return 2


def load_checked(args: argparse.Namespace):
    """The scenario ``args.scenario`` names, with every refusal `evobus run` would make
    before its first rollout checked (actors.runtime.checks.scenario_problems: nothing is
    called, no tasks built, no agent constructed); or the exit code after saying why."""

    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        return _err(str(exc) + _scenario_fix(args.scenario))
    problems = scenario_problems(scenario, args.scenario, log=args.log,
                                 overwrite=args.overwrite, insecure=args.insecure)
    if not problems and scenario.groups:   # their targets import: do they declare R?
        from actors.cli.groups import check_groups   # a scenario with groups only
        problems = [p for p in [check_groups(scenario, args.scenario,
                                             overwrite=args.overwrite)] if p is not None]
    if not problems:
        problems = [p for p in [_unpriced(scenario, args.scenario),
                                _unset_key(scenario, args.scenario)] if p is not None]
    for problem in problems:
        _err(problem)
    return 2 if problems else scenario


def _unpriced(scenario, source: str) -> str | None:
    """``max_cost`` with an OpenAIAgent whose model has no price (neither the agent's
    ``prices`` nor ``[budgets] prices``): the run would refuse at its first call, after
    writing a log; say it before, as validate. Other agents may price their own calls."""
    b, agent = scenario.budgets, _openai_agent(scenario)
    model = agent[1].get("model") if agent is not None else None
    if b.max_cost is None or not model:
        return None
    if model in (agent[1].get("prices") or {}) or model in (b.prices or {}):
        return None
    return (f"{source}: at `$.budgets.max_cost`: expected a price for the model "
            f"{model!r} (max_cost = {b.max_cost} counts the cost of every call), found none "
            f"in [budgets] prices nor the agent's prices; fix: add under [budgets] prices = "
            f'{{"{model}" = [INPUT, OUTPUT]}} (the price of 1M tokens each), or drop max_cost')


def _scenario_fix(path: str) -> str:
    """The fix for a scenario path that is no file: the scenario files of a directory
    given in its place, or what a scenario file is."""
    if os.path.isfile(path):
        return ""   # the file's own problem: the message names it and its fix
    if os.path.isfile(path + ".toml"):   # the name without its suffix
        return f"; fix: did you mean {path}.toml?"
    found = sorted(str(p) for p in Path(path).glob("*.toml")) if os.path.isdir(path) else []
    if found:
        return f"; fix: pass one of its scenario files: {', '.join(found)}"
    return ("; fix: pass the path of a scenario file (TOML: `evobus schema` prints its "
            "JSON Schema, docs/scenarios.md lists its keys)")


def _openai_agent(scenario) -> tuple[type, dict] | None:
    """(class, kwargs) of the scenario's agent when it is an OpenAIAgent (checked
    importable by scenario_problems), else None."""
    d = scenario.domain
    if d is None or not isinstance(d.agent, Ref):
        return None
    module, _, name = d.agent.ref.partition(":")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, OpenAIAgent)):
        return None
    return cls, dict(d.agent.kwargs or {})


def _unset_key(scenario, source: str) -> str | None:
    """An OpenAIAgent built here (local threads; process workers inherit this
    environment) whose ``api_key_env`` names a variable that is not set: the run would
    refuse as it builds the agent; say it as validate. Remote workers need the key on
    their side, and say so themselves."""
    agent, w = _openai_agent(scenario), scenario.workers
    if agent is None or not (w.local or w.processes):
        return None
    name = agent[1].get("api_key_env", inspect.signature(agent[0]).parameters[
        "api_key_env"].default)
    if not name or name in os.environ:
        return None
    return (f"{source}: at `$.domain.agent`: OpenAIAgent: the environment variable {name} "
            f"is not set; export {name}=<your key>, or set api_key_env to the variable "
            "that holds it (api_key_env = \"\" for an endpoint that needs no key)")


def cmd_validate(args: argparse.Namespace) -> int:
    scenario = load_checked(args)
    if isinstance(scenario, int):
        return scenario
    parts = []
    if scenario.domain is not None:
        parallel = type(scenario.parallel).__name__[:-4]
        per_worker = getattr(scenario.parallel, "per_worker", None)
        if per_worker is None and parallel == "DataParallel":   # the default round it runs
            per_worker = build_parallel(scenario.parallel, n_workers_of(scenario.workers),
                                        build_strategy(scenario.strategy)).per_worker
        if per_worker is not None:
            parallel += f"(per_worker={per_worker})"
        parts = [scenario.mode] + ([f"{scenario.rounds} rounds"] if scenario.mode == "sync"
                                   else []) + [type(scenario.strategy).__name__[:-4], parallel]
    if scenario.groups:
        names = ", ".join(g.name for g in scenario.groups)
        parts.append(f"{len(scenario.groups)} parallel group"
                     f"{'s' if len(scenario.groups) > 1 else ''}: {names}")
    print(f"{args.scenario}: ok ({', '.join(parts)})")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:

    print(json.dumps(json_schema(), indent=2, sort_keys=True))
    return 0
