"""The Planner: owns the parallelism strategy, the train/held-out split, the round
counter, the budgets and the stop decision. A pure state machine (DESIGN section 3):
``handle(msg) -> [(receiver, message), ...]``, no I/O, no clock, seeded randomness.
"""

from __future__ import annotations

import logging
import random

from actors.addresses import DRIVER, MERGER, SCHEDULER
from protocol import (Baseline, Finish, Lease, LeaseBatch, Message, Open, Progress,
                      RoundClosed, RoundRecord, Settled, Shutdown, Start, Tick, WorkUnit)

log = logging.getLogger(__name__)

Out = tuple[str, Message]


def split_tasks(task_ids: list[str], held_out_frac: float, seed: int) -> tuple[list[str], list[str]]:
    """Seeded split into (train, held-out); both non-empty, train keeps input order."""
    shuffled = list(task_ids)
    random.Random(seed).shuffle(shuffled)
    n_held = min(len(task_ids) - 1, max(1, round(len(task_ids) * held_out_frac)))
    held = set(shuffled[:n_held])
    return [t for t in task_ids if t not in held], [t for t in task_ids if t in held]


class Planner:
    name = "planner"

    def __init__(self, strategy, sampler=None) -> None:
        self.strategy = strategy
        self.sampler = sampler
        self._observe = getattr(strategy, "observe", None)
        self.start: Start | None = None
        self.train: list[str] = []
        self.heldout: list[str] = []
        self.round = -1
        self.units: dict[str, WorkUnit] = {}
        self.rollouts = 0
        self.calls = 0
        self.backend_errors = 0
        self.first_error: str | None = None
        self.elapsed = 0.0
        self.history: list[RoundRecord] = []
        self.rounds_without_commit = 0
        self.best_reward = 0.0
        self.round_rollouts = 0
        self.settled: list[Settled] = []
        self.finished = False

    # -- the machine ------------------------------------------------------------------

    def handle(self, msg: Message) -> list[Out]:
        match msg:
            case Start():
                return self._on_start(msg)
            case Baseline(heldout_reward=reward):
                self.best_reward = reward
                if self.start.target_reward is not None and reward >= self.start.target_reward:
                    return self._finish("target_reward")
                return self._plan_next()
            case Settled():
                return self._on_settled(msg)
            case RoundClosed():
                return self._on_round_closed(msg)
            case Tick(elapsed=elapsed):
                self.elapsed = elapsed
                return []
            case _:
                log.warning("planner: unexpected %s", type(msg).__name__)
                return []

    def _on_start(self, msg: Start) -> list[Out]:
        self.start = msg
        self.train, self.heldout = split_tasks(msg.task_ids, msg.held_out_frac, msg.seed)
        return [(MERGER, Open(heldout_ids=self.heldout, initial_state=msg.initial_state,
                              sections=msg.sections))]

    def _budget_left(self) -> int | None:
        if self.start.max_rollouts is None:
            return None
        return max(0, self.start.max_rollouts - self.rollouts)

    def _plan_next(self) -> list[Out]:
        self.round += 1
        r = self.round
        units = self.strategy.plan(self.start.n_workers, r, list(self.train))
        left = self._budget_left()
        leases = []
        for unit in units:
            keys = list(unit.keys)
            if self.sampler is not None:
                keys = list(self.sampler.order(keys, r))
            if left is not None:
                keys = keys[:left]
                left -= len(keys)
            if not keys:
                continue
            lease = Lease(lease_id=f"r{r}.u{unit.worker}", round=r, unit=unit.worker,
                          task_ids=keys, section=unit.section, stage=unit.stage)
            self.units[lease.lease_id] = unit
            leases.append(lease)
        self.round_rollouts = 0
        return [(SCHEDULER, LeaseBatch(round=r, leases=leases))]

    def _on_settled(self, msg: Settled) -> list[Out]:
        self.calls += msg.calls
        self.rollouts += len(msg.scores)
        self.round_rollouts += len(msg.scores)
        self.settled.append(msg)
        if msg.errors:
            self.backend_errors += len(msg.errors)
            if self.first_error is None:
                self.first_error = msg.errors[0]
        if msg.fatal and not self.finished:
            return self._finish("error", fatal=msg.fatal)
        return []

    def _learn(self) -> None:
        """Feed the round's rollouts to ``observe`` and the sampler, in plan order (the
        order results arrive in depends on thread timing; what is learnt must not)."""
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
        if self.finished:
            return []
        self._learn()
        record = RoundRecord(round=msg.round, version=msg.version, committed=msg.committed,
                             heldout_reward=msg.heldout_reward, rollouts=self.round_rollouts,
                             proposals=msg.proposals, reasons=dict(msg.outcomes),
                             elapsed=self.elapsed)
        self.history.append(record)
        out: list[Out] = [(DRIVER, Progress(record=record, rollouts=self.rollouts,
                                            calls=self.calls))]
        self.rounds_without_commit = 0 if msg.committed else self.rounds_without_commit + 1
        s = self.start
        reason = None
        if s.target_reward is not None and msg.heldout_reward >= s.target_reward:
            reason = "target_reward"
        elif s.max_rollouts is not None and self.rollouts >= s.max_rollouts:
            reason = "max_rollouts"
        elif s.max_calls is not None and self.calls >= s.max_calls:
            reason = "max_calls"
        elif s.max_seconds is not None and self.elapsed >= s.max_seconds:
            reason = "max_seconds"
        elif s.patience is not None and self.rounds_without_commit >= s.patience:
            reason = "patience"
        elif self.round + 1 >= s.rounds:
            reason = "rounds"
        elif not self.train:
            reason = "no_work"
        if reason is not None:
            return out + self._finish(reason)
        return out + self._plan_next()

    def _finish(self, reason: str, fatal: str | None = None) -> list[Out]:
        self.finished = True
        error = None
        if self.backend_errors:
            error = (f"{self.backend_errors} rollout(s) failed in the backend; first: "
                     f"{self.first_error}")
        return [(MERGER, Finish(stop_reason=reason, error=error, fatal=fatal,
                                rollouts=self.rollouts, calls=self.calls,
                                backend_errors=self.backend_errors, history=self.history)),
                (SCHEDULER, Shutdown(reason=reason))]
