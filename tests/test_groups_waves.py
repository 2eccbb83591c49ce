"""Waves of in-order leases (``GroupStart.waves``) and the workers' steal.

Once branches are measured no cheaper than ``batch_below``, the Collector cuts strided
in-order leases, one per worker with room. A worker whose next start waits for its turn
takes a lease queued in a box behind a running branch, and starts only its branches
below its own turn (the rest are answered unstarted and go out again at once). The
model below plays the workers' side (boxes, the start order, the steal, nested) against
the real Collector, in any order a seeded scheduler picks: the group always ends, every
start is in its turn, no branch runs twice. The regression test runs the real workers.
"""

from __future__ import annotations

import random
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from actors import Budgets, HostLimits
from actors.groups.host import _Host, _StartOrder
from actors.groups.limits import _Ledger
from actors.groups.store import Store
from actors.groups.worker import GroupWorker, _LeaseBox
from actors.machines.collector import Collector
from bus.memory import InMemoryBus
from protocol import Branch, BranchDone, GroupResult, GroupStart, Revoke, Stop

WAIT = 10.0   # every wait is bounded; a test that needs it has already failed


def _need(j: int, bound: int) -> int:
    """How many branches from 0 must have started before ``j`` may (_StartOrder.need)."""
    return 0 if j < bound else max(j - bound + 1, bound)


class _Run:
    """A lease in a model worker's box: its branches are taken one at a time, in lease
    order (``pos``), by its worker or by one waiting for its own turn (worker._Run)."""

    def __init__(self, lease: Branch, owner: str) -> None:
        self.lease, self.owner = lease, owner
        self.pos = 0

    def head(self) -> int | None:
        return self.lease.indices[self.pos] if self.pos < len(self.lease.indices) else None


class _Part:
    """What a model worker runs of one lease (all it takes of its own, or one branch it
    took from another's), answered as the lease's worker."""

    def __init__(self, run: _Run, one: bool) -> None:
        self.run, self.one = run, one
        self.running: int | None = None   # the branch that has started and not returned
        self.took = 0
        self.done: list[int] = []


class _Model:
    def __init__(self, n: int, n_workers: int, bound: int, prefetch: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.names = [f"w{k}" for k in range(n_workers)]
        self.c = Collector("c")
        self.boxes: dict[str, list[_Run]] = {w: [] for w in self.names}
        self.stacks: dict[str, list[_Part]] = {w: [] for w in self.names}
        self.started = [False] * n
        self.starts: list[int] = []
        self.result: GroupResult | None = None
        self.leases: list[Branch] = []
        self.parts = 0
        self.bound = min(bound, n_workers)
        self.feed(GroupStart(group_id="g", items=list(range(n)), workers=self.names,
                             max_concurrency=bound, max_items=max(n, 1), driver="d",
                             prefetch=prefetch, min_lease_seconds=0.01, ordered=True,
                             batch_below=0.0005, waves=True, suspend="all"))

    def feed(self, msg) -> None:
        for to, out in self.c.handle(msg):
            match out:
                case Branch():
                    self.boxes[to].append(_Run(out, to))
                    self.leases.append(out)
                case Revoke(lease_id=lid):
                    run = next((r for r in self.boxes[to] if r.lease.lease_id == lid), None)
                    if run is not None and run.pos == 0:   # nothing taken: given back
                        self.boxes[to].remove(run)
                        self.feed(BranchDone(group_id="g", lease_id=lid, worker=to,
                                             unstarted=list(run.lease.indices)))
                case Stop():   # (it may still run a branch it took from another's lease)
                    assert all(r.head() is None for r in self.boxes[to]), \
                        f"{to} was let go with branches in its box"
                case GroupResult():
                    assert self.result is None
                    self.result = out

    def answer(self, part: _Part) -> None:
        lease = part.run.lease
        if not part.took:
            return   # every branch of it taken by others, and answered by them
        self.parts += part.took != len(lease.indices)
        self.feed(BranchDone(group_id="g", lease_id=lease.lease_id, worker=part.run.owner,
                             indices=list(part.done), values=[10 * i for i in part.done],
                             elapsed=0.002 * len(part.done),
                             part=part.took != len(lease.indices)))

    def ready(self, run: _Run) -> bool:
        j = run.head()
        need = _need(j, self.bound) if run.lease.in_order else 0
        return all(self.started[:need])

    def stealable(self, w: str) -> _Run | None:
        """The run holding the lowest branch whose turn has come, that ``w`` may take: the
        lease a worker runs (not the one ``w`` waits in), or one queued in the box of a
        worker that runs (its own too), as GroupWorker._steal."""
        skip = self.stacks[w][-1].run if self.stacks[w] else None
        best = None
        for o in self.names:
            if not self.stacks[o]:
                continue   # not running: it starts its own box itself
            runs = [self.stacks[o][0].run] + self.boxes[o]
            for run in runs:
                if run is skip or run.head() is None or not self.ready(run):
                    continue
                if best is None or run.head() < best.head():
                    best = run
        return best

    def start(self, part: _Part) -> None:
        run = part.run
        j = run.head()
        assert not self.started[j], f"branch {j} started twice"
        need = _need(j, self.bound) if run.lease.in_order else 0
        assert all(self.started[:need]), f"branch {j} started before its turn"
        run.pos += 1
        part.took += 1
        part.running = j
        self.started[j] = True
        self.starts.append(j)

    def step(self, w: str, go: bool = True) -> bool:
        """One step of worker ``w`` (only whether it can move, with ``go`` false)."""
        stack, box = self.stacks[w], self.boxes[w]
        if not stack:
            while box and box[0].head() is None:   # every branch taken by others
                if not go:
                    break
                box.pop(0)
            if not any(r.head() is not None for r in box):
                return False
            if go:
                stack.append(_Part(box.pop(0), one=False))
            return True
        part = stack[-1]
        if part.running is not None:   # the branch returns
            if go:
                part.done.append(part.running)
                part.running = None
            return True
        if (part.one and part.took) or part.run.head() is None:
            if go:
                stack.pop()
                self.answer(part)
            return True
        if self.ready(part.run):
            if go:
                self.start(part)
            return True
        stolen = self.stealable(w)
        if stolen is None:
            return False
        if go:
            stack.append(_Part(stolen, one=True))
            self.start(stack[-1])
        return True

    def run(self) -> None:
        for _ in range(100_000):
            if self.result is not None:
                return
            ready = [w for w in self.names if self.step(w, go=False)]
            assert ready, (f"no worker can go on and the group has not ended: boxes "
                           f"{ {w: [r.lease.indices[r.pos:] for r in q] for w, q in self.boxes.items()} }, "
                           f"queue {list(self.c.queue)}, started {self.starts}")
            self.step(self.rng.choice(ready))
        raise AssertionError("the model did not end within its step bound")


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 120), n_workers=st.integers(1, 6), bound=st.integers(1, 6),
       prefetch=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
