"""The Planner: owns the parallelism strategy, the train/held-out split, the round (or
wave) counter, the budgets and the stop decision. A pure state machine (DESIGN
section 3): ``handle(msg) -> [(receiver, message), ...]``, no I/O, no clock, seeded
randomness.

Synchronous mode: plan round r, wait for ``RoundClosed(r)``, plan r + 1.
Asynchronous mode: plan a wave when the Scheduler says ``NeedWork``; every merge
closes one history entry; a stop drains the Scheduler, the Merger merges what is
left, and only then does the run finish (no completed rollout is lost).
"""

from __future__ import annotations

import logging
import random

from actors.addresses import DRIVER, MERGER, SCHEDULER, Out
from actors.machines.branches import UNGATED
from actors.machines.ids import tagged
from protocol import (Baseline, Branched, Budget, Drain, Finish, Halted, Lease, LeaseBatch, Message,
                      NeedWork, Open, Progress, RoundClosed, RoundRecord, Settled,
                      SettledBatch, Shutdown, Start, Tick, Unhalt, WaveSettled, WorkUnit)

log = logging.getLogger(__name__)


#: The backend is failing (stop reason ``backend_failing``) once this many rollout
#: leases per worker in a row, in settling order, had every rollout fail: 3 rounds of a
#: synchronous DataParallel run, 3 x n_workers leases in async mode. One rollout that
#: works resets the count: a flaky backend is evidence, not a stop.
FAILING_LEASES_PER_WORKER = 3


def split_tasks(task_ids: list[str], held_out_frac: float, seed: int) -> tuple[list[str], list[str]]:
    """Seeded split into (train, held-out); both non-empty, train keeps input order."""
    shuffled = list(task_ids)
    random.Random(seed).shuffle(shuffled)
    n_held = min(len(task_ids) - 1, max(1, round(len(task_ids) * held_out_frac)))
    held = set(shuffled[:n_held])
    return [t for t in task_ids if t not in held], [t for t in task_ids if t in held]


