"""Warm branch workers: the threads a runtime's groups run their branches on, kept
between groups.

A group's workers are bus names of that group (``branch-worker.<gid>.<i>``, in its
``GroupStart``, routed to its lease boxes by the driver); what runs them is a thread.
Starting a thread per worker per group (and its socket on the ZeroMQ bus) cost more than
the whole of a small group's work, so a runtime keeps the threads of groups that ended
and the next group *binds* them to its names: the same leases, boxes, messages and log,
on a thread that already runs. A worker thread is bound to one group at a time; a group
inside a branch (whose worker is bound) binds others, or starts new ones.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

import pykka

from actors.groups.host import _Host
from actors.groups.worker import GroupWorker, _LeaseBox, _release, _worker_deliver
from protocol import Branch, BranchDone, Stop

#: Idle threads a runtime keeps; those beyond it stop when their group ends.
MAX_IDLE = 64


#: The box of a worker bound to no group: nothing is ever put in it (a message for a name
#: it is no longer bound to is dropped before its box is looked at).
_IDLE = _LeaseBox()


class _Bind(NamedTuple):
    """Run this group's worker ``name``: its leases arrive in ``box``."""

    name: str
    host: _Host
    collector: str
    on_crash: Any
    box: _LeaseBox
    #: What its answers go out on (the bus, or the group's in-process lane).
    lane: Any = None
    #: A helper (actors.groups.driver._Actors.helpers): it holds no lease and takes the
    #: next branches of the group's leases running here, in input order, while any is
    #: left, then goes back to the pool.
    helps: bool = False


class _Unbind(NamedTuple):
    """The group of worker ``name`` has ended: back to the pool (if still bound to it)."""

    name: str


#: Value types msgpack gives back as they are (exact types: a subclass comes back as its
#: base).
_AS_IS = frozenset({int, float, str, bool, bytes, type(None)})


def _as_is(msg: BranchDone) -> bool:
    """Would decoding this answer give it back as it is? Yes when its values are plain
    scalars and it carries no effects (tuples) nor waiting branches: the rest of it is
    names and lists of indices the worker made."""
    if msg.effects or msg.suspended:
        return False
    for value in msg.values:
        if type(value) not in _AS_IS:
            return False
    return True


class PooledWorker(GroupWorker):
    """A :class:`GroupWorker` whose thread outlives its group: ``Stop`` (or the group's
    end) gives it back to its pool instead of ending it. What arrives for a name it is no
    longer bound to (a ``Stop`` crossing the group's end) is dropped."""

    def __init__(self, bus, pool: "WorkerPool") -> None:
        super().__init__(bus, "", None, "", None, _IDLE)
        self.pool = pool
        self.lane = bus
        self.send_as_is = None

    def on_start(self) -> None:
        # Its thread and ref, kept: each bind and unbind renames the thread.
        self._thread = threading.current_thread()
        self._ref = self.actor_ref
        self._thread.name = "evobus-branch-worker.idle"

    def on_receive(self, message) -> Any:
        if isinstance(message, _Bind):
            return self._bind(message)
        if isinstance(message, _Unbind):
            if message.name == self.name:
                self._unbind()
            return None
        if getattr(message, "receiver", None) != self.name:
            return None   # for a name of a group that ended: nothing to do
        match message.msg:
            case Branch():
                self._drain()
                if self.box.stop:   # marked while it ran (see pooled_deliver)
                    self._unbind()
            case Stop():
                self._unbind()
            case _:
                super().on_receive(message)
        return None

    def _send(self, name: str, msg) -> None:
        # An answer that would decode back as it is goes on the lane as it is (encoded
        # only for the log): the branch's values were checked against the frame limit.
        if self.send_as_is is not None and type(msg) is BranchDone and _as_is(msg):
            self.send_as_is(name, self.collector, msg)
        else:
            self.lane.send(name, self.collector, msg)

    def on_failure(self, exception_type, exception_value, traceback) -> None:
        if self.on_crash is not None:
            self.on_crash(self.name, exception_value)

    def on_stop(self) -> None:
        self.settle.close()
        _release(self.bus)

    def _bind(self, bind: _Bind) -> None:
        self.name, self.host, self.collector = bind.name, bind.host, bind.collector
        self.on_crash, self.box = bind.on_crash, bind.box
        self.lane = bind.lane if bind.lane is not None else self.bus
        self.send_as_is = getattr(self.lane, "send_as_is", None)
        self._thread.name = f"evobus-{bind.name}"
        bind.box.ref = self._ref   # before looking into the box (see _worker_deliver)
        if bind.helps:
            self._help()
            self._unbind()
            return
        self._drain()
        if bind.box.stop:
            self._unbind()

    def _help(self) -> None:
        """Take branches whose turn has come from the leases the group's workers run
        (``_steal``: each answered as its lease's worker would), until none is left. The
        box counts as running meanwhile: a group that ends leaving branches behind tells
        this worker to unbind rather than giving its thread to the next group."""
        box = self.box
        box.running = True
        try:
            while True:
                got = self._steal(None)
                if got:   # None: it ran one; 0: taken meanwhile; else: none to take
                    return
        finally:
            box.running = False

    def _unbind(self) -> None:
        if self.host is None:
            return
        self.pool.give_back(self._ref, self.box)
        self.name, self.host, self.collector, self.on_crash = "", None, "", None
        self.box = _IDLE
        self._thread.name = "evobus-branch-worker.idle"


