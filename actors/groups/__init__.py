"""Bounded parallel groups (docs/groups.md).

Layout, from the front door down:

- api: :func:`parallel`, :func:`run_group`, :func:`resume_group`
- driver: checks a call's options, starts the Collector and branch workers, drives
  them to a result or a suspension
- worker: the branch worker (a pykka thread calling the target)
- context: ``ctx`` (ask, approve, effect journal, store, nested groups)
- host: what the branches of one running group share in this process
- limits, store: host limits and budgets; the shared store
- outcome, checkpoint: what a group reports; its checkpoint file

Every decision about which branch runs when lives in :mod:`actors.machines.collector`.
"""

from actors.errors import (BranchCancelled, BranchError, BudgetExhausted, GroupError,
                           GroupFailed, GroupPaused, HostLimitExceeded, ResumeRefused)
from actors.groups.api import parallel, parallel_async, resume_group, run_group
from actors.groups.checkpoint import GroupCheckpoint, load_checkpoint
from actors.groups.context import BranchContext
from actors.groups.limits import Budgets, Consumed, HostLimits
from actors.groups.outcome import GroupOutcome, GroupProgress
from actors.groups.store import Store

__all__ = ["BranchCancelled", "BranchContext", "BranchError", "BudgetExhausted", "Budgets",
           "Consumed", "GroupCheckpoint", "GroupError", "GroupFailed", "GroupOutcome",
           "GroupPaused", "GroupProgress", "HostLimitExceeded", "HostLimits", "ResumeRefused",
           "Store", "load_checkpoint", "parallel", "parallel_async", "resume_group",
           "run_group"]
