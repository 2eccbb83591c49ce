"""What a warm call's shortcuts keep: a message handed over as it is on the in-process lane
is what its log record decodes to; the default settings are the checked ones; group ids
stay distinct."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import enum

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors import parallel, run_group
from actors.groups import api, driver
from actors.groups.limits import _Ledger
from actors.groups.pool import _as_is
from actors.machines.collector import Collector
from actors.runtime.runtime import Runtime
from bus.log import read_log
from protocol import BranchDone, GroupStart, decode, encode
from test_groups import error_at_one  # item 1 raises, the others wait to be cancelled

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                    st.floats(allow_nan=False), st.text(max_size=20), st.binary(max_size=20))


def _done(values, **kw) -> BranchDone:
    return BranchDone(group_id="g", lease_id="l1", worker="w", indices=list(range(len(values))),
                      values=values, cancelled=[], unstarted=[], effects=[], nbytes=1,
                      elapsed=0.25, suspended=[], **kw)


def _same(a, b) -> bool:
    """Equal, and every value of the same exact type (decoding must not change one)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, msgspec.Struct):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    return a == b


@settings(max_examples=60, deadline=None)
@given(st.lists(scalars, max_size=6))
def test_an_answer_of_plain_values_goes_as_it_is_and_decodes_back_the_same(values):
    msg = _done(values)
    assert _as_is(msg)
    assert _same(decode(encode(msg)), msg)


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize("value", [(1, 2), [1], {"a": 1}, Color.RED,
                                   collections.OrderedDict(a=1), bytearray(b"x")])
def test_an_answer_with_a_value_decoding_would_change_is_copied(value):
    assert not _as_is(_done([value]))


def test_an_answer_with_effects_or_waiting_branches_is_copied():
    assert not _as_is(msgspec.structs.replace(_done([1]), effects=[(0, "x")]))


def _plan(fn, items, max_concurrency, options=None, **kw):
    checked = driver._check_items(items)
    size, items = checked if checked is not None else (None, items)
    return driver._Plan(group_id="g", fn=fn, ref=None, items=items,
                        max_concurrency=max_concurrency, max_items=max(len(items), max_concurrency),
                        options=options or {}, parent=None, branches_to_run=len(items),
                        items_bytes=size, nested=run_group, **kw)


def item_only(x: int) -> int:
    return x


def with_ctx(x, ctx) -> int:
    return x


@pytest.mark.parametrize("fn", [item_only, with_ctx])
@pytest.mark.parametrize("bound,n", [(4, 4), (2, 10), (8, 3)])
def test_a_group_given_no_setting_gets_what_the_checks_give(fn, bound, n):
    plan = _plan(fn, list(range(n)), bound)
    fast = driver._settings(plan)
    plan.options = {"chunk": 0}   # a setting given as its default: the checked path
    assert fast == driver._settings(plan)


def test_a_fresh_groupstart_goes_as_it_is_and_decodes_back_the_same():
    items = [collections.OrderedDict(a=1), Color.RED, "x", [1, {"b": 2.5}], None]
    plan = _plan(item_only, items, 2, options={"cancel_deadline": 3})
    assert [type(i) for i in plan.items] == [dict, int, str, list, type(None)]
    settings_ = driver._settings(plan)
    ledger = _Ledger(plan.budgets)
    start, as_is = driver._group_start(plan, "g", "d", ["w0", "w1"], settings_, ledger)
    assert as_is and isinstance(start, GroupStart)
    assert _same(decode(encode(start)), start)
    plan.approvers = ["ann"]
    assert not driver._group_start(plan, "g", "d", ["w0", "w1"], settings_, ledger)[1]


