"""Thin pykka shells: receive a delivery, call the pure ``handle``, send what it returns.

Nothing here decides anything. A shell that crashes reports the exception through
``on_crash`` (the runtime then stops the run and raises it to the caller) instead of
leaving an ask or a driver waiting forever.
"""

from __future__ import annotations

import logging
import threading

import pykka

from actors.inbox import Crash, _FastInbox, teller
from bus.base import Bus, Delivery


log = logging.getLogger(__name__)


def pass_to(shell, message: Delivery) -> None:
    """Give one delivery to ``shell.machine`` (asking ``shell._admit`` first) and send
    what it returns, as ``shell.name``: the whole of a shell's work, on whatever thread
    runs it (a ControlActor's own, or a group driver's for its Collector)."""
    if shell._admit is not None:
        why = shell._admit(message.sender, message.msg)
        if why is not None:
            shell.bus.stats.refuse(message.peer or message.sender,
                                   f"{why} (refused by {shell.name})")
            return
    out = shell.machine.handle(message.msg)
    if len(out) > 1 and shell._send_many is not None:
        shell._send_many(shell.name, out)  # one hand-over to the bus for the lot
        return
    for receiver, msg in out:
        shell.bus.send(shell.name, receiver, msg)


class ControlActor(_FastInbox, pykka.ThreadingActor):
    """Planner, Scheduler, Merger (and Collector) all live in one of these."""

    def __init__(self, bus: Bus, name: str, machine, on_crash: Crash) -> None:
        super().__init__()
        self.bus = bus
        self.name = name
        self.machine = machine
        self.on_crash = on_crash
        # A bus that takes several messages at once (ZmqBus) gets an actor's outputs in
        # one call: a Scheduler dispatching a round to 256 workers hands the broker one
        # frame, not 256 (each a wake-up of the broker's thread and a hand-over of the
        # interpreter lock).
        self._send_many = getattr(bus, "send_many", None)
        # A machine that checks who may send what (Scheduler.admit) is asked first: a
        # refused message never reaches handle; it is counted per peer and reason.
        self._admit = getattr(machine, "admit", None)

    @classmethod
    def spawn(cls, bus: Bus, name: str, machine, on_crash: Crash) -> pykka.ActorRef:
        """Start the actor and route its name to it *before* returning: ``start()``
        runs ``on_start`` on the actor's own thread later, so attaching there would
        let a message sent right after (a worker's Hello) find nobody. Messages that
        arrive before ``on_start`` wait in the actor's inbox."""
        ref = cls.start(bus, name, machine, on_crash)
        bus.attach(name, teller(bus, ref))
        return ref

    def on_start(self) -> None:
        self._thread_name()

    def _thread_name(self) -> None:
        threading.current_thread().name = f"evobus-{self.name}"

    def on_receive(self, message: Delivery) -> None:
        pass_to(self, message)

    def on_failure(self, exception_type, exception_value, traceback) -> None:
        self.on_crash(self.name, exception_value)

    def on_stop(self) -> None:
        self.bus.detach(self.name)