def test_property_waves_with_steals_always_end_in_order(n, n_workers, bound, prefetch, seed):
    """Workers run at any relative speed (a seeded scheduler picks who moves), and one
    waiting for its turn takes the lowest branch whose turn has come from any lease of a
    running worker, answering it as a part: the group ends with every result, each
    branch started once and in its turn (``j`` only once every branch up to ``j - bound``
    had), and waves of several branches per lease are cut once the queue is long enough."""
    model = _Model(n, n_workers, bound, prefetch, seed)
    model.run()
    assert model.result.status == "completed"
    assert model.result.results == [10 * i for i in range(n)]
    assert sorted(model.starts) == list(range(n))
    w = model.bound
    seen: set[int] = set()
    for j in model.starts:
        behind = [i for i in range(_need(j, w)) if i not in seen]
        assert not behind, f"branch {j} started before {behind} (bound {w})"
        seen.add(j)
    if n > (prefetch + 4) * w:
        assert any(b.in_order and len(b.indices) > 1 for b in model.leases), \
            "no multi-branch wave was cut"


def test_the_model_answers_leases_in_parts_on_some_schedules():
    """The property above covers leases answered in parts: some seeds make a waiting
    worker take branches from another's wave."""
    parts = 0
    for seed in range(40):
        model = _Model(60, 4, 4, 1, seed)
        model.run()
        assert model.result.status == "completed"
        parts += model.parts
    assert parts > 0, "no schedule answered a lease in parts"


