"""The Collector's pool index (actors/machines/workerpool.py) against a scan of the pool:
random gives, answers, take-backs, revokes, losses and joins, every answer checked
(fewest, idle, full)."""

from __future__ import annotations

import random

import pytest

from actors.machines.leases import LeaseTable
from actors.machines.workerpool import WorkerPool


def scan_fewest(order: list[str], table: LeaseTable, cap: int) -> str | None:
    counts = [len(table.workers[w].held) for w in order]
    if not counts or min(counts) >= cap:
        return None
    return order[counts.index(min(counts))]


def check(order: list[str], table: LeaseTable, pool: WorkerPool, slots: int) -> None:
    assert list(pool) == order
    idle = [w for w in order if not table.workers[w].held]
    assert pool.idle == len(idle)
    assert pool.full == sum(1 for w in order if len(table.workers[w].held) >= slots)
    for cap in range(1, slots + 1):
        assert pool.fewest(cap) == scan_fewest(order, table, cap)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("size", [None, 8])   # the heaps, and a small pool's scan
def test_pool_index_matches_a_scan(seed: int, slots: int, size: int | None) -> None:
    rng = random.Random(seed)
    table: LeaseTable[int] = LeaseTable()
    pool = WorkerPool(table, slots, size)
    assert pool.scan == (size is not None)
    order: list[str] = []
    names = [f"w{i}" for i in range(12)]
    for name in names[:8]:
        table.join(name, 1, slots - 1)
        pool.add(name)
        order.append(name)
    n = 0
    for _ in range(600):   # bounded
        op = rng.random()
        if op < 0.45:
            worker = pool.fewest(slots)
            if worker is not None:
                table.add(f"l{n}", n)
                table.give(f"l{n}", worker)
                n += 1
        elif op < 0.75 and table.holder:
            table.answer(rng.choice(list(table.holder)))
        elif op < 0.82 and table.holder:
            table.take_back(rng.choice(list(table.holder)))
        elif op < 0.88 and table.holder:
            table.revoke(rng.choice(list(table.holder)))
        elif op < 0.92 and order:
            gone = rng.choice(order)
            table.lose(gone)
            pool.remove(gone)
            order.remove(gone)
        elif op < 0.96:
            name = rng.choice(names)
            if name not in pool:
                table.join(name, 1, slots - 1)
                pool.add(name)
                order.append(name)
        else:
            k = rng.randint(0, 3)
            idle = [w for w in order if not table.workers[w].held]
            go = pool.last_idle(k)
            assert go == idle[len(idle) - min(k, len(idle)):]
            for w in go:
                pool.remove(w)
                table.leave(w)
                order.remove(w)
        check(order, table, pool, slots)
        queued = [w for w in order if len(table.workers[w].held) >= 2]
        walked = list(pool.with_queued())
        assert walked == queued
        pool.keep(walked)
