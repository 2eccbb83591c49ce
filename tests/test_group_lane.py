"""The in-process lane a parallel group's actors send on (``send_inline``): stamped,
logged and delivered on the sending thread, in the bus's one order, on both buses."""

from __future__ import annotations

import threading

import pytest

from actors import run_group
from actors.runtime.runtime import Runtime
from bus import InMemoryBus, ZmqBus
from bus.log import FORMAT_VERSION, LogHeader, LogWriter, read_log
from protocol import Barrier, Tick, decode

WAIT_S = 10


class Inbox:
    """Records each delivery with the thread it came on."""

    def __init__(self, then=None) -> None:
        self.items: list = []
        self.threads: list[int] = []
        self.then = then
        self.cond = threading.Condition()

    def __call__(self, delivery) -> None:
        with self.cond:
            self.items.append(delivery)
            self.threads.append(threading.get_ident())
            self.cond.notify_all()
        if self.then is not None:
            self.then(delivery)

    def wait(self, n: int) -> list:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.items) >= n, timeout=WAIT_S), \
                f"only {len(self.items)} of {n} deliveries arrived within {WAIT_S} s"
            return list(self.items)


@pytest.fixture(params=["memory", "zmq"])
def make_bus(request, tmp_path):
    made = []

    def make(log=False):
        writer = LogWriter(tmp_path / "bus.evolog", LogHeader(format_version=FORMAT_VERSION)) \
            if log else None
        bus = InMemoryBus(writer) if request.param == "memory" else ZmqBus(writer)
        made.append(bus)
        return bus

    yield make
    for bus in made:
        bus.close()


def test_an_inline_send_is_stamped_logged_and_delivered_before_it_returns_on_the_senders_thread(
        make_bus, tmp_path):
    bus = make_bus(log=True)
    inbox = Inbox()
    bus.attach("a", inbox)
    for i in range(50):
        bus.send_inline("x", "a", Barrier(round=i))
        assert len(inbox.items) == i + 1   # delivered already, no wait
    assert set(inbox.threads) == {threading.get_ident()}
    assert [d.seq for d in inbox.items] == list(range(1, 51))
    bus.close()
    records = read_log(tmp_path / "bus.evolog").records
    assert [r.seq for r in records] == list(range(1, 51))
    assert [decode(r.body) for r in records] == [d.msg for d in inbox.items]


def test_what_a_handler_sends_inline_is_delivered_after_it_returns_in_order(make_bus):
    bus = make_bus()
    order: list[str] = []

    def on_a(delivery) -> None:
        bus.send_inline("a", "b", Barrier(round=1))
        bus.send_inline("a", "b", Barrier(round=2))
        order.append("a returned")

    b = Inbox(then=lambda d: order.append(f"b got {d.msg.round}"))
    bus.attach("a", Inbox(then=on_a))
    bus.attach("b", b)
    bus.send_inline("x", "a", Barrier(round=0))
    assert order == ["a returned", "b got 1", "b got 2"]
    assert [d.seq for d in b.items] == [2, 3]


def test_copy_false_hands_the_message_over_as_it_is_and_copy_true_as_it_crossed(make_bus,
                                                                                   tmp_path):
    bus = make_bus(log=True)
    inbox = Inbox()
    bus.attach("a", inbox)
    kept, copied = Barrier(round=7), Barrier(round=8)
    bus.send_inline("x", "a", kept, False)
    bus.send_inline("x", "a", copied)
    assert inbox.items[0].msg is kept
    assert inbox.items[1].msg == copied and inbox.items[1].msg is not copied
    bus.close()
    assert [decode(r.body) for r in read_log(tmp_path / "bus.evolog").records] == [kept, copied]


def test_inline_and_broker_messages_share_one_sequence_and_one_log(tmp_path):
    writer = LogWriter(tmp_path / "bus.evolog", LogHeader(format_version=FORMAT_VERSION))
    bus = ZmqBus(writer)
    try:
        inbox = Inbox()
        bus.attach("a", inbox)
        senders = [threading.Thread(target=lambda k=k: [
            (bus.send_inline if (i + k) % 2 else bus.send)(f"s{k}", "a", Tick(elapsed=i))
            for i in range(100)]) for k in range(4)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(WAIT_S)
        got = inbox.wait(400)
    finally:
        bus.close()
    assert sorted(d.seq for d in got) == list(range(1, 401))
    records = read_log(tmp_path / "bus.evolog").records
    assert [r.seq for r in records] == list(range(1, 401))
    by_seq = {d.seq: d.msg for d in got}
    assert all(decode(r.body) == by_seq[r.seq] for r in records)


def test_an_inline_send_to_a_name_not_in_this_process_goes_through_the_broker():
    bus = ZmqBus()
    try:
        inbox = Inbox()
        bus.attach("a", inbox)
        bus.send_inline("x", "nobody", Barrier(round=0))
        bus.send("x", "a", Barrier(round=1))   # behind it on this thread's socket
        inbox.wait(1)
        assert bus.stats.unroutable == 1
        assert inbox.threads != [threading.get_ident()]   # the broker's thread delivered it
    finally:
        bus.close()


def noop(x: int) -> int:
    return x


def test_a_groups_messages_on_threads_of_this_process_never_cross_the_brokers_thread(
        tmp_path):
    """Every message of a group is stamped and logged on the thread that sent it (the
    driver's or a worker's), in one order that replays."""
    stamped: list[tuple[str, str]] = []
    with Runtime(bus="zmq", log_path=str(tmp_path / "run.evolog"),
                 watch=lambda s, r, body: stamped.append(
                     (threading.current_thread().name, type(decode(body)).__name__))) as rt:
        for _ in range(3):   # warm: the pool's threads are bound again
            out = run_group(noop, list(range(6)), max_concurrency=4, max_items=6, runtime=rt)
            assert out.results == list(range(6))
    assert stamped and not [name for name, _ in stamped if name == "evobus-broker"]
    kinds = {kind for _, kind in stamped}
    assert {"GroupStart", "Branch", "BranchDone", "GroupResult"} <= kinds