def pooled_deliver(bus, host: _Host, box: _LeaseBox, name: str, collector: str):
    """The bus side of a pooled worker (:func:`_worker_deliver`), but a ``Stop`` that
    comes while the worker runs its leases (most often the Collector's answer to its own
    last one, delivered on its own thread) is only marked in the box: the worker looks
    there once its box is empty, so nothing is queued to wake it. (It marks ``running``
    false before it looks, and a Stop marks the box before it looks at ``running``: one
    of the two always sees the other.)"""
    inner = _worker_deliver(bus, host, box, name, collector)

    def deliver(delivery) -> None:
        if type(delivery.msg) is Stop:
            box.stop = True
            if box.running:
                return
        inner(delivery)

    return deliver


class WorkerPool:
    """The idle worker threads of one runtime."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.lock = threading.Lock()
        self.idle: list[pykka.ActorRef] = []

    def bind(self, binds: list[_Bind]) -> list[pykka.ActorRef]:
        """A thread for each of these workers: idle ones first, new ones for the rest."""
        with self.lock:
            k = min(len(binds), len(self.idle))
            refs = self.idle[len(self.idle) - k:]
            del self.idle[len(self.idle) - k:]
        bound = []
        for i, bind in enumerate(binds):
            ref = refs[i] if i < k else None
            if ref is not None:
                try:
                    ref.tell(bind)   # a dead one (a crash stopped it) raises: replaced
                    bound.append(ref)
                    continue
                except pykka.ActorDeadError:
                    pass
            ref = self.runtime.start_actor(PooledWorker, self.runtime.bus, self)
            ref.tell(bind)
            bound.append(ref)
        return bound

    def give_back(self, ref: pykka.ActorRef, box: _LeaseBox) -> None:
        """The worker that ran ``box``'s leases is free (once per box: the worker itself
        on ``Stop``, or the driver at the group's end, whichever comes first)."""
        with self.lock:
            if box.returned:
                return
            box.returned = True
            if len(self.idle) < MAX_IDLE:
                self.idle.append(ref)
                return
        ref.stop(block=False)

    def release(self, refs: list[pykka.ActorRef], boxes: list[_LeaseBox],
                left_behind: bool) -> None:
        """The group has ended: its workers go back. Every lease has answered, so a
        worker still in its loop only has an empty box to look into: the next group's
        bind waits in its mailbox behind that. With ``left_behind`` (a branch abandoned
        at the cancel deadline, or a crash), one still running goes back itself once its
        branch returns."""
        for ref, box in zip(refs, boxes):
            if box.returned:   # its worker went back on Stop (give_back checks again)
                continue
            if not (left_behind and box.running):
                self.give_back(ref, box)
                continue
            try:
                ref.tell(_Unbind(box.owner))
            except pykka.ActorDeadError:
                pass


_pools: "weakref.WeakKeyDictionary[Any, WorkerPool]" = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def pool_of(runtime) -> WorkerPool:
    """The worker pool of ``runtime`` (made at first use)."""
    with _pools_lock:
        pool = _pools.get(runtime)
        if pool is None:
            pool = _pools[runtime] = WorkerPool(runtime)
        return pool
