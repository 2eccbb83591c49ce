"""The branch worker: a pykka thread that takes ``Branch`` leases and calls the target.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import pykka

from actors.workers.core import Awaiter
from actors.workers.local import WAKE, Worker
from bus.base import Delivery
from protocol import (Branch, BranchDone, BranchFailed, Cancel, Hold, Interaction, Revoke, Stop,
                      Suspension)
from actors import usage
from actors.errors import BranchCancelled, ResultTooLarge, _Suspend, describe
from actors.groups.context import BranchContext
from actors.groups.host import _GO, _Host, _NOT_NOW, _StartOrder, _ambient
from actors.groups.limits import MAX_RESULT_BYTES
from actors.groups.store import _encoder, _enter_all

log = logging.getLogger(__name__)


class _Run:
    """A lease being run in this process: its branches are taken one at a time, in lease
    order (``pos``, under its box's lock), by the worker it went to and by any worker of
    the group waiting for its own turn, which takes the lowest branch whose turn has come
    (GroupWorker._steal): no branch waits behind a slot that is busy while another slot
    idles. ``runs`` (the start order's, when in-order starts are kept) finds the lease of
    a branch not taken yet by its index.

    Each taker runs a *part* of the lease. A part that ends with values only leaves them
    here, unless it is the last one out (every branch taken, no other part running),
    which answers the whole lease at once; a part that ends otherwise (a failure, a
    pause, branches unstarted) answers its own branches at once, as a part
    (``BranchAnswer.part``), so a lease is answered by one message unless a part of it
    stopped the group."""

    __slots__ = ("lease", "pos", "box", "runs", "active", "left")

    def __init__(self, lease: Branch, box: "_LeaseBox | None" = None,
                 runs: dict | None = None) -> None:
        self.lease = lease
        self.pos = 0
        self.box = box if box is not None else _LeaseBox()
        self.runs = runs
        self.active = 0            # parts that took branches and have not ended
        #: ended parts whose values wait for the last one (see end)
        self.left: list[tuple] | tuple = ()
        if runs is not None:
            for i in lease.indices:
                runs[i] = self

    def take(self, pos: int, first: bool) -> bool:
        """Take the branch at ``pos`` if it is still the next one not taken (``first``:
        the first one the taking part takes)."""
        with self.box.lock:
            indices = self.lease.indices
            if self.pos != pos or pos >= len(indices):
                return False
            self.pos = pos + 1
            self.active += first
        if self.runs is not None and self.runs.get(indices[pos]) is self:
            del self.runs[indices[pos]]
        return True

    def rest(self, first: bool) -> list[int]:
        """Every branch not taken yet, taken now (to be answered unstarted)."""
        with self.box.lock:
            indices = self.lease.indices
            rest, self.pos = indices[self.pos:], len(indices)
            self.active += first and bool(rest)
        runs = self.runs
        if runs is not None:
            for i in rest:
                if runs.get(i) is self:
                    del runs[i]
        return rest

    def end(self, part: tuple, alone: bool) -> tuple | None:
        """A part that took branches ends, ``(took, done, values, cancelled, effects,
        waiting, elapsed)``: what to answer now, or None (it is left for the last part).
        ``alone``: it must be answered now (it did not end with values only); with the
        parts left before it if it is the last."""
        with self.box.lock:
            self.active -= 1
            last = not self.active and self.pos >= len(self.lease.indices)
            if not last:
                if alone:
                    return part
                if self.left:
                    self.left.append(part)
                else:
                    self.left = [part]
                return None
            left, self.left = self.left, ()
        if not left:
            return part
        # The parts that ended before, with values only, joined to this one (whose lists
        # are its runner's, done with once it answers).
        took, done, values, cancelled, effects, waiting, elapsed = part
        for other in left:
            took += other[0]
            done += other[1]
            values += other[2]
            cancelled += other[3]
            effects += other[4]
            waiting += other[5]
            elapsed += other[6]
        return took, done, values, cancelled, effects, waiting, elapsed


class _LeaseBox:
    """The leases a worker holds but has not started, in the order they came: the worker
    runs them from here, one after the other (a waiting worker may have taken some of
    their branches meanwhile, see _Run), and ``Revoke`` takes one none of whose branches
    was taken back on the bus thread (the worker's own thread may be busy with a long
    branch).

    Leases may arrive before the worker's thread runs: the box keeps them, and the
    worker takes them when it starts (``ref`` is set then, by the worker itself)."""

    def __init__(self, owner: str = "") -> None:
        self.owner = owner         # the worker the Collector gave this box's leases to
        self.lock = threading.Lock()
        self.queued: dict[str, _Run] = {}
        self.ref: pykka.ActorRef | None = None
        self.stop = False          # a Stop came before the worker's thread ran
        self.finished = 0          # branches run to a value (written by the worker only)
        #: The worker is running its leases (so a lease still queued waits behind one it
        #: runs): only then may another worker take branches of its leases.
        self.running = False
        #: The thread that ran these leases is free again (actors.groups.pool).
        self.returned = False

    def put(self, lease: Branch, order=None) -> None:
        """Keep ``lease``; with ``order`` (the group's _StartOrder), its branches may be
        taken by workers waiting for their turn."""
        run = _Run(lease, self, order.runs if order is not None else None)
        with self.lock:
            self.queued[lease.lease_id] = run

    def take(self, lease_id: str) -> Branch | None:
        """The lease if none of its branches was taken (none ever will be now), else None."""
        with self.lock:
            run = self.queued.get(lease_id)
            if run is None or run.pos:
                return None
            del self.queued[lease_id]
            run.pos = len(run.lease.indices)   # nobody takes from it any more
            return run.lease

    def next(self) -> _Run | None:
        """The oldest lease with branches not taken yet, out of the box, or None (one whose
        every branch others took is answered by them)."""
        with self.lock:
            queued = self.queued
            while queued:
                run = queued.pop(next(iter(queued)))
                if run.pos < len(run.lease.indices):
                    return run
            return None


def _worker_deliver(bus, host: _Host, box: _LeaseBox, name: str,
                    collector: str) -> Callable[[Delivery], None]:
    """The bus side of a worker. A lease goes into the worker's box, and the worker is
    woken if its thread runs; one that has not started yet finds the lease when it does
    (``box.ref`` is set by the worker before it looks into the box: nothing is missed)."""

    def tell(delivery: Delivery) -> None:
        ref = box.ref
        if ref is None:   # not started: counted with unroutable messages
            bus.stats.unroutable += 1
            return
        try:
            ref.tell(delivery)
        except pykka.ActorDeadError:  # counted with unroutable messages
            bus.stats.unroutable += 1

    def deliver(delivery: Delivery) -> None:
        match delivery.msg:
            case Branch() as lease:
                box.put(lease, host.order if host is not None else None)
                # A worker running its leases finds it in its box: nothing to wake. (It
                # marks ``running`` false before it looks again, and the lease is in the
                # box before ``running`` is read here: one of the two sees the other.)
                if box.ref is not None and not box.running:
                    tell(delivery)
            case Stop():
                box.stop = True
                if box.ref is not None:
                    tell(delivery)
            case Revoke(lease_id=lease_id):
                lease = box.take(lease_id)
                if lease is not None:
                    bus.send(name, collector, BranchDone(group_id=lease.group_id,
                                                         lease_id=lease_id, worker=name,
                                                         unstarted=list(lease.indices)))
            case Cancel():
                host.cancel()
            case Hold():
                host.hold()
            case _:
                tell(delivery)

    return deliver


def _release(bus) -> None:
    """This actor's thread ends: its sockets close now (a runtime shared by many groups
    outlives many threads)."""
    release = getattr(bus, "release_thread", None)
    if release is not None:
        release()


_WAKE = WAKE   # a worker's note to itself: look into the box


class GroupWorker(Worker):
    """The one worker loop (:class:`actors.workers.local.Worker`) with a branch lane:
    runs one group's branches, one lease at a time, one branch at a time, in the order
    the leases came (from its :class:`_LeaseBox`; a message only wakes it). It takes
    ``Lease`` and ``Commit`` too when given a ``core`` (a rollout's WorkerCore).

    The group's driver attaches its bus name (:func:`_worker_deliver`): from one thread,
    one socket, instead of a socket per worker thread. ``Cancel`` and ``Hold`` take
    effect on the bus thread, at once (the worker's own thread is busy running the lease
    they are about). ``Stop`` (the Collector has no more work for it) ends it while the
    other workers finish, instead of at the group's end."""

    use_daemon_thread = True   # a branch stuck in user code must not keep the process alive

    def __init__(self, bus, name: str, host: _Host, collector: str, on_crash,
                 box: "_LeaseBox", core=None) -> None:
        super().__init__(bus, core, on_crash, name=name)
        self.host = host
        self.collector = collector
        self.box = box
        self.settle = Awaiter()   # async targets: one event loop for this worker's thread
        self._runner: BranchRunner | None = None

    def _run(self, lease: "Branch | _Run", owner: str | None = None,
             taken: int | None = None) -> None:
        # Built again when the worker is bound to another group's names, host and box
        # (a pooled worker, between two groups: actors.groups.pool); a runner only reads
        # what it was given, so a steal may run a branch with it inside one of its runs.
        runner = self._runner
        if runner is None or runner.host is not self.host or runner.box is not self.box \
                or runner.name != self.name:
            runner = self._runner = BranchRunner(self._send, self.name, self.host, self.box,
                                                 self.settle, self._steal)
        runner.run(lease, owner, taken)

    def _send(self, name: str, msg) -> None:
        self.bus.send(name, self.collector, msg)

    def on_start(self) -> None:
        threading.current_thread().name = f"evobus-{self.name}"
        box = self.box
        box.ref = self.actor_ref   # before looking into the box (see _worker_deliver)
        # Leases that came before the thread ran: run them from on_receive (where a
        # failure reaches on_failure, and so the driver), not here.
        self.actor_ref.tell(_WAKE)
        if box.stop:
            self.stop()

    def _drain(self) -> None:
        box = self.box
        while True:
            box.running = True
            try:
                run = box.next()
                while run is not None:   # a revoked lease is not in the box any more
                    self._run(run)
                    run = box.next()
            finally:
                box.running = False
            if not box.queued:   # one put from now on is told (see _worker_deliver)
                return

    def _stopped(self) -> None:
        self.stop()   # a tell to itself: no future to make, nobody waits on it

    def on_stop(self) -> None:
        self.settle.close()   # the event loop async targets ran on, if any
        if self.core is not None:
            self.core.close()
        _release(self.bus)

    def _steal(self, skip: "_Run | None") -> int | None:
        """Run, here, the lowest branch of this group whose turn has come and that waits,
        not taken yet, in a lease of a worker of this process that runs (the next of the
        lease it runs, perhaps behind a long branch, or of one queued behind it), answered
        as that lease's worker would (a part of it): while this worker waits for its turn,
        no branch that may start waits for a busy slot. ``skip`` is the lease this worker
        waits in (its next branch is the one it waits for). None once it ran one; else
        the fewest starts that would bring the turn of a branch it could take
        (_StartOrder.wait)."""
        order = self.host.order
        runs, started, bound, n = order.runs, order.started, order.bound, order.n
        order.reached(n)   # brings ``low`` up to date
        low = order.low
        soonest = n + 1
        # A branch whose turn has come is below low + bound; one more bound's worth tells
        # when the next may come.
        for i in range(low, min(n, low + 2 * bound)):
            run = runs.get(i)
            if run is None or run is skip or started[i]:
                continue
            pos = run.pos
            indices = run.lease.indices
            if pos >= len(indices) or indices[pos] != i or not run.box.running:
                continue   # not the next of its lease, or its worker has not started
            need = order.need(i) if run.lease.in_order else 0
            if need > low:
                soonest = need
                break
            if not run.take(pos, True):
                return 0   # taken meanwhile: look again
            self._run(run, owner=run.box.owner, taken=pos)   # answered as its owner would
            return None
        return soonest


class BranchRunner:
    """Runs a ``Branch`` lease's branches and answers it: the part of the one worker loop
    that calls a group's target, wherever it runs (a :class:`GroupWorker` thread here, a
    slot thread of a worker in another process: actors.groups.served). ``send(name,
    msg)`` carries the answer (to the Collector, or to the relay that forwards it)."""

    def __init__(self, send: Callable[[str, Any], None], name: str, host: _Host, box,
                 settle: Awaiter, steal: Callable[["_Run"], int | None] | None = None
                 ) -> None:
        self.send = send
        self.name = name
        self.host = host
        self.box = box
        self.settle = settle
        self.steal = steal

    def run(self, lease: "Branch | _Run", owner: str | None = None,
            taken: int | None = None) -> None:
        """Run a lease's branches and answer them, as ``owner`` when they are another
        worker's (the Collector admits an answer only from the worker the lease went to).
        With ``taken``, only the branch at that position, already taken from the lease
        (a worker waiting for its turn, :meth:`GroupWorker._steal`); the worker it went to
        runs and answers the others. Each branch is taken from the lease once its turn has
        come, never before, so a waiting worker may take the next one meanwhile."""
        run = lease if type(lease) is _Run else _Run(lease)
        lease = run.lease
        host = self.host
        target = host.target
        wants_ctx = host.wants_ctx
        live = host.live
        journals = lease.journals
        indices = lease.indices
        items = lease.items
        done: list[int] = []
        values: list[Any] = []
        cancelled: list[int] = []
        effects: list[tuple[int, str]] = []
        t0 = time.monotonic()
        previous = getattr(_ambient, "host", None)
        # A steal, run while this thread waits in a lease of the same group, finds the
        # group's host and meter bound already.
        nested = previous is host
        if not nested:
            _ambient.host = host
            outer_meter = usage.swap(getattr(host.ledger, "meter", None))   # with the caller
        fast = host.fast
        parent = host.parent
        box = self.box
        settle = self.settle
        starts = 0
        order = host.order      # every start is marked in it, whatever the lease
        in_order = order is not None and lease.in_order   # this lease waits for its turn
        steal = self.steal
        steal_run = (lambda _need: steal(run)) \
            if steal is not None and in_order and taken is None else None
        # This process's start order is read and marked here without a call; another
        # process's (actors.groups.served.RemoteOrder) is asked and told each time.
        local = type(order) is _StartOrder
        if local:
            bound, started = order.bound, order.started
        convert = host.convert
        exact = getattr(convert, "exact", None)   # a value of exactly R needs no call
        suspend_all = host.suspend_all
        waiting: list[Suspension] = []
        took = 0 if taken is None else 1   # branches of the lease this part took

        def give_up() -> bool:
            return host.cancelled or host.holding

        def rest() -> list[int]:
            nonlocal took
            left = run.rest(not took)
            took += len(left)
            return left

        def answer(unstarted: list[int], **kw) -> None:
            if not took:
                return   # every branch was taken by waiting workers, who answer them
            # Counted before the answer leaves: the driver reads the ledger at the end.
            if starts:
                host.ledger.add_calls(starts)
            whole = run.end((took, done, values, cancelled, effects, waiting,
                             time.monotonic() - t0), bool(unstarted or kw))
            if whole is not None:
                n, *fields, elapsed = whole
                self._answer(lease, *fields, elapsed=elapsed, owner=owner,
                             unstarted=unstarted, part=n != len(indices), **kw)

        try:
            while True:
                if taken is not None:   # one branch, taken by this worker's steal
                    if done or cancelled or waiting:
                        break
                    pos = taken
                else:
                    pos = run.pos
                    if pos >= len(indices):
                        break
                    # Before taking a live-branch slot: a worker waiting for its turn holds
                    # none (and has not taken the branch: another may, once it may start).
                    # (Its turn has come when ``low`` reached ``_StartOrder.need``: most
                    # often so, read here without a call.)
                    if in_order:
                        j = indices[pos]
                        if (not local or j >= bound and order.low < (
                                j - bound + 1 if j >= 2 * bound - 1 else bound)) \
                                and not order.wait(j, give_up, steal_run):
                            return answer(rest())
                    if not run.take(pos, not took):
                        continue   # taken meanwhile by a waiting worker
                    took += 1
                index = indices[pos]
                if live:
                    if not _enter_all(live, lambda: host.cancelled or host.holding):
                        return answer([index] + rest())
                    _ambient.slots = live
                try:
                    if fast:
                        if host.stopping or host.holding or (parent is not None
                                                             and parent.cancelled):
                            verdict = _NOT_NOW
                        else:
                            verdict = _GO
                            starts += 1
                    else:
                        verdict = host.begin(index)
                    if verdict is _NOT_NOW:
                        return answer([index] + rest())
                    if verdict is not _GO:
                        after = host.fail(index, verdict)
                        return answer(rest(), failed=(index, verdict, after))
                    if local:   # _StartOrder.mark, its wake-ups only if a worker waits
                        started[index] = 1
                        if order.waiting:
                            order.mark(index)
                    elif order is not None:
                        order.mark(index)
                    ctx = None
                    try:
                        if wants_ctx:
                            ctx = BranchContext(host, index, items[pos], journals.get(index))
                            value = target(items[pos], ctx)
                        else:
                            value = target(items[pos])
                        if hasattr(value, "__await__"):   # an async target: run it here
                            value = settle(value)
                        if convert is not None and type(value) is not exact:
                            value = convert(index, value)
                    except _Suspend as suspend:
                        if ctx is not None:
                            effects += ctx._effects
                        if suspend_all:   # this branch waits; the lease goes on
                            waiting.append(Suspension(index=index, pending=suspend.pending,
                                                      journal=suspend.journal))
                            continue
                        host.hold(index)
                        return answer(rest(), suspended=(index, suspend))
                    except BranchCancelled:
                        cancelled.append(index)
                        if ctx is not None:
                            effects += ctx._effects
                        continue
                    except Exception as exc:  # the branch's error -> Collector: stops the group
                        after = host.fail(index, exc)
                        if ctx is not None:
                            effects += ctx._effects
                        return answer(rest(), failed=(index, exc, after))
                    if ctx is not None and ctx._effects:
                        effects += ctx._effects
                    done.append(index)
                    values.append(value)
                    box.finished += 1
                finally:
                    if live:
                        _ambient.slots = ()
                        for gate in live:
                            gate.leave()
            return answer([])
        finally:
            if not nested:
                _ambient.host = previous
                usage.swap(outer_meter)

    @staticmethod
    def _unencodable(done, values) -> tuple[int, BaseException] | None:
        """The first result that cannot cross the bus, and the error its branch fails with."""
        for k, value in enumerate(values):
            try:
                _encoder.encode(value)
            except (TypeError, ValueError, OverflowError) as exc:
                return k, TypeError(
                    f"the result of branch {done[k]} ({type(value).__name__}) cannot cross "
                    f"the bus ({exc}): return JSON-like values (None, bool, int, float, "
                    "str, bytes, lists, dicts with str keys) or msgspec Structs")
        return None

    @staticmethod
    def _too_large(done, values) -> tuple[int, BaseException]:
        """The largest result of a lease whose results will not fit one message: its branch
        fails, by name, rather than the message (and with it the whole lease) being lost."""
        sizes = [len(_encoder.encode(v)) for v in values]
        k = max(range(len(values)), key=sizes.__getitem__)
        return k, ResultTooLarge(
            f"the result of branch {done[k]} takes {sizes[k]} bytes encoded, over the "
            f"{MAX_RESULT_BYTES} one message may carry: return something smaller (an id, a "
            "path to a file) and keep the bulk elsewhere")

    def _journal_fits(self, suspended, nbytes: int):
        """(failed, suspended) for a branch that paused: as it was, or, when its journal
        (answers, effect results) and question would not fit one message with the
        lease's results, failed by name instead (else the message would be lost)."""
        index, suspend = suspended
        size = len(_encoder.encode([suspend.journal, suspend.pending]))
        if nbytes + size <= MAX_RESULT_BYTES:
            return None, suspended
        error = ResultTooLarge(
            f"branch {index} paused with its journal and question taking {size} bytes "
            f"encoded, over the {MAX_RESULT_BYTES} one message may carry: have effects "
            "return something smaller (an id, a path to a file)")
        return (index, error, self.host.fail(index, error)), None

    def _waiting_fits(self, waiting: list[Suspension], nbytes: int):
        """(failed, waiting) for the branches of a lease that wait on a person (coordinated
        suspension): as they were, or, when their journals and questions would not fit
        one message with the lease's results, the largest fails by name (the others are
        reported waiting) instead of the message being lost."""
        sizes = [len(_encoder.encode(w)) for w in waiting]
        if nbytes + sum(sizes) <= MAX_RESULT_BYTES:
            return None, waiting
        k = max(range(len(waiting)), key=sizes.__getitem__)
        index = waiting[k].index
        error = ResultTooLarge(
            f"branch {index} paused with its journal and question taking {sizes[k]} bytes "
            f"encoded, over the {MAX_RESULT_BYTES} one message may carry: have effects "
            "return something smaller (an id, a path to a file)")
        return (index, error, self.host.fail(index, error)), waiting[:k] + waiting[k + 1:]

    def _answer(self, lease: Branch, done, values, cancelled, effects, waiting, *, unstarted,
                elapsed, failed=None, suspended=None, owner: str | None = None,
                part: bool = False) -> None:
        try:
            nbytes = len(_encoder.encode(values))
        except (TypeError, ValueError, OverflowError):
            # A result that cannot cross the bus fails its branch (and so the group).
            bad = self._unencodable(done, values)
            if bad is None:  # every value encodes alone: not a result's fault; a bug
                raise
            nbytes = MAX_RESULT_BYTES + 1  # not sent: the branch below fails instead
        else:
            bad = self._too_large(done, values) if nbytes > MAX_RESULT_BYTES else None
        if bad is not None:
            k, error = bad
            after = self.host.fail(done[k], error)
            self.box.finished -= 1   # counted when it returned: it failed instead
            if failed is None:
                failed, suspended = (done[k], error, after), None
            elif part:   # a part is counted branch by branch: this one is not left out
                cancelled = cancelled + [done[k]]
            return self._answer(lease, done[:k] + done[k + 1:], values[:k] + values[k + 1:],
                                cancelled, effects, waiting, unstarted=unstarted,
                                elapsed=elapsed,
                                failed=failed, suspended=suspended, owner=owner, part=part)
        if suspended is not None and failed is None:
            failed, suspended = self._journal_fits(suspended, nbytes)
        if waiting and failed is None:
            failed, waiting = self._waiting_fits(waiting, nbytes)
        name = owner or self.name
        common = dict(group_id=lease.group_id, lease_id=lease.lease_id, worker=name,
                      indices=done, values=values, cancelled=cancelled, unstarted=unstarted,
                      effects=effects, nbytes=nbytes, part=part)
        if failed is not None:
            index, exc, after = failed
            msg = BranchFailed(index=index, error=describe(exc, limit=500, typed=False),
                               error_type=type(exc).__name__, after_stop=after,
                               suspended=waiting, **common)
        elif suspended is not None:
            index, suspend = suspended
            msg = Interaction(index=index, pending=suspend.pending, journal=suspend.journal,
                              **common)
        else:
            msg = BranchDone(elapsed=round(elapsed, 6), suspended=waiting,
                             **common)
        self.send(name, msg)
