"""Behaviour: the actors, the policies they consult, the Python API."""

from actors.artifacts import AppendRules, ArtifactStrategy, KeyedRules, SingleSlot
from actors.errors import ConfigError, EvobusError, RunFailed
from actors.parallel import (ClusterParallel, DataParallel, ParallelConfigError,
                             ParallelStrategy, PipelineChain, PipelineParallel, SectionViolation,
                             StageRecord, TensorParallel, TensorParallelMerge,
                             assign_key_sections, section_of, shard_round_robin)
from actors.groups import (BranchCancelled, BranchContext, BudgetExhausted, Budgets,
                           GroupFailed, GroupOutcome, GroupPaused, GroupProgress, HostLimits,
                           ResumeRefused, Store, parallel, resume_group, run_group)
from actors.runtime import EvolveResult, Runtime, evolve
from actors.sampling import DifficultyWeighted, RoundRobin, TaskSampler
from protocol import Diff, Task, WorkUnit

__all__ = ["AppendRules", "ArtifactStrategy", "ClusterParallel", "ConfigError", "DataParallel",
           "Diff", "DifficultyWeighted", "EvobusError", "EvolveResult", "KeyedRules",
           "ParallelConfigError", "ParallelStrategy", "PipelineChain", "PipelineParallel",
           "RoundRobin", "Runtime", "RunFailed", "SectionViolation", "SingleSlot", "StageRecord",
           "Task", "TaskSampler", "TensorParallel", "TensorParallelMerge", "WorkUnit",
           "assign_key_sections", "evolve", "section_of", "shard_round_robin",
           "BranchCancelled", "BranchContext", "BudgetExhausted", "Budgets", "GroupFailed",
           "GroupOutcome", "GroupPaused", "GroupProgress", "HostLimits", "ResumeRefused", "Store", "parallel",
           "resume_group", "run_group"]
