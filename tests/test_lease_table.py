"""A model-based test of the Scheduler's lease table (hypothesis RuleBasedStateMachine).

Random workers register, rounds of leases arrive, holders answer, answers come late or
twice, workers go silent and are presumed lost (their leases re-dispatched under the
same id), come back, and the Scheduler is compared after every step with a plain-dict
model of who should hold what. Invariants: no lease is answered twice, none is lost
(every lease is queued, held, settled or given up), no worker holds more than its
capacity, no more than ``max_concurrency`` leases run, and ``Barrier(r)`` goes out once,
only when every lease of round r is settled.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from actors.addresses import MERGER, PLANNER
from actors.machines.scheduler import Scheduler
from protocol import (Barrier, Heartbeat, Hello, Lease, LeaseBatch, LeaseDone,
                      RolloutResult, Settled, SettledBatch, Tick)

DEADLINE = 1.0
MAX_TRIES = 3
NAMES = [f"w{i}" for i in range(4)]


class LeaseTable(RuleBasedStateMachine):
    @initialize(max_concurrency=st.integers(1, 4))
    def start(self, max_concurrency: int) -> None:
        self.s = Scheduler(max_concurrency, deadline=DEADLINE, max_tries=MAX_TRIES)
        self.max_concurrency = max_concurrency
        self.clock = 0.0
        self.round = -1
        self.all_leases: dict[str, int] = {}        # lease id -> round
        self.settled: dict[str, int] = {}           # lease id -> times settled
        self.given_up: set[str] = set()
        self.barriers: list[int] = []
        self.held_by: dict[str, str] = {}           # the model: lease id -> worker
        self.answered: list[tuple[str, str]] = []   # (lease id, worker) answered once

    # -- feeding the machine and reading what it sends --------------------------------

    def feed(self, msg) -> None:
        for to, out in self.s.handle(msg):
            match out:
                case Lease(lease_id=lid):
                    assert lid in self.all_leases, f"a lease nobody planned: {lid}"
                    assert lid in self.s.leases, f"{lid} dispatched after it settled"
                    self.held_by[lid] = to
                case Settled():
                    self.note_settled(out)
                case SettledBatch(settled=batch):
                    for one in batch:
                        self.note_settled(one)
                case Barrier(round=r):
                    assert to == MERGER
                    self.barriers.append(r)

    def all_settled(self) -> dict[str, int]:
        """Settlements reported to the Planner, and those the Scheduler holds until the
        Planner next has to act (a sync round reports at its Barrier)."""
        out = dict(self.settled)
        for one in self.s.unreported:
            out[one.lease_id] = out.get(one.lease_id, 0) + 1
        return out

    def note_settled(self, one: Settled) -> None:
        self.settled[one.lease_id] = self.settled.get(one.lease_id, 0) + 1
        if any("infrastructure failure" in e for e in one.errors):
            self.given_up.add(one.lease_id)

    # -- rules -----------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), slots=st.integers(1, 2))
    def register(self, name: str, slots: int) -> None:
        # A worker registering again lists the leases it still runs: no more than its
        # slots (it cannot run more), the rest were lost on the way.
        mine = sorted(lid for lid, w in self.held_by.items() if w == name
                      and lid in self.s.leases)
        self.feed(Hello(worker=name, slots=slots, heartbeat=0.5, leases=mine[:slots]))

    @precondition(lambda self: not self.s.open_rounds)
    @rule(n=st.integers(1, 6))
    def plan_a_round(self, n: int) -> None:
        self.round += 1
        leases = [Lease(lease_id=f"r{self.round}.u{i}", round=self.round, unit=i,
                        task_ids=[f"t{i}"]) for i in range(n)]
        for lease in leases:
            self.all_leases[lease.lease_id] = self.round
        self.feed(LeaseBatch(round=self.round, leases=leases))

    @precondition(lambda self: any(lid in self.s.leases for lid in self.held_by))
    @rule(data=st.data())
    def holder_answers(self, data) -> None:
        open_ = sorted(lid for lid in self.held_by if lid in self.s.leases)
        lid = data.draw(st.sampled_from(open_))
        worker = self.held_by[lid]
        self.answered.append((lid, worker))
        self.feed(LeaseDone(lease_id=lid, worker=worker, round=self.all_leases[lid],
                            results=[RolloutResult(task_id="t", score=0.5, calls=1)]))

    @precondition(lambda self: bool(self.answered))
    @rule(data=st.data())
    def a_late_or_duplicate_answer_is_dropped(self, data) -> None:
        lid, worker = data.draw(st.sampled_from(self.answered))
        before = self.s.duplicates_dropped
        settled = self.all_settled()
        self.feed(LeaseDone(lease_id=lid, worker=worker, round=self.all_leases[lid],
                            results=[RolloutResult(task_id="t", score=0.0, calls=1)]))
        assert self.s.duplicates_dropped == before + 1
        assert self.all_settled() == settled, "a late answer settled a lease again"

    @rule(name=st.sampled_from(NAMES))
    def heartbeat(self, name: str) -> None:
        self.feed(Heartbeat(worker=name))

    @rule(dt=st.sampled_from([0.1, 0.6, 1.5]))
    def time_passes(self, dt: float) -> None:
        self.clock += dt
        self.feed(Tick(elapsed=self.clock))

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def no_lease_is_settled_twice(self) -> None:
        if hasattr(self, "s"):
            twice = {lid: n for lid, n in self.all_settled().items() if n > 1}
            assert not twice, f"settled more than once: {twice}"

    @invariant()
    def no_lease_is_lost(self) -> None:
        if not hasattr(self, "s"):
            return
        queued = {lease.lease_id for lease in self.s.queue}
        held = set(self.s.holder)
        settled = self.all_settled()
        for lid in self.all_leases:
            assert (lid in settled) != (lid in self.s.leases), \
                f"{lid}: settled and in the table, or neither (lost)"
            if lid in self.s.leases:
                assert (lid in queued) != (lid in held), f"{lid}: queued and held, or neither"

    @invariant()
    def capacity_and_concurrency_are_never_exceeded(self) -> None:
        if not hasattr(self, "s"):
            return
        for w in self.s.workers.values():
            assert len(w.held) <= w.capacity, (w.name, w.held, w.capacity)
        assert self.s.active <= self.max_concurrency
        assert self.s.active == sum(min(len(w.held), w.slots)
                                    for w in self.s.workers.values())
        for lid, name in self.s.holder.items():
            assert name in self.s.workers, f"{lid} held by {name}, not a live worker"
            assert lid in self.s.workers[name].held

    @invariant()
    def a_barrier_closes_a_round_once_every_lease_of_it_settled(self) -> None:
        if not hasattr(self, "s"):
            return
        assert len(self.barriers) == len(set(self.barriers)), self.barriers
        for r in self.barriers:
            assert all(lid in self.settled for lid, rr in self.all_leases.items() if rr == r)
        for r in range(self.round + 1):
            if r not in self.barriers:
                assert any(lid not in self.settled for lid, rr in self.all_leases.items()
                           if rr == r), f"round {r} settled but no Barrier"


LeaseTable.TestCase.settings = settings(max_examples=100, stateful_step_count=40,
                                        deadline=None, derandomize=True)
test_the_schedulers_lease_table_matches_its_model = LeaseTable.TestCase


@pytest.mark.parametrize("slots", [1, 2])
def test_a_lost_workers_lease_is_redispatched_under_the_same_id(slots):
    s = Scheduler(2, deadline=DEADLINE, max_tries=MAX_TRIES)
    s.handle(Hello(worker="a", slots=slots, heartbeat=0.5))
    out = s.handle(LeaseBatch(round=0, leases=[Lease(lease_id="r0.u0", round=0)]))
    assert [(to, m.lease_id) for to, m in out if isinstance(m, Lease)] == [("a", "r0.u0")]
    s.handle(Hello(worker="b", slots=1, heartbeat=0.5))
    s.handle(Heartbeat(worker="b"))
    s.handle(Tick(elapsed=0.9))
    s.handle(Heartbeat(worker="b"))
    out = s.handle(Tick(elapsed=1.2))   # a: silent for 1.2 s > deadline; b heard at 0.9
    assert [(to, m.lease_id) for to, m in out if isinstance(m, Lease)] == [("b", "r0.u0")]
    done = LeaseDone(lease_id="r0.u0", worker="b", round=0,
                     results=[RolloutResult(task_id="t", score=1.0, calls=1)])
    assert any(to == PLANNER for to, _ in s.handle(done))
    late = s.handle(msgspec.structs.replace(done, worker="a"))
    assert not any(to == PLANNER for to, _ in late)   # a is back, but nothing settles again
    assert s.duplicates_dropped == 1 and not s.holder
