"""The lease table: which lease is with which worker. A pure state machine's part, shared
by the Scheduler (rollout and eval leases) and the Collector (branch leases).

A lease is *waiting* (known, no holder), *held* (with one worker) or gone (answered,
given up, cancelled). Lease ids are never reused, so an answer for an id the table does
not hold is late or a duplicate: it is dropped and counted, never settled twice, and the
table's memory is bounded by the work in flight. A worker runs ``slots`` leases at once
and may hold ``queued`` more behind them (prefetch), so it never idles for a round trip;
the table refuses to give a worker more than that. Taking a lease back (a revoke, a lost
worker) makes it waiting again under the same id: whoever answers first settles it.

What the table does not decide: the order in which waiting leases go out, which worker
gets one, when to revoke, what an answer means. Those are its users' policies.
"""

from __future__ import annotations

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
    """Leases (``lease id -> payload``) and their holders."""

    def __init__(self) -> None:
        self.payload: dict[str, P] = {}
        self.holder: dict[str, str] = {}
        self.workers: dict[str, Holder] = {}
        self.late = 0          # answers for leases not in the table (late, duplicate)
        self.taken_back = 0    # leases made waiting again (revoked, or their worker lost)

    # -- workers ------------------------------------------------------------------------

    def join(self, name: str, slots: int = 1, queued: int = 0) -> list[str]:
        """A worker registers, or registers again with new slots. It keeps what it holds
        up to its new capacity; the leases beyond it (the last ones it got, queued behind
        the ones it runs) are taken back, and their ids returned."""
        worker = self.workers.get(name)
        if worker is None:
            self.workers[name] = Holder(name, max(1, slots), max(0, queued))
            return []
        worker.slots, worker.queued = max(1, slots), max(0, queued)
        back = worker.held[worker.capacity:]
        for lease_id in back:
            self.take_back(lease_id)
        return back

    def leave(self, name: str) -> list[str]:
        """The worker is gone (lost, stopped, released): every lease it held is waiting
        again, in the order it got them; returns their ids."""
        worker = self.workers.pop(name, None)
        if worker is None:
            return []
        back = list(worker.held)
        for lease_id in back:
            del self.holder[lease_id]
        self.taken_back += len(back)
        return back

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
        if len(worker.held) >= worker.capacity:
            raise ValueError(f"{name} holds {len(worker.held)} lease(s), its capacity")
        worker.held.append(lease_id)
        self.holder[lease_id] = name
        return worker

    def answer(self, lease_id: str) -> P | None:
        """The lease is settled: it leaves the table and its payload is returned. None for
        an id the table does not hold (late, or a duplicate): counted in ``late``
        (payloads are never None)."""
        if lease_id not in self.payload:
            self.late += 1
            return None
        self._unhold(lease_id)
        return self.payload.pop(lease_id)

    def take_back(self, lease_id: str) -> bool:
        """A held lease becomes waiting again under the same id (revoked, or its worker is
        presumed lost); False if it was not held."""
        if lease_id not in self.holder:
            return False
        self._unhold(lease_id)
        self.taken_back += 1
        return True

    def drop(self, lease_id: str) -> P | None:
        """A lease leaves the table unanswered (cancelled, given up)."""
        if lease_id not in self.payload:
            return None
        self._unhold(lease_id)
        return self.payload.pop(lease_id)

    # -- reading ------------------------------------------------------------------------

    def waiting(self, lease_id: str) -> bool:
        return lease_id in self.payload and lease_id not in self.holder

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
        return sum(w.running for w in self.workers.values())

    @property
    def held(self) -> int:
        return len(self.holder)

    def _unhold(self, lease_id: str) -> None:
        name = self.holder.pop(lease_id, None)
        if name is not None and name in self.workers:
            self.workers[name].held.remove(lease_id)
