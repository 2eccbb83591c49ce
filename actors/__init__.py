"""Behaviour: the actors, the policies they consult, the Python API.

General layout (each room imports only from the rooms listed after it):

- cli/       the ``evobus`` verbs, live progress, HTML reports (nothing imports it)
- replay/    rebuild control machines from a log; verify (replay); resume
- groups/    bounded parallel groups: parallel(), run_group(), resume_group()
- runtime/   Runtime (bus, actors, teardown), pykka shells, evolve(), worker pools,
             launching a scenario
- workers/   the worker loop (WorkerCore), the thread and remote workers, naming code
- machines/  the pure control machines (planner, scheduler, merger, collector, registry)
- policies/  pure strategies they consult (parallelism, pipeline, sampling)
- artifacts, errors, addresses, version, openai_agent, testing, usage, throttle:
  shared leaves

The public names below are loaded on first use, so importing one pure machine
(``actors.machines.collector``) does not start pykka or ZeroMQ.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "actors.artifacts": ["AppendRules", "ArtifactStrategy", "KeyedRules", "SingleSlot"],
    "actors.errors": ["BackendFailing", "BranchCancelled", "BudgetExhausted", "ConfigError",
                      "EvobusError", "GroupFailed", "GroupPaused", "ParallelConfigError",
                      "ResumeRefused", "RetryLater", "RunFailed", "SectionViolation",
                      "Throttled"],
    "actors.policies.parallelism": ["ClusterParallel", "DataParallel", "ParallelStrategy",
                                    "TensorParallel", "TensorParallelMerge",
                                    "assign_key_sections", "section_of", "shard_round_robin"],
    "actors.policies.pipeline": ["PipelineChain", "PipelineParallel", "StageRecord"],
    "actors.policies.sampling": ["DifficultyWeighted", "RoundRobin", "TaskSampler"],
    "actors.groups": ["BranchContext", "Budgets", "GroupOutcome", "GroupProgress",
                      "HostLimits", "Store", "parallel", "parallel_async", "resume_group",
                      "run_group"],
    "actors.runtime.evolve": ["EvolveResult", "evolve", "evolve_async"],
    "actors.runtime.runtime": ["Runtime"],
    "protocol": ["Diff", "Ref", "Task", "WorkUnit"],
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = ["AppendRules", "ArtifactStrategy", "BackendFailing", "BranchCancelled",
           "BranchContext",
           "BudgetExhausted", "Budgets", "ClusterParallel", "ConfigError", "DataParallel",
           "Diff", "DifficultyWeighted", "EvobusError", "EvolveResult", "GroupFailed",
           "GroupOutcome", "GroupPaused", "GroupProgress", "HostLimits", "KeyedRules",
           "ParallelConfigError", "ParallelStrategy", "PipelineChain", "PipelineParallel",
           "Ref", "ResumeRefused", "RetryLater", "RoundRobin", "RunFailed", "Runtime",
           "SectionViolation", "SingleSlot", "StageRecord", "Store", "Task", "TaskSampler",
           "TensorParallel", "TensorParallelMerge", "Throttled", "WorkUnit",
           "assign_key_sections",
           "evolve", "evolve_async", "parallel", "parallel_async", "resume_group",
           "run_group", "section_of", "shard_round_robin"]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what a type checker and an IDE see: the same names, eagerly
    from actors.artifacts import AppendRules, ArtifactStrategy, KeyedRules, SingleSlot
    from actors.errors import (BackendFailing, BranchCancelled, BudgetExhausted,
                               ConfigError, EvobusError, GroupFailed, GroupPaused,
                               ParallelConfigError, ResumeRefused, RetryLater, RunFailed,
                               SectionViolation, Throttled)
    from actors.groups import (BranchContext, Budgets, GroupOutcome, GroupProgress,
                               HostLimits, Store, parallel, parallel_async, resume_group,
                               run_group)
    from actors.policies.parallelism import (ClusterParallel, DataParallel,
                                             ParallelStrategy, TensorParallel,
                                             TensorParallelMerge, assign_key_sections,
                                             section_of, shard_round_robin)
    from actors.policies.pipeline import PipelineChain, PipelineParallel, StageRecord
    from actors.policies.sampling import DifficultyWeighted, RoundRobin, TaskSampler
    from actors.runtime.evolve import EvolveResult, evolve, evolve_async
    from actors.runtime.runtime import Runtime
    from protocol import Diff, Ref, Task, WorkUnit
