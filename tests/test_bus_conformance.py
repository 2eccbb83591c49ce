"""One conformance suite, run against the in-memory bus and the ZeroMQ bus.

Also: the ZeroMQ broker reached over ipc:// and tcp:// from a second endpoint.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
import zmq

from bus import MAX_FRAME_BYTES, Endpoint, InMemoryBus, ZmqBus
from bus.log import FLUSH_EVERY_S, FORMAT_VERSION, LogHeader, LogWriter, read_log
from protocol import Barrier, Tick, decode

WAIT_S = 10


class Inbox:
    """Collects deliveries; wait(n) blocks (bounded) until n have arrived."""

    def __init__(self) -> None:
        self.items = []
        self._cond = threading.Condition()

    def __call__(self, delivery) -> None:
        with self._cond:
            self.items.append(delivery)
            self._cond.notify_all()

    def wait(self, n: int) -> list:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.items) >= n, timeout=WAIT_S), \
                f"only {len(self.items)} of {n} deliveries arrived within {WAIT_S} s"
            return list(self.items)

    def wait_for(self, done) -> list:
        """Block (bounded) until ``done(items)`` holds."""
        with self._cond:
            assert self._cond.wait_for(lambda: done(self.items), timeout=WAIT_S), \
                f"{len(self.items)} deliveries, not what was awaited, within {WAIT_S} s"
            return list(self.items)


@pytest.fixture(params=["memory", "zmq"])
def make_bus(request, tmp_path):
    made = []

    def make(log=False, first_seq=1, sync_on=(), flush_every=FLUSH_EVERY_S):
        writer = None
        if log:
            writer = LogWriter(tmp_path / "bus.evolog", LogHeader(format_version=FORMAT_VERSION),
                               flush_every=flush_every)
        bus = InMemoryBus(writer, first_seq=first_seq, sync_on=sync_on) \
            if request.param == "memory" else ZmqBus(writer, first_seq=first_seq,
                                                     sync_on=sync_on)
        made.append(bus)
        return bus

    yield make
    for bus in made:
        bus.close()


def test_messages_arrive_in_order_with_increasing_sequence_numbers(make_bus):
    bus = make_bus()
    inbox = Inbox()
    bus.attach("a", inbox)
    for i in range(200):
        bus.send("x", "a", Barrier(round=i))
    got = inbox.wait(200)
    assert [d.msg.round for d in got] == list(range(200))
    assert [d.seq for d in got] == list(range(1, 201))
    assert {d.sender for d in got} == {"x"} and {d.receiver for d in got} == {"a"}


def test_a_frame_that_does_not_decode_is_counted_and_dropped_and_the_bus_goes_on(make_bus):
    bus = make_bus()
    inbox = Inbox()
    bus.attach("a", inbox)
    bus.send_frame("mallory", "a", b"\xc1not msgpack")
    bus.send("x", "a", Barrier(round=1))
    got = inbox.wait(1)
    assert [d.msg for d in got] == [Barrier(round=1)]
    assert bus.stats.rejected_frames == 1
    assert bus.stats.rejected_by_sender == {"mallory": 1}


def test_a_frame_over_the_size_limit_is_refused(make_bus):
    bus = make_bus()
    inbox = Inbox()
    bus.attach("a", inbox)
    bus.send_frame("x", "a", b"\x00" * (MAX_FRAME_BYTES + 1))
    bus.send("x", "a", Barrier(round=2))
    got = inbox.wait(1)
    assert [d.msg for d in got] == [Barrier(round=2)]
    assert bus.stats.rejected_frames == 1


def test_a_message_to_nobody_is_counted_as_unroutable(make_bus):
    bus = make_bus()
    inbox = Inbox()
    bus.attach("a", inbox)
    bus.send("x", "ghost", Barrier(round=0))
    bus.send("x", "a", Barrier(round=1))
    inbox.wait(1)
    assert bus.stats.unroutable == 1


def test_senders_on_many_threads_are_all_delivered_fifo_per_sender(make_bus):
    bus = make_bus()
    inbox = Inbox()
    bus.attach("a", inbox)

    def sender(k: int) -> None:
        for i in range(100):
            bus.send(f"s{k}", "a", Tick(elapsed=float(i)))

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    got = inbox.wait(400)
    for k in range(4):
        mine = [d.msg.elapsed for d in got if d.sender == f"s{k}"]
        assert mine == [float(i) for i in range(100)]
    assert sorted(d.seq for d in got) == list(range(1, 401))


def test_a_lot_sent_in_order_is_stamped_whole_and_before_the_answers_to_it(make_bus):
    # What resume sends again (several senders' messages, in the old run's order): an
    # actor answering each on its own thread, and another thread sending all along,
    # never get a message of theirs stamped between the lot's.
    bus = make_bus()
    seen = Inbox()   # every delivery, to "a" and to "b"
    asked: queue.SimpleQueue = queue.SimpleQueue()
    bus.attach("b", seen)

    def to_a(delivery) -> None:
        seen(delivery)
        asked.put(delivery)

    bus.attach("a", to_a)

    def actor_a() -> None:  # answers on its own thread, as a pykka actor does
        while (delivery := asked.get(timeout=WAIT_S)) is not None:
            bus.send("a", "b", Tick(elapsed=float(delivery.msg.round)))

    stop = threading.Event()

    def chatter() -> None:
        while not stop.is_set():
            bus.send("z", "b", Tick(elapsed=-1.0))

    threads = [threading.Thread(target=actor_a), threading.Thread(target=chatter)]
    for t in threads:
        t.start()
    lot = [(f"s{i % 3}", "a" if i % 2 else "b", Barrier(round=i)) for i in range(20)]
    try:
        seen.wait(5)  # the chatter is under way
        bus.send_in_order(lot)
        got = seen.wait_for(lambda items: sum(d.sender == "a" for d in items) == 10)
    finally:
        stop.set()
        asked.put(None)
        for t in threads:
            t.join(WAIT_S)
    mine = sorted((d for d in got if isinstance(d.msg, Barrier)), key=lambda d: d.seq)
    assert [(d.sender, d.receiver, d.msg) for d in mine] == lot
    assert [d.seq for d in mine] == list(range(mine[0].seq, mine[0].seq + 20))
    answers = [d for d in got if d.sender == "a"]
    assert min(d.seq for d in answers) > mine[-1].seq


def test_every_delivered_message_is_in_the_log_with_its_sequence_number(make_bus, tmp_path):
    bus = make_bus(log=True)
    inbox = Inbox()
    bus.attach("a", inbox)
    bus.send_frame("m", "a", b"junk")
    for i in range(50):
        bus.send("x", "a", Barrier(round=i))
    got = inbox.wait(50)
    bus.close()
    records = read_log(tmp_path / "bus.evolog").records
    assert [r.seq for r in records] == [d.seq for d in got]
    assert [decode(r.body) for r in records] == [d.msg for d in got]
    assert all(r.sender == "x" and r.receiver == "a" for r in records)
    assert all(b.t >= a.t for a, b in zip(records, records[1:]))


def test_numbering_starts_at_first_seq_in_deliveries_and_the_log(make_bus, tmp_path):
    """A resumed run's log goes on after the one it continues (actors/replay/resume.py)."""
    bus = make_bus(log=True, first_seq=178)
    inbox = Inbox()
    bus.attach("a", inbox)
    for i in range(5):
        bus.send("x", "a", Barrier(round=i))
    got = inbox.wait(5)
    bus.close()
    assert [d.seq for d in got] == [178, 179, 180, 181, 182]
    assert [r.seq for r in read_log(tmp_path / "bus.evolog").records] == [d.seq for d in got]


