"""The remote wire at its cheapest (the 256-connection target): one frame per
message between the broker and a remote worker, an actor's outputs handed to the broker
as one frame, heartbeats only on a quiet line, and a worker whose threads wait instead
of polling.

Loopback only; every wait is bounded and waits on an event, never on a sleep.
"""

from __future__ import annotations

import queue
import threading
import types
import time

import pykka
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from test_bus_conformance import WAIT_S, Inbox  # deliveries collected, waits bounded

from actors.workers.remote import EXIT_LOST, EXIT_STOPPED, RemoteWorker
from actors.runtime.shell import ControlActor
from bus.frames import (
    LISTEN_BACKLOG,
    batch,
    delivery,
    envelope,
    open_batch,
    open_delivery,
    open_envelope,
)
from bus.log import FORMAT_VERSION, LogHeader, LogWriter, read_log
from bus.memory import InMemoryBus
from bus.remote import PeerPort, RemoteEndpoint
from bus.zmq_bus import ZmqBus
from protocol import Heartbeat, Hello, Join, LeaseDone, Stop, Tick

NAME = st.binary(min_size=0, max_size=40)
BODY = st.binary(max_size=200)


# -- the one-frame formats (bus/frames.py) ----------------------------------------------------


@settings(max_examples=200, deadline=None, derandomize=True)
@given(NAME, NAME, BODY, st.integers(min_value=0, max_value=2**64 - 1))
def test_one_frame_envelopes_and_deliveries_give_back_what_went_in(sender, receiver, body,
                                                                  seq):
    assert open_envelope(envelope(sender, receiver, body)) == (sender, receiver, body)
    assert open_delivery(delivery(seq, sender, receiver, body)) == (seq, sender, receiver,
                                                                    body)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.tuples(NAME, NAME, BODY), max_size=8))
def test_a_batch_gives_back_its_envelopes_in_order(messages):
    frames = [envelope(*m) for m in messages]
    assert open_batch(batch(frames)) == frames


def test_truncated_frames_open_as_none_never_as_a_wrong_message():
    env = envelope(b"w", b"scheduler", b"body")
    dlv = delivery(7, b"scheduler", b"w", b"body")
    bat = batch([env, env])
    for cut in range(1, 9):  # a header cut short, or lengths that run past the end
        assert open_envelope(env[:cut]) is None
        assert open_delivery(dlv[:cut]) is None
    assert open_batch(bat[:-1]) is None and open_batch(bat[:3]) is None
    assert open_delivery(b"m" + dlv[1:]) is None  # not a delivery at all


# -- the broker and a remote worker, one frame a message -----------------------------------------


@pytest.fixture
def port_bus():
    port = PeerPort(["tcp://127.0.0.1:0"], receivers=["scheduler"])
    bus = ZmqBus(peers=(port,))
    yield port, bus
    bus.close()


def test_both_listening_sockets_queue_a_fleet_joining_at_once(port_bus):
    # ZeroMQ's default listen queue (100) overflowed when 256 workers connected to a
    # busy broker at once; every dropped SYN cost its worker the kernel's 1 s retransmit.
    port, bus = port_bus
    assert port.socket.getsockopt(zmq.BACKLOG) == LISTEN_BACKLOG
    assert bus.broker._router.getsockopt(zmq.BACKLOG) == LISTEN_BACKLOG


def test_a_remote_worker_and_the_broker_exchange_one_frame_messages(port_bus):
    port, bus = port_bus
    scheduler, worker = Inbox(), Inbox()
    bus.attach("scheduler", scheduler)
    ep = RemoteEndpoint(port.addresses[0])
    try:
        ep.attach("w", worker)
        ep.send("w", "scheduler", Hello(worker="w"))
        (hello,) = scheduler.wait(1)
        assert hello.msg == Hello(worker="w") and hello.sender == "w"
        bus.send("scheduler", "w", Stop(reason="bye"))
        (stop,) = worker.wait(1)
        assert stop.msg == Stop(reason="bye") and stop.seq == hello.seq + 1
        assert bus.stats.rejected_frames == 0
    finally:
        ep.close()


def test_a_malformed_one_frame_envelope_from_a_registered_peer_is_counted(port_bus):
    port, bus = port_bus
    bus.attach("scheduler", Inbox())
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(port.addresses[0])
        raw.send_multipart([b"A", b"w-raw"])
        assert raw.poll(int(WAIT_S * 1000)) and raw.recv_multipart()[:2] == [b"a", b"w-raw"]
        raw.send(envelope(b"w-raw", b"scheduler", b"")[:6])  # lengths past the end
        end = time.monotonic() + WAIT_S
        while bus.stats.rejected_frames == 0 and time.monotonic() < end:
            raw.poll(10)  # bounded wait for the broker's thread to count it
        assert bus.stats.rejected_frames == 1
    finally:
        raw.close(0)
        ctx.destroy(0)


# -- heartbeats on a quiet line --------------------------------------------------------------


