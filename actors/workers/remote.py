"""A worker in another process: ``evobus worker --connect tcp://HOST:PORT`` (or a
process worker the coordinator spawned). The edge where nondeterminism lives, now on
another machine; everything it does still arrives as messages.

1. Connect (one DEALER, CURVE keys if given) and register the worker's name.
2. ``Join`` -> the registry answers with the run's :class:`~protocol.Spec`.
3. Resolve the spec: every module it names is checked against the allowlist
   (``--allow``, plus evobus's own artifact strategies) **before** anything is imported;
   environment variables it names must be set here (their values never travel); the
   tasks must match the coordinator's digest and the code its fingerprint. Otherwise the
   worker says why (``Refused``) and exits with status 2.
4. ``Hello`` (worker id, slots, package version, code fingerprint, heartbeat), then take
   leases on ``slots`` threads, each with its own snapshot of the artifact, while the
   endpoint's I/O thread sends ``Heartbeat`` whenever the worker has sent the scheduler
   nothing (an answer, a hello) for ``spec.heartbeat`` seconds, so a long rollout is
   never mistaken for death and a busy worker's answers are its heartbeats. Each slot
   thread is one loop for every kind of work, in arrival order, through the one dispatch
   a thread worker uses too (:class:`~actors.workers.core.Serve`): ``Lease`` (rollouts
   and evals) through :class:`~actors.workers.core.WorkerCore`, and, when the worker was
   built with ``branches=`` (``evobus worker`` and group process workers are), a
   parallel group's ``Branch`` leases through that service
   (:mod:`actors.groups.served`, which sits above this module and is handed in).
5. Losing the broker: the endpoint reconnects with backoff (Paranoid Pirate) and the
   worker joins again, listing the leases it still holds. ``Stop`` ends the process
   (status 0); no word from the broker for ``give_up`` seconds ends it with status 1.

No pickle anywhere: code is named by import path, everything else is msgspec data.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from actors.workers import code as refs
from actors.addresses import SCHEDULER
from actors.workers.code import BUILTIN_ALLOW, combined_fingerprint, module_of, module_fingerprint
from actors.addresses import REGISTRY
from actors.workers.code import spec_refs, task_digest
from actors.errors import ConfigError
from actors.workers.core import MAX_CALL_CONCURRENCY, Awaiter, Serve, WorkerCore, crashed
from actors.workers.scope import AskedRun, BudgetAsks
from bus.base import Delivery
from bus.remote import RemoteEndpoint
from bus.security import ClientKeys
from protocol import (Branch, CallsGranted, Cancel, Commit, GroupOpen, Heartbeat, Hello, Hold,
                      HostReply, Join, Lease, LeaseDone, Refused, Revoke, Spec, Stop, Task)
from actors.version import PACKAGE_VERSION

log = logging.getLogger(__name__)

#: Exit statuses of the worker process.
EXIT_STOPPED, EXIT_LOST, EXIT_REFUSED = 0, 1, 2
#: A Join not answered with a Spec this soon is sent again (the registry may not have
#: been listening yet, or the frame was lost with a connection).
JOIN_RETRY_S = 1.0
#: The endpoint pings a line quiet this long (seconds); the broker timeout must exceed it.
PING_S = 1.0
#: A connection made after this long says how long it took (seconds).
WAIT_WORTH_SAYING_S = 1.0
#: How long a leaving worker waits for the calls its slots are in the middle of: a request
#: cut off mid-flight may still be billed, and its usage would never be reported. What is
#: queued behind them is dropped (the coordinator re-dispatches or no longer needs it).
STOP_DRAIN_S = 3.0


def default_worker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def package_version() -> str:

    return PACKAGE_VERSION


@dataclass
class Resolved:
    """A spec made runnable on this worker."""

    tasks: dict[str, Task]
    reward: Callable
    run: Callable
    propose: Callable | None
    strategy: Any
    fingerprint: str


def resolve_spec(spec: Spec, allow: list[str]) -> Resolved:
    """Check the allowlist for every module first, then the environment, then import.
    A spec without a reward is a session of parallel groups only: nothing to resolve
    (each group names its target in its ``GroupOpen``)."""
    allowlist = sorted(set(allow) | set(BUILTIN_ALLOW))
    named = spec_refs(spec)
    for what, ref in named:
        module = module_of(ref)
        if not refs.allowed(module, allowlist):
            raise ConfigError(f"{what}: module {module!r} is not in this worker's allowlist "
                              f"{allowlist}; if you trust the coordinator's code, start the "
                              f"worker with --allow {module.split('.')[0]}")
    missing = [name for name in spec.env if name not in os.environ]
    if missing:
        raise ConfigError(f"environment variable(s) {missing} are not set on this worker; "
                          "export them here (the coordinator sends names, never values)")
    fingerprints = {m: module_fingerprint(m) for m in spec.fingerprints}
    differ = sorted(m for m, fp in fingerprints.items() if fp != spec.fingerprints[m])
    if differ:
        raise ConfigError(f"this worker's copy of {differ} differs from the coordinator's "
                          "(source fingerprints do not match): install the same version here")
    if spec.reward is None:
        return Resolved(tasks={}, reward=None, run=None, propose=None, strategy=None,
                        fingerprint=combined_fingerprint(fingerprints))
    if spec.tasks is not None:
        tasks = refs.resolve(spec.tasks, allowlist, what="tasks")
        tasks = list(tasks() if callable(tasks) else tasks)
    else:
        tasks = list(spec.inline_tasks)
    if task_digest(tasks) != spec.task_digest:
        raise ConfigError("the tasks resolved here differ from the coordinator's (digest "
                          "mismatch): install the same version of the tasks module")
    reward = refs.resolve(spec.reward, allowlist, what="reward")
    if spec.agent is not None:
        agent = refs.resolve(spec.agent, allowlist, what="agent")
        run, propose = agent.solve, agent.propose
    else:
        run = refs.resolve(spec.run, allowlist, what="run")
        propose = refs.resolve(spec.propose, allowlist, what="propose")
    strategy = refs.resolve(spec.strategy, allowlist, what="strategy")
    return Resolved(tasks={t.id: t for t in tasks}, reward=reward, run=run, propose=propose,
                    strategy=strategy, fingerprint=combined_fingerprint(fingerprints))


class RemoteWorker:
    """One worker process's logic around a :class:`~bus.remote.RemoteEndpoint`."""

    def __init__(self, connect: str, *, worker_id: str | None = None, slots: int = 1,
                 allow: list[str] | tuple[str, ...] = (), keys: ClientKeys | None = None,
                 broker_timeout: float = 5.0, give_up: float = 60.0, ctx=None,
                 say: Callable[[str], None] | None = None,
                 branches: Callable[..., Any] | None = None) -> None:
        if slots < 1:
            raise ConfigError(f"--slots must be >= 1, got {slots}")
        self.connect = connect
        self.name = worker_id or default_worker_id()
        self.slots = slots
        self.allow = list(allow)
        self.keys = keys
        self.broker_timeout = broker_timeout
        self.give_up = give_up
        self.ctx = ctx  # a zmq.Context to share (many workers in one process), or None
        self.ep: RemoteEndpoint | None = None
        self.spec: Spec | None = None
        self.resolved: Resolved | None = None
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.done = threading.Event()
        self.stop_reason = ""
        self.lock = threading.Lock()
        self.held: set[str] = set()
        self.cancelled: set[str] = set()
        self.slot_queues: list[queue.SimpleQueue] = []
        self.slot_load: list[int] = []
        self.threads: list[threading.Thread] = []
        self.asks: BudgetAsks | None = None   # the run's budget, asked by message
        self.leases_done = 0
        self.awaiting_spec = False  # a Join is out: the next Spec is answered with Hello
        self.joined_at = 0.0
        # `evobus worker` prints these: connected, what it runs, how it ended.
        self.say: Callable[[str], None] = say or (lambda text: None)
        #: Parallel groups' branches (actors.groups.served.BranchService), when the
        #: worker serves them too: built with (name, allow, send) once connected.
        self.branch_service = branches
        self.branches = None
        self.started = time.monotonic()   # run() begins trying to reach the broker

    # -- the main thread ----------------------------------------------------------------------

    def run(self) -> int:
        """Serve until Stop (0), a lost or never reached broker (1) or a refused spec (2);
        ``stop_reason`` says why it ended (the caller reports it)."""
        self.started = time.monotonic()
        # Said before the first attempt, not once it failed: a silent terminal reads as a
        # hang. Each new connection while none answered says so again (_on_reconnect).
        self.say(f"waiting for the broker at {self.connect} (a new connection after each "
                 f"{self.broker_timeout:g} s of silence, --broker-timeout; giving up after "
                 f"{self.give_up:g} s without an answer, --give-up) ...")
        self.ep = RemoteEndpoint(self.connect, keys=self.keys, ping_interval=PING_S,
                                 broker_timeout=self.broker_timeout,
                                 on_reconnect=self._on_reconnect, name=self.name,
                                 ctx=self.ctx)
        try:
            try:
                self.ep.attach(self.name, self._on_delivery, timeout=self.give_up)
            except ConnectionRefusedError as exc:  # e.g. --id names a coordinator actor
                self.stop_reason = f"{exc}; start the worker with another --id"
                log.error("worker %s: %s", self.name, self.stop_reason)
                return EXIT_REFUSED
            except TimeoutError as exc:   # the caller says it (stop_reason), once
                self.stop_reason = str(exc) if self.ep.auth_error else self._unreachable()
                log.info("worker %s: %s", self.name, self.stop_reason)
                return EXIT_LOST
            if self.branch_service is not None:
                self.branches = self.branch_service(
                    self.name, self.allow,
                    lambda receiver, msg: self.ep.send(self.name, receiver, msg))
            log.info("worker %s: connected to %s", self.name, self.connect)
            waited = time.monotonic() - self.started
            after = f" after {waited:.1f} s" if waited >= WAIT_WORTH_SAYING_S else ""
            self.say(f"connected to {self.connect}{after}; waiting for the run's spec")
            self._join()
            return self._serve()
        finally:
            self._leave()
            self._drain_slots()
            # Last answers get a second to leave; to a broker never reached nothing can.
            self.ep.close(flush=1.0 if self.reached else 0.0)

    def _serve(self) -> int:
        while True:
            # Sleep until the next thing to check: the join's retry, or the broker's
            # silence reaching give_up (a message wakes it at once).
            now = time.monotonic()
            due = self.ep.last_frame + self.give_up
            if self.awaiting_spec:
                due = min(due, self.joined_at + JOIN_RETRY_S)
            try:
                item = self.inbox.get(timeout=min(max(0.0, due - now) + 0.01, 30.0))
            except queue.Empty:
                if self.awaiting_spec and time.monotonic() - self.joined_at > JOIN_RETRY_S:
                    self._join()
                if time.monotonic() - self.ep.last_frame > self.give_up:
                    self.stop_reason = f"no word from the broker for {self.give_up:g} s"
                    log.info("worker %s: no word from the broker at %s for %.0f s; giving up",
                             self.name, self.connect, self.give_up)   # the caller says it
                    return EXIT_LOST
                continue
            match item:
                case Spec() as spec:
                    code = self._on_spec(spec)
                    if code is not None:
                        return code
                case Stop(reason=reason):
                    self.stop_reason = reason
                    self.say(f"stopped by the coordinator ({reason or 'no reason given'}) "
                             f"after {self.leases_done} lease(s)")
                    log.info("worker %s: stopped (%s) after %d lease(s)", self.name,
                             reason or "no reason given", self.leases_done)
                    return EXIT_STOPPED
                case Refused(reason=reason):
                    self.stop_reason = reason
                    log.error("worker %s: the coordinator refused it: %s", self.name, reason)
                    return EXIT_REFUSED

    def _join(self) -> None:
        self.awaiting_spec = True
        self.joined_at = time.monotonic()
        self.ep.send(self.name, REGISTRY, Join(worker=self.name, slots=self.slots,
                                               package_version=package_version()))

    def _on_spec(self, spec: Spec) -> int | None:
        if not self.awaiting_spec:
            return None  # the answer to a repeated Join: already registered
        self.awaiting_spec = False
        if self.resolved is None or spec.run_id != self.spec.run_id:
            try:
                self.resolved = resolve_spec(spec, self.allow)
            except ConfigError as exc:
                log.error("worker %s: refusing the run's spec: %s", self.name, exc)
                self.ep.send(self.name, REGISTRY, Refused(worker=self.name, reason=str(exc)))
                return EXIT_REFUSED
            self.spec = spec
            self.say(f"running {_what_runs(spec)} (run {spec.run_id or '-'}, "
                     f"{len(self.resolved.tasks)} tasks, {self.slots} slot(s))")
            self._start_threads()
            self.ep.ping_interval = min(self.ep.ping_interval, spec.heartbeat)
            # Heartbeats from the I/O thread, on a quiet line only (bus/remote.py): to
            # the Scheduler, or to a group session's relay, while leases or branches run.
            self.ep.keepalive(self.name, spec.heartbeat_to or SCHEDULER,
                              Heartbeat(worker=self.name), spec.heartbeat)
        self._hello()
        return None

    def _hello(self) -> None:
        with self.lock:
            held = sorted(self.held)
        self.ep.send(self.name, REGISTRY, Hello(
            worker=self.name, slots=self.slots, package_version=package_version(),
            fingerprint=self.resolved.fingerprint, heartbeat=self.spec.heartbeat, leases=held))

    def _start_threads(self) -> None:
        for q in self.slot_queues:  # a new run: retire the previous slots
            q.put(None)
        r, spec = self.resolved, self.spec
        self.slot_queues, self.slot_load = [], []
        # Groups started inside a call are part of the run (actors.workers.scope).
        self.asks = BudgetAsks(self.name, lambda m: self.ep.send(self.name, SCHEDULER, m)) \
            if spec.ask_budget else None
        for i in range(self.slots):
            core = WorkerCore(self.name, r.tasks, r.reward, r.run, r.propose, r.strategy,
                              solved=spec.solved, initial_state=dict(spec.initial_state),
                              scope=AskedRun(spec.run_id, self.asks),
                              call_concurrency=max(1, min(spec.call_concurrency,
                                                          MAX_CALL_CONCURRENCY))) \
                if r.strategy is not None else None   # a session of groups: no rollouts
            q: queue.SimpleQueue = queue.SimpleQueue()
            self.slot_queues.append(q)
            self.slot_load.append(0)
            t = threading.Thread(target=self._slot, args=(i, core, q),
                                 name=f"evobus-{self.name}-slot{i}", daemon=True)
            t.start()
            self.threads.append(t)

    # -- the slot threads ------------------------------------------------------------------------

    def _leave(self) -> None:
        """The worker's end: nothing more starts. Queued work is dropped, and so is what
        the leases held have not begun: each is cancelled, so a lease stops before its
        next task and a lease's calls still queued on its call pool never start (they
        would run after the worker left, keeping the process alive to make calls no one
        counts). The calls in the middle of being made end on their own (_drain_slots)."""
        self.done.set()
        with self.lock:
            self.cancelled.update(self.held)
        self._release_slots()

    def _release_slots(self) -> None:
        """Idle slot threads wait on their queue (no polling): the worker's end wakes them."""
        for q in self.slot_queues:
            q.put(None)

    def _drain_slots(self) -> None:
        deadline = time.monotonic() + STOP_DRAIN_S
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self.threads):
            log.warning("worker %s: a slot was still in a call %.0f s after the worker "
                        "stopped; leaving it behind", self.name, STOP_DRAIN_S)

    def _slot(self, index: int, core: WorkerCore | None, q: queue.SimpleQueue) -> None:
        """One slot's loop: every kind of work, one at a time, in the order it came, through
        the one dispatch (:class:`~actors.workers.core.Serve`) a thread worker uses too;
        what is this loop's own is the transport (the endpoint) and which slot holds what."""
        own = Awaiter() if core is None else None   # a session of groups: no core
        branches = self.branches
        serve = Serve(core, self._answer,
                      (lambda lease: branches.run(lease, own or core.settle))
                      if branches is not None else None,
                      self.cancelled, crash=lambda lease, exc: crashed(self.name, lease, exc))
        try:
            while not self.done.is_set():
                item = q.get()  # None (a new run, or the worker's end) releases it
                if item is None or self.done.is_set():   # leaving: queued work is dropped
                    return
                self._serve_one(index, serve, item)
        finally:
            (own or core).close()

    def _serve_one(self, index: int, serve: Serve, item) -> None:
        held = isinstance(item, (Lease, Branch))   # put here by _to_slot, counted there
        try:
            if not serve(item):
                log.warning("worker %s: a %s this worker does not serve (no %s); dropped",
                            self.name, type(item).__name__,
                            "rollout code" if isinstance(item, (Lease, Commit))
                            else "branch service")
            elif held:
                self.leases_done += 1
        finally:
            if held:
                with self.lock:
                    self.held.discard(item.lease_id)
                    self.slot_load[index] -= 1

    def _answer(self, done: LeaseDone) -> None:
        self.ep.send(self.name, SCHEDULER, done)

    # -- the I/O thread (deliveries must not block) -------------------------------------

    def _on_delivery(self, delivery: Delivery) -> None:
        branches = self.branches
        match delivery.msg:
            case Branch() as lease if branches is not None:
                if branches.queued(lease):
                    self._to_slot(lease)
            case GroupOpen() as msg if branches is not None:
                branches.on_open(msg)
            case (HostReply() | Revoke() | Hold() | Cancel()) as msg \
                    if branches is not None and branches.on_message(msg):
                pass
            case Lease() as lease:
                self._to_slot(lease)
            case Commit() as commit:
                for q in self.slot_queues:
                    q.put(commit)
            case Cancel(lease_id=lease_id):
                self.cancelled.add(lease_id)
            case CallsGranted() as granted if self.asks is not None:
                self.asks.answer(granted)
            case Spec() | Stop() | Refused():
                self.inbox.put(delivery.msg)
            case other:
                log.warning("worker %s: unexpected %s from %s", self.name,
                            type(other).__name__, delivery.sender)

    def _to_slot(self, lease: Lease | Branch) -> None:
        """The least loaded slot takes it (checked: the slots exist)."""
        with self.lock:
            if not self.slot_queues:
                log.warning("worker %s: a lease before the spec; dropped (the "
                            "scheduler re-dispatches it)", self.name)
                return
            index = min(range(len(self.slot_load)), key=self.slot_load.__getitem__)
            self.slot_load[index] += 1
            self.held.add(lease.lease_id)
        self.slot_queues[index].put(lease)

    @property
    def reached(self) -> bool:
        """Whether the broker ever answered this worker (else it was never connected)."""
        return self.ep is not None and self.ep.heard.is_set()

    def _on_reconnect(self) -> None:
        if not self.reached:   # never connected: not a reconnect; attach() still waits
            waited = time.monotonic() - self.started
            self.say(f"no broker at {self.connect} yet after {waited:.0f} s "
                     f"({self._transport()}); still trying, until {self.give_up:g} s have "
                     "passed (--give-up)")
            return
        # A new connection: the broker (maybe a restarted one) must hear from us again;
        # the registry answers with the spec and we say hello listing what we hold.
        log.warning("worker %s: reconnected to %s; joining again", self.name, self.connect)
        self._join()

    def _transport(self) -> str:
        """What the transport saw of a broker that never answered."""
        ep = self.ep
        if ep.transport_connected:
            return "a connection was made there, but no evobus broker answered on it"
        if ep.connect_failures:
            return (f"{ep.connect_failures} connection attempt(s) refused: nothing listens "
                    "there")
        return "no connection could be made yet"

    def _unreachable(self) -> str:
        """Why a worker that never heard from its broker gives up, and the fix."""
        tried = f"for {time.monotonic() - self.started:.0f} s"
        if self.ep.transport_connected:
            fix = ("check that --connect names the coordinator's [workers] bind address "
                   "and not another service's, and that --key/--server-key are the keys "
                   "its `evobus keys` wrote (a CURVE broker answers no plain peer)")
        else:
            fix = (f"start the coordinator first (`evobus run SCENARIO` with [workers] "
                   f"remote = N and bind = \"{self.connect}\"), and check that --connect "
                   "names its host and port")
        return (f"cannot reach the broker at {self.connect}: {self._transport()} ({tried}); "
                f"fix: {fix}, or wait longer with --give-up S (it was {self.give_up:g} s)")


def _what_runs(spec: Spec) -> str:
    if spec.reward is None:
        return "parallel groups' branches"
    if spec.agent is not None:
        return f"agent {spec.agent.ref}"
    return f"run {spec.run.ref if spec.run else '-'} + propose " \
           f"{spec.propose.ref if spec.propose else '-'}"


def process_main(*, address: str, worker_id: str, allow: list[str],
                 broker_timeout: float = 5.0, branches: Callable[..., Any] | None = None
                 ) -> None:
    """Entry point of a process worker (multiprocessing 'spawn' target)."""
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(levelname)s {worker_id} %(name)s: %(message)s")
    worker = RemoteWorker(address, worker_id=worker_id, allow=allow,
                          broker_timeout=broker_timeout, give_up=max(30.0, 6 * broker_timeout),
                          branches=branches)
    code = worker.run()
    if code == EXIT_LOST:   # RemoteWorker leaves saying why to its caller
        log.error("worker %s: %s", worker_id, worker.stop_reason)
    sys.exit(code)
