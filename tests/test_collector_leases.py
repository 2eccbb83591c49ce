"""Branch leases on the one lease table: the Collector, driven by messages, re-dispatches
a lost worker's branch leases under their ids, never re-runs a branch whose answer
arrived, and drops and counts late and duplicate answers (DESIGN section 4, liveness)."""

from __future__ import annotations

from actors.machines.collector import Collector
from protocol import (Branch, BranchDone, BranchFailed, Cancel, GroupResult, GroupStart, Heartbeat, Hello,
                      Hold, Interaction, Lost, PendingInteraction, Tick)

DEADLINE = 1.0


def _start(n=4, workers=("w0", "w1"), bound=2, prefetch=0, **kw) -> GroupStart:
    return GroupStart(group_id="g", items=[f"i{i}" for i in range(n)], workers=list(workers),
                      max_concurrency=bound, max_items=n, driver="d", chunk=1,
                      prefetch=prefetch, deadline=DEADLINE, **kw)


def _up(c: Collector, start: GroupStart) -> list:
    """Start the group; every worker says it heartbeats. The leases sent, in order."""
    out = c.handle(start)
    for w in start.workers:
        out += c.handle(Hello(worker=w, heartbeat=0.25))
    return [(to, m) for to, m in out if isinstance(m, Branch)]


def _done(lease: Branch, worker: str) -> BranchDone:
    return BranchDone(group_id="g", lease_id=lease.lease_id, worker=worker,
                      indices=lease.indices, values=[f"r{i}" for i in lease.indices])


def _branches(out) -> list[tuple[str, str, list[int]]]:
    return [(to, m.lease_id, m.indices) for to, m in out if isinstance(m, Branch)]


def _result(out) -> GroupResult:
    (result,) = [m for _, m in out if isinstance(m, GroupResult)]
    return result


def test_a_silent_workers_branch_lease_is_redispatched_under_its_id():
    c = Collector("c")
    sent = _up(c, _start(n=3))
    assert _branches(sent) == [("w0", "g.0", [0]), ("w1", "g.1", [1])]
    c.handle(Heartbeat(worker="w1"))
    c.handle(Tick(elapsed=0.9))
    out = c.handle(_done(sent[1][1], "w1"))                    # w1 answers at 0.9
    assert _branches(out) == [("w1", "g.2", [2])]
    (_, third), = out
    out = c.handle(Tick(elapsed=1.2))                          # w0: silent 1.2 s > 1.0
    assert _branches(out) == []                                # w1 is busy with g.2
    assert "w0" in c.table.lost and c.table.waiting("g.0")
    out = c.handle(_done(third, "w1"))
    assert _branches(out) == [("w1", "g.0", [0])]               # same id, same branch
    result = _result(c.handle(_done(sent[0][1], "w1")))
    assert result.status == "completed" and result.results == ["r0", "r1", "r2"]
    assert result.leases == 3 and c.table.redispatched == 1 and c.table.lost_workers == 1


def test_a_worker_reported_lost_has_its_leases_sent_at_once_to_one_with_room():
    c = Collector("c")
    sent = _up(c, _start(n=2, workers=("w0", "w1", "w2"), bound=3))
    assert [to for to, _ in sent] == ["w0", "w1"]               # w2 idle: nothing left
    out = c.handle(Lost(worker="w0", reason="its process exited (code -9)"))
    assert _branches(out) == [("w2", "g.0", [0])]
    assert c.admit("w2", _done(sent[0][1], "w2")) is None
    assert "which went to" in c.admit("mallory", _done(sent[0][1], "mallory"))
    assert "never reports another lost" in c.admit("w1", Lost(worker="w2"))


def test_a_branch_whose_answer_arrived_is_never_run_again():
    c = Collector("c")
    sent = _up(c, _start(n=4, prefetch=1))
    assert _branches(sent) == [("w0", "g.0", [0]), ("w1", "g.1", [1]), ("w0", "g.2", [2]),
                               ("w1", "g.3", [3])]
    c.handle(_done(sent[0][1], "w0"))                          # branch 0 answered by w0
    assert c.handle(Lost(worker="w0")) == []                   # w1 holds its capacity
    assert list(c.again) == ["g.2"]                             # only what w0 still held
    out = c.handle(_done(sent[1][1], "w1"))
    assert _branches(out) == [("w1", "g.2", [2])]
    c.handle(_done(sent[3][1], "w1"))
    out = c.handle(BranchDone(group_id="g", lease_id="g.2", worker="w1", indices=[2],
                              values=["r2"]))
    result = _result(out)
    assert result.results == ["r0", "r1", "r2", "r3"] and result.leases == 4


