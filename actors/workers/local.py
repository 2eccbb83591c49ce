"""The thread worker: a pykka actor around :class:`~actors.workers.core.WorkerCore`.
"""

from __future__ import annotations

import logging
import threading

import pykka

from actors.addresses import SCHEDULER
from actors.workers.core import WorkerCore
from bus.base import Bus, Delivery
from protocol import Cancel, Commit, Hello, Lease, Stop
from actors.inbox import Crash, _FastInbox, teller

log = logging.getLogger(__name__)


class WorkerActor(_FastInbox, pykka.ThreadingActor):
    """A local (thread) worker: one lease at a time, in its own thread."""

    def __init__(self, bus: Bus, core: WorkerCore, on_crash: Crash, slots: int = 1) -> None:
        super().__init__()
        self.bus = bus
        self.core = core
        self.on_crash = on_crash
        self.slots = slots
        self.cancelled: set[str] = set()

    @classmethod
    def spawn(cls, bus: Bus, core: WorkerCore, on_crash: Crash, slots: int = 1) -> pykka.ActorRef:
        """Start the worker, route its name, and only then say Hello: the Scheduler's
        first lease must find the worker's name routed (see ControlActor.spawn)."""
        ref = cls.start(bus, core, on_crash, slots)
        deliver = teller(bus, ref)
        asks = getattr(core.scope, "asks", None)
        if asks is not None:   # answers to its budget asks must not queue behind its lease
            deliver = asks.deliverer(deliver)
        bus.attach(core.name, deliver)
        # Its inbox queues leases in arrival order, so it can hold one more than it runs:
        # the next lease is there when the current one ends (the Scheduler uses that in
        # async mode, where it saves a round trip through the bus per lease).
        bus.send(core.name, SCHEDULER, Hello(worker=core.name, slots=slots, prefetch=1))
        return ref

    def on_start(self) -> None:
        threading.current_thread().name = f"evobus-{self.core.name}"

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
        self.core.close()
