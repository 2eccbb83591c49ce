"""The Collector: the join of one bounded parallel group. A pure state machine
(DESIGN section 3): ``handle(msg) -> [(receiver, message), ...]``; no I/O, no threads,
no clock. Time enters only as ``Tick`` messages.

What it owns: the group's bounds, every branch's state, the finished results, the
interactions waiting for an answer, the first error. What it decides:

- which branches go to which worker, as ``Branch`` leases. A worker runs one branch at a
  time and the Collector uses at most ``max_concurrency`` workers, so running branches
  never exceed the bound; a worker holds at most ``1 + prefetch`` leases (the one it
  runs, and ``prefetch`` queued behind it so it never idles for a round trip). Lease
  sizes shrink as the queue does (guided self-scheduling:
  ``ceil(queued / (chunk_factor * concurrency))``): a cheap target costs a handful of
  messages per worker, a slow one still balances at the tail. With ``GroupStart.shares``
  (every worker in another process) they are even shares instead: rounds of one lease
  per worker, all of a round the same size, the first ``shares`` of a fair share, each
  later one half of what is queued over the workers (factoring);
- with ``GroupStart.ordered``, starts follow input order: one branch per lease, marked
  ``in_order``, until ``concurrency`` branches are measured cheaper than ``batch_below``
  seconds each (then guided leases as above). With ``GroupStart.waves`` too, branches
  measured no cheaper than that go out in *waves*: strided in-order leases cut at once,
  one per worker with room (:meth:`Collector._wave`), and a branch that comes back below
  one dealt goes out again at once, alone. A lease may be answered in parts
  (``BranchAnswer.part``: threads of one process took turns at its branches); it is
  settled once every branch of it is reported.
  The workers hold each ``in_order`` start to the order: branch ``j`` starts once every
  branch up to ``j - bound`` has (:class:`actors.groups.host._StartOrder`);
- on the first error: no new lease, ``Cancel`` to every lease out, then wait for them
  until ``cancel_deadline`` seconds of ``Tick`` have passed (the rest is *abandoned*);
- on an interaction (``ctx.ask``/``ctx.approve`` without an answer), with
  ``GroupStart.suspend == "all"``: that branch waits (its worker goes on with the rest
  of its lease); the group goes on until every branch has ended or waits, then
  ``GroupSuspended`` once, with every pending interaction. With ``"first"``: no new
  lease, ``Hold`` to every lease out; once they have all answered, ``GroupSuspended``;
- on resume: the checkpoint arrives in ``GroupStart``; ``UserInputs`` are checked
  (unknown or already-used ids, approval rights) before anything is dispatched;
  finished branches are never dispatched again;
- letting workers go: once nothing is left to lease, a worker without a lease gets no
  other unless one comes back (a lease being revoked, or queued behind a running one):
  the idle workers beyond those are sent ``Stop`` at once, so they end while the others
  finish instead of at the group's end;
- liveness (``GroupStart.deadline``): a worker whose Hello declares a heartbeat and is
  silent past the deadline, or one reported ``Lost``, is presumed lost; the branch
  leases it held go, under their ids, to the next worker with room (before any new
  lease). The first answer settles a lease; any later one is dropped and counted, so a
  branch whose answer arrived never runs again. A lease lost ``max_tries`` times, or a
  group whose every worker is lost and none back within the deadline, fails the group
  (``WorkersLost``). Holders, capacity, revokes and losses live in the one lease table
  (actors/machines/leases.py), shared with the Scheduler;
- the end: ``GroupResult`` with every result in input order, or the first error and
  where every branch stands. No partial result is ever published as a success.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Iterable, Mapping

from actors.addresses import Out
from actors.machines.leases import LeaseTable
from actors.machines.workerpool import WorkerPool
from protocol import (Branch, BranchDone, BranchFailed, Cancel, GroupCancel, GroupResult,
                      GroupStart, GroupSuspended, Heartbeat, Hello, Hold, Interaction,
                      JournalEntry, Lost, Message, PendingInteraction, Revoke, Stop, Tick,
                      UserInputs)

log = logging.getLogger(__name__)


# Branch states.
PENDING = "pending"            # not started (queued, or left over by a stop or a pause)
LEASED = "leased"              # in a lease that has not answered yet
FINISHED = "finished"
FAILED = "failed"
CANCELLED = "cancelled"
SUSPENDED = "suspended"        # waiting on an interaction; its journal is kept
ABANDONED = "abandoned"        # its lease did not answer within the cancel deadline

# Phases.
IDLE = "idle"
AWAITING_INPUTS = "awaiting_inputs"
RUNNING = "running"
PAUSING = "pausing"
STOPPING = "stopping"
ENDED = "ended"

_ANSWERS = frozenset((BranchDone, BranchFailed, Interaction))


def _reported(msg: BranchDone | BranchFailed | Interaction) -> int:
    """How many branches of its lease an answer reports (finished, cancelled, unstarted,
    waiting, and the one a failure or an interaction stopped at)."""
    n = len(msg.indices) + len(msg.cancelled) + len(msg.unstarted)
    if type(msg) is not Interaction:
        n += len(msg.suspended)
    if type(msg) is not BranchDone:
        n += 1
    return n
_RELEASED = Stop(reason="the group has no more branches for this worker")


def check_inputs(pending: Mapping[str, PendingInteraction], used: Iterable[str],
                 answers: Mapping[str, Any], approvals: Mapping[str, Any],
                 principal: str | None, approvers: list[str] | None) -> str | None:
    """Why these resume inputs are refused, or None if they fit. Pure; shared by the
    Collector (on ``UserInputs``) and ``resume_group`` (before anything starts)."""
    used = set(used)
    waiting = sorted(pending)
    if not answers and not approvals:
        return (f"nothing to resume with: {len(waiting)} interaction(s) pending "
                f"({', '.join(waiting) or 'none'}); pass user_inputs={{id: answer}} for "
                "questions and approvals={id: True/False} for actions")
    for iid in [*answers, *approvals]:
        if iid in used:
            return (f"interaction {iid!r} was already answered: each answer is consumed by "
                    f"exactly one occurrence; the pending ones are {waiting}")
        if iid not in pending:
            return f"unknown interaction id {iid!r}: the pending ones are {waiting}"
    for iid in answers:
        p = pending[iid]
        if p.kind != "ask":
            return (f"{iid!r} asks for an approval of {p.prompt!r}: pass it in "
                    f"approvals={{{iid!r}: True or False}}, not in user_inputs")
    for iid, decision in approvals.items():
        p = pending[iid]
        if p.kind != "approve":
            return (f"{iid!r} is a question ({p.prompt!r}): pass its answer in "
                    f"user_inputs={{{iid!r}: ...}}, not in approvals")
        if not isinstance(decision, bool):
            return f"approval {iid!r}: expected True or False, got {decision!r}"
    if approvals:
        if not approvers:
            return ("no approvers were declared for this group, so nobody may approve: "
                    "start it with approvers=[...] (scenario: approvers = [...])")
        if principal is None:
            return (f"approvals need the resumer's identity: pass principal=NAME (CLI: "
                    f"--as NAME); allowed approvers: {approvers}")
        if principal not in approvers:
            return (f"{principal!r} has no approval rights in this group: the approvers are "
                    f"{approvers}; resume as one of them (principal={approvers[0]!r}; CLI: "
                    f"--as {approvers[0]})")
    return None


class Collector:
    """One group per Collector; ``name`` is its bus address."""

    def __init__(self, name: str = "collector") -> None:
        self.name = name
        self.start: GroupStart | None = None
        self.phase = IDLE
        self.gid = ""
        self.driver = ""
        self.state: list[str] = []
        self.values: dict[int, Any] = {}
        self.queue: collections.deque[int] = collections.deque()
        self.concurrency = 0
        self.planned: list[str] = []  # the workers to use: at most max_concurrency
        self.planned_set: frozenset[str] = frozenset()
        self.slots = 1
        # The branch leases out (actors/machines/leases.py): who holds which, capacity
        # and prefetch, leases being revoked, late answers, watched workers and losses.
        self.table: LeaseTable[Branch] = LeaseTable()
        self.pool = WorkerPool(self.table, 1, 0)   # the planned workers ready for leases
        self.again: collections.deque[str] = collections.deque()  # taken back, to re-send
        self.released: set[str] = set()   # workers sent Stop: no lease goes to them
        self.lost_at = 0.0                # when a worker was last presumed lost
        self.journals: dict[int, list[JournalEntry]] = {}
        self.pending: dict[str, PendingInteraction] = {}
        self.used: list[str] = []
        self.effects: list[tuple[int, str]] = []
        self.errors: dict[int, str] = {}
        self.first: tuple[int | None, str, str] | None = None   # (branch, error, type)
        self.first_is_secondary = False
        self.elapsed = 0.0
        self.stop_at = 0.0
        self.result_bytes = 0
        self.busy_seconds = 0.0      # as measured by the workers (BranchDone.elapsed)
        self.busy_items = 0
        self.n_leases = 0
        self.peak_leases = 0
        self.dropped = 0             # messages not for this group, or out of turn
        self.batching = True         # several branches per lease (see GroupStart.ordered)
        self.share_rounds = 0        # rounds of even shares cut (GroupStart.shares)
        self.share_left = 0          # leases left to cut in the current round
        self.share_size = 0          # the size of each lease of the current round
        self.frontier = 0            # one past the highest branch leased so far
        self.parts: dict[str, int] = {}   # lease id -> branches reported by its parts so far

    # -- the table, read -------------------------------------------------------------

    @property
    def leases(self) -> dict[str, Branch]:
        """The branch leases out (held, or taken back and waiting to be sent again)."""
        return self.table.payload

    @property
    def late(self) -> int:
        """Dropped and counted: answers for leases no longer out (late, duplicate), and
        messages for another group or out of turn."""
        return self.dropped + self.table.late

    # -- the machine ------------------------------------------------------------------

    def admit(self, sender: str, msg: Message) -> str | None:
        """Why ``msg`` from ``sender`` must not reach :meth:`handle` (None: it may): an
        answer for a branch lease that is out must come from a worker it went to.
        Pure; asked by the shell and by replay, as the Scheduler's is."""
        kind = type(msg)
        if kind in _ANSWERS or isinstance(msg, (BranchDone, BranchFailed, Interaction)):
            table = self.table
            if msg.lease_id in table.payload and not table.may_answer(msg.lease_id, sender):
                went = ", ".join(repr(w) for w in sorted(table.given.get(msg.lease_id, ())))
                return (f"an answer for branch lease {msg.lease_id!r}, which went to "
                        f"{went}, not to {sender!r}")
        elif kind is Lost and (sender in self.planned_set or self.table.known(sender)):
            return (f"a Lost for {msg.worker!r} from worker {sender!r}: a worker never "
                    "reports another lost (the runtime does)")
        return None

    def handle(self, msg: Message) -> list[Out]:
        if type(msg) in _ANSWERS:   # the bulk of a group's messages: tested first
            lease = self._settle(msg)
            out = [] if lease is None else self._on_answer(msg, lease.indices)
            # Any answer, even a late one, is a sign of life: it takes a worker presumed
            # lost back (nothing to do while no worker is watched or lost).
            table = self.table
            if table.lost or table.seen:
                out += self._on_heartbeat(msg.worker)
            return out
        match msg:
            case GroupStart():
                return self._on_start(msg)
            case UserInputs():
                return self._on_inputs(msg)
            case Hello():
                return self._on_hello(msg)
            case Heartbeat(worker=worker):
                return self._on_heartbeat(worker)
            case Lost(worker=worker, reason=reason):
                return self._lose(worker, reason or "reported lost") + self._dispatch() \
                    + self._maybe_end()
            case Tick(elapsed=elapsed):
                return self._on_tick(elapsed)
            case GroupCancel(group_id=gid, reason=reason):
                if gid != self.gid or self.phase in (IDLE, ENDED):
                    self.dropped += 1
                    return []
                return self._fail(None, reason, "GroupCancelled") + self._maybe_end()
            case _:
                log.warning("%s: unexpected %s", self.name, type(msg).__name__)
                return []

    def _settle(self, msg: BranchDone | BranchFailed | Interaction) -> Branch | None:
        """The lease this answer settles, out of the table; None for an answer to a lease
        no longer out (late, a duplicate, after the lease was abandoned, or after another
        worker it went to answered first) or another group's: dropped and counted."""
        if msg.group_id != self.gid:
            self.dropped += 1
            return None
        table = self.table
        lease_id = msg.lease_id
        if msg.part and not self._last_part(msg):
            return table.payload[lease_id] if lease_id in table.holder else None
        waiting = lease_id not in table.holder   # taken back: its first holder answers
        lease = table.answer(lease_id)
        if lease is not None and waiting:
            self.again.remove(lease_id)
        return lease

    def _last_part(self, msg: BranchDone | BranchFailed | Interaction) -> bool:
        """Whether this part of a lease answered in parts (``BranchAnswer.part``) reports
        its last branches, so the lease is settled now. A part for a lease not held (late,
        another group's) is dropped by the caller."""
        lease_id = msg.lease_id
        lease = self.table.payload.get(lease_id)
        if lease is None or lease_id not in self.table.holder:
            self.parts.pop(lease_id, None)
            return True   # settled or never held: table.answer counts it late
        n = _reported(msg) + self.parts.get(lease_id, 0)
        if n < len(lease.indices):
            self.parts[lease_id] = n
            return False
        self.parts.pop(lease_id, None)
        return True

    # -- workers ------------------------------------------------------------------------

    def _on_hello(self, msg: Hello) -> list[Out]:
        """A planned worker is on the bus (``announce``), registers again after a
        reconnect, or is back after being presumed lost."""
        worker, table = msg.worker, self.table
        if worker not in self.planned_set or worker in self.released:
            self.dropped += 1
            return []
        known = worker in table.seen    # it said Hello with a heartbeat before
        if msg.heartbeat > 0:
            table.watch(worker, self.elapsed)
        if table.back(worker) is not None:
            return self._rejoin(worker)
        if worker in self.pool:
            if not known:   # registers its heartbeat (else: a Hello out of turn)
                self.dropped += msg.heartbeat <= 0
                return []
            # The connection dropped: leases it does not list were lost on the way.
            self.again.extend(table.reconnect(worker, 1, msg.leases))
            return self._dispatch()
        self.pool.add(worker)
        return self._dispatch() + self._maybe_end()

    def _on_heartbeat(self, worker: str) -> list[Out]:
        """A sign of life (a heartbeat, an answer even a late one): a worker presumed lost
        is taken back, holding nothing (its leases went elsewhere)."""
        if self.table.back(worker) is None:
            self.table.heard(worker, self.elapsed)
            return []
        self.table.watch(worker, self.elapsed)
        return self._rejoin(worker)

    def _rejoin(self, worker: str) -> list[Out]:
        log.warning("%s: worker %s is back after being presumed lost; its leases were "
                    "re-dispatched", self.name, worker)
        self.table.join(worker, 1, self.slots - 1)
        self.pool.add(worker)
        return self._dispatch() + self._maybe_end()

    def _lose(self, worker: str, why: str) -> list[Out]:
        """``worker`` is presumed lost: its leases wait again under their ids (and go to
        the next worker with room), those lost ``max_tries`` times fail the group."""
        table = self.table
        if worker not in table.workers or worker in self.released:
            return []
        log.warning("%s: worker %s %s: presumed lost; re-dispatching %s", self.name, worker,
                    why, table.workers[worker].held or "nothing")
        again, given_up = table.lose(worker)
        self.lost_at = self.elapsed
        self.pool.remove(worker)
        if self.phase == RUNNING:
            self.again.extend(again)
        else:  # stopping or pausing: nothing new starts, and this worker will not answer
            for lease_id in again:
                self._unlease(lease_id, ABANDONED if self.phase == STOPPING else PENDING)
        return self._give_up(given_up) if given_up else []

    def _give_up(self, lease_ids: list[str]) -> list[Out]:
        """Workers were lost running these leases ``max_tries`` times: their branches
        fail, by name, and the group with them."""
        errors = []
        for lease_id in lease_ids:
            indices = self.table.payload[lease_id].indices
            error = (f"infrastructure failure: branch lease {lease_id} (branches "
                     f"{indices[:10]}) given up after {self.table.max_tries} worker(s) "
                     "were lost running it")
            log.error("%s: %s", self.name, error)
            self._unlease(lease_id, FAILED)
            for i in indices:
                self.errors[i] = f"WorkersLost: {error}"
            errors.append((indices[0], error))
        return self._fail(*errors[0], "WorkersLost")

    def _unlease(self, lease_id: str, state: str) -> None:
        """A lease leaves the table unanswered; its branches are now ``state``."""
        for i in self.table.drop(lease_id).indices:
            if self.state[i] == LEASED:
                self.state[i] = state

    def _check_liveness(self) -> list[Out]:
        deadline = self.start.deadline
        if deadline is None:
            return []
        out: list[Out] = []
        silent = self.table.silent(self.elapsed, deadline)
        for worker in silent:
            quiet = self.elapsed - self.table.seen[worker]
            out += self._lose(worker, f"silent for {quiet:.2f} s (deadline {deadline:.2f} s)")
        if self.phase == RUNNING and not self.pool and self.table.lost \
                and (self.again or self.queue) and self.elapsed - self.lost_at > deadline:
            out += self._fail(None, f"every worker of the group was presumed lost "
                              f"({', '.join(sorted(self.table.lost))}) and none came back "
                              f"within {deadline:g} s; branches wait for a worker",
                              "WorkersLost")
        return out + (self._dispatch() if silent else [])

    # -- inputs -------------------------------------------------------------------------

    def _on_start(self, msg: GroupStart) -> list[Out]:
        if self.start is not None:
            log.warning("%s: a second GroupStart (%s) ignored: one group per collector",
                        self.name, msg.group_id)
            self.dropped += 1
            return []
        self.start = msg
        self.gid = msg.group_id
        self.driver = msg.driver
        n = len(msg.items)
        self.state = [PENDING] * n
        for i, value in msg.finished.items():
            self.state[i] = FINISHED
            self.values[i] = value
        self.pending = {p.id: p for p in msg.pending}
        waiting = {p.branch for p in msg.pending}
        for i, journal in msg.journals.items():
            # A journal without a pending interaction: answered, but not started again
            # before the group paused; it runs again with that journal.
            if i in waiting:
                self.state[i] = SUSPENDED
            self.journals[i] = list(journal)
        self.used = list(msg.used_ids)
        self.effects = list(msg.effects)
        # One worker runs one branch at a time, so the bound is the number of workers
        # used; each may hold ``prefetch`` more leases queued behind the one it runs, so
        # it never idles for a round trip between two leases.
        self.concurrency = max(0, min(msg.max_concurrency, len(msg.workers)))
        self.planned = list(msg.workers[:self.concurrency])
        self.planned_set = frozenset(self.planned)
        # With ``announce``, a worker takes leases once a Hello says it is on the bus:
        # work starts with the first worker instead of waiting for all of them.
        self.slots = 1 + max(0, msg.prefetch)
        self.table.max_tries = max(0, msg.max_tries)   # (empty until the group starts)
        self.pool = WorkerPool(self.table, self.slots, len(self.planned))
        for worker in self.planned:
            self.table.join(worker, 1, self.slots - 1)
            if not msg.announce:
                self.pool.add(worker)
        self.batching = not msg.ordered
        if msg.resume:
            self.phase = AWAITING_INPUTS
            return []
        self.queue = collections.deque(
            range(n) if not msg.finished and not msg.journals
            else (i for i in range(n) if self.state[i] == PENDING))
        self.phase = RUNNING
        return self._dispatch() + self._maybe_end()

    def _on_inputs(self, msg: UserInputs) -> list[Out]:
        if msg.group_id != self.gid or self.phase != AWAITING_INPUTS:
            self.dropped += 1
            return []
        problem = check_inputs(self.pending, self.used, msg.answers, msg.approvals,
                               msg.principal, self.start.approvers)
        if problem is not None:
            self.phase = ENDED
            return [(self.driver, GroupResult(group_id=self.gid, status="refused",
                                              error=problem, error_type="ResumeRefused"))]
        answered: list[int] = []
        for kind, given in (("ask", msg.answers), ("approve", msg.approvals)):
            for iid, value in given.items():
                p = self.pending.pop(iid)
                self.journals.setdefault(p.branch, []).append(
                    JournalEntry(kind=kind, key=p.prompt, value=value, id=iid))
                self.used.append(iid)
                answered.append(p.branch)
        for i in answered:
            self.state[i] = PENDING
        # Answered continuations run again. Branches never started start only if no
        # interaction is left waiting: a pending question keeps the group paused.
        run = {i for i, s in enumerate(self.state) if s == PENDING and i in self.journals}
        if not self.pending or self.start.suspend == "all":
            run |= {i for i, s in enumerate(self.state) if s == PENDING}
        self.queue = collections.deque(sorted(run))
        self.phase = RUNNING if self.queue else PAUSING
        return self._dispatch() + self._maybe_end()

    def _on_answer(self, msg: BranchDone | BranchFailed | Interaction,
                   indices: list[int]) -> list[Out]:
        state, values = self.state, self.values
        for i, value in zip(msg.indices, msg.values):
            state[i] = FINISHED
            values[i] = value
        for i in msg.cancelled:
            state[i] = CANCELLED
        if msg.effects:
            self.effects.extend(msg.effects)
        self.result_bytes += msg.nbytes
        n_reported = len(msg.indices) + len(msg.cancelled) + len(msg.unstarted)
        out: list[Out] = []
        kind = type(msg)
        if kind is BranchDone and (msg.indices or msg.suspended):
            self._measure(msg)
        if kind is not Interaction:
            for s in msg.suspended:
                n_reported += 1
                self._wait(s.index, s.pending, s.journal)
        if kind is not BranchDone:
            n_reported += 1
            out += self._stopped_at(msg)
        if msg.unstarted or (n_reported != len(indices) and not msg.part):
            self._requeue(msg, indices, n_reported)
        limit = self.start.max_result_bytes
        if limit and msg.indices and self.result_bytes > limit:
            out += self._too_large(msg, limit)
        return out + self._dispatch() + self._maybe_end()

    def _stopped_at(self, msg: BranchFailed | Interaction) -> list[Out]:
        """The branch a failed or interrupted lease stopped at."""
        match msg:
            case BranchFailed(index=i, error=error, error_type=etype, after_stop=after):
                self.state[i] = FAILED
                self.errors[i] = f"{etype}: {error}" if etype else error
                return self._fail(i, error, etype, secondary=after)
            case Interaction(index=i, pending=p, journal=journal):
                if self._wait(i, p, journal) and self.start.suspend != "all":
                    return self._pause()
        return []

    def _requeue(self, msg: BranchDone | BranchFailed | Interaction, indices: list[int],
                 n_reported: int) -> None:
        """Branches of the lease that did not start go back to the head of the queue."""
        requeue = list(msg.unstarted)   # in lease order: the worker stops at one point
        if n_reported != len(indices) and not msg.part:
            # A worker that does not account for a branch: never count it as done.
            reported = {*msg.indices, *msg.cancelled, *msg.unstarted}
            if not isinstance(msg, Interaction):
                reported.update(s.index for s in msg.suspended)
            if isinstance(msg, (BranchFailed, Interaction)):
                reported.add(msg.index)
            lost = [i for i in indices if i not in reported]
            log.warning("%s: lease %s did not report branches %s", self.name, msg.lease_id,
                        lost)
            requeue = sorted({*requeue, *lost})
        for i in requeue:
            self.state[i] = PENDING
        if self.phase == RUNNING:
            self.queue.extendleft(reversed(requeue))
            if requeue and self.start.waves:   # waves deal from a queue in input order
                self.queue = collections.deque(sorted(self.queue))

    def _measure(self, msg: BranchDone) -> None:
        self.busy_seconds += msg.elapsed
        self.busy_items += len(msg.indices) + len(msg.cancelled) + len(msg.suspended)
        if not self.batching and self.busy_items >= self.concurrency \
                and self.busy_seconds < self.start.batch_below * self.busy_items:
            self.batching = True

    def _wait(self, i: int, p: PendingInteraction, journal: list[JournalEntry]) -> bool:
        """Branch ``i`` waits on ``p``; False if the group is failing (then it counts as
        cancelled: nothing will resume it)."""
        if self.phase == STOPPING:
            self.state[i] = CANCELLED
            return False
        self.state[i] = SUSPENDED
        self.journals[i] = list(journal)
        self.pending[p.id] = p
        return True

    def _too_large(self, msg: BranchDone | BranchFailed | Interaction,
                   limit: int) -> list[Out]:
        """With this answer's results the group's would not fit the one message that
        carries them (the result, or the report of a failure): its branches fail, by
        name, and their values are dropped, so what the group reports is what it holds."""
        self.result_bytes -= msg.nbytes
        error = (f"with the result of branch {msg.indices[0]} the group's results would take "
                 f"more than {limit} bytes, over what one message may carry; return smaller "
                 "results (an id or a path) or split the group")
        for i in msg.indices:
            self.state[i] = FAILED
            self.values.pop(i, None)
            self.errors[i] = f"ResultsTooLarge: {error}"
        return self._fail(msg.indices[0], error, "ResultsTooLarge")

    def _on_tick(self, elapsed: float) -> list[Out]:
        self.elapsed = elapsed
        if self.phase in (IDLE, ENDED, AWAITING_INPUTS):
            return []
        out: list[Out] = []
        budget = self.start.max_seconds
        if budget is not None and elapsed >= budget and self.phase in (RUNNING, PAUSING):
            out += self._fail(None, f"the run's seconds budget is used up ({budget:.3f} s left "
                              "when the group started); raise budgets=Budgets(seconds=...)",
                              "BudgetExhausted")
        if self.phase == STOPPING and self.leases \
                and elapsed - self.stop_at >= self.start.cancel_deadline:
            for lease_id in list(self.leases):
                self._unlease(lease_id, ABANDONED)
        return out + self._check_liveness() + self._maybe_end()

    # -- decisions ------------------------------------------------------------------------

    def _fail(self, branch: int | None, error: str, etype: str,
              secondary: bool = False) -> list[Out]:
        """Record an error; the first one stops the group: no new lease, Cancel to every
        lease out. A secondary error (raised after the stop) is the group's error only
        until a primary one arrives."""
        if self.first is None or (self.first_is_secondary and not secondary):
            self.first = (branch, error, etype)
            self.first_is_secondary = secondary
        if self.phase in (STOPPING, ENDED):
            return []
        self.phase = STOPPING
        self.stop_at = self.elapsed
        self.queue.clear()
        self._drop_waiting()
        return [(self.table.holder[lease_id], Cancel(lease_id=lease_id))
                for lease_id in self.leases]

    def _pause(self) -> list[Out]:
        if self.phase != RUNNING:
            return []
        self.phase = PAUSING
        self.queue.clear()
        self._drop_waiting()
        return [(self.table.holder[lease_id], Hold(lease_id=lease_id))
                for lease_id in self.leases]

    def _drop_waiting(self) -> None:
        """Leases taken back and not sent again never will be: their branches are not
        started (a continuation keeps its journal)."""
        while self.again:
            self._unlease(self.again.popleft(), PENDING)

    def _dispatch(self) -> list[Out]:
        if self.phase != RUNNING:
            return []
        if not self.again and not self.queue:
            return self._rebalance() + self._release()
        waving = self.waving and not self.table.lost
        # While waves go out, a branch that came back below one leased (the rest of a
        # stolen lease, a revoked one) goes out at once, on its own: a branch waiting for
        # its turn may need it, so it never waits for the next wave.
        out = self._one_by_one(self.frontier if waving else None)
        queue = self.queue
        if waving and queue and not self.again and queue[0] >= self.frontier:
            out += self._wave()
        if self.again or queue:   # (then there is nothing to rebalance or release)
            return out
        return out + self._rebalance() + self._release()

    def _one_by_one(self, below: int | None) -> list[Out]:
        """Leases taken back (first, under their ids), then leases cut from the head of
        the queue (only branches below ``below`` if given), each to the worker with the
        fewest leases, while one has room."""
        out: list[Out] = []
        again, table = self.again, self.table
        # The worker with the fewest leases out, the first in pool order among them (an
        # idle one first), from the pool's index by leases held.
        pool = self.pool
        # Queue leases behind running ones only once every planned worker is ready (or
        # presumed lost): the first workers up must not hoard what the next ones would
        # start at once. (An in-order lease queued behind a long branch is not stuck
        # there: a worker whose next start waits for it takes it, see
        # actors.groups.host._StartOrder.)
        batching = self.batching
        cap = self.slots if len(pool) + len(table.lost) >= len(self.planned) else 1
        queue = self.queue
        fewest = pool.fewest
        while again or (queue and (below is None or queue[0] < below)):
            worker = fewest(cap)
            if worker is None:
                break
            if again:  # taken back from a lost worker: the same lease, under its id
                lease = table.payload[again.popleft()]
            else:
                lease = self._cut(batching)
                table.add(lease.lease_id, lease)
            table.give(lease.lease_id, worker)
            if len(table.payload) > self.peak_leases:
                self.peak_leases = len(table.payload)
            out.append((worker, lease))
        return out

    def _cut(self, batching: bool) -> Branch:
        """The next lease, from the head of the queue (its branches are leased now)."""
        start = self.start
        popleft = self.queue.popleft
        k = self._lease_size() if batching else 1
        if k == 1:
            i = popleft()
            indices, items = [i], [start.items[i]]
            self.state[i] = LEASED
        else:
            indices = [popleft() for _ in range(k)]
            items = self._lease_items(indices)
        if indices[-1] >= self.frontier:
            self.frontier = indices[-1] + 1
        return self._lease(indices, items, in_order=not batching)

    @property
    def waving(self) -> bool:
        """Leases go out as waves (``GroupStart.waves``): starts follow input order and
        the branches are measured, no cheaper than ``batch_below`` each."""
        return self.start.waves and not self.batching and self.busy_items >= self.concurrency

    def _wave(self) -> list[Out]:
        """In-order leases cut at once, one per worker with room, once every worker has
        room or one holds nothing: the ``p``-th of them holds the ``p``-th, ``p + W``-th,
        ... of the first ``W x d`` queued branches (``W`` workers with room; ``d``
        shrinks with the queue as guided leases do, or is ``GroupStart.chunk``). The
        queue is in input order, so each worker's branches rise across its leases and
        every branch below a dealt one is dealt, started or done (a branch that comes
        back goes out again at once, see :meth:`_dispatch`): the smallest branch not
        started is its worker's next, or in a lease queued in a box that a waiting
        worker takes branches from (those below its own turn, actors.groups.worker), so
        every branch still starts in its turn and nobody waits for ever on another
        worker's queue. A worker held up by a long branch does not hold the others up:
        once one of them is idle, the wave goes to those with room."""
        table, pool, queue = self.table, self.pool, self.queue
        if not pool or (pool.full and not pool.idle):
            return []
        room = [w for w in pool if len(table.workers[w].held) < self.slots] \
            if pool.full else list(pool)
        width = len(room)
        start = self.start
        depth = start.chunk if start.chunk > 0 else \
            -(-len(queue) // (start.chunk_factor * len(pool)))
        depth = max(1, min(start.max_chunk, depth))
        popleft = queue.popleft
        dealt = [popleft() for _ in range(min(len(queue), width * depth))]
        self.frontier = dealt[-1] + 1
        items, state = start.items, self.state
        out: list[Out] = []
        for p, worker in zip(range(len(dealt)), room):
            indices = dealt[p::width]
            for i in indices:
                state[i] = LEASED
            lease = self._lease(indices, [items[i] for i in indices], in_order=True)
            table.add(lease.lease_id, lease)
            table.give(lease.lease_id, worker)
            out.append((worker, lease))
        self.peak_leases = max(self.peak_leases, len(table.payload))
        return out

    def _lease(self, indices: list[int], items: list[Any], in_order: bool) -> Branch:
        lease_id = f"{self.gid}.{self.n_leases}"
        self.n_leases += 1
        journals = ({i: self.journals[i] for i in indices if i in self.journals}
                    if self.journals else {})
        return Branch(group_id=self.gid, lease_id=lease_id, indices=indices, items=items,
                      journals=journals, in_order=in_order)

    def _lease_items(self, indices: list[int]) -> list[Any]:
        """The items of a lease's branches, now leased."""
        start = self.start
        k = len(indices)
        first, last = indices[0], indices[-1]
        contiguous = last - first == k - 1 and indices == list(range(first, last + 1))
        if contiguous:
            self.state[first:last + 1] = [LEASED] * k
            items = start.items[first:last + 1]
        else:
            for i in indices:
                self.state[i] = LEASED
            items = [start.items[i] for i in indices]
        return items

    def _lease_size(self) -> int:
        start = self.start
        queued = len(self.queue)
        if start.chunk > 0:
            return min(max(1, min(start.max_chunk, start.chunk)), queued)
        if start.shares > 0:
            return self._share_size(queued)
        k = self._at_least_min_lease(-(-queued // (start.chunk_factor * self.concurrency)),
                                     queued)
        return min(max(1, min(start.max_chunk, k)), queued)

    def _at_least_min_lease(self, k: int, queued: int) -> int:
        """Leases shorter than a round trip leave workers idle between them: keep each at
        least min_lease_seconds long (by the workers' own measure, reported in
        BranchDone), but never above a fair share."""
        start = self.start
        if not (self.busy_items and start.min_lease_seconds):
            return k
        per_item = self.busy_seconds / self.busy_items
        floor = int(start.min_lease_seconds / per_item) if per_item > 0 else start.max_chunk
        return max(k, min(floor, -(-queued // self.concurrency)))

    def _share_size(self, queued: int) -> int:
        """Even shares (``GroupStart.shares``): one lease per worker a round, all of a round
        the same size, so no worker starts with more than another and the tail is cut
        small for every worker alike (factoring, not guided's per-lease shrink)."""
        start = self.start
        if self.share_left <= 0:
            w = self.concurrency
            k = int(start.shares * queued / w) if self.share_rounds == 0 \
                else self._at_least_min_lease(-(-queued // (start.chunk_factor * w)), queued)
            self.share_size = min(max(1, k), start.max_chunk)
            self.share_left = w
            self.share_rounds += 1
        self.share_left -= 1
        return min(self.share_size, queued)

    def _rebalance(self) -> list[Out]:
        """Nothing left to lease, yet a worker is idle while another holds a lease queued
        behind the one it runs (perhaps a long branch): ask for that lease back."""
        if self.phase != RUNNING or self.queue or self.again or self.slots == 1:
            return []
        table = self.table
        workers, revoking = table.workers, table.revoking
        pool = self.pool
        need = pool.idle - len(revoking)
        out: list[Out] = []
        if need <= 0 or len(table.holder) <= len(pool) - pool.idle:
            return out   # (no worker holds a lease queued behind the one it runs)
        asked: list[str] = []
        for worker in pool.with_queued():   # in pool order
            for lease_id in reversed(workers[worker].held[1:]):   # never the running one
                if lease_id not in revoking:
                    table.revoke(lease_id)
                    out.append((worker, Revoke(lease_id=lease_id)))
                    asked.append(worker)
                    need -= 1
                    break
            if need <= 0:
                break
        pool.keep(asked)
        return out

    def _release(self) -> list[Out]:
        """Nothing left to lease: a worker without a lease is done, unless a lease may
        still come back (one being revoked, or one queued behind a running lease that
        ``_rebalance`` may revoke): as many idle workers as those stay, the others are
        sent ``Stop`` now, so they end while the rest finish, not at the group's end."""
        if self.phase != RUNNING or self.queue or self.again or not self.table.payload:
            return []   # (no lease out: the group ends now, and every worker with it)
        pool, table = self.pool, self.table
        if not pool.idle:
            return []
        # A lease queued behind a running one may be revoked, as may one being revoked
        # (always held: counted once); with liveness on, any lease out comes back if its
        # worker is lost. (Every worker holding a lease is in the pool.)
        may_return = len(table.holder)
        if self.start.deadline is None:
            workers, holder = table.workers, table.holder
            may_return -= len(pool) - pool.idle
            may_return += sum(1 for lease_id in table.revoking
                              if workers[holder[lease_id]].held[0] == lease_id)
        go = pool.last_idle(pool.idle - may_return)
        if not go:
            return []
        self.released.update(go)
        for w in go:
            pool.remove(w)
            table.leave(w)   # holds nothing; no longer watched
        return [(w, _RELEASED) for w in go]

    def _maybe_end(self) -> list[Out]:
        if self.phase in (IDLE, AWAITING_INPUTS, ENDED) or self.table.payload:
            return []
        if self.phase == RUNNING and self.queue:
            if not self.planned:
                return self._fail(None, "no worker to run the branches on", "ConfigError") \
                    + self._maybe_end()
            if self.released and not self.pool and not self.table.lost:
                # Defensive: branches came back (a lease that did not account for them)
                # after every worker was let go; never wait for a worker that left.
                return self._fail(None, f"branches {list(self.queue)[:10]} came back after "
                                  "every worker had been let go", "IncompleteJoin") \
                    + self._maybe_end()
            return []
        self.phase = ENDED
        if self.first is not None:
            return [(self.driver, self._failed_result())]
        if self.pending:
            return [(self.driver, self._suspended())]
        n = len(self.state)
        if self.state.count(FINISHED) != n:  # defensive: never publish a partial join
            missing = [i for i, s in enumerate(self.state) if s != FINISHED]
            self.first = (None, f"branches {missing[:10]} ended without a result",
                          "IncompleteJoin")
            return [(self.driver, self._failed_result())]
        values = self.values
        return [(self.driver, GroupResult(group_id=self.gid, status="completed",
                                          results=list(map(values.__getitem__, range(n))),
                                          effects=self.effects, leases=self.n_leases,
                                          peak_leases=self.peak_leases, late=self.late))]

    def _failed_result(self) -> GroupResult:
        branch, error, etype = self.first
        by: dict[str, list[int]] = collections.defaultdict(list)
        for i, s in enumerate(self.state):
            by[s].append(i)
        return GroupResult(
            group_id=self.gid, status="failed", error=error, error_type=etype,
            error_branch=branch,
            finished={i: self.values[i] for i in by[FINISHED]},
            failed=by[FAILED], cancelled=by[CANCELLED] + by[SUSPENDED],
            never_started=by[PENDING], abandoned=by[ABANDONED], errors=dict(self.errors),
            effects=self.effects, leases=self.n_leases, peak_leases=self.peak_leases,
            late=self.late)

    def _suspended(self) -> GroupSuspended:
        pending = sorted(self.pending.values(), key=lambda p: (p.branch, p.id))
        status = ("user_input_pending" if any(p.kind == "ask" for p in pending)
                  else "approval_pending")
        # Every continuation not finished: suspended branches, and answered ones the
        # pause caught before they started again (their answers must not be lost).
        keep = [i for i, s in enumerate(self.state)
                if s == SUSPENDED or (s == PENDING and i in self.journals)]
        return GroupSuspended(
            group_id=self.gid, status=status, pending=pending,
            finished={i: v for i, v in sorted(self.values.items())},
            journals={i: self.journals.get(i, []) for i in keep},
            not_started=[i for i, s in enumerate(self.state) if s == PENDING],
            used_ids=list(self.used), effects=self.effects, leases=self.n_leases,
            peak_leases=self.peak_leases)
