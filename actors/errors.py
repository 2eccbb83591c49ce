"""Every exception type of actors/: what callers catch, in one place."""

from __future__ import annotations

from protocol import JournalEntry, PendingInteraction


def describe(exc: BaseException, *, limit: int = 300, typed: bool = True) -> str:
    """An error as one line for a message or a report: ``Type: text`` (``typed``) cut to
    ``limit`` characters."""
    text = f"{type(exc).__name__}: {exc}" if typed else str(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class EvobusError(Exception):
    """Base of evobus's own errors."""


class ConfigError(EvobusError, ValueError):
    """A caller's mistake found before (or at) the first rollout; the message names the fix."""


class RetryLater(EvobusError):
    """Raise it from run, propose or an agent's method to say "not now, try again later"
    (a 429, a 503, a quota window): the worker calls again with jittered exponential
    backoff, waiting at least ``retry_after`` seconds when given, until the deadline
    (docs/budgets.md). The retried call counts once in ``max_calls``; its attempts and
    the seconds it waited are reported with the rollout. When the deadline passes, the
    call fails with :class:`Throttled` (a failed rollout: evidence, not a crash)."""

    def __init__(self, message: str = "retry later", *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Throttled(EvobusError):
    """A call was still told to retry later when its deadline passed."""


class BackendFailing(EvobusError):
    """The run halted: the backend failed every rollout of its last ``3 x n_workers``
    leases (docs/budgets.md). ``error`` names the first error; the log (``log_path``)
    is closed and resumable: fix the backend, then ``evobus resume`` it."""

    def __init__(self, error: str, log_path: str | None = None) -> None:
        super().__init__(error)
        self.error = error
        self.log_path = log_path


class RunFailed(EvobusError):
    """The runtime itself failed (an actor crashed, the bus died); carries the cause."""


class ParallelConfigError(ConfigError):
    """A parallelism strategy cannot work with the configuration it was given.

    Raised before the first rollout (``validate``) or by ``plan``; the message says
    what was expected, what was found, and the fix."""



class SectionViolation(Exception):
    """A tensor-parallel diff writes a key outside the section it was proposed from.

    ``owner`` is the section that does own ``key``, or None when no section does
    (a key outside the declared key space)."""

    def __init__(self, message: str, *, diff_id: str, key: str, section: int,
                 owner: int | None) -> None:
        super().__init__(message)
        self.diff_id = diff_id
        self.key = key
        self.section = section
        self.owner = owner


# -- parallel groups ------------------------------------------------------------------


class GroupError(EvobusError):
    """Base of the errors of parallel groups."""


class BudgetExhausted(GroupError):
    """A run budget (calls, seconds, cost units) is used up; an error of the whole group."""


class HostLimitExceeded(GroupError):
    """A host limit refuses the request (a group nested deeper than ``max_depth``)."""


class EffectInDoubt(GroupError):
    """An effect started before its group stopped (a crash) and its result was never
    recorded: it may have run, so it is not run again; its branch fails."""


class ResultTooLarge(GroupError):
    """A branch's result is larger than one message may carry: that branch fails."""


class BranchError(GroupError):
    """A branch's error known only by its text (it was raised where the object could not
    travel back, e.g. in another process)."""


class ResumeRefused(ConfigError):
    """A resume that does not fit its checkpoint: unknown or already-used interaction ids,
    no approval rights, a checkpoint that already ended. Nothing ran."""


class GroupFailed(GroupError):
    """The group failed: ``error`` is the first error (also ``__cause__``); the lists say
    which branches finished, failed, were cancelled, never started or were abandoned."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome
        self.error = outcome.error
        self.finished = outcome.finished
        self.failed = outcome.failed
        self.cancelled = outcome.cancelled
        self.never_started = outcome.never_started
        self.abandoned = outcome.abandoned
        self.effects = outcome.effects
        where = (f" at branch {outcome.error_branch}" if outcome.error_branch is not None
                 else "")
        text = f"{type(self.error).__name__}: {self.error}" if self.error else "unknown error"
        parts = [f"finished {len(self.finished)}", f"failed {len(self.failed)}",
                 f"cancelled {len(self.cancelled)}",
                 f"never started {len(self.never_started)}"]
        if self.abandoned:
            parts.append(f"abandoned {len(self.abandoned)} (still running past the "
                         "cancel deadline)")
        if self.effects:
            parts.append(f"{len(self.effects)} effect(s) already performed, not undone")
        super().__init__(f"parallel group {outcome.group_id} failed{where}: {text} "
                         f"({', '.join(parts)})")


class GroupPaused(GroupError):
    """``parallel()`` cannot return: the group waits on answers or approvals. The
    checkpoint is written; resume it with :func:`resume_group`."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome
        ids = ", ".join(p.id for p in outcome.pending_interactions)
        super().__init__(f"parallel group {outcome.group_id} is paused ({outcome.status}: "
                         f"{ids}); answer with resume_group({str(outcome.checkpoint)!r}, "
                         "user_inputs={id: answer}, approvals={id: True}) or `evobus resume "
                         f"{outcome.checkpoint} --answers FILE`")


class BranchCancelled(BaseException):
    """Raised by ``ctx.raise_if_cancelled()``: the branch stops because the group is
    stopping. A ``BaseException`` (like trio's ``Cancelled``) so ``except Exception`` in
    the target does not swallow it."""


class _Suspend(BaseException):
    """Unwinds a branch at an unanswered ``ask``/``approve``; never seen by the caller."""

    def __init__(self, pending: PendingInteraction, journal: list[JournalEntry]) -> None:
        super().__init__(pending.id)
        self.pending = pending
        self.journal = journal
