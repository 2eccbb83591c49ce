"""Even shares (GroupStart.shares, what a group whose every worker is in another process
leases): rounds of one lease per worker, all of a round the same size; the first round a
fraction of each worker's fair share, later rounds half of what is queued over the
workers, none shorter than min_lease_seconds by the workers' measure. The Collector is
fed messages; workers answer in a seeded random order."""

from __future__ import annotations

import random

import pytest

from actors.machines.collector import Collector
from protocol import Branch, BranchDone, GroupResult, GroupStart


def _start(n: int, workers: int, **kw) -> GroupStart:
    return GroupStart(group_id="g", items=list(range(n)),
                      workers=[f"w{i}" for i in range(workers)], max_concurrency=workers,
                      max_items=n, driver="d", prefetch=1, **kw)


def _run(start: GroupStart, seed: int, per_item: float = 0.05):
    """Drive the group to its end; returns (the leases in the order cut, the result)."""
    rng = random.Random(seed)
    c = Collector("c")
    out = c.handle(start)
    held: dict[str, list[Branch]] = {}
    cut: list[Branch] = []
    result = None
    for _ in range(10 * len(start.items) + 100):   # bounded: every answer settles a lease
        for to, msg in out:
            if isinstance(msg, Branch):
                held.setdefault(to, []).append(msg)
                cut.append(msg)
            elif isinstance(msg, GroupResult):
                result = msg
        if result is not None:
            return cut, result
        worker = rng.choice(sorted(w for w, leases in held.items() if leases))
        lease = held[worker].pop(0)   # a worker answers its leases in the order it got them
        out = c.handle(BranchDone(group_id="g", lease_id=lease.lease_id, worker=worker,
                                  indices=lease.indices, values=[i * 10 for i in lease.indices],
                                  elapsed=per_item * len(lease.indices)))
    raise AssertionError("the group did not end")


def _rounds(cut: list[Branch], workers: int) -> list[list[int]]:
    sizes = [len(lease.indices) for lease in cut]
    return [sizes[k:k + workers] for k in range(0, len(sizes), workers)]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_round_of_even_shares_gives_each_worker_the_same_size(seed):
    cut, result = _run(_start(1000, 8, shares=0.8, min_lease_seconds=0.15), seed)
    assert result.status == "completed" and result.results == [i * 10 for i in range(1000)]
    rounds = _rounds(cut, 8)
    assert rounds[0] == [100] * 8            # 0.8 of a fair share of 125
    assert rounds[1] == [13] * 8             # ceil(200 / (2 x 8))
    for sizes in rounds[2:-1]:               # the last round may run out of branches
        assert len(set(sizes)) == 1, rounds
    # Measured at 50 ms a branch, no lease is shorter than 0.15 s (3 branches), except
    # the very last one, cut from what was left.
    assert min(len(lease.indices) for lease in cut[:-1]) >= 3
    assert sorted(i for lease in cut for i in lease.indices) == list(range(1000))


def test_without_shares_leases_stay_guided():
    cut, result = _run(_start(100, 4), seed=0)
    assert result.status == "completed"
    assert [len(lease.indices) for lease in cut[:3]] == [13, 11, 10]   # ceil(q / 8)


def test_shares_on_fewer_items_than_workers_still_lease_every_branch_once():
    cut, result = _run(_start(5, 8, shares=0.8, min_lease_seconds=0.15), seed=0)
    assert result.status == "completed" and result.results == [i * 10 for i in range(5)]
    assert [len(lease.indices) for lease in cut] == [1] * 5