def test_the_keepalive_heartbeats_a_quiet_line_from_the_io_thread(port_bus):
    port, bus = port_bus
    scheduler = Inbox()
    bus.attach("scheduler", scheduler)
    ep = RemoteEndpoint(port.addresses[0])
    try:
        ep.attach("w", Inbox())
        ep.keepalive("w", "scheduler", Heartbeat(worker="w"), 0.05)
        got = scheduler.wait(2)  # nothing else is sent: heartbeats keep coming
        assert [d.msg for d in got[:2]] == [Heartbeat(worker="w")] * 2
        assert ep.keepalives >= 2
    finally:
        ep.close()


def test_a_message_to_the_keepalive_receiver_restarts_its_interval(port_bus):
    port, bus = port_bus
    bus.attach("scheduler", Inbox())
    bus.attach("registry", Inbox())
    ep = RemoteEndpoint(port.addresses[0])
    try:
        ep.attach("w", Inbox())
        ep.keepalive("w", "scheduler", Heartbeat(worker="w"), 3600.0)
        before = ep.kept_alive
        ep.send("w", "registry", Join(worker="w"))  # another receiver: no heartbeat
        assert ep.kept_alive == before
        ep.send("w", "scheduler", LeaseDone(lease_id="l", worker="w", round=0))
        assert ep.kept_alive > before  # an answer is as good as a heartbeat
        with pytest.raises(ValueError, match="interval"):
            ep.keepalive("w", "scheduler", Heartbeat(worker="w"), 0)
    finally:
        ep.close()


# -- an actor's outputs as one frame (ZmqBus.send_many) ------------------------------------------


def test_messages_sent_together_arrive_in_order_as_consecutive_records(tmp_path):
    writer = LogWriter(tmp_path / "b.evolog", LogHeader(format_version=FORMAT_VERSION))
    bus = ZmqBus(writer)
    a, b = Inbox(), Inbox()
    try:
        bus.attach("a", a)
        bus.attach("b", b)
        out = [("a", Tick(elapsed=float(i))) if i % 2 else ("b", Tick(elapsed=float(i)))
               for i in range(6)]
        bus.send_many("s", out)
        got = sorted(a.wait(3) + b.wait(3), key=lambda d: d.seq)
        assert [(d.receiver, d.msg) for d in got] == out
        assert [d.seq for d in got] == list(range(got[0].seq, got[0].seq + 6))
    finally:
        bus.close()
    assert [r.receiver for r in read_log(tmp_path / "b.evolog").records] == [r for r, _ in out]


def test_a_malformed_batch_at_the_intake_is_counted_and_its_good_envelopes_delivered():
    bus = ZmqBus()
    inbox = Inbox()
    push = bus.ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        bus.attach("a", inbox)
        push.connect(bus.broker.intake_addr)
        push.send(b"n\x05\x00\x00\x00ab")  # an envelope longer than the frame
        good = envelope(b"s", b"a", bus._codec.encode(Tick(elapsed=1.0)))
        push.send(batch([b"x-not-an-envelope", good]))
        assert inbox.wait(1)[0].msg == Tick(elapsed=1.0)
        assert bus.stats.rejected_frames == 2
    finally:
        push.close(0)
        bus.close()


class _Fanout:
    """A machine whose every input is answered with several outputs."""

    def handle(self, msg):
        return [("sink", Tick(elapsed=float(i))) for i in range(5)]