def test_the_first_answer_settles_a_redispatched_lease_and_the_later_one_is_dropped():
    c = Collector("c")
    sent = _up(c, _start(n=2, workers=("w0", "w1", "w2"), bound=3))
    c.handle(Lost(worker="w0"))                                # g.0 goes to w2
    c.handle(Heartbeat(worker="w0"))                           # w0 is back after all
    assert "w0" not in c.table.lost and "w0" in c.pool
    assert c.admit("w0", _done(sent[0][1], "w0")) is None      # it may still answer
    c.handle(_done(sent[0][1], "w0"))                          # and it answers first
    late = c.late
    out = c.handle(_done(sent[0][1], "w2"))                    # w2's copy: late
    assert out == [] and c.late == late + 1
    result = _result(c.handle(_done(sent[1][1], "w1")))
    assert result.results == ["r0", "r1"] and result.late == late + 1


def test_a_lost_workers_answer_before_the_resend_withdraws_the_waiting_copy():
    c = Collector("c")
    sent = _up(c, _start(n=3, workers=("w0", "w1"), bound=2))
    c.handle(Lost(worker="w0"))                                # w1 is busy: g.0 waits
    assert list(c.again) == ["g.0"]
    out = c.handle(_done(sent[0][1], "w0"))                    # the lost worker answers
    assert not c.again and _branches(out) == [("w0", "g.2", [2])]   # and is back
    out = c.handle(_done(sent[1][1], "w1"))
    assert _branches(out) == []                                # g.0 is never sent again
    result = _result(c.handle(BranchDone(group_id="g", lease_id="g.2", worker="w0",
                                         indices=[2], values=["r2"])))
    assert result.results == ["r0", "r1", "r2"]


def test_a_duplicate_answer_is_dropped_and_counted():
    c = Collector("c")
    sent = _up(c, _start(n=3))
    c.handle(_done(sent[0][1], "w0"))
    assert c.handle(_done(sent[0][1], "w0")) == [] and c.table.late == 1


def test_a_lease_lost_max_tries_times_fails_the_group_by_name():
    c = Collector("c")
    sent = _up(c, _start(n=1, workers=("w0", "w1", "w2"), bound=3, max_tries=2))
    assert _branches(sent) == [("w0", "g.0", [0])]
    out = c.handle(Lost(worker="w0"))
    assert _branches(out) == [("w1", "g.0", [0])]
    result = _result(c.handle(Lost(worker="w1")))
    assert result.status == "failed" and result.error_type == "WorkersLost"
    assert "given up after 2 worker(s) were lost" in result.error and result.failed == [0]


def test_a_group_whose_every_worker_is_lost_fails_once_none_comes_back():
    c = Collector("c")
    _up(c, _start(n=2))
    c.handle(Tick(elapsed=0.5))
    assert c.handle(Tick(elapsed=1.1)) == []                   # both silent: lost, waiting
    assert sorted(c.table.lost) == ["w0", "w1"] and sorted(c.again) == ["g.0", "g.1"]
    result = _result(c.handle(Tick(elapsed=2.2)))
    assert result.status == "failed" and result.error_type == "WorkersLost"
    assert result.never_started == [0, 1]


def test_a_worker_lost_while_the_group_stops_is_abandoned_and_while_it_pauses_is_kept():
    c = Collector("c")
    _up(c, _start(n=2))
    out = c.handle(BranchFailed(group_id="g", lease_id="g.1", worker="w1", index=1,
                                error="boom", error_type="ValueError"))
    assert out == [("w0", Cancel(lease_id="g.0"))]
    result = _result(c.handle(Lost(worker="w0")))
    assert result.abandoned == [0] and result.failed == [1]

    c = Collector("c")
    sent = _up(c, _start(n=2))
    ask = PendingInteraction(id="g.1.0", branch=1, kind="ask", prompt="?")
    out = c.handle(Interaction(group_id="g", lease_id="g.1", worker="w1", index=1,
                               pending=ask))
    assert out == [("w0", Hold(lease_id="g.0"))]
    (suspended,) = [m for _, m in c.handle(Lost(worker="w0"))]
    assert suspended.not_started == [0] and [p.id for p in suspended.pending] == ["g.1.0"]
    assert [to for to, _ in sent] == ["w0", "w1"]


def test_a_reconnecting_worker_keeps_what_it_lists_and_the_rest_goes_elsewhere():
    c = Collector("c")
    sent = _up(c, _start(n=4, workers=("w0", "w1", "w2"), bound=3, prefetch=1))
    w0 = [m.lease_id for to, m in sent if to == "w0"]
    assert len(w0) == 2
    out = c.handle(Hello(worker="w0", heartbeat=0.25, leases=w0[:1]))
    assert [lid for _, lid, _ in _branches(out)] == w0[1:]     # the one it did not list
    assert c.table.holder[w0[0]] == "w0"