class Planner:
    name = "planner"

    def __init__(self, strategy, sampler=None, *, waves: int | None = None) -> None:
        self.strategy = strategy
        self.sampler = sampler
        # Async pacing (None: a wave on every ask): at most ``waves`` waves planned and
        # not yet merged; a wave is planned once the one before it has settled, and the
        # Merger hears of each settled wave (WaveSettled).
        if waves is not None and (isinstance(waves, bool) or not isinstance(waves, int)
                                  or waves < 1):
            raise ValueError(f"Planner(waves=...) takes an integer >= 1, got {waves!r}")
        self.waves = waves
        self._open: dict[int, int] = {}   # wave -> its tasks not settled yet
        self._unmerged = 0                # waves settled whose merge has not closed
        self._wanted = False              # a NeedWork held back
        self._observe = getattr(strategy, "observe", None)
        self.start: Start | None = None
        self.train: list[str] = []
        self.heldout: list[str] = []
        self.round = -1
        self.units: dict[str, WorkUnit] = {}
        # Plan unit -> the state its next rollout lease rolls out on (RoundClosed.bases),
        # and the merge that gave them (told to the Merger: Branched).
        self.bases: dict[int, dict[str, str]] = {}
        self.bases_of = -1
        self.planned = 0
        self.rollouts = 0
        self.calls = 0
        self.backend_errors = 0
        self.first_error: str | None = None
        self.failing = 0          # rollout leases in a row with every rollout failed
        self.exhausted: str | None = None  # a budget the Scheduler found spent
        self.elapsed = 0.0
        self.history: list[RoundRecord] = []
        self.without_commit = 0
        self.since_merge = 0
        self.settled: list[Settled] = []
        self.stopping: str | None = None
        self.fatal: str | None = None
        self.finished = False
        self.halted = False       # backend_failing: no plan until Unhalt (a resume)
        self.baseline_failed = False  # halted before anything was scored

    @property
    def asynchronous(self) -> bool:
        return bool(self.start and self.start.asynchronous)

    # -- the machine ------------------------------------------------------------------

    def handle(self, msg: Message) -> list[Out]:
        match msg:
            case Start():
                return self._on_start(msg)
            case Baseline(failed=str() as error, errors=errors):
                return self._halt(f"the baseline could not be scored: all {errors} "
                                  f"held-out call(s) failed; first error: {error}",
                                  baseline=True)
            case Baseline(heldout_reward=reward):
                if self.start.target_reward is not None and reward >= self.start.target_reward:
                    return self._stop("target_reward")
                return self._plan_next()
            case Settled():
                return self._on_settled(msg)
            case SettledBatch(settled=settled):
                out: list[Out] = []
                for one in settled:
                    out += self._on_settled(one)
                return out
            case RoundClosed():
                return self._on_round_closed(msg)
            case Unhalt():
                return self._unhalt()
            case NeedWork():
                if self.stopping or self.finished or self.halted or self.round < 0:
                    return []  # not open yet (the baseline plans wave 0), or stopping
                if self._paced() and not self._may_plan():
                    self._wanted = True   # planned once the wave before has settled
                    return []
                return self._plan_next()
            case Tick(elapsed=elapsed):
                self.elapsed = elapsed
                s = self.start
                if (s is not None and s.max_seconds is not None and elapsed >= s.max_seconds
                        and self.asynchronous and not self.stopping):
                    return self._stop("max_seconds")
                return []
            case _:
                log.warning("planner: unexpected %s", type(msg).__name__)
                return []

    def _on_start(self, msg: Start) -> list[Out]:
        self.start = msg
        self.train, self.heldout = split_tasks(msg.task_ids, msg.held_out_frac, msg.seed)
        out: list[Out] = []
        if msg.max_calls is not None or msg.max_tokens is not None or msg.max_cost is not None:
            # Before the baseline's scoring is asked for: it counts too.
            out.append((SCHEDULER, Budget(max_calls=msg.max_calls, max_tokens=msg.max_tokens,
                                          max_cost=msg.max_cost, prices=dict(msg.prices),
                                          calls_per_task=msg.calls_per_task)))
        return out + self._open_merger()

    def _open_merger(self) -> list[Out]:
        """Open the Merger: it scores version 0 on the held-out split (the baseline)."""
        s = self.start
        return [(MERGER, Open(heldout_ids=self.heldout, initial_state=s.initial_state,
                              sections=s.sections, lease_key=s.lease_key))]

    def _budget_left(self) -> int | None:
        if self.start.max_rollouts is None:
            return None
        return max(0, self.start.max_rollouts - self.planned)

    def _plan_next(self) -> list[Out]:
        left = self._budget_left()
        if self.asynchronous and (left == 0 or not self.train):
            return []  # nothing more to plan; the stop comes with the last settlement
        self.round += 1
        r = self.round
        units = self.strategy.plan(self.start.n_workers, r, list(self.train))
        leases = []
        prefix = "w" if self.asynchronous else "r"
        for unit in units:
            keys = list(unit.keys)
            if self.sampler is not None:
                keys = list(self.sampler.order(keys, r))
            if left is not None:
                keys = keys[:left]
                left -= len(keys)
            if not keys:
                continue
            size = self.start.lease_size or len(keys)
            for c, first in enumerate(range(0, len(keys), size)):
                lease_id = tagged(self.start.lease_key, f"{prefix}{r}.u{unit.worker}"
                                  + (f".{c}" if size < len(keys) else ""))
                lease = Lease(lease_id=lease_id, round=r, unit=unit.worker,
                              task_ids=keys[first:first + size], section=unit.section,
                              stage=unit.stage, chain=self.start.chain,
                              state=self.bases.get(unit.worker))
                self.units[lease.lease_id] = unit
                leases.append(lease)
            self.planned += len(keys)
        # max_calls is checked per settled lease in async mode (so that a crossing
        # cancels what has not started); everything else can wait for a batch.
        report_each = self.asynchronous and self.start.max_calls is not None
        if self._paced() and leases:
            self._open[r] = sum(len(lease.task_ids) for lease in leases)
        # Before the leases: the Merger hears which bases they carry before any result.
        branched: list[Out] = [(MERGER, Branched(round=r, merge=self.bases_of))] \
            if any(lease.state is not None for lease in leases) else []
        return branched + [(SCHEDULER, LeaseBatch(round=r, leases=leases,
                                                  report_each=report_each))]

    def _paced(self) -> bool:
        return self.waves is not None and self.asynchronous

    def _may_plan(self) -> bool:
        return not self._open and self._unmerged < self.waves

    def _on_settled(self, msg: Settled) -> list[Out]:
        out = self._settle_one(msg)
        if not self._paced() or self.finished:
            return out
        left = self._open.get(msg.round)
        if left is None:
            return out
        left -= len(msg.scores) + msg.skipped
        if left > 0:
            self._open[msg.round] = left
            return out
        del self._open[msg.round]
        self._unmerged += 1
        return [(MERGER, WaveSettled(wave=msg.round))] + out + self._plan_if_wanted()

    def _plan_if_wanted(self) -> list[Out]:
        if (not self._wanted or not self._may_plan() or self.stopping or self.finished
                or self.halted):
            return []
        self._wanted = False
        return self._plan_next()

    def _settle_one(self, msg: Settled) -> list[Out]:
        self.calls += msg.calls
        self.rollouts += len(msg.scores)
        self.since_merge += len(msg.scores)
        if msg.errors:
            self.backend_errors += len(msg.errors)
            if self.first_error is None:
                self.first_error = msg.errors[0]
        if msg.fatal and not self.finished:
            self.fatal = msg.fatal
            return self._finish("error")
        if msg.exhausted and self.exhausted is None:
            self.exhausted = msg.exhausted
        if msg.scores:
            all_failed = len(msg.errors) == len(msg.scores)
            self.failing = self.failing + 1 if all_failed else 0
        self.settled.append(msg)
        if not self.asynchronous or self.halted:
            return []
        # Async: learn from each rollout as it arrives (the log fixes that order).
        self._learn()
        s = self.start
        if self.stopping:
            return []
        if self._backend_failing():
            return self._halt()
        if s.max_rollouts is not None and self.rollouts >= s.max_rollouts:
            return self._stop("max_rollouts")
        if s.max_calls is not None and self.calls >= s.max_calls:
            return self._stop("max_calls")
        if self.exhausted:
            return self._stop(self.exhausted)
        return []

    def _halt(self, error: str | None = None, *, baseline: bool = False) -> list[Out]:
        """The backend fails every rollout, or every call of the baseline (``baseline``:
        nothing was scored): plan nothing more and tell the driver, which stops the run
        as Ctrl-C would (the log stays resumable; leases in flight are re-issued by a
        resume)."""
        self.halted = True
        self.baseline_failed = baseline
        error = error or (f"the backend is failing: the last {self.failing} rollout "
                          f"lease(s) failed in every rollout ({self.backend_errors} failed "
                          f"rollout(s) in all); first error: {self.first_error}")
        return [(DRIVER, Halted(reason="backend_failing", error=error))]

    def _unhalt(self) -> list[Out]:
        """A resumed halted run: count failures afresh and plan (the next round, or a
        wave for the ask the halt left unanswered); a baseline that was never scored
        is asked for again first."""
        if not self.halted:
            return []
        self.halted = False
        self.failing = 0
        if self.baseline_failed:
            self.baseline_failed = False
            return self._open_merger()
        return self._plan_next()

    def _backend_failing(self) -> bool:
        return self.failing >= FAILING_LEASES_PER_WORKER * self.start.n_workers

    def _learn(self) -> None:
        """Feed settled rollouts to ``observe`` and the sampler. Synchronous mode does it
        at the end of the round in plan order, so what is learnt does not depend on
        thread timing."""
        if self._observe is None and self.sampler is None:  # nothing learns: forget them
            for settled in self.settled:
                self.units.pop(settled.lease_id, None)
            self.settled.clear()
            return
        for settled in sorted(self.settled, key=lambda s: s.unit):
            unit = self.units.pop(settled.lease_id, None)
            for task_id, score in settled.scores:
                if score is None:
                    continue
                if self._observe is not None and unit is not None:
                    self._observe(unit, task_id, score)
                if self.sampler is not None:
                    self.sampler.record(task_id, score)
        self.settled.clear()

    def _on_round_closed(self, msg: RoundClosed) -> list[Out]:
        if self.finished or self.halted:
            return []
        self._learn()
        self.bases, self.bases_of = dict(msg.bases), msg.round
        out: list[Out] = []
        if msg.proposals or msg.committed or not self.asynchronous:
            record = RoundRecord(round=msg.round, version=msg.version, committed=msg.committed,
                                 heldout_reward=msg.heldout_reward, rollouts=self.since_merge,
                                 proposals=msg.proposals, reasons=dict(msg.outcomes),
                                 elapsed=self.elapsed)
            self.since_merge = 0
            self.history.append(record)
            out.append((DRIVER, Progress(record=record, rollouts=self.rollouts,
                                         calls=self.calls)))
            # A merge that carried its chains on ungated is no failed gate: patience
            # counts gates.
            if UNGATED not in msg.outcomes:
                self.without_commit = 0 if msg.committed else self.without_commit + 1
        elif self._paced():
            self.without_commit += 1   # a settled wave that proposed nothing
        if self.asynchronous:
            self._unmerged = max(0, self._unmerged - 1)
            if msg.final:
                return out + self._finish(self.stopping or "drained")
            reason = None if self.stopping else self._reason(msg)
            if reason == "backend_failing":
                return out + self._halt()
            return out + (self._stop(reason) if reason else self._plan_if_wanted())
        reason = self._reason(msg)
        if reason is None and self.round + 1 >= self.start.rounds:
            reason = "rounds"
        if reason == "backend_failing":
            return out + self._halt()
        if reason is not None:
            return out + self._finish(reason)
        return out + self._plan_next()

    def _reason(self, msg: RoundClosed) -> str | None:
        s = self.start
        if self._backend_failing():
            return "backend_failing"
        if s.target_reward is not None and msg.heldout_reward >= s.target_reward:
            return "target_reward"
        if s.max_rollouts is not None and self.rollouts >= s.max_rollouts:
            return "max_rollouts"
        if s.max_calls is not None and self.calls >= s.max_calls:
            return "max_calls"
        if self.exhausted:
            return self.exhausted
        if s.max_seconds is not None and self.elapsed >= s.max_seconds:
            return "max_seconds"
        if s.patience is not None and self.without_commit >= s.patience:
            return "patience"
        if not self.train:
            return "no_work"
        return None

    def _stop(self, reason: str) -> list[Out]:
        """Stop: at once in sync mode (between rounds); by draining in async mode."""
        if not self.asynchronous:
            return self._finish(reason)
        if self.stopping:
            return []
        self.stopping = reason
        # Out of time: do not spend more of it merging; any other stop merges what the
        # completed rollouts proposed before returning.
        return [(SCHEDULER, Drain(reason=reason, merge=reason != "max_seconds"))]

    def _finish(self, reason: str) -> list[Out]:
        self.finished = True
        error = None
        if self.backend_errors:
            error = (f"{self.backend_errors} rollout(s) failed in the backend; first: "
                     f"{self.first_error}")
        return [(MERGER, Finish(stop_reason=reason, error=error, fatal=self.fatal,
                                rollouts=self.rollouts, calls=self.calls,
                                backend_errors=self.backend_errors, history=self.history)),
                (SCHEDULER, Shutdown(reason=reason))]
