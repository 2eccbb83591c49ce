"""The thread worker: the one worker loop (DESIGN section 2) on a pykka thread.

:class:`Worker` receives every kind of work a worker takes, one at a time in arrival
order, and hands it to the one dispatch (:class:`~actors.workers.core.Serve`): ``Lease``
(rollouts, and evals: a lease of kind ``eval``) through its
:class:`~actors.workers.core.WorkerCore`, ``Commit`` (a new snapshot), ``Cancel``, and
a parallel group's ``Branch`` leases through its branch lane; ``Stop`` ends it. The lane
is the part that calls a group's target; it lives with the groups
(:class:`actors.groups.worker.GroupWorker` is this worker with a lane: its lease box,
its group's host and the work stealing between boxes), which sit above this module, so
a worker here serves rollouts only. The remote worker's slot threads
(:mod:`actors.workers.remote`) call the same dispatch for a worker in another process;
only the transport differs.
"""

from __future__ import annotations

import logging
import threading

import pykka

from actors.addresses import SCHEDULER
from actors.workers.core import Serve, WorkerCore
from bus.base import Bus
from protocol import Hello, Stop
from actors.inbox import Crash, _FastInbox, teller

log = logging.getLogger(__name__)

#: A worker's note to itself: look into its branch lane (leases may have come before
#: its thread ran).
WAKE = object()


class Worker(_FastInbox, pykka.ThreadingActor):
    """One worker thread: ``Lease`` (rollouts and evals), ``Commit``, ``Cancel`` and
    ``Stop``, and ``Branch`` leases when it has a branch lane (:meth:`_drain`, given by
    a subclass above this layer)."""

    #: A daemon thread, as the call pool's (actors/workers/core.py): a worker stuck in a
    #: call (an endpoint that stalls, or keeps answering 429 until the call's retry
    #: deadline) is left behind once the run has stopped (Runtime.close, after
    #: STOP_DEADLINE_S), and must not then keep the process from exiting. pykka's actor
    #: threads are not daemons by default.
    use_daemon_thread = True

    def __init__(self, bus: Bus, core: WorkerCore | None, on_crash: Crash | None,
                 slots: int = 1, name: str = "") -> None:
        super().__init__()
        self.bus = bus
        self.core = core
        self.name = name or (core.name if core is not None else "")
        self.on_crash = on_crash
        self.slots = slots
        self.cancelled: set[str] = set()
        # A crash is let through: on_failure tells the runtime, which stops the run.
        self.serve = Serve(core, self._answer, lambda lease: self._drain(), self.cancelled)

    @classmethod
    def spawn(cls, bus: Bus, core: WorkerCore, on_crash: Crash, slots: int = 1) -> pykka.ActorRef:
        """Start a rollout worker, route its name, and only then say Hello: the
        Scheduler's first lease must find the worker's name routed (see
        ControlActor.spawn)."""
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
        threading.current_thread().name = f"evobus-{self.name}"

    def on_receive(self, message) -> None:
        """The one loop: whatever came, in the order it came."""
        if message is WAKE:
            return self._drain()
        msg = message.msg
        if msg.__class__ is Stop:
            return self._stopped()
        if not self.serve(msg):
            log.warning("%s: unexpected %s", self.name, type(msg).__name__)

    def _answer(self, done) -> None:
        self.bus.send(self.name, SCHEDULER, done)

    def _drain(self) -> None:
        """Run the branch leases waiting in this worker's lane: none here (a worker of
        this layer has no lane; a Branch for it is a routing mistake, said so)."""
        log.warning("%s: a Branch lease, but this worker serves no parallel group", self.name)

    def _stopped(self) -> None:
        self.actor_ref.stop(block=False)   # a tell to itself: nobody waits on it

    def on_failure(self, exception_type, exception_value, traceback) -> None:
        if self.on_crash is not None:
            self.on_crash(self.name, exception_value)

    def on_stop(self) -> None:
        if self.core is not None:
            self.bus.detach(self.name)
            self.core.close()
