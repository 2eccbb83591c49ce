"""The lease table: which lease is with which worker. A pure state machine's part, shared
by the Scheduler (rollout and eval leases) and the Collector (branch leases).

A lease is *waiting* (known, no holder), *held* (with one worker) or gone (answered,
given up, cancelled). Lease ids are never reused, so an answer for an id the table does
not hold is late or a duplicate: it is dropped and counted, never settled twice, and the
table's memory is bounded by the work in flight. A worker runs ``slots`` leases at once
and may hold ``queued`` more behind them (prefetch), so it never idles for a round trip;
the table refuses to give a worker more than that. Taking a lease back (a revoke
answered, a worker lost or reconnected without it) makes it waiting again under the same
id: whoever answers first settles it, and every worker it went to may answer it.

Liveness: a worker that heartbeats is *watched*; one silent past a deadline (the user
passes the time in, the table reads no clock) or reported lost is *presumed lost*: it
leaves, its leases wait again, and a lease whose workers were lost ``max_tries`` times is
handed back to the user as given up. A lost worker heard from again comes back empty.

What the table does not decide: the order in which waiting leases go out, which worker
gets one, when to revoke, what an answer means. Those are its users' policies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P")


@dataclass
class Holder:
    """A worker as the table sees it: the leases it holds, in the order it got them (it
    runs the first ``slots`` and starts the next one as one ends)."""

    name: str
    slots: int
    queued: int = 0
    held: list[str] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.slots + self.queued

    @property
    def running(self) -> int:
        return min(len(self.held), self.slots)


class LeaseTable(Generic[P]):
    """Leases (``lease id -> payload``) and their holders. ``max_tries``: a lease whose
    workers were lost that many times is given up (0: never). ``on_held(name, was,
    now)``, if given, is told every change of a registered worker's number of leases
    held (a user that indexes workers by it keeps its index up to date from there)."""

    def __init__(self, max_tries: int = 0,
                 on_held: Callable[[str, int, int], None] | None = None) -> None:
        self.on_held = on_held
        self.payload: dict[str, P] = {}
        self.holder: dict[str, str] = {}
        #: Every worker a live lease went to: who may answer it (a taken-back lease's
        #: first holder may still answer first).
        self.given: dict[str, set[str]] = {}
        self.workers: dict[str, Holder] = {}
        self.lost: dict[str, Holder] = {}      # presumed lost; remembered if it comes back
        self.seen: dict[str, float] = {}       # watched workers: when last heard from
        self.tries: dict[str, int] = {}        # lease id -> workers lost holding it
        self.revoking: set[str] = set()        # held leases asked back, not yet answered
        self.max_tries = max(0, max_tries)
        self.active = 0          # leases running: sum over workers of min(held, slots)
        self.late = 0            # answers for leases not in the table (late, duplicate)
        self.redispatched = 0    # leases made waiting again to go to another worker
        self.lost_workers = 0
        self.given_up = 0

    # -- workers ------------------------------------------------------------------------

    def join(self, name: str, slots: int = 1, queued: int = 0) -> list[str]:
        """A worker registers, or registers again with new slots. It keeps what it holds
        up to its new capacity; the leases beyond it (the last ones it got, queued behind
        the ones it runs) are taken back, and their ids returned."""
        worker = self.workers.get(name)
        if worker is None:
            self.workers[name] = Holder(name, max(1, slots), max(0, queued))
            return []
        self.active -= worker.running
        worker.slots, worker.queued = max(1, slots), max(0, queued)
        self.active += worker.running
        back = worker.held[worker.capacity:]
        for lease_id in back:
            self.take_back(lease_id)
        return back

    def reconnect(self, name: str, slots: int, holding: list[str]) -> list[str]:
        """A known worker registers again after its connection dropped, listing what it
        still holds: the leases it does not list were lost on the way and wait again (in
        the order it got them), as do those beyond its new slots' capacity."""
        worker = self.workers[name]
        still = set(holding)
        back = [lease_id for lease_id in worker.held if lease_id not in still]
        for lease_id in back:
            self.take_back(lease_id)
        return back + self.join(name, slots, worker.queued)

    def leave(self, name: str) -> list[str]:
        """The worker is gone (stopped, released): every lease it held is waiting again,
        in the order it got them; returns their ids."""
        worker = self.workers.pop(name, None)
        if worker is None:
            return []
        back = list(worker.held)
        for lease_id in back:
            self._unhold(lease_id, worker)
        self.redispatched += len(back)
        return back

    def lose(self, name: str) -> tuple[list[str], list[str]]:
        """The worker is presumed lost (silent past its deadline, or reported lost): it
        leaves and is remembered in ``lost``. Returns the leases it held, in the order it
        got them: those waiting again under their ids, and those given up (lost
        ``max_tries`` times; still in the table, for the user to settle)."""
        worker = self.workers.pop(name, None)
        if worker is None:
            return [], []
        self.lost[name] = worker
        self.lost_workers += 1
        again: list[str] = []
        given_up: list[str] = []
        for lease_id in list(worker.held):
            self._unhold(lease_id, worker)
            tries = self.tries[lease_id] = self.tries.get(lease_id, 0) + 1
            if self.max_tries and tries >= self.max_tries:
                self.given_up += 1
                del self.tries[lease_id]
                given_up.append(lease_id)
            else:
                self.redispatched += 1
                again.append(lease_id)
        worker.held = []
        return again, given_up

    def back(self, name: str) -> Holder | None:
        """A worker presumed lost is heard from again: it is no longer lost (it registers
        again, holding nothing: its leases went elsewhere). Its old self, or None."""
        return self.lost.pop(name, None)

    def forget_workers(self) -> list[str]:
        """Every worker is forgotten (a run resumed with new ones): every held lease is
        waiting again, in the order they were given; returns their ids."""
        order = list(self.holder)
        self.holder.clear()
        self.given.clear()
        self.revoking.clear()
        self.workers.clear()
        self.active = 0
        return order

    # -- liveness -----------------------------------------------------------------------

    def watch(self, name: str, now: float) -> None:
        """The worker heartbeats: from now on, silence past a deadline means lost."""
        self.seen[name] = now

    def heard(self, name: str, now: float) -> None:
        """Anything from a watched worker is a sign of life."""
        if name in self.seen:
            self.seen[name] = now

    def silent(self, now: float, deadline: float) -> list[str]:
        """The live watched workers not heard from for more than ``deadline``."""
        workers = self.workers
        return [name for name, seen in self.seen.items()
                if name in workers and now - seen > deadline]

    def known(self, name: str) -> bool:
        """A worker registered, presumed lost, or watched."""
        return name in self.workers or name in self.lost or name in self.seen

    # -- leases -------------------------------------------------------------------------

    def add(self, lease_id: str, payload: P) -> None:
        """A new lease, waiting. Ids are never reused."""
        if lease_id in self.payload:
            raise ValueError(f"lease {lease_id!r} is already in the table: lease ids are "
                             "never reused")
        self.payload[lease_id] = payload

    def give(self, lease_id: str, name: str) -> Holder:
        """A waiting lease goes to a registered worker with room for it."""
        if lease_id not in self.payload or lease_id in self.holder:
            raise ValueError(f"lease {lease_id!r} is not waiting: only a waiting lease "
                             "can be given")
        worker = self.workers.get(name)
        if worker is None:
            raise ValueError(f"{name!r} is not a registered worker")
        held = worker.held
        n = len(held)
        if n >= worker.slots + worker.queued:
            raise ValueError(f"{name} holds {n} lease(s), its capacity")
        if n < worker.slots:
            self.active += 1
        held.append(lease_id)
        self.holder[lease_id] = name
        if self.on_held is not None:
            self.on_held(name, n, n + 1)
        given = self.given.get(lease_id)
        if given is None:
            self.given[lease_id] = {name}
        else:
            given.add(name)
        return worker

    def set(self, lease_id: str, payload: P) -> None:
        """Replace a live lease's payload (a lease cut to what a budget allows)."""
        if lease_id not in self.payload:
            raise ValueError(f"lease {lease_id!r} is not in the table")
        self.payload[lease_id] = payload

    def answer(self, lease_id: str) -> P | None:
        """The lease is settled: it leaves the table and its payload is returned. None for
        an id the table does not hold (late, or a duplicate): counted in ``late``
        (payloads are never None)."""
        if lease_id not in self.payload:
            self.late += 1
            return None
        return self.drop(lease_id)

    def take_back(self, lease_id: str) -> bool:
        """A held lease becomes waiting again under the same id (revoked, or its worker
        reconnected without it); False if it was not held."""
        name = self.holder.get(lease_id)
        if name is None:
            return False
        self._unhold(lease_id, self.workers.get(name))
        self.redispatched += 1
        return True

    def revoke(self, lease_id: str) -> str | None:
        """Mark a held lease as asked back (its holder answers it unstarted, or runs it
        if it had started); returns the holder, or None if it is not held."""
        name = self.holder.get(lease_id)
        if name is not None:
            self.revoking.add(lease_id)
        return name

    def drop(self, lease_id: str) -> P | None:
        """A lease leaves the table unanswered (cancelled, given up)."""
        if lease_id not in self.payload:
            return None
        name = self.holder.get(lease_id)
        if name is not None:
            self._unhold(lease_id, self.workers.get(name))
        self.given.pop(lease_id, None)
        self.tries.pop(lease_id, None)
        return self.payload.pop(lease_id)

    # -- reading ------------------------------------------------------------------------

    def waiting(self, lease_id: str) -> bool:
        return lease_id in self.payload and lease_id not in self.holder

    def may_answer(self, lease_id: str, name: str) -> bool:
        """Whether ``name`` is a worker the live lease went to."""
        return name in self.given.get(lease_id, ())

    def room(self, name: str) -> int:
        """How many more leases the worker may hold now."""
        worker = self.workers[name]
        return worker.capacity - len(worker.held)

    def free_slots(self, name: str) -> int:
        """How many more leases would start at once at the worker (not queue)."""
        worker = self.workers[name]
        return max(0, worker.slots - len(worker.held))

    @property
    def running(self) -> int:
        """Leases running now: at most ``slots`` per worker."""
        return self.active

    @property
    def held(self) -> int:
        return len(self.holder)

    def _unhold(self, lease_id: str, worker: Holder | None) -> None:
        del self.holder[lease_id]
        self.revoking.discard(lease_id)
        if worker is not None:
            held = worker.held
            held.remove(lease_id)
            n = len(held)
            if n < worker.slots:
                self.active -= 1
            if self.on_held is not None:
                self.on_held(worker.name, n + 1, n)