def on_disk_within(path, n: int, deadline_s: float) -> float:
    """Seconds until the file at ``path`` holds ``n`` records (bounded poll)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if len(read_log(path).records) >= n:
            return time.monotonic() - t0
        time.sleep(0.01)  # polling period, not a synchronisation
    raise AssertionError(f"{path} did not hold {n} records within {deadline_s} s")


def test_a_delivered_record_reaches_the_os_within_a_second_with_no_more_traffic(make_bus,
                                                                                tmp_path):
    bus = make_bus(log=True)
    inbox = Inbox()
    bus.attach("a", inbox)
    bus.send("x", "a", Barrier(round=0))  # one record, far below any batch size
    inbox.wait(1)
    assert on_disk_within(tmp_path / "bus.evolog", 1, deadline_s=1.0) < 1.0


def test_a_sync_message_is_on_disk_before_the_flush_interval_passes(make_bus, tmp_path):
    bus = make_bus(log=True, sync_on=(Barrier,), flush_every=1.0)
    inbox = Inbox()
    bus.attach("a", inbox)
    bus.send("x", "a", Tick(elapsed=0.0))  # not a sync message: waits for its interval
    bus.send("x", "a", Barrier(round=0))   # a sync message: fsynced with what precedes it
    inbox.wait(2)
    assert on_disk_within(tmp_path / "bus.evolog", 2, deadline_s=0.9) < 0.9


@pytest.mark.parametrize("first_seq", [0, -3, True, 1.5])
def test_a_first_seq_below_1_or_not_an_integer_is_refused(make_bus, first_seq):
    with pytest.raises(ValueError, match="first_seq must be an integer >= 1"):
        make_bus(first_seq=first_seq)


def test_detached_names_stop_receiving(make_bus):
    bus = make_bus()
    inbox, other = Inbox(), Inbox()
    bus.attach("a", inbox)
    bus.attach("b", other)
    bus.send("x", "a", Barrier(round=0))
    inbox.wait(1)
    bus.detach("a")
    bus.send("x", "a", Barrier(round=1))
    bus.send("x", "b", Barrier(round=2))
    other.wait(1)
    assert len(inbox.items) == 1


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_an_endpoint_in_another_context_reaches_the_broker_over(transport, tmp_path):
    addr = f"ipc://{tmp_path}/broker.sock" if transport == "ipc" else "tcp://127.0.0.1:0"
    bus = ZmqBus(binds=[addr])
    ctx = zmq.Context()
    try:
        external = [a for a in bus.addresses if not a.startswith("inproc://")][0]
        remote = Endpoint(ctx, external, name="remote")
        try:
            far, near = Inbox(), Inbox()
            remote.attach("far", far)
            bus.attach("near", near)
            bus.send("near", "far", Barrier(round=7))
            assert far.wait(1)[0].msg == Barrier(round=7)
            remote.send("far", "near", Barrier(round=8))
            assert near.wait(1)[0].msg == Barrier(round=8)
        finally:
            remote.close()
    finally:
        bus.close()
        ctx.destroy(linger=0)


def test_binding_a_non_loopback_address_without_keys_is_refused():
    with pytest.raises(ValueError, match="loopback only"):
        ZmqBus(binds=["tcp://0.0.0.0:5599"])


@pytest.mark.parametrize("addr, local", [
    ("inproc://x", True), ("ipc:///tmp/evobus.sock", True), ("tcp://127.0.0.1:5555", True),
    ("tcp://127.3.4.5:5555", True), ("tcp://localhost:5555", True), ("tcp://[::1]:5555", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://10.0.0.2:5555", False), ("tcp://*:5555", False),
    ("udp://127.0.0.1:5555", False), ("tipc://{5560,0,0}", False), ("pgm://eth0;239.1.1.1:5555", False),
    ("epgm://eth0;239.1.1.1:5555", False), ("ws://127.0.0.1:5555", False),
    ("vmci://1:5555", False)])
def test_one_loopback_rule_for_every_transport(addr, local):
    from bus.security import loopback_only

    assert loopback_only(addr) is local
