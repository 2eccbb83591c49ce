"""Behaviour: the actors, the policies they consult, the Python API."""

from actors.artifacts import AppendRules, ArtifactStrategy, KeyedRules, SingleSlot
from actors.errors import ConfigError, EvobusError, RunFailed
from actors.runtime import EvolveResult, Runtime, evolve
from protocol import Diff, Task, WorkUnit

__all__ = ["AppendRules", "ArtifactStrategy", "ConfigError", "Diff", "EvobusError",
           "EvolveResult", "KeyedRules", "Runtime", "RunFailed", "SingleSlot", "Task",
           "WorkUnit", "evolve"]