def seen_types(x):
    return type(x).__name__


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_a_branch_gets_its_item_as_decoding_gives_it_on_the_lane(bus):
    items = [collections.OrderedDict(a=1), Color.RED, 2.0]
    got = parallel(seen_types, items, max_concurrency=3, max_items=3, bus=bus, returns=str)
    assert got == ["dict", "int", "float"]


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_what_the_collector_was_handed_is_what_the_log_holds_and_replays(bus, tmp_path,
                                                                          monkeypatch):
    """A warm group with a log: every message its Collector was handed (some as they
    were sent) is, type for type, what its log record decodes to, and a fresh Collector
    fed the log's inputs answers what the log recorded."""
    handed: list = []
    handle = Collector.handle
    monkeypatch.setattr(Collector, "handle",
                        lambda self, msg: handed.append(msg) or handle(self, msg))
    path = tmp_path / "run.evolog"
    with Runtime(bus=bus, log_path=str(path)) as rt:
        for _ in range(3):   # warm: the pool's threads bound again
            out = run_group(item_only, [0, 1, 2.5, "x"], max_concurrency=4, max_items=4,
                            runtime=rt, returns=object)
            assert out.results == [0, 1, 2.5, "x"]
    records = read_log(path).records
    last = out.group_id
    name = f"collector.{last}"
    inputs = [decode(r.body) for r in records if r.receiver == name]
    recorded = [(r.receiver, decode(r.body)) for r in records if r.sender == name]
    live = [m for m in handed if getattr(m, "group_id", last) == last]
    # 5 inputs (a GroupStart, 4 answers), or 2 once the target is measured cheap (one
    # lease): either way, what was handed is what the log holds.
    assert len(inputs) == len(live) in (2, 5) and all(_same(a, b) for a, b in zip(live, inputs))
    machine = Collector(name)
    assert [o for msg in inputs for o in machine.handle(msg)] == recorded


def test_standalone_group_ids_are_distinct():
    ids = {api._new_group_id() for _ in range(1000)}
    assert len(ids) == 1000


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_a_warm_call_leaves_none_of_its_drivers_objects_in_reference_cycles(bus):
    """The driver's side of a group (its actors, lanes, lease boxes, ledger) is freed
    when the call returns, not later by the garbage collector."""
    import gc

    for _ in range(3):
        parallel(item_only, [0, 1, 2, 3], max_concurrency=4, max_items=4, bus=bus)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(5):
            parallel(item_only, [0, 1, 2, 3], max_concurrency=4, max_items=4, bus=bus)
        gc.collect()
        kinds = {type(o).__name__ for o in gc.garbage}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert not kinds & {"_Actors", "_CollectorShell", "_Lane", "_LeaseBox", "_Ledger",
                        "_Names", "Collector", "GroupStart", "_Host"}, kinds


# -- a target measured cheap: one lease, one worker, helpers if it turns out slow --------

WAIT = 10.0   # every wait is bounded; a test that needs it has already failed


def cheap(x: int) -> int:
    return x


def naps(x: int) -> int:
    time.sleep(0.002)   # simulated work: above the one-lease threshold for 2 items
    return x


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_a_target_measured_cheap_goes_in_one_lease_to_one_worker(bus):
    driver._remember(cheap, 1e-5)
    out = run_group(cheap, list(range(6)), max_concurrency=4, max_items=6, bus=bus)
    assert out.results == list(range(6))
    assert out.stats["leases"] == 1 and out.stats["workers"] == 1
    assert driver._measured(cheap) is not None    # measured again by that group
    driver._remember(cheap, 0.01)                  # measured slow: a lease a branch
    out = run_group(cheap, list(range(6)), max_concurrency=4, max_items=6, bus=bus)
    assert out.results == list(range(6))
    assert out.stats["workers"] == 4 and out.stats["leases"] >= 4


def test_a_target_measured_slow_is_spread_over_the_bound_from_its_next_call():
    for _ in range(2):
        out = run_group(naps, [0, 1, 2, 3], max_concurrency=4, max_items=4, bus="memory")
        assert out.results == [0, 1, 2, 3] and out.stats["workers"] == 4
    assert driver._measured(naps) >= 0.002