def test_regression_a_waiting_worker_takes_only_the_branch_whose_turn_has_come():
    """Bound 2. The thief (w1) runs its lease [1, 3]; branch 3 needs 0 and 1 started, and
    0 waits in w0's box, behind the branch w0 runs, in the strided lease [0, 5]. The thief
    takes branch 0 alone from that lease (its turn has come) and leaves its value in the
    lease; 5 stays there for w0 (5 needs 0-3 started, and 3 is the thief's own waiting
    branch: taking it too waited for ever, the hang of the first waves); then it starts
    3. Nothing is taken from w2, whose worker has not started. w0 then runs 5 and
    answers the whole lease, 0 and 5, in one message."""
    order = _StartOrder(6, 2)
    host = _Host(group_id="g", target=lambda i: i * 10, wants_ctx=False, depth=1,
                 limits=HostLimits(), ledger=_Ledger(Budgets()), store=Store(), live=(),
                 external=(), parent=None, trace=True, runtime=None, nested=None,
                 order=order)
    bus = InMemoryBus()
    answers: dict[str, list[BranchDone]] = {}
    bus.attach("c", lambda d: answers.setdefault(d.msg.lease_id, []).append(d.msg))
    boxes = {w: _LeaseBox(w) for w in ("w0", "w1", "w2")}
    host.boxes = list(boxes.values())
    thief = GroupWorker(bus, "w1", host, "c", lambda name, exc: None, boxes["w1"])
    boxes["w0"].put(Branch(group_id="g", lease_id="g.0", indices=[0, 5], items=[0, 5],
                           in_order=True), order)
    boxes["w0"].running = True      # w0 runs a (long) branch: its box waits behind it
    boxes["w2"].put(Branch(group_id="g", lease_id="g.2", indices=[2, 4], items=[2, 4],
                           in_order=True), order)   # w2 has not started: nothing taken
    unstick = threading.Timer(WAIT, host.hold)   # a stuck wait gives up: fails, not hangs
    unstick.start()
    try:
        thief._run(Branch(group_id="g", lease_id="g.1", indices=[1, 3], items=[1, 3],
                          in_order=True))
        assert [i for kind, i in host.trace if kind == "start"] == [1, 0, 3]
        assert "g.0" not in answers, "the thief answered its part of g.0 before the rest ran"
        (own,) = answers["g.1"]
        assert (own.worker, own.indices, own.values, own.unstarted, own.part) == \
            ("w1", [1, 3], [10, 30], [], False)
        assert boxes["w2"].queued["g.2"].pos == 0
        run = boxes["w0"].next()
        assert run.lease.indices == [0, 5] and run.pos == 1, \
            "the thief took more than the branch whose turn had come"
        # 5 needs 2 and 3 started: w2 runs its lease first.
        GroupWorker(bus, "w2", host, "c", lambda name, exc: None, boxes["w2"])._drain()
        GroupWorker(bus, "w0", host, "c", lambda name, exc: None, boxes["w0"])._run(run)
    finally:
        unstick.cancel()
    (whole,) = answers["g.0"]
    assert (whole.worker, sorted(whole.indices), whole.unstarted, whole.part) == \
        ("w0", [0, 5], [], False)
    assert dict(zip(whole.indices, whole.values)) == {0: 0, 5: 50}


def test_a_branch_that_comes_back_below_a_wave_goes_out_at_once_on_its_own():
    """Waves on, every worker full: the rest of a stolen lease comes back unstarted below
    branches already dealt; it goes out at once, in an in-order lease of its own, to
    the worker whose slot the answer freed, not with the next wave."""
    c = Collector("c")
    workers = ["w0", "w1"]
    out = c.handle(GroupStart(group_id="g", items=list(range(40)), workers=workers,
                              max_concurrency=2, max_items=40, driver="d", prefetch=1,
                              ordered=True, batch_below=0.0005, waves=True))
    sent = {m.lease_id: (to, m) for to, m in out if isinstance(m, Branch)}
    assert [m.indices for _, m in sent.values()] == [[0], [1], [2], [3]]

    def done(lid, indices, unstarted=()):
        to, _ = sent[lid]
        got = c.handle(BranchDone(group_id="g", lease_id=lid, worker=to, indices=list(indices),
                                  values=list(indices), unstarted=list(unstarted),
                                  elapsed=0.002 * len(indices)))
        sent.update({m.lease_id: (w, m) for w, m in got if isinstance(m, Branch)})
        return [(w, m.indices, m.in_order) for w, m in got if isinstance(m, Branch)]

    assert done("g.0", [0]) == [("w0", [4], True)]     # one measured: not yet waves
    assert done("g.1", [1]) == []      # two measured, but w0 is full and w1 not idle
    # Every worker with room: a wave, strided over both (depth ceil(35 / (2 x 2))).
    assert done("g.2", [2]) == [("w0", [5, 7, 9, 11, 13, 15, 17, 19, 21], True),
                                ("w1", [6, 8, 10, 12, 14, 16, 18, 20, 22], True)]
    assert c.pool.full == 2
    # w1's wave was taken by a worker whose turn needed 6: nothing started, all back.
    back = done("g.6", [], unstarted=[6, 8, 10, 12, 14, 16, 18, 20, 22])
    assert back == [("w1", [6], True)]                 # at once, alone, to the freed slot
    assert list(c.queue)[:3] == [8, 10, 12] and c.pool.full == 2
    # The next answer frees a slot of w1's again: the next branch below the wave goes there.
    assert done("g.3", [3]) == [("w1", [8], True)]
