"""The Scheduler: owns the lease table (which lease is with which worker), worker
registrations and credits, and the round barrier. A pure state machine.

- Rollout leases come from the Planner in batches; eval leases are cut from the
  Merger's ``EvalRequest`` (held-out scoring is work done by workers too) and go first.
- Never more than ``max_concurrency`` leases run at once, and a worker holds at most
  ``slots`` leases.
- ``Barrier(r)`` goes to the Merger once every lease of round r is settled, after the
  results themselves (one sender, FIFO: the Merger always sees results first).
- A late answer for a lease already answered is dropped and counted.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

import msgspec

from actors.addresses import MERGER, PLANNER
from protocol import (Barrier, Commit, EvalDone, EvalRequest, Hello, Lease, LeaseBatch,
                      LeaseDone, Message, Settled, Shutdown, Stop)

log = logging.getLogger(__name__)

Out = tuple[str, Message]


@dataclass
class _Worker:
    name: str
    slots: int
    running: set[str] = field(default_factory=set)


@dataclass
class _Eval:
    n_chunks: int
    scores: dict[str, float] = field(default_factory=dict)
    errors: int = 0
    done: int = 0


class Scheduler:
    name = "scheduler"

    def __init__(self, max_concurrency: int) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self.workers: dict[str, _Worker] = {}
        self.queue: collections.deque[Lease] = collections.deque()
        self.leases: dict[str, Lease] = {}
        self.holder: dict[str, str] = {}
        self.answered: set[str] = set()
        self.open_rounds: dict[int, set[str]] = {}
        self.evals: dict[str, _Eval] = {}
        self.head: Commit | None = None
        self.running = 0
        self.peak_running = 0
        self.duplicates_dropped = 0
        self.shut = False

    def handle(self, msg: Message) -> list[Out]:
        match msg:
            case Hello():
                return self._on_hello(msg)
            case LeaseBatch():
                return self._on_batch(msg)
            case EvalRequest():
                return self._on_eval_request(msg)
            case LeaseDone():
                return self._on_done(msg)
            case Commit():
                self.head = msg
                return [(w, msg) for w in self.workers]
            case Shutdown(reason=reason):
                self.shut = True
                self.queue.clear()
                return [(w, Stop(reason=reason)) for w in self.workers]
            case _:
                log.warning("scheduler: unexpected %s", type(msg).__name__)
                return []

    # -- inputs -------------------------------------------------------------------------

    def _on_hello(self, msg: Hello) -> list[Out]:
        out: list[Out] = []
        if msg.worker not in self.workers:
            self.workers[msg.worker] = _Worker(msg.worker, max(1, msg.slots))
        if self.head is not None:
            out.append((msg.worker, self.head))
        if self.shut:
            return out + [(msg.worker, Stop(reason="run finished"))]
        return out + self._dispatch()

    def _on_batch(self, msg: LeaseBatch) -> list[Out]:
        self.open_rounds[msg.round] = {lease.lease_id for lease in msg.leases}
        for lease in msg.leases:
            self.leases[lease.lease_id] = lease
            self.queue.append(lease)
        return self._barrier_if_settled(msg.round) + self._dispatch()

    def _on_eval_request(self, msg: EvalRequest) -> list[Out]:
        n = max(1, min(len(msg.task_ids), len(self.workers) or 1, self.max_concurrency))
        chunks = [msg.task_ids[i::n] for i in range(n)]
        chunks = [c for c in chunks if c]
        self.evals[msg.eval_id] = _Eval(n_chunks=len(chunks))
        if not chunks:
            del self.evals[msg.eval_id]
            return [(MERGER, EvalDone(eval_id=msg.eval_id, score=0.0))]
        # Evals jump the queue: a round's merge waits on them.
        for i, chunk in reversed(list(enumerate(chunks))):
            lease = Lease(lease_id=f"{msg.eval_id}.{i}", round=-1, kind="eval",
                          task_ids=chunk, state=msg.state)
            self.leases[lease.lease_id] = lease
            self.queue.appendleft(lease)
        return self._dispatch()

    def _on_done(self, msg: LeaseDone) -> list[Out]:
        lease = self.leases.get(msg.lease_id)
        if lease is None or msg.lease_id in self.answered:
            self.duplicates_dropped += 1
            return []
        self.answered.add(msg.lease_id)
        holder = self.holder.pop(msg.lease_id, None)
        if holder is not None and holder in self.workers:
            self.workers[holder].running.discard(msg.lease_id)
            self.running -= 1
        del self.leases[msg.lease_id]
        out: list[Out] = []
        if lease.kind == "eval":
            out += self._on_eval_chunk(lease, msg)
        else:
            out += self._on_rollout_done(lease, msg)
        return out + self._dispatch()

    def _on_rollout_done(self, lease: Lease, msg: LeaseDone) -> list[Out]:
        out: list[Out] = []
        scores = [(r.task_id, r.score) for r in msg.results]
        errors = [f"{r.task_id}: {r.error}" for r in msg.results if r.error]
        calls = sum(r.calls for r in msg.results)
        out.append((PLANNER, Settled(lease_id=lease.lease_id, round=lease.round, unit=lease.unit,
                                     scores=scores, calls=calls, errors=errors, fatal=msg.fatal,
                                     section=lease.section, stage=lease.stage)))
        if any(r.diff is not None for r in msg.results):
            out.append((MERGER, msg))
        pending = self.open_rounds.get(lease.round)
        if pending is not None:
            pending.discard(lease.lease_id)
            out += self._barrier_if_settled(lease.round)
        return out

    def _barrier_if_settled(self, round_: int) -> list[Out]:
        if self.open_rounds.get(round_) == set():
            del self.open_rounds[round_]
            return [(MERGER, Barrier(round=round_))]
        return []

    def _on_eval_chunk(self, lease: Lease, msg: LeaseDone) -> list[Out]:
        eval_id = lease.lease_id.rsplit(".", 1)[0]
        agg = self.evals.get(eval_id)
        if msg.fatal:  # a caller's mistake found while scoring: the planner stops the run
            return [(PLANNER, Settled(lease_id=lease.lease_id, round=lease.round, unit=0,
                                      fatal=msg.fatal))]
        if agg is None:
            return []
        for r in msg.results:
            agg.scores[r.task_id] = r.score if r.score is not None else 0.0
            agg.errors += r.error is not None
        agg.done += 1
        if agg.done < agg.n_chunks:
            return []
        del self.evals[eval_id]
        # Summed in task-id order: the mean must not depend on which chunk came back first.
        ordered = {k: agg.scores[k] for k in sorted(agg.scores)}
        mean = sum(ordered.values()) / len(ordered) if ordered else 0.0
        return [(MERGER, EvalDone(eval_id=eval_id, score=mean, scores=ordered,
                                  errors=agg.errors))]

    # -- dispatch -------------------------------------------------------------------------

    def _dispatch(self) -> list[Out]:
        out: list[Out] = []
        if self.shut:
            return out
        order = list(self.workers)
        while self.queue and self.running < self.max_concurrency:
            free = [w for w in order if len(self.workers[w].running) < self.workers[w].slots]
            if not free:
                break
            lease = self.queue.popleft()
            # Affinity: logical unit i prefers the i-th registered worker.
            preferred = order[lease.unit % len(order)] if lease.kind == "rollout" else None
            name = preferred if preferred in free else free[0]
            self.workers[name].running.add(lease.lease_id)
            self.holder[lease.lease_id] = name
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            if self.head is not None and lease.kind == "rollout":
                lease = msgspec.structs.replace(lease, version=self.head.version)
            out.append((name, lease))
        return out

