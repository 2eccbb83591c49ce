"""Sends made by handlers that run on the ZeroMQ broker's thread (the Collector, the
group relay and its proxies): forwarded depth first, so what a delivery's handler sends
goes before the rest of what was sent before it, unless that would put a sender's
messages out of the order it sent them."""

from __future__ import annotations

import threading

from bus import ZmqBus
from protocol import Tick

WAIT_S = 10


def _chain(bus: ZmqBus, seen: list, done: threading.Event, fan: int, again_as: str | None):
    """``a`` fans out to b0..b{fan-1}; each b_i sends one message on to ``sink`` (as
    ``again_as``, when given, instead of as itself)."""

    def a(delivery) -> None:
        seen.append((delivery.seq, delivery.sender, "a"))
        bus.send_many("a", [(f"b{i}", Tick(elapsed=float(i))) for i in range(fan)])

    def b(name: str):
        def deliver(delivery) -> None:
            seen.append((delivery.seq, delivery.sender, name))
            bus.send(again_as or name, "sink", Tick(elapsed=delivery.msg.elapsed))
        return deliver

    def sink(delivery) -> None:
        seen.append((delivery.seq, delivery.sender, "sink"))
        if sum(1 for _, _, to in seen if to == "sink") == fan:
            done.set()

    bus.attach("a", a)
    for i in range(fan):
        bus.attach(f"b{i}", b(f"b{i}"))
    bus.attach("sink", sink)


def test_a_handlers_sends_go_before_the_rest_of_the_batch_that_caused_them():
    bus = ZmqBus()
    try:
        seen: list = []
        done = threading.Event()
        _chain(bus, seen, done, fan=4, again_as=None)
        bus.send("driver", "a", Tick(elapsed=0.0))
        assert done.wait(WAIT_S)
        order = [(sender, to) for _, sender, to in sorted(seen)]
        assert order == [("driver", "a"), ("a", "b0"), ("b0", "sink"), ("a", "b1"),
                         ("b1", "sink"), ("a", "b2"), ("b2", "sink"), ("a", "b3"),
                         ("b3", "sink")]
    finally:
        bus.close()


def test_a_sender_with_messages_still_waiting_keeps_its_order():
    bus = ZmqBus()
    try:
        seen: list = []
        done = threading.Event()
        # Each b_i answers as "a", which still has messages to b_(i+1).. waiting: they
        # leave first, in the order "a" sent everything.
        _chain(bus, seen, done, fan=3, again_as="a")
        bus.send("driver", "a", Tick(elapsed=0.0))
        assert done.wait(WAIT_S)
        order = [(sender, to) for _, sender, to in sorted(seen)]
        assert order == [("driver", "a"), ("a", "b0"), ("a", "b1"), ("a", "b2"),
                         ("a", "sink"), ("a", "sink"), ("a", "sink")]
    finally:
        bus.close()
