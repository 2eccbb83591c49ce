"""The one worker loop (actors.workers.core.Serve) on a thread (actors.workers.local.Worker)
and on a remote worker's slot thread (actors.workers.remote): one actor serves rollout
leases, eval leases, commits and a group's branch leases, in arrival order, on one
thread; a rollout-only worker says so when a branch lease reaches it; a slot of a worker
in another process runs the same dispatch, only its transport differs."""

from __future__ import annotations

import queue
import threading

import pytest

from actors.artifacts import SingleSlot
from actors.groups.host import _Host
from actors.groups.limits import Budgets, HostLimits, _Ledger
from actors.groups.store import Store
from actors.groups.worker import GroupWorker, _LeaseBox, _worker_deliver
from actors.workers.core import WorkerCore
from actors.workers.local import Worker
from bus import InMemoryBus
from protocol import Branch, BranchDone, Commit, Lease, LeaseDone, Stop, Task

DEADLINE_S = 10.0


def _collect(bus: InMemoryBus, *names: str) -> "queue.SimpleQueue":
    got: queue.SimpleQueue = queue.SimpleQueue()
    for name in names:
        bus.attach(name, lambda d: got.put(d.msg))
    return got


def test_one_thread_worker_serves_rollouts_evals_commits_and_branches_in_arrival_order():
    bus = InMemoryBus()
    got = _collect(bus, "scheduler", "collector.g")
    threads: list[str] = []

    def run(rendered: str, task: Task) -> str:
        threads.append(threading.current_thread().name)
        return rendered

    def double(x: int) -> int:
        threads.append(threading.current_thread().name)
        return 2 * x

    core = WorkerCore("w0", {"t": Task("t", "?")}, lambda task, out: float(out == "b"), run,
                      None, SingleSlot(initial_value="a"))
    host = _Host(group_id="g", target=double, wants_ctx=False, depth=1, limits=HostLimits(),
                 ledger=_Ledger(Budgets()), store=Store(), live=(), external=(), parent=None,
                 trace=False, runtime=None, nested=None)
    box = _LeaseBox("w0")
    host.boxes = [box]
    crashes: list = []
    ref = GroupWorker.start(bus, "w0", host, "collector.g", lambda n, e: crashes.append(e),
                            box, core=core)
    bus.attach("w0", _worker_deliver(bus, host, box, "w0", "collector.g"))
    try:
        for msg in (Lease(lease_id="r1", round=0, task_ids=["t"]),
                    Lease(lease_id="e1", round=0, kind="eval", task_ids=["t"],
                          state={"value": "b"}),
                    Branch(group_id="g", lease_id="g.1", indices=[0, 1], items=[3, 4]),
                    Commit(version=1, state={"value": "b"}),
                    Lease(lease_id="r2", round=1, task_ids=["t"])):
            bus.send("driver", "w0", msg)
        answers = [got.get(timeout=DEADLINE_S) for _ in range(4)]
    finally:
        bus.send("driver", "w0", Stop())
        ref.stop()
    assert not crashes
    r1, e1, branches, r2 = answers
    assert isinstance(r1, LeaseDone) and r1.lease_id == "r1" and r1.results[0].score == 0.0
    assert isinstance(e1, LeaseDone) and e1.kind == "eval" and e1.results[0].score == 1.0
    assert isinstance(branches, BranchDone) and branches.values == [6, 8]
    assert r2.lease_id == "r2" and r2.version == 1 and r2.results[0].score == 1.0
    assert len(threads) == 5 and set(threads) == {"evobus-w0"}


def test_a_rollout_worker_without_a_branch_lane_says_a_branch_lease_is_not_its(caplog):
    bus = InMemoryBus()
    got = _collect(bus, "scheduler")
    core = WorkerCore("w1", {"t": Task("t", "?")}, lambda task, out: 1.0, lambda r, t: r,
                      None, SingleSlot(initial_value="a"))
    ref = Worker.spawn(bus, core, lambda n, e: None)
    try:
        assert got.get(timeout=DEADLINE_S).worker == "w1"   # its Hello
        bus.send("driver", "w1", Branch(group_id="g", lease_id="g.1", indices=[0], items=[1]))
        bus.send("driver", "w1", Lease(lease_id="r1", round=0, task_ids=["t"]))
        done = got.get(timeout=DEADLINE_S)
    finally:
        ref.stop()
    assert done.lease_id == "r1"
    assert "a Branch lease, but this worker serves no parallel group" in caplog.text