@pytest.mark.parametrize("kind", ["memory", "zmq"])
def test_a_control_actors_outputs_arrive_in_order_on_either_bus(kind):
    bus = InMemoryBus() if kind == "memory" else ZmqBus()
    sink = Inbox()
    crashes = []
    try:
        bus.attach("sink", sink)
        ref = ControlActor.spawn(bus, "fanout", _Fanout(), lambda n, e: crashes.append(e))
        bus.send("driver", "fanout", Tick(elapsed=0.0))
        assert [d.msg.elapsed for d in sink.wait(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
        ref.stop(timeout=WAIT_S)
        assert crashes == []
    finally:
        pykka.ActorRegistry.stop_all(timeout=WAIT_S)
        bus.close()


# -- the worker's threads wait, never poll -----------------------------------------------------


class _FakeEndpoint:
    """What RemoteWorker._serve touches of its endpoint."""

    def __init__(self, worker: RemoteWorker, last_heard: float) -> None:
        self.worker = worker
        self.last_heard = self.last_frame = last_heard
        self.sent = []

    def send(self, sender, receiver, msg) -> None:
        self.sent.append(msg)
        if isinstance(msg, Join):  # answer the retried join by ending the serve loop
            self.worker.inbox.put(Stop(reason="test over"))


def test_a_worker_that_hears_nothing_for_give_up_seconds_stops_as_lost():
    w = RemoteWorker("tcp://127.0.0.1:1", give_up=5.0)
    w.ep = _FakeEndpoint(w, last_heard=time.monotonic() - 6.0)
    assert w._serve() == EXIT_LOST and "5 s" in w.stop_reason


def test_a_stop_sent_while_the_broker_is_stopping_still_reaches_the_remote_worker():
    # The broker is busy (a local handler) when the runtime sends the worker its Stop and
    # closes the bus: the Stop waits in the broker's intake, behind its stop flag. It
    # must still be forwarded, and its frame leave the port before the socket closes.
    bus = ZmqBus(peers=(PeerPort(["tcp://127.0.0.1:0"]),))
    entered, release = threading.Event(), threading.Event()
    bus.attach("busy", lambda d: (entered.set(), release.wait(WAIT_S)))
    inbox = Inbox()
    ep = RemoteEndpoint(bus.addresses[-1])
    try:
        ep.attach("w", inbox)
        ep.send("w", "busy", Tick(elapsed=0.0))
        assert entered.wait(WAIT_S)
        bus.send("driver", "w", Stop(reason="run finished"))
        closer = threading.Thread(target=bus.close, daemon=True)
        closer.start()
        assert _wait_until(bus.broker._stop.is_set, WAIT_S)
        release.set()
        closer.join(WAIT_S)
        assert [type(d.msg) for d in inbox.wait(1)] == [Stop]
    finally:
        release.set()
        ep.close()
        bus.close()


def test_a_worker_whose_broker_is_gone_gives_up_although_it_keeps_reconnecting():
    # Each reconnect resets the endpoint's own broker timeout, never the give_up: that
    # counts from the broker's last frame (here its last ping answer before it closed).
    bus = ZmqBus(peers=(PeerPort(["tcp://127.0.0.1:0"]),))
    w = RemoteWorker(bus.addresses[-1], worker_id="w-gone", broker_timeout=1.5, give_up=3.0)
    codes = queue.SimpleQueue()
    t = threading.Thread(target=lambda: codes.put(w.run()), daemon=True)
    t.start()
    try:
        assert _wait_until(lambda: w.ep is not None and w.ep.heard.is_set(), WAIT_S)
    finally:
        bus.close()
    closed = time.monotonic()
    t.join(3.0 + 1.5 + 3.0)  # give_up, one broker timeout, and slack for a loaded machine
    assert not t.is_alive(), "the worker kept reconnecting past its give_up"
    assert codes.get_nowait() == EXIT_LOST and "3 s" in w.stop_reason
    assert w.ep.reconnects >= 1 and time.monotonic() - closed < 7.5


def _wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)  # polling period of a bounded wait, not a synchronisation
    return cond()


def test_a_worker_still_awaiting_its_spec_joins_again_then_serves_until_stop():
    w = RemoteWorker("tcp://127.0.0.1:1", give_up=60.0)
    w.ep = _FakeEndpoint(w, last_heard=time.monotonic())
    w.awaiting_spec, w.joined_at = True, time.monotonic() - 2.0
    assert w._serve() == EXIT_STOPPED
    assert [type(m) for m in w.ep.sent] == [Join] and w.stop_reason == "test over"


def test_idle_slot_threads_end_when_the_worker_does():
    w = RemoteWorker("tcp://127.0.0.1:1")
    q: queue.SimpleQueue = queue.SimpleQueue()
    w.slot_queues = [q]
    closed = threading.Event()   # the slot closes its core (its event loop) as it ends
    core = types.SimpleNamespace(close=closed.set)
    t = threading.Thread(target=w._slot, args=(0, core, q), daemon=True)
    t.start()
    w.done.set()
    w._release_slots()  # what run() does on its way out
    t.join(WAIT_S)
    assert not t.is_alive() and closed.is_set()


def test_a_leaving_worker_lets_the_call_its_slot_is_in_finish_and_drops_what_is_queued():
    # A process worker told Stop while a slot is inside a model call: cutting the call off
    # mid-flight may still be billed and its usage would never be reported, so the worker
    # waits for it (bounded by STOP_DRAIN_S); the lease queued behind it never starts.
    from protocol import Lease
    w = RemoteWorker("tcp://127.0.0.1:1")
    w.ep = _FakeEndpoint(w, last_heard=time.monotonic())
    q: queue.SimpleQueue = queue.SimpleQueue()
    w.slot_queues, w.slot_load = [q], [0]
    entered, release, ran = threading.Event(), threading.Event(), []

    def run_lease(lease, cancelled=None):
        ran.append(lease.lease_id)
        entered.set()
        release.wait(WAIT_S)
        return LeaseDone(lease_id=lease.lease_id, worker=w.name, round=1)

    core = types.SimpleNamespace(run_lease=run_lease, close=lambda: None)
    slot = threading.Thread(target=w._slot, args=(0, core, q), daemon=True)
    w.threads = [slot]
    slot.start()
    for lease_id in ("first", "queued"):
        w._to_slot(Lease(lease_id=lease_id, round=1, task_ids=["t"]))
    assert entered.wait(WAIT_S)
    w.done.set()
    w._release_slots()
    drained = threading.Event()
    drainer = threading.Thread(target=lambda: (w._drain_slots(), drained.set()), daemon=True)
    drainer.start()
    assert not drained.wait(0.2), "the worker left while its slot was in a call"
    release.set()
    assert drained.wait(WAIT_S)
    assert ran == ["first"]
    assert [(type(m), m.lease_id) for m in w.ep.sent] == [(LeaseDone, "first")]
