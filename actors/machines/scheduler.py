"""The Scheduler: rollout and eval leases to workers, and the round barrier. A pure state
machine. Which lease is with which worker, capacity and prefetch, late answers, liveness
and re-dispatch are the one lease table's (actors/machines/leases.py, shared with the
Collector); the Scheduler keeps rounds, barriers, evals, budgets and the queue's order.

- Rollout leases come from the Planner in batches; eval leases are cut from the
  Merger's ``EvalRequest`` (held-out scoring is work done by workers too) and go first.
- Never more than ``max_concurrency`` leases run at once, and a worker runs at most
  ``slots`` leases (in async mode it may hold its ``Hello.prefetch`` more, queued
  behind them: rollout leases only, never evals).
- ``Barrier(r)`` goes to the Merger once every lease of round r is settled, after the
  results themselves (one sender, FIFO: the Merger always sees results first).
- A late answer for a lease already answered is dropped and counted.
- A worker whose Hello declares a heartbeat is presumed lost after ``deadline`` seconds
  of silence, or at once on ``Lost``: its leases go back to the head of the queue under
  their ids; one lost ``max_tries`` times is settled as an infrastructure failure.
- Only a worker the lease went to may answer it (:meth:`Scheduler.admit`, asked by the
  shell and by replay before ``handle``): an answer for a lease another worker holds, or
  one still queued (never dispatched), never reaches ``handle``.
- Settlements reach the Planner in batches (``SettledBatch``), when it next has to
  act: before a round's ``Barrier``, before ``NeedWork``, when nothing is left running,
  before a drain ends. A fatal settlement goes at once; a ``LeaseBatch`` with
  ``report_each`` asks for a ``Settled`` per lease (a budget checked per lease).
- Budgets (``Budget``, from the Planner): a rollout lease reserves its calls before it
  is dispatched and is cut to what ``max_calls`` allows; a lease no budget allows is
  settled unrun (``Settled.exhausted``), a scoring request no budget allows is answered
  ``EvalDone(unscored=...)`` (actors/machines/budget.py).

Asynchronous mode (``asynchronous=True``) has no barrier: when the queue runs dry and a
worker has room (a free slot, or room to queue a lease) the Planner is asked for a wave
(``NeedWork``); a worker is sent the head
before a lease once the head is more than ``async_ratio`` versions ahead of its
snapshot (the lag budget); rollout leases are held back while more than
``async_ratio * n_workers`` proposals wait unmerged (backpressure), and the
worker-seconds spent starved that way are counted; ``Drain`` cancels what no worker
holds yet and, once the leases workers hold settle, asks the Merger to ``Flush``.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

import msgspec

from actors.addresses import MERGER, PLANNER, Out
from actors.machines.budget import Ledger
from actors.machines.leases import Holder, LeaseTable
from protocol import (Barrier, Budget, CallsAsk, CallsGranted, Commit, Drain, EvalDone,
                      EvalRequest, Flush, Heartbeat, Hello, Lease, LeaseBatch, LeaseDone, Lost,
                      Merged, Message, NeedWork, Refresh, RolloutResult, Settled,
                      SettledBatch, Shutdown, Stop, Tick)

log = logging.getLogger(__name__)



@dataclass
class _Eval:
    n_chunks: int
    scores: dict[str, float] = field(default_factory=dict)
    errors: int = 0
    done: int = 0
    #: (task id, error) of the failed call first in task-id order (chunks come back in
    #: any order; the message must not depend on it).
    first_error: tuple[str, str] | None = None


class Scheduler:
    name = "scheduler"

    def __init__(self, max_concurrency: int, *, asynchronous: bool = False,
                 async_ratio: int = 3, n_workers: int = 1,
                 deadline: float | None = None, max_tries: int = 3,
                 lag: int | None = None) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        # The lease table (actors/machines/leases.py): which lease is with which worker,
        # capacity and prefetch, late answers, liveness. Workers whose Hello declares a
        # heartbeat are presumed lost after ``deadline`` seconds of silence (time
        # arrives only as Tick messages) or on ``Lost``; their leases are re-dispatched
        # under the same id, up to ``max_tries`` losses.
        self.deadline = deadline
        self.max_tries = max(1, max_tries)
        self.table: LeaseTable[Lease] = LeaseTable(max_tries=self.max_tries)
        self.asynchronous = asynchronous
        self.async_ratio = async_ratio
        # The lag budget: a worker is sent the head before a rollout lease once its
        # snapshot is more than ``lag`` versions behind (``async_ratio`` unless given).
        self.lag = async_ratio if lag is None else lag
        self.backlog_bound = max(1, async_ratio * n_workers)
        self.unmerged = 0
        self.asked = False
        self.draining = False
        self.flushed = False
        self.merge_on_flush = True
        self.cancelled = 0
        # Backend calls spent scoring (held-out gates, re-verifications): not in the
        # Planner's ``calls``; the ledger counts them against max_calls.
        self.eval_calls = 0
        # Every call used, by kind, and the calls reserved by leases in flight: the
        # budgets on calls, tokens and cost (actors/machines/budget.py).
        self.ledger = Ledger()
        self.exhausted: dict[str, tuple[str, int]] = {}  # lease id -> (budget, tasks cut)
        self.worker_version: dict[str, int] = {}
        self.elapsed = 0.0
        self.starved_seconds = 0.0
        self.held_back = 0
        self.refreshes = 0
        # The leases waiting for a worker, in the order they go out (evals first, leases
        # taken back at the head); every one of them is in the table, unheld.
        self.queue: collections.deque[Lease] = collections.deque()
        self.open_rounds: dict[int, set[str]] = {}
        self.evals: dict[str, _Eval] = {}
        self.head: Commit | None = None
        # Settlements not yet reported to the Planner (see _report).
        self.unreported: list[Settled] = []
        self.report_each = False
        self.peak_running = 0  # the most leases running at once (<= max_concurrency)
        self.shut = False

    # -- the table, read (the runtime, bench and tests read these) --------------------

    @property
    def leases(self) -> dict[str, Lease]:
        """Leases not yet answered (queued or held). An answered (or cancelled) lease
        leaves the table, and lease ids are never reused, so an answer for an id not in
        it is late or a duplicate."""
        return self.table.payload

    @property
    def holder(self) -> dict[str, str]:
        return self.table.holder

    @property
    def workers(self) -> dict[str, Holder]:
        return self.table.workers

    @property
    def lost(self) -> dict[str, Holder]:
        return self.table.lost

    @property
    def running(self) -> int:
        """Leases held by workers (running or queued behind)."""
        return self.table.held

    @property
    def active(self) -> int:
        """Leases running: the sum over workers of min(held, slots)."""
        return self.table.active

    @property
    def duplicates_dropped(self) -> int:
        return self.table.late

    @property
    def redispatched(self) -> int:
        return self.table.redispatched

    @property
    def lost_workers(self) -> int:
        return self.table.lost_workers

    @property
    def given_up(self) -> int:
        return self.table.given_up

    def admit(self, sender: str, msg: Message) -> str | None:
        """Why ``msg`` from ``sender`` must not reach :meth:`handle` (None: it may).

        An answer (``LeaseDone``) for an open lease must come from a worker it was
        dispatched to, as that worker; an answer for a lease no longer open (late, or a
        duplicate) from a worker this Scheduler knows, which ``handle`` then drops and
        counts. Pure: the shell and replay ask it alike, so a log holding refused
        messages replays to the same outcome."""
        if type(msg) is Lost and self.table.known(sender):
            return (f"a Lost for {msg.worker!r} from worker {sender!r}: a worker never "
                    "reports another lost (the runtime does)")
        if type(msg) is CallsAsk:   # answered in handle; only as itself, a known worker
            return None if msg.worker == sender and self.table.known(sender) else (
                f"a CallsAsk naming worker {msg.worker!r}, sent by {sender!r}")
        if type(msg) is not LeaseDone:
            return None
        if msg.worker != sender:
            return (f"a LeaseDone for {msg.lease_id!r} that names worker {msg.worker!r}, "
                    f"sent by {sender!r}")
        table = self.table
        lease = table.payload.get(msg.lease_id)
        if lease is not None:
            if not table.may_answer(msg.lease_id, sender):
                state = "still queued (never dispatched)" if msg.lease_id not in table.holder \
                    else "held by another worker"
                return f"an answer for lease {msg.lease_id!r} it does not hold ({state})"
            said = (msg.round, msg.kind, msg.unit, msg.section)
            known = (lease.round, lease.kind, lease.unit, lease.section)
            if said != known:
                return (f"an answer for lease {msg.lease_id!r} that gives its round, kind, "
                        f"unit and section as {said}, where the lease has {known}")
            return None
        if table.known(sender):
            return None
        return f"an answer for lease {msg.lease_id!r} from {sender!r}, not a known worker"

    def handle(self, msg: Message) -> list[Out]:
        match msg:
            case Hello():
                return self._rejoin(msg) + self._on_hello(msg)
            case Heartbeat(worker=name):
                return self._on_heartbeat(name)
            case Lost(worker=name, reason=reason):
                if name not in self.table.workers:
                    return []
                return self._lose(name, reason or "reported lost") + self._dispatch()
            case Budget():
                self.ledger.limits = msg
                return []
            case LeaseBatch():
                return self._on_batch(msg)
            case EvalRequest():
                return self._on_eval_request(msg)
            case LeaseDone():
                return self._on_done(msg)
            case CallsAsk(worker=name, lease_id=lease_id, calls=n):
                lease = self.table.payload.get(lease_id)   # (an eval chunk: its request's)
                key = lease_id if lease is None or lease.kind == "rollout" else \
                    lease_id.rsplit(".", 1)[0]
                refused = self.ledger.extend(key, n) if lease is not None and \
                    self.table.may_answer(lease_id, name) else \
                    f"lease {lease_id!r} is not {name!r}'s"
                return [(name, CallsGranted(lease_id=lease_id, ask=msg.ask,
                                            refused=refused or ""))]
            case Commit():
                self.head = msg
                if self.asynchronous:
                    return self._dispatch()  # workers refresh lazily, by the lag budget
                for w in self.workers:
                    self.worker_version[w] = msg.version
                return [(w, msg) for w in self.workers]
            case Merged(consumed=n):
                self.unmerged = max(0, self.unmerged - n)
                return self._dispatch()
            case Refresh():
                return self._refresh_all()
            case Drain(merge=merge):
                self.merge_on_flush = merge
                return self._on_drain()
            case Tick(elapsed=elapsed):
                if self._starving():
                    free = sum(1 for w in self.workers.values() if len(w.held) < w.slots)
                    self.starved_seconds += max(0.0, elapsed - self.elapsed) * free
                self.elapsed = elapsed
                return self._check_liveness()
            case Shutdown(reason=reason):
                self.shut = True
                self.queue.clear()
                return [(w, Stop(reason=reason)) for w in self.workers]
            case _:
                log.warning("scheduler: unexpected %s", type(msg).__name__)
                return []

    # -- resume ---------------------------------------------------------------------------

    def reopen(self) -> list[str]:
        """Make this Scheduler, rebuilt from a log (actors/replay/resume.py), one that a *new*
        set of workers can join; nothing is sent.

        It forgets the old workers (new ones register with ``Hello`` and get the head
        version first) and puts every lease a worker held and never answered back into
        its queue, under its original id, in the order they were dispatched: eval leases
        at the front (a merge waits on them), rollout leases after the evals already
        queued and before the rollouts not yet dispatched. Returns the re-issued ids."""
        order = self.table.forget_workers()
        again = [self.table.payload[lease_id] for lease_id in order]
        # Keep the queue's discipline: eval leases (a merge waits on them) ahead of rollout
        # leases, which backpressure may hold back; each group in its order.
        waiting = list(self.queue)
        split = next((i for i, lease in enumerate(waiting) if lease.kind == "rollout"),
                     len(waiting))
        self.queue.clear()
        self.queue.extend([lease for lease in again if lease.kind != "rollout"]
                          + waiting[:split]
                          + [lease for lease in again if lease.kind == "rollout"]
                          + waiting[split:])
        return order

    # -- inputs -------------------------------------------------------------------------

    def _on_hello(self, msg: Hello) -> list[Out]:
        out: list[Out] = []
        if msg.worker not in self.table.workers:
            queued = max(0, msg.prefetch) if self.asynchronous else 0
            self.table.join(msg.worker, max(1, msg.slots), queued)
        if self.head is not None:
            out.append((msg.worker, self.head))
            self.worker_version[msg.worker] = self.head.version
        if self.shut:
            return out + [(msg.worker, Stop(reason="run finished"))]
        return out + self._dispatch()

    def _on_batch(self, msg: LeaseBatch) -> list[Out]:
        self.asked = False
        self.report_each = msg.report_each
        if not self.asynchronous:
            self.open_rounds[msg.round] = {lease.lease_id for lease in msg.leases}
        for lease in msg.leases:
            self.table.add(lease.lease_id, lease)
            self.queue.append(lease)
        if self.asynchronous:
            return self._dispatch()
        return self._barrier_if_settled(msg.round) + self._dispatch()

    def _on_drain(self) -> list[Out]:
        self.draining = True
        kept = collections.deque()
        for lease in self.queue:
            if lease.kind == "rollout":
                self.cancelled += 1
                self.table.drop(lease.lease_id)
            else:
                kept.append(lease)
        self.queue = kept
        return self._flush_if_drained()

    def _flush_if_drained(self) -> list[Out]:
        if not self.draining or self.flushed:
            return []
        if any(lease.kind == "rollout" for lease in self.leases.values()):
            return []
        self.flushed = True
        return self._report() + [(MERGER, Flush(cancelled=self.cancelled,
                                                merge=self.merge_on_flush))]

    def _refresh_all(self) -> list[Out]:
        if self.head is None:
            return []
        self.refreshes += 1
        out: list[Out] = []
        for w in self.workers:
            if self.worker_version.get(w, 0) != self.head.version:
                self.worker_version[w] = self.head.version
                out.append((w, self.head))
        return out

    def _starving(self) -> bool:
        """Rollout work is waiting, a worker is free, and only backpressure stops it."""
        return (self.asynchronous and self.unmerged > self.backlog_bound
                and any(lease.kind == "rollout" for lease in self.queue)
                and any(len(w.held) < w.slots for w in self.workers.values()))

    def _on_eval_request(self, msg: EvalRequest) -> list[Out]:
        n = max(1, min(len(msg.task_ids), len(self.workers) or 1, self.max_concurrency))
        chunks = [msg.task_ids[i::n] for i in range(n)]
        chunks = [c for c in chunks if c]
        refused = self.ledger.admit_eval(msg.eval_id, len(msg.task_ids)) if chunks else None
        if refused is not None:  # no scoring call starts once a budget is spent
            return [(MERGER, EvalDone(eval_id=msg.eval_id, score=0.0, unscored=refused))]
        self.evals[msg.eval_id] = _Eval(n_chunks=len(chunks))
        if not chunks:
            del self.evals[msg.eval_id]
            return [(MERGER, EvalDone(eval_id=msg.eval_id, score=0.0))]
        # Evals jump the queue: a round's merge waits on them.
        for i, chunk in reversed(list(enumerate(chunks))):
            lease = Lease(lease_id=f"{msg.eval_id}.{i}", round=-1, kind="eval",
                          task_ids=chunk, state=msg.state)
            self.table.add(lease.lease_id, lease)
            self.queue.appendleft(lease)
        return self._dispatch()

    def _on_done(self, msg: LeaseDone) -> list[Out]:
        table = self.table
        waiting = table.waiting(msg.lease_id)   # taken back, and its first holder answers
        lease = table.answer(msg.lease_id)
        if lease is None:  # answered already (or never ours): late, dropped and counted
            # An answer, even a late one, is a sign of life like a heartbeat (a
            # remote worker heartbeats only when it has sent nothing else for a while): it
            # takes a worker presumed lost back.
            return self._on_heartbeat(msg.worker)
        table.heard(msg.worker, self.elapsed)
        if waiting:  # its re-queued copy is withdrawn
            self.queue = collections.deque(q for q in self.queue
                                           if q.lease_id != msg.lease_id)
        fatal = self._account(lease, msg)
        if fatal is not None and msg.fatal is None:
            msg = msgspec.structs.replace(msg, fatal=fatal)
        if lease.kind == "eval":
            out = self._on_eval_chunk(lease, msg)
        else:
            out = self._on_rollout_done(lease, msg)
        return out + self._dispatch()

    def _account(self, lease: Lease, msg: LeaseDone) -> str | None:
        """Count the lease's usage in the ledger and release what it reserved (an eval
        chunk's reservation is its request's, released with its last chunk)."""
        if lease.kind == "rollout":
            return self.ledger.settle(lease, msg.results)
        eval_id = lease.lease_id.rsplit(".", 1)[0]
        agg = self.evals.get(eval_id)
        last = agg is None or agg.done + 1 >= agg.n_chunks
        return self.ledger.settle(lease, msg.results,
                                  reservation=eval_id if last else "")

    def _on_rollout_done(self, lease: Lease, msg: LeaseDone) -> list[Out]:
        scores: list[tuple[str, float | None]] = []
        errors: list[str] = []
        calls = proposals = 0
        for r in msg.results:  # one pass over the results
            scores.append((r.task_id, r.score))
            calls += r.calls
            if r.error:
                errors.append(f"{r.task_id}: {r.error}")
            if r.diff is not None:
                proposals += 1
        exhausted, skipped = self.exhausted.pop(lease.lease_id, (None, 0))
        self.unreported.append(Settled(
            lease_id=lease.lease_id, round=lease.round, unit=lease.unit, scores=scores,
            calls=calls, errors=errors, fatal=msg.fatal, section=lease.section,
            stage=lease.stage, exhausted=exhausted, skipped=skipped))
        out: list[Out] = []
        if msg.fatal or exhausted or (self.asynchronous and self.report_each):
            out += self._report()  # the Planner acts on this one now
        if not proposals and lease.state is not None and lease.kind == "rollout":
            proposals = 1   # a branch's lease: the Merger holds the branch (branches.py)
        if proposals:
            out.append((MERGER, msg))
            self.unmerged += proposals
        if self.asynchronous:
            return out + self._flush_if_drained()
        pending = self.open_rounds.get(lease.round)
        if pending is not None:
            pending.discard(lease.lease_id)
            if not pending:
                out += self._barrier_if_settled(lease.round)
        return out

    def _report(self) -> list[Out]:
        """The settlements held so far, to the Planner: one ``SettledBatch`` (a single
        one goes as itself, as do fatal ones and ``report_each`` ones)."""
        held = self.unreported
        if not held:
            return []
        self.unreported = []
        if len(held) == 1:
            return [(PLANNER, held[0])]
        return [(PLANNER, SettledBatch(settled=held))]

    def _barrier_if_settled(self, round_: int) -> list[Out]:
        pending = self.open_rounds.get(round_)
        if pending is not None and not pending:  # every lease of the round is settled
            del self.open_rounds[round_]
            # The Planner hears of the round's rollouts before the Merger closes it.
            return self._report() + [(MERGER, Barrier(round=round_))]
        return []

    def _on_eval_chunk(self, lease: Lease, msg: LeaseDone) -> list[Out]:
        eval_id = lease.lease_id.rsplit(".", 1)[0]
        agg = self.evals.get(eval_id)
        if msg.fatal:  # a caller's mistake found while scoring: the planner stops the run
            self.unreported.append(Settled(lease_id=lease.lease_id, round=lease.round,
                                           unit=0, fatal=msg.fatal))
            return self._report()
        self.eval_calls += sum(r.calls for r in msg.results)
        if agg is None:
            return []
        for r in msg.results:
            agg.scores[r.task_id] = r.score if r.score is not None else 0.0
            agg.errors += r.error is not None
            if r.error is not None and (agg.first_error is None
                                        or r.task_id < agg.first_error[0]):
                agg.first_error = (r.task_id, r.error)
        agg.done += 1
        if agg.done < agg.n_chunks:
            return []
        del self.evals[eval_id]
        # Summed in task-id order: the mean must not depend on which chunk came back first.
        ordered = {k: agg.scores[k] for k in sorted(agg.scores)}
        mean = sum(ordered.values()) / len(ordered) if ordered else 0.0
        first = "{}: {}".format(*agg.first_error) if agg.first_error else None
        failed = first if ordered and agg.errors == len(ordered) else None  # nothing scored
        return [(MERGER, EvalDone(eval_id=eval_id, score=mean, scores=ordered,
                                  errors=agg.errors, failed=failed, first_error=first))]

    # -- dispatch -------------------------------------------------------------------------

    def _dispatch(self) -> list[Out]:
        out: list[Out] = []
        if self.shut or (not self.queue and not self.asynchronous):
            return out  # nothing waits and nothing to ask
        queue = self.queue
        free = _Free(self.table, self.asynchronous) if queue else None
        while queue:
            lease = queue[0]
            rollout = lease.kind == "rollout"
            chosen = free.choose(rollout, self.table.active < self.max_concurrency)
            if chosen is None:
                break  # no lease may start or queue now
            if rollout and self.asynchronous and self.unmerged > self.backlog_bound:
                self.held_back += 1
                break  # backpressure: the merger is behind; evals still jump the queue
            if rollout and self.ledger.limits is not None:
                lease = self._within_budget(lease, out)
                if lease is None:
                    continue
            queue.popleft()
            # Affinity: logical unit i prefers the i-th registered worker.
            name = free.take(chosen, lease.unit if rollout else None)
            out += self._send(lease, name)
        return out + self._ask_or_report()

    def _within_budget(self, lease: Lease, out: list[Out]) -> Lease | None:
        """The rollout lease at the queue's head as a budget allows it (cut to what
        ``max_calls`` leaves), or None: no budget allows it, and it is settled unrun."""
        admitted, cut, spent = self.ledger.admit(lease)
        if admitted is None:  # a budget is spent: this lease never starts
            self.queue.popleft()
            out += self._refuse(lease, spent)
            return None
        if cut:
            self.exhausted[lease.lease_id] = (spent, cut)
            self.table.set(lease.lease_id, admitted)
            self.queue[0] = admitted
        return admitted

    def _send(self, lease: Lease, name: str) -> list[Out]:
        """Give ``lease`` to worker ``name``, with the head first if its snapshot lags
        more than the lag budget (async), stamped with the version it rolls out on."""
        self.table.give(lease.lease_id, name)
        if self.table.active > self.peak_running:
            self.peak_running = self.table.active
        out: list[Out] = []
        if self.head is not None and lease.kind == "rollout":
            known = self.worker_version.get(name, 0)
            if self.asynchronous and self.head.version - known > self.lag:
                self.worker_version[name] = self.head.version
                out.append((name, self.head))  # the lag budget is spent: refresh
            lease = msgspec.structs.replace(
                lease, version=self.worker_version.get(name, self.head.version))
        out.append((name, lease))
        return out

    def _ask_or_report(self) -> list[Out]:
        """Async: the queue ran dry and a worker has room, so the Planner is asked for a
        wave; or nothing is left running, so what settled is reported now."""
        if (self.asynchronous and not self.queue and not self.asked and not self.draining
                and not self.shut and self._room()):
            self.asked = True
            # What settled, before the Planner plans the next wave.
            return self._report() + [(PLANNER, NeedWork())]
        if self.asynchronous and self.unreported and not self.table.held:
            return self._report()  # nothing left running: nothing else would report them
        return []

    def _refuse(self, lease: Lease, spent: str) -> list[Out]:
        """Settle a lease a budget keeps from starting: a rollout lease as settled with
        nothing run (the Planner stops on ``exhausted``); an eval lease is never refused
        here (its request reserved every chunk)."""
        self.table.drop(lease.lease_id)
        done = LeaseDone(lease_id=lease.lease_id, worker=self.name, round=lease.round,
                         kind=lease.kind, unit=lease.unit, section=lease.section)
        self.exhausted[lease.lease_id] = (spent, len(lease.task_ids))
        return self._on_rollout_done(lease, done)

    def _room(self) -> bool:
        """Could a rollout lease be handed out now (to start, or to queue at a worker)?"""
        workers = self.table.workers.values()
        if self.table.active < self.max_concurrency and any(
                len(w.held) < w.slots for w in workers):
            return True
        return any(w.slots <= len(w.held) < w.capacity for w in workers)

    # -- liveness (remote and process workers) -----------------------------------

    def _rejoin(self, msg: Hello) -> list[Out]:
        """A worker that heartbeats registers, or registers again after a reconnect."""
        if msg.heartbeat <= 0:
            return []  # an in-process worker: never presumed lost
        table = self.table
        table.watch(msg.worker, self.elapsed)
        if table.back(msg.worker) is not None:
            log.warning("scheduler: worker %s is back after being presumed lost (it "
                        "registered again); its old leases were re-dispatched", msg.worker)
            return []  # _on_hello takes it back with an empty lease set
        if msg.worker not in table.workers:
            return []
        # The connection dropped: leases it does not list were lost on the way.
        self._requeue(sorted(table.reconnect(msg.worker, msg.slots, msg.leases)),
                      msg.worker)
        return []

    def _on_heartbeat(self, name: str) -> list[Out]:
        back = self.table.back(name)
        if back is not None:
            # Presumed lost, alive after all (a stopped process, a slow network): take it
            # back; its old leases were re-dispatched and its late answers are dropped.
            log.warning("scheduler: worker %s is back after being presumed lost", name)
            self.table.watch(name, self.elapsed)
            return self._on_hello(Hello(worker=name, slots=back.slots, prefetch=back.queued))
        self.table.heard(name, self.elapsed)
        return []

    def _check_liveness(self) -> list[Out]:
        if self.deadline is None:
            return []
        silent = self.table.silent(self.elapsed, self.deadline)
        out: list[Out] = []
        for name in silent:
            quiet = self.elapsed - self.table.seen[name]
            out += self._lose(name, f"silent for {quiet:.2f} s (deadline "
                                    f"{self.deadline:.2f} s)")
        if silent and not self.table.workers:
            log.warning("scheduler: no worker left; %d lease(s) wait for one to (re)join",
                        len(self.queue))
        return out + (self._dispatch() if silent else [])

    def _lose(self, name: str, why: str) -> list[Out]:
        """Worker ``name`` is presumed lost: the leases it held go back to the head of the
        queue under their ids, those lost ``max_tries`` times are given up."""
        log.warning("scheduler: worker %s %s: presumed lost; re-dispatching %s", name, why,
                    sorted(self.table.workers[name].held) or "nothing")
        again, given_up = self.table.lose(name)
        out: list[Out] = []
        for lease_id in sorted(given_up):
            out += self._give_up(self.table.payload[lease_id], self.max_tries)
        self._requeue(sorted(again), name)
        return out

    def _requeue(self, lease_ids: list[str], was_with: str) -> None:
        """Put leases taken back from ``was_with`` at the head of the queue (same ids)."""
        back: list[Lease] = []
        for lease_id in lease_ids:
            log.info("scheduler: lease %s re-dispatched (was with %s)", lease_id, was_with)
            back.append(self.table.payload[lease_id])
        self.queue.extendleft(reversed(back))

    def _give_up(self, lease: Lease, tries: int) -> list[Out]:
        """Workers died holding this lease ``tries`` times: settle it as an
        infrastructure failure (reported to the Planner, counted) so the round closes."""
        reason = (f"infrastructure failure: lease {lease.lease_id} given up after {tries} "
                  f"worker(s) were lost running it")
        log.error("scheduler: %s", reason)
        done = LeaseDone(lease_id=lease.lease_id, worker=self.name, round=lease.round,
                         kind=lease.kind, unit=lease.unit, section=lease.section,
                         version=lease.version,
                         results=[RolloutResult(task_id=t, error=reason)
                                  for t in lease.task_ids])
        return self._on_done(done)


class _Free:
    """The workers a lease may go to now, for one dispatch pass: built once per pass (only
    when work waits) and kept up to date as leases go out; rebuilding them per lease cost
    O(workers) each time (~30 ms to dispatch a round to 256 remote workers).

    ``idle``: a slot is free, the lease starts at once (while fewer than max_concurrency
    run). ``spare``: every slot runs, but the worker can queue a rollout lease behind them
    (async prefetch: it starts the moment a slot frees, with no round trip through the
    bus); evals never queue behind rollouts, a merge waits on them."""

    def __init__(self, table: LeaseTable[Lease], asynchronous: bool) -> None:
        workers = self.workers = table.workers
        self.order = list(workers)
        self.idle = [w for w in self.order if len(workers[w].held) < workers[w].slots]
        self.spare = [w for w in self.order if workers[w].slots <= len(workers[w].held)
                      < workers[w].capacity] if asynchronous else []
        self.idle_set, self.spare_set = set(self.idle), set(self.spare)

    def choose(self, rollout: bool, may_start: bool) -> list[str] | None:
        """The list to take a worker from for the next lease, or None."""
        if self.idle and may_start:
            return self.idle
        if self.spare and rollout:
            return self.spare
        return None

    def take(self, free: list[str], unit: int | None) -> str:
        """A worker from ``free`` (unit i's preferred one, the i-th registered, if it is
        there), the lists updated as if the lease were given to it."""
        free_set = self.idle_set if free is self.idle else self.spare_set
        preferred = self.order[unit % len(self.order)] if unit is not None else None
        name = preferred if preferred in free_set else free[0]
        worker = self.workers[name]
        held = len(worker.held) + 1
        if free is self.idle and held >= worker.slots:
            self.idle.remove(name)
            free_set.discard(name)
            if held < worker.capacity:
                self.spare.append(name)
                self.spare_set.add(name)
        elif free is self.spare and held >= worker.capacity:
            self.spare.remove(name)
            free_set.discard(name)
        return name