class _Endpoint:
    """What a remote worker's slot sends through (its endpoint): kept in a queue."""

    def __init__(self) -> None:
        self.sent: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, sender, receiver, msg) -> None:
        self.sent.put((receiver, msg))


def _slot_of(worker, core):
    from actors.workers.remote import RemoteWorker
    assert isinstance(worker, RemoteWorker)
    q: queue.SimpleQueue = queue.SimpleQueue()
    worker.slot_queues, worker.slot_load = [q], [0]
    t = threading.Thread(target=worker._slot, args=(0, core, q), daemon=True)
    t.start()
    return t


def test_a_remote_workers_slot_serves_through_the_same_dispatch_as_a_thread_worker(caplog):
    """The slot thread of a worker in another process runs rollouts, evals and commits,
    in arrival order, through the one dispatch (workers.core.Serve); what differs is the
    transport (its endpoint) and the slot's own bookkeeping: each lease it held is let
    go once answered, and a Branch for a worker without a branch service is said and
    dropped (its slot freed) rather than crashing the slot."""
    from actors.workers.remote import RemoteWorker
    w = RemoteWorker("tcp://127.0.0.1:1", worker_id="r0")
    w.ep = _Endpoint()
    core = WorkerCore("r0", {"t": Task("t", "?")}, lambda task, out: float(out == "b"),
                      lambda rendered, task: rendered, None, SingleSlot(initial_value="a"))
    slot = _slot_of(w, core)
    try:
        for msg in (Lease(lease_id="r1", round=0, task_ids=["t"]),
                    Lease(lease_id="e1", round=0, kind="eval", task_ids=["t"],
                          state={"value": "b"}),
                    Branch(group_id="g", lease_id="g.1", indices=[0], items=[3])):
            w._to_slot(msg)
        for q in w.slot_queues:
            q.put(Commit(version=1, state={"value": "b"}))
        w._to_slot(Lease(lease_id="r2", round=1, task_ids=["t"]))
        answers = [w.ep.sent.get(timeout=DEADLINE_S) for _ in range(3)]
    finally:
        w.done.set()
        w._release_slots()
        slot.join(DEADLINE_S)
    r1, e1, r2 = (msg for _, msg in answers)
    assert all(to == "scheduler" for to, _ in answers)
    assert r1.lease_id == "r1" and r1.results[0].score == 0.0
    assert e1.kind == "eval" and e1.results[0].score == 1.0
    assert r2.lease_id == "r2" and r2.version == 1 and r2.results[0].score == 1.0
    assert "a Branch this worker does not serve (no branch service)" in caplog.text
    assert w.held == set() and w.slot_load == [0] and w.leases_done == 3


class _Broken(SingleSlot):
    """A strategy with a bug: rendering an eval lease's state raises."""

    def render(self, state):
        if state.get("value") == "bad":
            raise KeyError("boom")
        return super().render(state)


def test_a_lease_that_raises_is_answered_fatal_on_a_remote_slot_and_raised_on_a_thread():
    """One dispatch, two transports of a crash: a thread worker's reaches its supervisor
    (the runtime stops the run with it); a remote slot's is answered as a fatal LeaseDone
    (nobody else would see it), naming the worker and the lease."""
    from actors.workers.core import Serve, crashed

    core = WorkerCore("w2", {"t": Task("t", "?")}, lambda task, out: 0.0,
                      lambda rendered, task: rendered, None, _Broken(initial_value="a"))
    lease = Lease(lease_id="e1", round=0, kind="eval", task_ids=["t"], state={"value": "bad"})
    answered: list = []
    with pytest.raises(KeyError, match="boom"):
        Serve(core, answered.append, None, set())(lease)
    assert answered == []
    Serve(core, answered.append, None, set(),
          crash=lambda lease, exc: crashed("w2", lease, exc))(lease)
    (done,) = answered
    assert done.lease_id == "e1" and done.kind == "eval"
    assert "worker w2 crashed running lease e1" in done.fatal and "boom" in done.fatal
