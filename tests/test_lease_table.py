"""A model-based test of the one lease table (hypothesis RuleBasedStateMachine), through
both of its users: the Scheduler (rollout leases) and the Collector (branch leases).

Random workers register, leases arrive (rounds of rollout leases and the Merger's eval
requests, synchronous or asynchronous with prefetch; a group's branches, guided, in
waves or in even shares), holders answer, answers come late or twice, workers go silent,
are reported lost (their leases re-dispatched under the same id) or reconnect listing
what they still hold, come back, and each machine is compared
after every step with a plain-dict model of who should hold what. The table's own
invariants are checked the same way for both (:func:`the_table_is_consistent`): a lease
is held by one live worker at most, no worker holds more than its capacity, the running
count is the sum over workers. Per user: no lease (and no branch) is settled twice, none
is lost, no more than ``max_concurrency`` run; ``Barrier(r)`` goes out once, only when
every lease of round r is settled; a group's result is in input order.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from actors.addresses import MERGER, PLANNER
from actors.machines.collector import FINISHED, LEASED, PENDING, RUNNING, Collector
from actors.machines.leases import LeaseTable
from actors.machines.scheduler import Scheduler
from protocol import (Barrier, Branch, BranchDone, EvalDone, EvalRequest, GroupResult,
                      GroupStart, Heartbeat, Hello, Lease, LeaseBatch, LeaseDone, Lost, Revoke,
                      RolloutResult, Settled, SettledBatch, Stop, Tick)

DEADLINE = 1.0
MAX_TRIES = 3
NAMES = [f"w{i}" for i in range(4)]


def the_table_is_consistent(t: LeaseTable, model: dict[str, str]) -> None:
    """The table's invariants, whoever uses it; ``model``: lease id -> the worker the
    user last sent it to (from the messages it sent), for the leases still out."""
    assert set(t.holder) <= set(t.payload), "a held lease that is not in the table"
    for lid, name in t.holder.items():
        assert name in t.workers, f"{lid} held by {name}, not a live worker"
        assert t.workers[name].held.count(lid) == 1, (lid, name, t.workers[name].held)
        assert model.get(lid) == name, f"{lid}: held by {name}, last sent to {model.get(lid)}"
        assert name in t.given[lid], f"{lid}: its holder {name} may not answer it"
    assert sum(len(w.held) for w in t.workers.values()) == len(t.holder)
    for w in t.workers.values():
        assert len(w.held) <= w.capacity, (w.name, w.held, w.capacity)
    assert t.active == sum(min(len(w.held), w.slots) for w in t.workers.values())
    assert not set(t.lost) & set(t.workers), "a worker both live and presumed lost"
    assert set(t.given) <= set(t.payload) and t.revoking <= set(t.holder)


class SchedulerLeases(RuleBasedStateMachine):
    """The Scheduler's leases on the table: rounds of rollout leases and the Merger's eval
    requests (eval leases, ahead of rollouts), synchronous (barriers) or asynchronous
    (workers queue ``prefetch`` rollout leases behind their slots, never an eval)."""

    @initialize(max_concurrency=st.integers(1, 4), asynchronous=st.booleans())
    def start(self, max_concurrency: int, asynchronous: bool) -> None:
        self.s = Scheduler(max_concurrency, asynchronous=asynchronous, deadline=DEADLINE,
                           max_tries=MAX_TRIES)
        self.asynchronous = asynchronous
        self.max_concurrency = max_concurrency
        self.evals: dict[str, int] = {}             # eval id -> its chunks
        self.eval_done: dict[str, int] = {}         # eval id -> EvalDone sent (times)
        self.chunks_answered: set[str] = set()      # eval leases answered
        self.chunks_given_up: set[str] = set()      # eval leases given up (workers lost)
        self.chunk_tasks: dict[str, list[str]] = {}  # eval lease -> its tasks
        self.clock = 0.0
        self.round = -1
        self.all_leases: dict[str, int] = {}        # lease id -> round
        self.settled: dict[str, int] = {}           # lease id -> times settled
        self.given_up: set[str] = set()
        self.barriers: list[int] = []
        self.held_by: dict[str, str] = {}           # the model: lease id -> worker
        self.answered: list[tuple[str, str]] = []   # (lease id, worker) answered once

    # -- feeding the machine and reading what it sends --------------------------------

    def feed(self, msg, asking: str = "") -> None:
        """Hand the Scheduler ``msg`` and check what it sends (``asking``: the eval whose
        request this is, whose chunk leases may go out at once)."""
        chunks = {lid for lid in self.s.leases if self.all_leases.get(lid, 0) < 0}
        for to, out in self.s.handle(msg):
            match out:
                case Lease(lease_id=lid):
                    if asking and lid.startswith(asking + "."):
                        self.all_leases[lid] = -1
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
                case EvalDone(eval_id=eid):
                    assert to == MERGER and (eid in self.evals or eid == asking), (to, out)
                    self.eval_done[eid] = self.eval_done.get(eid, 0) + 1
                    lost = [lid for lid in self.chunk_tasks if lid.startswith(eid + ".")
                            and lid not in self.chunks_answered]
                    assert out.errors == sum(len(self.chunk_tasks[lid]) for lid in lost), \
                        "an eval's score counted a chunk that was given up, or missed one"
        # A chunk leaves the table answered, or given up (its workers were lost max_tries
        # times: its tasks count as errors in the eval's score, see EvalDone above).
        answered = msg.lease_id if isinstance(msg, LeaseDone) else None
        self.chunks_given_up |= {lid for lid in chunks - set(self.s.leases) if lid != answered}

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

    @rule(name=st.sampled_from(NAMES), slots=st.integers(1, 2), prefetch=st.integers(0, 2))
    def register(self, name: str, slots: int, prefetch: int) -> None:
        # A worker registering again lists the leases it still runs: no more than its
        # slots (it cannot run more), the rest were lost on the way.
        mine = sorted(lid for lid, w in self.held_by.items() if w == name
                      and lid in self.s.leases)
        self.feed(Hello(worker=name, slots=slots, prefetch=prefetch, heartbeat=0.5,
                        leases=mine[:slots]))

    @rule(n=st.integers(1, 5))
    def the_merger_asks_for_an_eval(self, n: int) -> None:
        eid = f"e{len(self.evals)}"
        before = set(self.s.leases)
        self.feed(EvalRequest(eval_id=eid, state={"p": eid},
                              task_ids=[f"t{i}" for i in range(n)]), asking=eid)
        chunks = [lid for lid in self.s.leases if lid not in before]
        assert sorted(t for lid in chunks for t in self.s.leases[lid].task_ids) == \
            sorted(f"t{i}" for i in range(n)), "an eval's tasks not each in one chunk"
        for lid in chunks:
            assert self.s.leases[lid].kind == "eval" and lid.startswith(eid + ".")
            self.all_leases[lid] = -1
            self.chunk_tasks[lid] = list(self.s.leases[lid].task_ids)
        self.evals[eid] = len(chunks)

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
        if self.all_leases[lid] < 0:
            self.chunks_answered.add(lid)
        self.feed(self.done(lid, worker, 0.5))

    def done(self, lid: str, worker: str, score: float) -> LeaseDone:
        lease = self.s.leases.get(lid)
        kind = "eval" if self.all_leases[lid] < 0 else "rollout"
        tasks = lease.task_ids if lease is not None else ["t"]
        return LeaseDone(lease_id=lid, worker=worker, round=self.all_leases[lid], kind=kind,
                         results=[RolloutResult(task_id=t, score=score, calls=1)
                                  for t in tasks])

    @precondition(lambda self: bool(self.answered))
    @rule(data=st.data())
    def a_late_or_duplicate_answer_is_dropped(self, data) -> None:
        lid, worker = data.draw(st.sampled_from(self.answered))
        before = self.s.duplicates_dropped
        settled, evals = self.all_settled(), dict(self.eval_done)
        self.feed(self.done(lid, worker, 0.0))
        assert self.s.duplicates_dropped == before + 1
        assert self.all_settled() == settled, "a late answer settled a lease again"
        assert self.eval_done == evals, "a late answer scored an eval again"

    @rule(name=st.sampled_from(NAMES))
    def heartbeat(self, name: str) -> None:
        self.feed(Heartbeat(worker=name))

    @rule(name=st.sampled_from(NAMES))
    def a_worker_is_reported_lost(self, name: str) -> None:
        self.feed(Lost(worker=name, reason="its process exited"))

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
        settled.update(dict.fromkeys(self.chunks_answered | self.chunks_given_up, 1))
        for lid in self.all_leases:
            assert (lid in settled) != (lid in self.s.leases), \
                f"{lid}: settled and in the table, or neither (lost)"
            if lid in self.s.leases:
                assert (lid in queued) != (lid in held), f"{lid}: queued and held, or neither"

    @invariant()
    def capacity_and_concurrency_are_never_exceeded(self) -> None:
        if not hasattr(self, "s"):
            return
        the_table_is_consistent(self.s.table, self.held_by)
        assert self.s.active <= self.max_concurrency

    @invariant()
    def an_eval_is_scored_once_when_its_chunks_are_answered_and_never_queues(self) -> None:
        if not hasattr(self, "s"):
            return
        assert all(k == 1 for k in self.eval_done.values()), self.eval_done
        ended = self.chunks_answered | self.chunks_given_up
        for eid, n in self.evals.items():
            out = [f"{eid}.{i}" for i in range(n) if f"{eid}.{i}" not in ended]
            assert (eid in self.eval_done) == (not out), (eid, out)
        for w in self.s.workers.values():   # held in the order given: never behind a slot
            for k, lid in enumerate(w.held):
                assert self.all_leases[lid] >= 0 or k < w.slots, (w.name, w.held, w.slots)

    @invariant()
    def a_barrier_closes_a_round_once_every_lease_of_it_settled(self) -> None:
        if not hasattr(self, "s"):
            return
        if self.asynchronous:
            assert not self.barriers, "a Barrier in asynchronous mode"
            return
        assert len(self.barriers) == len(set(self.barriers)), self.barriers
        for r in self.barriers:
            assert all(lid in self.settled for lid, rr in self.all_leases.items() if rr == r)
        for r in range(self.round + 1):
            if r not in self.barriers:
                assert any(lid not in self.settled for lid, rr in self.all_leases.items()
                           if rr == r), f"round {r} settled but no Barrier"


SchedulerLeases.TestCase.settings = settings(max_examples=100, stateful_step_count=40,
                                             deadline=None, derandomize=True)
test_the_schedulers_lease_table_matches_its_model = SchedulerLeases.TestCase


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


class _CollectorModel(RuleBasedStateMachine):
    """The Collector's branch leases on the same table: a group of heartbeating workers,
    answered in any order, with revokes, losses, comebacks, reconnects and late answers.
    Its two machines below start it in each way a group leases its branches."""

    def begin(self, n: int, n_workers: int, bound: int, prefetch: int, chunk: int,
              mode: str, shares: float = 0.0, min_lease: float = 0.0) -> None:
        waves = mode == "waves"
        self.shares = shares if mode == "shares" else 0.0
        self.c = Collector("c")
        self.n = n
        self.names = NAMES[:n_workers]
        self.bound = min(bound, n_workers)
        self.clock = 0.0
        self.sent_to: dict[str, str] = {}          # lease id -> the worker it last went to
        self.went_to: dict[str, set[str]] = {}     # lease id -> every worker it went to
        self.indices: dict[str, list[int]] = {}    # lease id -> its branches
        self.answered: list[tuple[str, str]] = []  # (lease id, worker) settled
        self.results: dict[int, int] = {}          # branch -> times its value was taken
        self.result: GroupResult | None = None
        # Waves: starts in input order, answers measured slow (2 ms a branch), so strided
        # in-order leases are cut once the bound's worth are measured.
        # Shares: answers measured 50 ms a branch, so min_lease_seconds keeps leases long.
        self.elapsed = 0.002 if waves else 0.05 if self.shares else 0.0
        self.feed(GroupStart(group_id="g", items=list(range(n)), workers=list(self.names),
                             max_concurrency=bound, max_items=n, driver="d", chunk=chunk,
                             prefetch=prefetch, deadline=DEADLINE, max_tries=MAX_TRIES,
                             ordered=waves, waves=waves, batch_below=0.0005,
                             shares=self.shares, min_lease_seconds=min_lease))
        for name in self.names:
            self.feed(Hello(worker=name, heartbeat=0.5))

    def feed(self, msg) -> None:
        c = self.c
        cut: list[int] = []   # the sizes of the leases cut now (not ones sent again)
        rounds = getattr(c, "share_rounds", 0)
        for to, out in c.handle(msg):
            match out:
                case Branch(lease_id=lid, indices=indices):
                    assert lid not in {a for a, _ in self.answered}, f"{lid} sent again"
                    if lid in self.indices:   # re-dispatched: the same lease, same branches
                        assert self.indices[lid] == indices
                    else:
                        cut.append(len(indices))
                    self.indices[lid] = indices
                    self.sent_to[lid] = to
                    self.went_to.setdefault(lid, set()).add(to)
                case GroupResult():
                    assert self.result is None, "a second GroupResult"
                    self.result = out
                case Revoke() | Stop():
                    pass
        if self.shares and cut:
            self.even_shares(cut, began=c.share_rounds > rounds)

    def even_shares(self, cut: list[int], began: bool) -> None:
        """The leases of the current round of shares cut by this step (the last ones cut:
        the round's count says how many) are the round's size, but where the queue ran
        out. A round that began in this step (answers that put branches back in the
        queue come before the leases are cut) began with the queue now plus those
        leases: the first round's size is ``shares`` of a fair share of it, a later
        one's, once answers were measured, at least ``min_lease_seconds`` long by that
        measure, unless that would be over a fair share."""
        c, start = self.c, self.c.start
        now = cut[len(cut) - min(len(cut), c.concurrency - c.share_left):]
        size = c.share_size
        assert all(k <= size for k in now), (now, size)
        if c.queue:   # it did not run out: every lease of the round is the round's size
            assert all(k == size for k in now), (now, size, list(c.queue))
        if not began:
            return
        queued = len(c.queue) + sum(now)
        if c.share_rounds == 1:
            assert size == max(1, int(start.shares * queued / c.concurrency)), (size, queued)
        elif start.min_lease_seconds and c.busy_items:
            floor = int(start.min_lease_seconds / (c.busy_seconds / c.busy_items))
            assert size >= min(floor, -(-queued // c.concurrency)), (size, floor, queued)

    def answer(self, lid: str, worker: str, unstarted: bool = False,
               ran: int | None = None) -> None:
        """Answer lease ``lid``: every branch run, none (``unstarted``), or the first
        ``ran`` and the rest unstarted (a thief that took it ran those below its turn)."""
        indices = self.indices[lid]
        k = 0 if unstarted else len(indices) if ran is None else ran
        done = list(indices[:k])
        msg = BranchDone(group_id="g", lease_id=lid, worker=worker,
                         unstarted=list(indices[k:]), indices=done,
                         values=[10 * i for i in done], elapsed=self.elapsed * len(done))
        assert self.c.admit(worker, msg) is None, self.c.admit(worker, msg)
        settles = lid in self.c.leases
        before = self.c.late
        self.feed(msg)
        if settles:
            self.answered.append((lid, worker))
            for i in done:
                self.results[i] = self.results.get(i, 0) + 1
        else:
            assert self.c.late == before + 1, "a late answer not counted"

    def out(self) -> list[str]:
        return sorted(self.c.leases)

    # -- rules -----------------------------------------------------------------------

    @precondition(lambda self: any(lid in self.c.table.holder for lid in self.c.leases))
    @rule(data=st.data())
    def the_holder_answers(self, data) -> None:
        lid = data.draw(st.sampled_from(sorted(self.c.table.holder)))
        self.answer(lid, self.c.table.holder[lid])

    @precondition(lambda self: any(len(self.went_to.get(lid, ())) > 1
                                   for lid in self.c.leases))
    @rule(data=st.data())
    def an_earlier_holder_answers_first(self, data) -> None:
        lid = data.draw(st.sampled_from([lid for lid in self.out()
                                         if len(self.went_to[lid]) > 1]))
        self.answer(lid, data.draw(st.sampled_from(sorted(self.went_to[lid]))))

    @precondition(lambda self: any(len(self.indices[lid]) > 1 for lid in self.c.table.holder))
    @rule(data=st.data())
    def a_thief_runs_the_branches_below_its_turn_and_the_rest_comes_back(self, data) -> None:
        lid = data.draw(st.sampled_from(sorted(lid for lid in self.c.table.holder
                                               if len(self.indices[lid]) > 1)))
        ran = data.draw(st.integers(0, len(self.indices[lid]) - 1))
        self.answer(lid, self.c.table.holder[lid], ran=ran)

    @precondition(lambda self: bool(self.c.table.revoking))
    @rule(data=st.data())
    def a_revoked_lease_comes_back_unstarted(self, data) -> None:
        lid = data.draw(st.sampled_from(sorted(self.c.table.revoking)))
        self.answer(lid, self.c.table.holder[lid], unstarted=True)

    @precondition(lambda self: bool(self.answered))
    @rule(data=st.data())
    def a_late_or_duplicate_answer_is_dropped(self, data) -> None:
        lid, worker = data.draw(st.sampled_from(self.answered))
        results = dict(self.results)
        self.answer(lid, worker)
        assert self.results == results, "a late answer settled a branch again"

    @precondition(lambda self: bool(self.c.leases))
    @rule(data=st.data())
    def a_stranger_is_refused(self, data) -> None:
        lid = data.draw(st.sampled_from(self.out()))
        msg = BranchDone(group_id="g", lease_id=lid, worker="mallory", indices=[0],
                         values=[0])
        assert "which went to" in self.c.admit("mallory", msg)

    @rule(name=st.sampled_from(NAMES))
    def heartbeat(self, name: str) -> None:
        self.feed(Heartbeat(worker=name))

    @rule(name=st.sampled_from(NAMES))
    def a_worker_is_reported_lost(self, name: str) -> None:
        self.feed(Lost(worker=name, reason="its connection closed"))

    @rule(data=st.data())
    def a_worker_reconnects_listing_what_it_still_holds(self, data) -> None:
        """Its connection dropped: the leases it does not list were lost on the way and
        go out again under their ids; those it lists it keeps."""
        name = data.draw(st.sampled_from(self.names))
        mine = sorted(lid for lid, w in self.c.table.holder.items() if w == name)
        kept = data.draw(st.lists(st.sampled_from(mine), unique=True)) if mine else []
        self.feed(Hello(worker=name, heartbeat=0.5, leases=kept))
        for lid in kept:
            if lid in self.c.leases and name in self.c.table.workers:
                assert self.c.table.holder.get(lid) == name, f"{name} listed {lid}, lost it"

    @rule(dt=st.sampled_from([0.1, 0.6, 1.5]))
    def time_passes(self, dt: float) -> None:
        self.clock += dt
        self.feed(Tick(elapsed=self.clock))

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def the_table_matches_what_was_sent(self) -> None:
        if not hasattr(self, "c"):
            return
        c = self.c
        the_table_is_consistent(c.table, self.sent_to)
        waiting = [lid for lid in c.leases if lid not in c.table.holder]
        assert sorted(waiting) == sorted(c.again) and len(c.again) == len(set(c.again))
        assert c.table.active <= self.bound

    @invariant()
    def no_branch_is_settled_twice_or_lost(self) -> None:
        if not hasattr(self, "c"):
            return
        c = self.c
        assert all(k == 1 for k in self.results.values()), self.results
        if c.phase != RUNNING:
            return
        leased = [i for lid in c.leases for i in c.leases[lid].indices]
        assert len(leased) == len(set(leased)), "a branch in two leases"
        queued = set(c.queue)
        for i, state in enumerate(c.state):
            assert state in (FINISHED, PENDING, LEASED), (i, state)
            assert (state == FINISHED) == (i in self.results), (i, state)
            assert (state == PENDING) == (i in queued), (i, state)
            assert (state == LEASED) == (i in leased), (i, state)

    @invariant()
    def the_group_ends_once_in_input_order_or_fails_by_name(self) -> None:
        if not hasattr(self, "c") or self.result is None:
            return
        r = self.result
        if r.status == "completed":
            assert r.results == [10 * i for i in range(self.n)]
        else:
            assert r.status == "failed" and r.error_type == "WorkersLost", r
            assert set(r.finished) == set(self.results)


class CollectorLeases(_CollectorModel):
    """Guided leases, or (with waves: starts in input order, branches measured slow)
    strided leases whose later branches come back unstarted."""

    @initialize(n=st.integers(1, 30), n_workers=st.integers(1, 4), bound=st.integers(1, 4),
                prefetch=st.integers(0, 2), chunk=st.integers(0, 3), waves=st.booleans())
    def start(self, n: int, n_workers: int, bound: int, prefetch: int, chunk: int,
              waves: bool) -> None:
        self.begin(n, n_workers, bound, prefetch, chunk, "waves" if waves else "guided")


class CollectorShares(_CollectorModel):
    """Even shares (GroupStart.shares: every worker in another process): rounds of one
    lease per worker, all of a round the same size but where the queue ran out, each at
    least ``min_lease_seconds`` long by the measure the answers report (50 ms a branch),
    through the same losses, re-dispatches, reconnects and late answers."""

    @initialize(n=st.integers(4, 60), n_workers=st.integers(2, 4), bound=st.integers(2, 4),
                prefetch=st.integers(0, 2), shares=st.sampled_from([0.5, 0.8, 1.0]),
                min_lease=st.sampled_from([0.0, 0.15, 0.4]))
    def start(self, n: int, n_workers: int, bound: int, prefetch: int, shares: float,
              min_lease: float) -> None:
        self.begin(n, n_workers, bound, prefetch, 0, "shares", shares, min_lease)


CollectorLeases.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                             deadline=None, derandomize=True)
test_the_collectors_lease_table_matches_its_model = CollectorLeases.TestCase
CollectorShares.TestCase.settings = settings(max_examples=40, stateful_step_count=40,
                                             deadline=None, derandomize=True)
test_the_collectors_even_shares_match_the_model = CollectorShares.TestCase


def test_a_worker_reported_lost_has_its_leases_redispatched_at_once():
    s = Scheduler(2, deadline=DEADLINE, max_tries=MAX_TRIES)
    s.handle(Hello(worker="a", slots=1, heartbeat=0.5))
    s.handle(Hello(worker="b", slots=1, heartbeat=0.5))
    out = s.handle(LeaseBatch(round=0, leases=[Lease(lease_id=f"r0.u{u}", round=0, unit=u)
                                               for u in range(3)]))
    assert [(to, m.lease_id) for to, m in out] == [("a", "r0.u0"), ("b", "r0.u1")]
    done = LeaseDone(lease_id="r0.u1", worker="b", round=0, unit=1,
                     results=[RolloutResult(task_id="t", score=1.0, calls=1)])
    assert [(to, m.lease_id) for to, m in s.handle(done)
            if isinstance(m, Lease)] == [("b", "r0.u2")]
    assert s.handle(Lost(worker="a", reason="its process exited")) == []   # b is busy
    assert [q.lease_id for q in s.queue] == ["r0.u0"] and "a" in s.lost
    assert s.admit("a", LeaseDone(lease_id="r0.u0", worker="a", round=0)) is None
    assert "never reports another lost" in s.admit("b", Lost(worker="a"))
    assert s.admit("driver", Lost(worker="a")) is None
    out = s.handle(msgspec.structs.replace(done, lease_id="r0.u2", unit=2))
    assert [(to, m.lease_id) for to, m in out if isinstance(m, Lease)] == [("b", "r0.u0")]
    assert s.redispatched == 1 and s.lost_workers == 1 and s.handle(Lost(worker="a")) == []


def test_a_lost_worker_back_by_heartbeat_keeps_its_prefetch():
    s = Scheduler(1, asynchronous=True, deadline=DEADLINE)
    s.handle(Hello(worker="a", slots=1, prefetch=2, heartbeat=0.5))
    assert s.workers["a"].capacity == 3
    s.handle(Lost(worker="a"))
    s.handle(Heartbeat(worker="a"))
    assert "a" not in s.lost and s.workers["a"].capacity == 3
