"""Thin pykka shells: receive a delivery, call the pure ``handle``, send what it returns.

Nothing here decides anything. A shell that crashes reports the exception through
``on_crash`` (the runtime then stops the run and raises it to the caller) instead of
leaving an ask or a driver waiting forever.
"""

from __future__ import annotations

import logging
from typing import Callable

import pykka

from actors.addresses import SCHEDULER
from actors.worker import WorkerCore
from bus.base import Bus, Delivery
from protocol import Cancel, Commit, Hello, Lease, Stop

log = logging.getLogger(__name__)

Crash = Callable[[str, BaseException], None]


class ControlActor(pykka.ThreadingActor):
    """Planner, Scheduler, Merger (and Collector) all live in one of these."""

    def __init__(self, bus: Bus, name: str, machine, on_crash: Crash) -> None:
        super().__init__()
        self.bus = bus
        self.name = name
        self.machine = machine
        self.on_crash = on_crash

    def on_start(self) -> None:
        self._thread_name()
        self.bus.attach(self.name, self.actor_ref.tell)

    def _thread_name(self) -> None:
        import threading

        threading.current_thread().name = f"evobus-{self.name}"

    def on_receive(self, message: Delivery) -> None:
        for receiver, msg in self.machine.handle(message.msg):
            self.bus.send(self.name, receiver, msg)

    def on_failure(self, exception_type, exception_value, traceback) -> None:
        self.on_crash(self.name, exception_value)

    def on_stop(self) -> None:
        self.bus.detach(self.name)


class WorkerActor(pykka.ThreadingActor):
    """A local (thread) worker: one lease at a time, in its own thread."""

    def __init__(self, bus: Bus, core: WorkerCore, on_crash: Crash, slots: int = 1) -> None:
        super().__init__()
        self.bus = bus
        self.core = core
        self.on_crash = on_crash
        self.slots = slots
        self.cancelled: set[str] = set()

    def on_start(self) -> None:
        import threading

        threading.current_thread().name = f"evobus-{self.core.name}"
        self.bus.attach(self.core.name, self.actor_ref.tell)
        self.bus.send(self.core.name, SCHEDULER, Hello(worker=self.core.name, slots=self.slots))

    def on_receive(self, message: Delivery) -> None:
        match message.msg:
            case Lease() as lease:
                if lease.lease_id in self.cancelled:
                    return
                done = self.core.run_lease(lease)
                self.bus.send(self.core.name, SCHEDULER, done)
            case Commit() as commit:
                self.core.on_commit(commit)
            case Cancel(lease_id=lease_id):
                self.cancelled.add(lease_id)
            case Stop():
                self.actor_ref.stop(block=False)
            case other:
                log.warning("%s: unexpected %s", self.core.name, type(other).__name__)

    def on_failure(self, exception_type, exception_value, traceback) -> None:
        self.on_crash(self.core.name, exception_value)

    def on_stop(self) -> None:
        self.bus.detach(self.core.name)