class Tally:
    """Branches running at once (and the most ever), and how often each item ran."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = self.peak = 0
        self.calls: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def entered(self, i: int):
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.calls[i] += 1
        try:
            yield
        finally:
            with self.lock:
                self.running -= 1


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_branches_slower_than_measured_are_taken_by_helpers_within_the_bound(bus):
    """Branch 0 waits until branch 5 has run: in one lease on one worker it would wait for
    ever; helpers take the next branches meanwhile, never more at once than the bound."""
    last = threading.Event()
    tally = Tally()

    def target(i: int) -> int:
        with tally.entered(i):
            if i == 0:
                assert last.wait(WAIT), "branch 0 waited for ever: nobody ran branch 5"
            elif i == 5:
                last.set()
            return i

    driver._remember(target, 1e-5)
    out = run_group(target, list(range(8)), max_concurrency=3, max_items=8, bus=bus)
    assert out.results == list(range(8)) and out.stats["leases"] == 1
    assert tally.peak <= 3 and set(tally.calls.values()) == {1} and len(tally.calls) == 8


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_in_one_lease_an_error_is_seen_as_soon_as_its_branch_raises(bus):
    from actors import GroupFailed

    check = error_at_one()
    driver._remember(check, 1e-5)
    t0 = time.monotonic()
    with pytest.raises(GroupFailed) as info:
        parallel(check, range(6), max_concurrency=2, max_items=6, bus=bus)
    assert time.monotonic() - t0 < 1.5
    assert info.value.never_started == list(range(2, 6))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 24), bound=st.integers(1, 5),
       slow=st.sets(st.integers(0, 23), max_size=3),
       failures=st.sets(st.integers(0, 23), max_size=2),
       bus=st.sampled_from(["memory", "zmq"]))
def test_property_one_lease_keeps_the_bound_the_partition_and_no_start_after_an_error(
        n, bound, slow, failures, bus):
    """A target measured cheap whose branches turn out slow (3 ms, past the helpers'
    delay) or failing: never more than the bound at once, nothing twice, no start after
    the first error, every branch accounted for once."""
    tally = Tally()
    failing = {i for i in failures if i < n}

    def target(i: int) -> int:
        with tally.entered(i):
            if i in slow:
                time.sleep(0.003)      # simulated work, not synchronisation
            if i in failing:
                raise ValueError(f"item {i}")
            return i

    driver._remember(target, 1e-6)
    out = run_group(target, list(range(n)), max_concurrency=bound, max_items=max(n, bound),
                    bus=bus, trace=True)
    assert out.stats["workers"] == 1                     # it went in one lease
    assert tally.peak <= bound and set(tally.calls.values()) <= {1}
    if not failing:
        assert out.status == "completed" and out.results == list(range(n))
        return
    assert out.status == "failed" and out.error_branch in failing
    first_error = next(k for k, (kind, _) in enumerate(out.trace) if kind == "error")
    assert all(kind != "start" for kind, _ in out.trace[first_error:])
    parts = [list(out.finished), out.failed, out.cancelled, out.never_started, out.abandoned]
    assert sorted(i for part in parts for i in part) == list(range(n))
    assert set(out.never_started).isdisjoint(tally.calls)


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_in_one_lease_every_interaction_is_pending_in_one_suspension(bus, tmp_path):
    from actors import resume_group

    def label(i: int, ctx) -> str:
        return ctx.ask(f"label for {i}?") if i in (0, 2) else f"auto {i}"

    driver._remember(label, 1e-5)
    out = run_group(label, list(range(5)), max_concurrency=4, max_items=5, bus=bus,
                    checkpoint=tmp_path / "g.ckpt")
    assert out.status == "user_input_pending" and out.stats["workers"] == 1
    assert sorted(p.branch for p in out.pending_interactions) == [0, 2]
    answers = {p.id: f"human {p.branch}" for p in out.pending_interactions}
    done = resume_group(out.checkpoint, target=label, user_inputs=answers, bus=bus)
    assert done.results == ["human 0", "auto 1", "human 2", "auto 3", "auto 4"]
