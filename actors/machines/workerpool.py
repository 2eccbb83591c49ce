"""The workers a Collector leases to, in the order they became ready, indexed by how many
leases each holds in its :class:`~actors.machines.leases.LeaseTable` (the table's
``on_held`` keeps the index up to date). What the Collector asks of its pool for every
answer (the first worker in order among those holding the fewest leases, how many are
idle, the next one with a lease queued behind the one it runs, the last idle ones) is
answered in O(log workers) amortised instead of a scan of the pool.

Each index is a heap of ``(rank, name)`` (a worker's rank: when it joined the pool, so
heap order is pool order) read lazily: an entry is pushed whenever a worker's count
changes, and one that no longer holds (the worker left, or holds another count) is
popped when it comes to the top. The heaps are compacted once the entries pushed
since the last time are several times the pool.

A pool planned for at most ``SCAN_UP_TO`` workers keeps no heaps: it answers the same
questions by a scan of its members in pool order, cheaper for a handful of workers than
keeping three heaps up to date on every change (the small groups' case).
"""

from __future__ import annotations

import heapq
from typing import Any, Iterator

from actors.machines.leases import LeaseTable

Entry = tuple[int, str]

#: Pools of at most this many workers scan instead of keeping an index.
SCAN_UP_TO = 8


class WorkerPool:
    """The pool of ``table``'s workers ready for leases; ``slots``: the most leases a
    worker holds (the one it runs and those queued behind it); ``size``: the most
    workers it will hold, if known (a small pool scans, see ``SCAN_UP_TO``)."""

    def __init__(self, table: LeaseTable[Any], slots: int, size: int | None = None) -> None:
        self.table = table
        self.slots = max(1, slots)
        self.scan = size is not None and size <= SCAN_UP_TO
        self.rank: dict[str, int] = {}   # the members, in pool order
        self.next_rank = 0
        self.idle = 0                    # members holding no lease
        self.full = 0                    # members holding ``slots`` leases (no room)
        self.fewest_by: list[list[Entry]] = [[] for _ in range(self.slots)]  # held == c
        self.queued: list[Entry] = []    # held >= 2: a lease queued behind a running one
        self.last: list[Entry] = []      # (-rank, name): idle, last in order first
        self.pushed = 0                  # entries pushed since the heaps were compacted
        table.on_held = self.changed

    # -- membership -----------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self.rank

    def __len__(self) -> int:
        return len(self.rank)

    def __iter__(self) -> Iterator[str]:
        return iter(self.rank)

    def add(self, name: str) -> None:
        """The worker is ready: it joins the pool last."""
        if name in self.rank:
            return
        self.rank[name] = self.next_rank
        self.next_rank += 1
        held = self.held(name)
        self.idle += held == 0
        self.full += held >= self.slots
        if not self.scan:
            self._index(name, held)

    def remove(self, name: str) -> None:
        if self.rank.pop(name, None) is not None:
            held = self.held(name)
            self.idle -= held == 0
            self.full -= held >= self.slots

    def held(self, name: str) -> int:
        worker = self.table.workers.get(name)
        return 0 if worker is None else len(worker.held)

    def changed(self, name: str, was: int, now: int) -> None:
        """The lease table's ``on_held``: ``name`` held ``was`` leases, now ``now``."""
        if name not in self.rank:
            return
        self.idle += (now == 0) - (was == 0)
        self.full += (now >= self.slots) - (was >= self.slots)
        if not self.scan:
            self._index(name, now)

    # -- reading --------------------------------------------------------------------------

    def fewest(self, cap: int) -> str | None:
        """The first worker in pool order among those holding the fewest leases, if that
        is fewer than ``cap`` (<= slots); else None."""
        rank, workers = self.rank, self.table.workers
        if self.scan:
            best, fewest = None, cap
            for name in rank:
                worker = workers.get(name)
                if worker is not None and len(worker.held) < fewest:
                    best, fewest = name, len(worker.held)
                    if not fewest:
                        break
            return best
        for count in range(cap):
            heap = self.fewest_by[count]
            while heap:
                r, name = heap[0]
                worker = workers.get(name)
                if worker is not None and len(worker.held) == count and rank.get(name) == r:
                    return name
                heapq.heappop(heap)
        return None

    def with_queued(self) -> Iterator[str]:
        """The workers holding a lease queued behind the one they run, in pool order, each
        once. One the caller passes over (nothing of it to revoke) is indexed again only
        when its count changes; the caller says which it used with :meth:`keep`."""
        if self.scan:
            workers = self.table.workers
            yield from [name for name in self.rank
                        if name in workers and len(workers[name].held) >= 2]
            return
        heap, seen = self.queued, set()
        while heap:
            r, name = heapq.heappop(heap)
            if name in seen or self.rank.get(name) != r or self.held(name) < 2:
                continue
            seen.add(name)
            yield name

    def keep(self, names: list[str]) -> None:
        """Index again workers :meth:`with_queued` yielded (still holding what they did)."""
        if self.scan:
            return
        for name in names:
            heapq.heappush(self.queued, (self.rank[name], name))

    def last_idle(self, k: int) -> list[str]:
        """The ``k`` idle workers last in pool order (fewer if there are not), in order;
        for the caller to remove."""
        if self.scan:
            found = []
            for name in reversed(self.rank):
                if len(found) >= k:
                    break
                if self.held(name) == 0:
                    found.append(name)
            found.reverse()
            return found
        heap, found = self.last, []
        while heap and len(found) < k:
            r, name = heapq.heappop(heap)
            if self.rank.get(name) == -r and self.held(name) == 0 and name not in found:
                found.append(name)
        found.reverse()
        return found

    # -- the index ------------------------------------------------------------------------

    def _index(self, name: str, held: int) -> None:
        r = self.rank[name]
        if held < self.slots:
            heapq.heappush(self.fewest_by[held], (r, name))
        if held >= 2:
            heapq.heappush(self.queued, (r, name))
        if held == 0:
            heapq.heappush(self.last, (-r, name))
        self.pushed += 1
        if self.pushed > 4 * len(self.rank) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries (each heap mostly stale by now), keeping the live once."""
        self.pushed = 0
        rank, workers = self.rank, self.table.workers
        # Each member's count read once (not once an entry: the heaps hold many).
        held = {name: len(workers[name].held) if name in workers else 0 for name in rank}
        get = held.get
        for count, heap in enumerate(self.fewest_by):
            heap[:] = sorted({e for e in heap
                              if rank.get(e[1]) == e[0] and get(e[1]) == count})
        self.queued[:] = sorted({e for e in self.queued
                                 if rank.get(e[1]) == e[0] and get(e[1], 0) >= 2})
        self.last[:] = sorted({e for e in self.last
                               if rank.get(e[1]) == -e[0] and get(e[1]) == 0})
