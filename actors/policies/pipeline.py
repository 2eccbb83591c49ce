"""Pipeline parallelism: refused by evolve(), offered as a standalone chain with blame.

:class:`PipelineParallel` names stages (evolve() refuses it); :class:`PipelineChain` runs
them as a chain and blames the stage whose output broke a task (docs/parallelism.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from protocol.domain import WorkUnit
from actors.policies.parallelism import ParallelConfigError


def _stage_tuple(who: str, stages: Iterable[str]) -> tuple[str, ...]:
    if isinstance(stages, str):
        raise ParallelConfigError(f"{who}(stages={stages!r}): stages is a list of stage "
                                  "names, not one string")
    out = tuple(stages)
    if not out:
        raise ParallelConfigError(f"{who}(stages=[]): a pipeline needs at least one stage")
    for s in out:
        if not isinstance(s, str):
            raise ParallelConfigError(
                f"{who}(stages=...): stage names are str, got {type(s).__name__} {s!r}")
    if len(set(out)) != len(out):
        raise ParallelConfigError(f"{who}(stages={list(out)}): stage names must be unique")
    return out


@dataclass(frozen=True)
class PipelineParallel:
    """PP, as a name only: ``evolve()`` refuses it, and so does :meth:`plan`.

    ``evolve()`` evolves one artifact; pipeline parallelism needs one artifact per
    stage. ``plan`` exists so the object satisfies :class:`ParallelStrategy` and
    the refusal can name the fix; :meth:`chain` gives the :class:`PipelineChain`
    that does the real work."""

    stages: tuple[str, ...]
    name: ClassVar[str] = "PP"

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", _stage_tuple("PipelineParallel", self.stages))

    @staticmethod
    def refusal_message() -> str:
        return ("evolve() evolves one artifact; pipeline parallelism needs one artifact "
                "per stage. Use PipelineChain(stages) directly: stage order, blame, "
                "counterfactual replay.")

    def plan(self, n_workers: int, round_index: int,
             keys: Sequence[str]) -> list[WorkUnit]:
        raise ParallelConfigError(self.refusal_message())

    def chain(self) -> PipelineChain:
        return PipelineChain(self.stages)


@dataclass(frozen=True)
class StageRecord:
    """One recorded call of a pipeline stage: what it was given and what it returned."""

    stage: str
    input: Any
    output: Any = None


class CounterfactualPair(NamedTuple):
    """Re-run ``input`` through ``stage`` under the old and under the new artifact.

    The input is what the stage was actually given, so every upstream stage is
    held fixed and only this stage's artifact changes."""

    stage: str
    input: Any
    recorded_output: Any


class CounterfactualOutcome(NamedTuple):
    """One replayed input with the outputs of the old and the new stage artifact."""

    input: Any
    old_output: Any
    new_output: Any


@dataclass(frozen=True)
class PipelineChain:
    """An ordered chain of stages (upstream first), each with its own artifact.

    Blame flows back to the earliest failing stage; a blamed stage is then judged
    by counterfactual replay: its recorded inputs re-run under the old and the new
    version of its artifact, everything upstream held fixed."""

    stages: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", _stage_tuple("PipelineChain", self.stages))

    def _index(self, stage: str) -> int:
        try:
            return self.stages.index(stage)
        except ValueError:
            raise ValueError(f"{stage!r} is not a stage of this pipeline "
                             f"(stages: {list(self.stages)})") from None

    def upstream_of(self, stage: str) -> list[str]:
        """The stages before ``stage``, upstream first."""
        return list(self.stages[:self._index(stage)])

    def blame(self, stage_success: Mapping[str, bool]) -> str | None:
        """The earliest stage that failed, or None when none did.

        A stage missing from ``stage_success`` counts as a success. A downstream
        failure is charged downstream only when every stage before it succeeded.
        A name that is not a stage is refused rather than ignored."""
        unknown = sorted(set(stage_success) - set(self.stages))
        if unknown:
            raise ValueError(f"stage_success names {unknown}, which are not stages of this "
                             f"pipeline (stages: {list(self.stages)})")
        for stage in self.stages:
            if not stage_success.get(stage, True):
                return stage
        return None

    def _records(self, records: Iterable[StageRecord | Mapping[str, Any]]) -> list[StageRecord]:
        out: list[StageRecord] = []
        for r in records:
            if isinstance(r, Mapping):
                missing = {"stage", "input"} - set(r)
                if missing:
                    raise ValueError(f"stage record {dict(r)!r} lacks {sorted(missing)}")
                r = StageRecord(r["stage"], r["input"], r.get("output"))
            elif not isinstance(r, StageRecord):
                raise TypeError(f"expected a StageRecord or a mapping, got "
                                f"{type(r).__name__}")
            self._index(r.stage)
            out.append(r)
        return out

    def counterfactual_pairs(self, stage: str, records: Iterable[StageRecord | Mapping[str, Any]]
                             ) -> list[CounterfactualPair]:
        """One pair per recorded input of ``stage``, in record order.

        ``records`` may hold every stage's records (``StageRecord`` or mappings
        with ``stage``, ``input`` and optionally ``output``); only ``stage``'s are
        paired. A record of a stage not in the chain is refused."""
        self._index(stage)
        return [CounterfactualPair(r.stage, r.input, r.output)
                for r in self._records(records) if r.stage == stage]

    def replay_counterfactual(self, stage: str,
                              records: Iterable[StageRecord | Mapping[str, Any]],
                              run_stage: Callable[[Any, Any], Any],
                              old_artifact: Any, new_artifact: Any
                              ) -> list[CounterfactualOutcome]:
        """Re-run each recorded input of ``stage`` under both artifacts.

        Calls ``run_stage(old_artifact, input)`` then ``run_stage(new_artifact,
        input)`` for each pair in :meth:`counterfactual_pairs` order; an exception
        from ``run_stage`` propagates to the caller."""
        return [CounterfactualOutcome(p.input, run_stage(old_artifact, p.input),
                                      run_stage(new_artifact, p.input))
                for p in self.counterfactual_pairs(stage, records)]
