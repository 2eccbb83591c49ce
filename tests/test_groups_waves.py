"""The workers' steal: a worker whose next start waits for its turn takes a lease queued
in a box behind a running branch, and starts only its branches below its own turn (the
rest are answered unstarted)."""

from __future__ import annotations

import threading

from actors import Budgets, HostLimits
from actors.groups.host import _Host, _StartOrder
from actors.groups.limits import _Ledger
from actors.groups.store import Store
from actors.groups.worker import GroupWorker, _LeaseBox
from bus.memory import InMemoryBus
from protocol import Branch, BranchDone

WAIT = 10.0   # every wait is bounded; a test that needs it has already failed


def test_regression_a_thief_starts_only_the_branches_of_a_stolen_lease_below_its_turn():
    """Bound 2. The thief (w1) runs its lease [1, 3]; branch 3 needs 0 and 1 started, and
    0 waits in w0's box, behind the branch w0 runs, in the strided lease [0, 5]. The thief
    takes that lease, starts 0 and answers 5 unstarted (5 needs 0-3 started, and 3 is
    the thief's own waiting branch: running it there waited for ever), then starts 3."""
    order = _StartOrder(6, 2)
    host = _Host(group_id="g", target=lambda i: i * 10, wants_ctx=False, depth=1,
                 limits=HostLimits(), ledger=_Ledger(Budgets()), store=Store(), live=(),
                 external=(), parent=None, trace=True, runtime=None, nested=None,
                 order=order)
    bus = InMemoryBus()
    answers: dict[str, BranchDone] = {}
    bus.attach("c", lambda d: answers.__setitem__(d.msg.lease_id, d.msg))
    boxes = {w: _LeaseBox(w) for w in ("w0", "w1", "w2")}
    host.boxes = list(boxes.values())
    thief = GroupWorker(bus, "w1", host, "c", lambda name, exc: None, boxes["w1"])
    boxes["w0"].put(Branch(group_id="g", lease_id="g.0", indices=[0, 5], items=[0, 5],
                           in_order=True))
    boxes["w0"].running = True      # w0 runs a (long) branch: its box waits behind it
    boxes["w2"].put(Branch(group_id="g", lease_id="g.2", indices=[2, 4], items=[2, 4],
                           in_order=True))   # w2 has not started: nothing is taken from it
    unstick = threading.Timer(WAIT, host.hold)   # a stuck wait gives up: fails, not hangs
    unstick.start()
    try:
        thief._run(Branch(group_id="g", lease_id="g.1", indices=[1, 3], items=[1, 3],
                          in_order=True))
    finally:
        unstick.cancel()
    stolen, own = answers["g.0"], answers["g.1"]
    assert (stolen.worker, stolen.indices, stolen.values, stolen.unstarted) == \
        ("w0", [0], [0], [5]), "the thief started a branch at or past its own turn"
    assert (own.worker, own.indices, own.values, own.unstarted) == ("w1", [1, 3], [10, 30], [])
    assert [i for kind, i in host.trace if kind == "start"] == [1, 0, 3]
    assert boxes["w2"].queued and not boxes["w0"].queued
