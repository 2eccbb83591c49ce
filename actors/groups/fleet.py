"""A group's workers in other processes: process workers and ``evobus worker --connect``
(docs/remote.md, "Parallel groups on remote workers").

The coordinator's half. A group with ``workers=Workers(processes=..., remote=...)``
starts its own runtime with the peer ports, answers each worker's ``Join`` with a spec
that names no rollout code (``Spec.reward`` is None: a session of groups), checks its
``Hello`` (same package, same code), and opens the group on it (``GroupOpen``: the
target by import path, checked there against the worker's allowlist before import).

The Collector sees one logical worker per remote slot: a *proxy* name attached here,
bound to one worker. The relay (actor ``groups``) carries a proxy's ``Branch``,
``Revoke``, ``Cancel`` and ``Hold`` to its worker, and the worker's answers back to the
Collector as that proxy; a worker's heartbeat (or any message from it, at most once per
heartbeat) becomes a ``Heartbeat`` of each of its proxies. Liveness is the Collector's
(the one lease table, GroupStart.deadline): a proxy silent past the deadline, or reported
``Lost`` here (its process exited), has its leases re-dispatched to other proxies under
the same lease id, the first answer wins and a later one is dropped and counted. A
worker that joins mid-group (a respawned process, a reconnect under a new name) takes
over the proxies of a worker gone for good, and its heartbeat brings them back.
Calls a branch makes to what stays in one place (the store and its lock, the budget
ledger, the effect journal) arrive as ``HostCall`` and are answered from the group's
host here.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import msgspec

from actors.addresses import REGISTRY
from actors.errors import ConfigError, EffectInDoubt, RunFailed
from actors.groups.host import _ambient
from actors.groups.limits import Budgets, HostLimits
from actors.groups.served import process_main
from actors.groups.store import StoreSteps
from actors.groups.types import type_name, type_named
from actors.workers import code as refs
from actors.machines.registry import Registry
from actors.runtime.pools import (ProcessPool, all_in_text, joined_text, origin_of,
                                  waiting_text, workers_problems)
from actors.runtime.runtime import Runtime, make_log_directory
from actors.version import PACKAGE_VERSION
from actors.workers.code import (code_ref, combined_fingerprint, module_fingerprint,
                                 module_of)
from bus.base import Delivery
from bus.remote import PeerPort
from bus.security import load_server_keys
from protocol import (Branch, BranchDone, BranchFailed, Cancel, GroupCancel, GroupOpen,
                      GroupOpened, Heartbeat, Hello, HostCall, HostReply, Interaction, Join,
                      Lost, Ref, Refused, Spec, Stop)
from protocol.scenario import Workers

log = logging.getLogger(__name__)

#: The relay's bus name: where workers in other processes answer a group's leases.
RELAY = "groups"

#: What a worker in another process may send, and to whom, in a session of groups: its
#: join, hello and refusal to the registry; answers, heartbeats, the group's opening and
#: calls to the relay (which checks that the sender holds what it answers). Never a
#: control message, nor anything to a Collector directly.
GROUP_ROLE = {RELAY: (BranchDone, BranchFailed, Interaction, Heartbeat, GroupOpened,
                      HostCall),
              REGISTRY: (Join, Hello, Refused)}

_ANSWERS = (BranchDone, BranchFailed, Interaction)

#: How long a worker may take to answer ``GroupOpen`` (its import of the target).
OPEN_DEADLINE_S = 30.0

#: Nested groups the coordinator runs at once for branches on workers elsewhere, per
#: remote slot: a branch starts one at a time; a branch run again after its worker was
#: lost may start its own while the lost copy's still runs.
NESTED_PER_SLOT = 4
#: How long a branch elsewhere waits here for its turn to start, in input order, before
#: it is told "not now" (Fleet._turn), and how many such waits run at once per remote
#: slot (one branch starts at a time per slot; a lost worker's copy may still wait).
ORDER_WAIT_S = 1.0
TURNS_PER_SLOT = 2

#: Process workers get this long to leave after the group's Stop.
PROCESS_STOP_DEADLINE_S = 5.0


def elsewhere(workers) -> bool:
    """Does this ``workers`` section put anyone in another process?"""
    return workers is not None and bool(workers.processes or workers.remote)


def check_workers(workers, fn, ref, *, where: str = "workers") -> None:
    """Refusals made before the first call: a section that is not Workers, a target that
    cannot be named by import path, a section that cannot work (bind, keys, deadline)."""
    if not isinstance(workers, Workers):
        raise ConfigError(f"{where} must be actors.Workers(local=, processes=, remote=, ...) "
                          f"(as evolve() takes it), got {type(workers).__name__}")
    if not elsewhere(workers):
        return
    if ref is None:
        code_ref(fn, "target")   # raises, naming why it cannot be named and the fix
    problems = workers_problems(workers)
    if problems:
        raise ConfigError(problems[0][1])


def start_fleet(plan) -> "Fleet | None":
    """The fleet of a group whose ``workers=`` puts anyone in another process, connected
    (every expected worker registered), or None: every branch runs on a thread here.
    Refused by name before the first call: a target that cannot be named by import path,
    a group nested in a branch or started inside an evolve() run, ``runtime=``."""
    workers = plan.options.get("workers")
    if workers is None:
        return None
    check_workers(workers, plan.fn, plan.ref)
    if not elsewhere(workers):
        return None
    opts = plan.options
    where = ("inside a branch (a nested group runs on its parent's runtime)"
             if plan.parent is not None else
             "inside an evolve() run's call (it runs on the run's runtime)"
             if plan.call is not None else
             "with runtime= (the group starts its own, with the workers' ports)"
             if opts.get("runtime") is not None else
             "with bus='memory' (workers in other processes need bus='zmq')"
             if opts.get("bus", "zmq") != "zmq" else None)
    if where is not None:
        raise ConfigError(f"workers= with processes or remote workers cannot be used {where}; "
                          "start the group at top level, or use thread workers "
                          "(workers=Workers(local=N))")
    ref = plan.ref if plan.ref is not None else code_ref(plan.fn, "target")
    if opts.get("log"):
        make_log_directory(opts["log"], "log")
    fleet = Fleet(workers, gid=plan.group_id, log_path=opts.get("log"),
                  log_overwrite=bool(opts.get("log_overwrite")), allow=[module_of(ref)])
    try:
        fleet.connect()
    except BaseException:
        fleet.runtime.close()
        raise
    plan.ref = ref
    return fleet


class MemoryEffects:
    """The effect journal of a group without a checkpoint (EffectLog's interface, kept
    in memory here): a branch run again on another worker gets a finished effect's
    result back instead of running it twice, and so do the branches of a group nested
    in it (each under its ``scope``, as in EffectLog)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[tuple[str, int, int], tuple[str, str, Any]] = {}

    def replayed(self, branch: int, step: int, name: str, scope: str = ""
                 ) -> tuple[bool, Any]:
        with self.lock:
            rec = self.records.get((scope, branch, step))
        if rec is None or rec[1] != name or rec[0] == "failed":
            return False, None
        if rec[0] == "result":
            return True, rec[2]
        where = f" of the nested group at {scope!r}" if scope else ""
        raise EffectInDoubt(
            f"branch {branch}{where}: effect {name!r} (step {step}) started on worker "
            f"{rec[2]}, which was lost before its result came back, so it may or may not "
            "have run; it is not run a second time. Check its outcome by hand; this "
            "branch fails")

    def intent(self, branch: int, step: int, name: str, scope: str = "",
               worker: str = "") -> None:
        with self.lock:
            self.records[(scope, branch, step)] = ("intent", name,
                                                   worker or "(a thread of the coordinator)")

    def result(self, branch: int, step: int, name: str, value: Any, scope: str = "") -> None:
        with self.lock:
            self.records[(scope, branch, step)] = ("result", name, value)

    def failed(self, branch: int, step: int, name: str, scope: str = "") -> None:
        with self.lock:
            self.records[(scope, branch, step)] = ("failed", name, None)

    def close(self) -> None:
        """Nothing to close (EffectLog's interface: the driver closes a group's log)."""


@dataclasses.dataclass
class _Peer:
    """A worker in another process, as the relay sees it."""

    name: str
    slots: int
    last_heard: float
    alive: bool = True
    opened: bool = False          # it answered the current group's GroupOpen
    proxies: list = dataclasses.field(default_factory=list)   # the proxies bound to it
    forwarded: float = 0.0        # when its proxies' last heartbeat went to the Collector


class Fleet:
    """One group's workers in other processes, its relay and its proxies."""

    def __init__(self, workers: Workers, *, gid: str, log_path: str | None = None,
                 log_overwrite: bool = False, allow: list[str] = ()) -> None:
        self.workers = workers
        self.gid = gid
        self.heartbeat = workers.heartbeat
        self.deadline = workers.deadline
        # No rollout code: each group names its target in its GroupOpen.
        self.spec = Spec(run_id=gid, package_version=PACKAGE_VERSION,
                         heartbeat=workers.heartbeat, heartbeat_to=RELAY,
                         fingerprint=combined_fingerprint({}))
        self.registry = Registry(self.spec)
        self.lock = threading.Lock()
        self.peers: dict[str, _Peer] = {}
        self.events: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.bound: dict[str, str] = {}     # proxy -> the worker it stands for
        #: (lease id, worker) -> its proxy and the lease's branches
        self.sent: dict[tuple[str, str], tuple[str, list[int]]] = {}
        #: Branches held by workers elsewhere (running, or queued there) when the group
        #: last stopped (a crash), from its checkpoint's effect log: branch -> worker.
        self.held_before: dict[int, str] = {}
        self.nesting = 0   # nested groups running for branches on workers elsewhere
        self.turns = 0     # branches elsewhere waiting here for their turn (_turn)
        self.host = None
        self.effects = None
        self.open_msg: GroupOpen | None = None
        self.collector = ""
        self.proxies: list[str] = []
        self.late = 0
        self.finished = 0   # branches finished on these workers (the progress display)
        self.served: dict[str, int] = {}   # worker -> branches it finished
        self.lost_workers = 0
        self.refused: dict[str, str] = {}
        self.failed_open: dict[str, str] = {}
        self.pool: ProcessPool | None = None
        self.tmpdir: str | None = None
        self._stop = threading.Event()
        self.ports = self._ports()
        meta = {"scenario": "parallel-group", "run_id": gid}
        self.runtime = Runtime(bus="zmq", log_path=log_path, log_meta=meta,
                               log_overwrite=log_overwrite, peers=self.ports)
        self.bus = self.runtime.bus
        self.runtime.own(self.close)
        self.bus.attach(RELAY, self._on_relay)
        self.bus.attach(REGISTRY, self._on_registry)
        self.allow = sorted(set(allow) | set(workers.allow))
        self._watch = threading.Thread(target=self._liveness, name=f"evobus-fleet-{gid}",
                                       daemon=True)

    # -- setting up ---------------------------------------------------------------------

    def _ports(self) -> list[PeerPort]:
        w, ports = self.workers, []
        if w.remote:
            try:
                keys = load_server_keys(w.keys) if w.keys else None
                ports.append(PeerPort([w.bind], keys=keys, insecure=w.insecure,
                                      allowed=GROUP_ROLE, label="remote"))
            except ValueError as exc:
                raise ConfigError(f"workers: {exc}") from None
        if w.processes:
            if sys.platform == "win32":
                addr = "tcp://127.0.0.1:*"
            else:
                self.tmpdir = tempfile.mkdtemp(prefix="evobus-group-")
                addr = f"ipc://{self.tmpdir}/workers.sock"
            ports.append(PeerPort([addr], allowed=GROUP_ROLE, label="process"))
        return ports

    def connect(self) -> None:
        """Start the process workers and wait (``wait_seconds``) for every expected one."""
        w = self.workers
        if w.processes:
            self.pool = ProcessPool(w.processes, self.ports[-1].addresses[0],
                                    allow=self.allow, broker_timeout=max(5.0, 5 * self.heartbeat),
                                    main=process_main)
            self.pool.start()
        self._watch.start()
        expected = w.processes + w.remote
        begun, said = time.monotonic(), set()
        end = begun + w.wait_seconds
        if w.remote:   # said as the wait begins, as a run's does, not only once it ran out
            log.warning(waiting_text(w.wait_seconds, w.remote, w.bind, self._start_command()))
        while True:
            # Every Hello is said, in the order taken, counted as said: a worker that
            # joined while the one before was being said is in _joined() already, and
            # its Hello still waits in the queue once the count is reached.
            waiting = self._joined() < expected
            left = end - time.monotonic()
            if waiting and (left <= 0 or (self.pool is not None and self.pool.exited())):
                raise ConfigError(self._missing(expected))
            try:
                event = (self.events.get(timeout=min(left, 0.1)) if waiting
                         else self.events.get_nowait())
            except queue.Empty:
                if waiting:
                    continue
                break
            if isinstance(event, Hello) and w.remote and event.worker not in said:
                said.add(event.worker)   # who joined, from where, as a run's wait says
                log.info(joined_text(event, origin_of(self.ports, event.worker),
                                     len(said), expected, left))
        if w.remote:
            log.info(all_in_text(expected, time.monotonic() - begun, "group"))

    def _start_command(self) -> str:
        """The `evobus worker` command a remote worker of this group is started with."""
        return (f"evobus worker --connect {self.workers.bind} "
                f"--allow {self.allow[0] if self.allow else 'PKG'}")

    def _joined(self) -> int:
        with self.lock:
            return sum(1 for p in self.peers.values() if p.alive)

    def _missing(self, expected: int) -> str:
        with self.lock:
            have = sorted(self.peers)
        text = (f"expected {expected} worker(s) in other processes within "
                f"{self.workers.wait_seconds:g} s (wait_seconds), {len(have)} registered"
                + (f" ({', '.join(have)})" if have else ""))
        if self.workers.remote:
            text += f"; start each missing one with `{self._start_command()}`"
        if self.pool is not None and self.pool.exited():
            text += f"; process workers exited: {self.pool.exited()} (see their stderr)"
        for worker, why in sorted(self.refused.items()):
            text += f"; worker {worker} refused: {why}"
        return text

    def slot_count(self) -> int:
        with self.lock:
            return sum(p.slots for p in self.peers.values() if p.alive)

    def open(self, *, host, target_ref, wants_ctx: bool, suspend_all: bool, returns,
             collector: str, proxies: list[str]) -> None:
        """Open the group on every worker (refused by name if one refuses its target) and
        bind the Collector's proxies to the workers' slots."""
        self.host = host
        host.steps = StoreSteps()   # branches may run twice: their store writes count once
        if getattr(host, "effect_log", None) is None:   # the groups nested here use it too
            host.effect_log = MemoryEffects()
        self.effects = host.effect_log
        self._opened_log()
        self.collector = collector
        module = module_of(target_ref)
        self.open_msg = GroupOpen(group_id=self.gid, target=target_ref,
                                  fingerprint=module_fingerprint(module), wants_ctx=wants_ctx,
                                  suspend_all=suspend_all, limited=host.ledger.limited,
                                  returns=type_name(returns) if returns is not object else "",
                                  relay=RELAY)
        with self.lock:
            names = [p.name for p in self.peers.values() if p.alive]
        for name in names:
            self.bus.send(RELAY, name, self.open_msg)
        end = time.monotonic() + OPEN_DEADLINE_S
        while True:
            with self.lock:
                if self.failed_open:
                    worker, why = sorted(self.failed_open.items())[0]
                    raise ConfigError(f"worker {worker} refused the group's target: {why}")
                if all(self.peers[n].opened for n in names):
                    break
            if time.monotonic() > end:
                raise ConfigError(f"workers did not open group {self.gid} within "
                                  f"{OPEN_DEADLINE_S:g} s (importing {module!r})")
            try:
                self.events.get(timeout=0.1)
            except queue.Empty:
                pass
        self.proxies = list(proxies)
        with self.lock:   # one slot of each worker in turn, up to the proxies planned
            ready = [p for p in self.peers.values() if p.alive and p.opened]
            slots = [p for k in range(max((p.slots for p in ready), default=0))
                     for p in ready if k < p.slots]
            for proxy, peer in zip(self.proxies, slots):
                self.bound[proxy] = peer.name
                peer.proxies.append(proxy)

    def _opened_log(self) -> None:
        """With a checkpoint (its effect log): which branches workers elsewhere held
        (running, or queued behind) when the group last stopped (a crash of the
        coordinator), said and kept for the outcome; then the log hears that the group
        opened again (nothing is held elsewhere yet)."""
        opened = getattr(self.effects, "opened", None)
        if opened is None:
            return
        self.held_before = dict(self.effects.held)
        if self.held_before:
            by_worker: dict[str, list[int]] = {}
            for branch, worker in sorted(self.held_before.items()):
                by_worker.setdefault(worker, []).append(branch)
            log.warning("group %s stopped while workers elsewhere held branches (%s); "
                        "they run again (effects they finished are taken from the journal)",
                        self.gid, "; ".join(f"{w}: {b}" for w, b in sorted(by_worker.items())))
        opened()

    def started(self) -> None:
        """After GroupStart: each proxy says Hello with the heartbeat, so the Collector
        watches it (silence past the deadline: presumed lost)."""
        for proxy in self.proxies:
            self.bus.send(proxy, self.collector, Hello(worker=proxy, heartbeat=self.heartbeat))

    def routes(self) -> list[tuple[str, Any]]:
        """(proxy name, deliver) for the driver to attach with its own names."""
        return [(name, self._proxy(name)) for name in self.proxies]

    # -- the registry (Join, Hello, Refused from workers) -----------------------------

    def _on_registry(self, delivery: Delivery) -> None:
        msg = delivery.msg
        for receiver, out in self.registry.handle(msg):
            if isinstance(out, Hello):
                self._joined_peer(out)
            elif isinstance(out, Refused):
                self.refused[out.worker] = out.reason
                if receiver == out.worker:
                    self.bus.send(REGISTRY, receiver, out)
                self.events.put(out)
            elif receiver not in ("driver", "scheduler"):
                self.bus.send(REGISTRY, receiver, out)

    def _joined_peer(self, hello: Hello) -> None:
        with self.lock:
            peer = self.peers.get(hello.worker)
            if peer is None:
                peer = self.peers[hello.worker] = _Peer(hello.worker, max(1, hello.slots),
                                                        time.monotonic())
            peer.alive, peer.last_heard, peer.opened = True, time.monotonic(), False
            late_open = self.open_msg
        if late_open is not None:   # a worker that joined (or came back) mid-group
            self.bus.send(RELAY, hello.worker, late_open)
        self.events.put(hello)

    # -- the relay (answers, heartbeats, calls from workers) ----------------------------

    def _on_relay(self, delivery: Delivery) -> None:
        msg = delivery.msg
        worker = getattr(msg, "worker", delivery.sender)
        now = time.monotonic()
        beats: list[str] = []
        with self.lock:
            peer = self.peers.get(worker)
            if peer is not None:
                peer.last_heard = now
                if now - peer.forwarded >= self.heartbeat / 2:
                    peer.forwarded = now
                    # The answer of a one-slot worker, forwarded as its proxy, is that
                    # proxy's sign of life already (the Collector counts any answer).
                    if len(peer.proxies) != 1 or type(msg) not in _ANSWERS:
                        beats = list(peer.proxies)
        for proxy in beats:   # a sign of life of every slot of this worker
            self.bus.send(proxy, self.collector, Heartbeat(worker=proxy))
        match msg:
            case BranchDone() | BranchFailed() | Interaction():
                self._on_answer(msg)
            case HostCall():
                self._on_call(msg)
            case GroupOpened(error=error) if msg.group_id == self.gid:
                self._on_opened(msg, peer, error)
            case Heartbeat() | GroupOpened():
                pass

    def _on_opened(self, msg: GroupOpened, peer: _Peer | None, error: str) -> None:
        with self.lock:
            if error and peer is not None and peer.opened:   # broke mid-group
                failed = True
            else:
                failed = False
                if error:
                    self.failed_open[msg.worker] = error
                elif peer is not None:
                    peer.opened = True
                    if not peer.proxies and self.proxies:
                        self._adopt(peer)
        if failed:
            self.bus.send(RELAY, self.collector, GroupCancel(group_id=self.gid, reason=error))
        self.events.put(msg)

    def _adopt(self, peer: _Peer) -> None:
        """A worker that joined mid-group takes over the proxies of workers gone for good
        (under the lock); its next heartbeat brings them back to the Collector."""
        for other in self.peers.values():
            if other is not peer and not other.alive and other.proxies:
                moved = other.proxies[:peer.slots - len(peer.proxies)]
                other.proxies = other.proxies[len(moved):]
                for proxy in moved:
                    self.bound[proxy] = peer.name
                peer.proxies += moved
                peer.forwarded = 0.0
                if len(peer.proxies) >= peer.slots:
                    return

    def _on_answer(self, msg) -> None:
        with self.lock:
            sent = self.sent.pop((msg.lease_id, msg.worker), None)
            if sent is None:   # never sent to this worker: not its to answer
                self.late += 1
                return
            proxy, branches = sent
            self.finished += len(msg.indices)
            self.served[msg.worker] = self.served.get(msg.worker, 0) + len(msg.indices)
        ledger = self.host.ledger if self.host is not None else None
        if ledger is not None and not ledger.limited:
            # Counted here from the answer (every branch of the lease not reported
            # unstarted began), not by a message of its own from the worker.
            ledger.add_calls(len(branches) - len(msg.unstarted))
        answered = getattr(self.effects, "answered", None)
        if answered is not None:
            answered(branches)
        self.bus.send(proxy, self.collector, msgspec.structs.replace(msg, worker=proxy))

    def _on_call(self, msg: HostCall) -> None:
        if msg.op == "order.turn":
            return self._turn(msg)
        if msg.op == "group.run":   # a nested group runs as long as it runs: not here
            with self.lock:   # a bound on what peers can make this process run
                busy = self.nesting >= NESTED_PER_SLOT * max(1, len(self.proxies))
                self.nesting += not busy
            if busy:
                self.bus.send(RELAY, msg.worker, HostReply(
                    call_id=msg.call_id, error_type="GroupError",
                    error=f"worker {msg.worker} asked for a nested group while "
                          f"{self.nesting} run already, {NESTED_PER_SLOT} per remote slot at "
                          "most (a branch runs one at a time; the others are copies of "
                          "branches whose worker was lost)"))
                return
            threading.Thread(target=self._nested, args=(msg,), daemon=True,
                             name=f"evobus-nested-{self.gid}").start()
            return
        reply = _answered(msg, self._call)
        if msg.call_id:
            self.bus.send(RELAY, msg.worker, reply)
        elif reply.error:
            log.error("group %s: %s from worker %s failed: %s", self.gid, msg.op,
                      msg.worker, reply.error)

    def _turn(self, msg: HostCall) -> None:
        """A branch of an in-order lease on a worker elsewhere waits for its turn here,
        where the start order of the group's thread workers is kept (a group with
        workers in both places): its turn is given at once when it has come, else by a
        thread that waits for it ORDER_WAIT_S at most (the worker reports the start
        itself once the branch has begun: ``order.mark``). Past that,
        or once the group stops or pauses, the answer is "not now": the worker answers
        the rest of its lease unstarted and the Collector sends it out again, so a slot
        never waits for a branch queued behind it on that slot."""
        host = self.host
        order = host.order if host is not None and msg.group_id == self.gid else None
        if order is None:
            self.bus.send(RELAY, msg.worker, HostReply(call_id=msg.call_id, value=True))
            return
        try:
            j = _branch_arg(msg, order, "asked for the turn of")
        except ValueError as exc:
            self.bus.send(RELAY, msg.worker, HostReply(
                call_id=msg.call_id, error_type="ValueError", error=str(exc)))
            return
        if order.reached(order.need(j)):
            self.bus.send(RELAY, msg.worker, HostReply(call_id=msg.call_id, value=True))
            return
        with self.lock:
            busy = self.turns >= TURNS_PER_SLOT * max(1, len(self.proxies))
            self.turns += not busy
        if busy:
            self.bus.send(RELAY, msg.worker, HostReply(call_id=msg.call_id, value=False))
            return
        threading.Thread(target=self._wait_turn, args=(msg, host, order, j), daemon=True,
                         name=f"evobus-turn-{self.gid}").start()

    def _mark(self, host, msg: HostCall) -> None:
        order = host.order
        if order is None:
            return
        j = _branch_arg(msg, order, "reported the start of")
        _traced(host, j)
        order.mark(j)

    def _wait_turn(self, msg: HostCall, host, order, j: int) -> None:
        release = getattr(self.bus, "release_thread", None)
        until = time.monotonic() + ORDER_WAIT_S
        try:
            try:
                turn = order.wait(j, lambda: host.cancelled or host.holding
                                  or time.monotonic() > until)
            finally:   # no longer waiting: counted out before the worker hears the answer
                with self.lock:
                    self.turns -= 1
            self.bus.send(RELAY, msg.worker, HostReply(call_id=msg.call_id, value=turn))
        finally:
            if release is not None:
                release()

    def _call(self, msg: HostCall) -> Any:
        host, args = self.host, msg.args
        if host is None or msg.group_id != self.gid:
            raise RunFailed(f"group {msg.group_id} is not running here any more")
        op = msg.op
        if op == "store.get":
            return host.store.get(*args)
        if op == "store.write":   # scope, branch, n, op (set or incr), key, value
            scope, branch, n, write, key, *rest = args
            if write not in ("set", "incr"):
                raise ValueError(f"store write {write!r} from worker {msg.worker}: only "
                                 "set and incr travel")
            return host.store.write(host.steps, (scope, branch, n), write, key, *rest)
        if op == "store.snapshot":
            return host.store.snapshot()
        if op == "order.mark":   # a branch elsewhere began in its turn (Fleet._turn)
            return self._mark(host, msg)
        if op == "ledger.charge_call":
            return host.ledger.charge_call()
        if op == "ledger.charge_cost":
            return host.ledger.charge_cost(*args)
        if op == "effect.replayed":
            return list(self.effects.replayed(*args))
        if op == "effect.intent":   # recorded with the worker it runs on
            return self.effects.intent(*args, worker=msg.worker)
        if op in ("effect.result", "effect.failed"):
            return getattr(self.effects, op.partition(".")[2])(*args)
        raise ValueError(f"unknown host call {op!r} from worker {msg.worker}")

    def _nested(self, msg: HostCall) -> None:
        """A group a branch on a worker elsewhere started (ctx.parallel / ctx.run_group):
        run here, nested in this group (its host: limits tightened, budgets and store
        shared, effects journaled under the branch's scope), on this group's runtime and
        log, its branches on threads of this process; the outcome goes back as data."""
        release = getattr(self.bus, "release_thread", None)
        try:
            self.bus.send(RELAY, msg.worker, _answered(msg, self._run_nested))
        finally:
            with self.lock:
                self.nesting -= 1
            if release is not None:
                release()

    def _run_nested(self, msg: HostCall) -> dict[str, Any]:
        host = self.host
        if host is None or msg.group_id != self.gid:
            raise RunFailed(f"group {msg.group_id} is not running here any more")
        scope, target, items, max_concurrency, max_items, options, fingerprint = msg.args
        module = module_of(Ref(ref=target))
        fn = refs.resolve(Ref(ref=target, call=False), self.allow,
                          what=f"the nested group's target (from worker {msg.worker})")
        if fingerprint != module_fingerprint(module):
            raise ConfigError(f"the nested group's target {target!r}: worker {msg.worker}'s "
                              f"copy of {module!r} differs from the coordinator's (source "
                              "fingerprints do not match): install the same version there")
        options = dict(options)
        if options.get("limits") is not None:
            options["limits"] = HostLimits(**options["limits"])
        if options.get("budgets") is not None:
            options["budgets"] = Budgets(**options["budgets"])
        if options.get("returns") is not None:
            options["returns"] = type_named(options["returns"], "the nested group's returns")
        _ambient.effect_scope = scope   # where its branches journal their effects
        try:
            outcome = host.nested(fn, items, max_concurrency=max_concurrency,
                                  max_items=max_items, _parent=host, **options)
        finally:
            _ambient.effect_scope = ""
        error = outcome.error
        return {"status": outcome.status, "group_id": outcome.group_id,
                "results": outcome.results, "error_branch": outcome.error_branch,
                "error": str(error) if error is not None else "",
                "error_type": type(error).__name__ if error is not None else "",
                "finished": outcome.finished, "failed": outcome.failed,
                "cancelled": outcome.cancelled, "never_started": outcome.never_started,
                "abandoned": outcome.abandoned, "errors": outcome.errors,
                "effects": [list(e) for e in outcome.effects],
                "consumed": msgspec.to_builtins(outcome.consumed), "store": outcome.store}

    # -- the proxies (what the Collector sends to a logical worker) ---------------------

    def _proxy(self, proxy: str):
        def deliver(delivery: Delivery) -> None:
            msg = delivery.msg
            with self.lock:
                worker = self.bound.get(proxy)
                placed = isinstance(msg, Branch) and worker is not None
                if placed:
                    self.sent[(msg.lease_id, worker)] = (proxy, msg.indices)
            if isinstance(msg, Stop):
                return   # the Collector lets this logical worker go: nothing runs here
            if isinstance(msg, Cancel) and self.host is not None:
                self.host.cancel()   # the group stops: so do the groups nested here
            if placed and hasattr(self.effects, "placed"):   # a checkpoint's effect log
                self.effects.placed(worker, msg.indices)
            if placed and not msg.in_order:
                self._started(msg.indices)
            if worker is not None:
                self.bus.send(RELAY, worker, msg)
        return deliver

    def _started(self, indices: list[int]) -> None:
        """A lease that does not wait for its turn (batched: branches measured cheap) is
        marked started in the start order as it leaves: its branches may start at once,
        and a thread worker here waiting for one of them must not wait for a mark that
        only a thread of this process makes."""
        host = self.host
        order = host.order if host is not None else None
        if order is not None:
            for i in indices:
                _traced(host, i)
                order.mark(i)

    # -- liveness -------------------------------------------------------------------------

    def _liveness(self) -> None:
        """Every heartbeat: which workers are gone (silent past the deadline, or their
        process exited: then their proxies are reported ``Lost`` at once), and dead
        process workers started again (ProcessPool.respawn_dead); re-dispatch is the
        Collector's."""
        release = getattr(self.bus, "release_thread", None)
        try:
            while not self._stop.wait(self.heartbeat):
                exited: set[str] = set()
                if self.pool is not None:
                    exited = set(self.pool.dead_names())
                    self.pool.respawn_dead()
                self.check(time.monotonic(), exited)
        finally:
            if release is not None:
                release()

    def check(self, now: float, exited: set[str] = frozenset()) -> None:
        lost = []
        with self.lock:
            for peer in self.peers.values():
                if peer.alive and (peer.name in exited or now - peer.last_heard > self.deadline):
                    peer.alive = False
                    self.lost_workers += 1
                    if peer.name in exited:
                        lost += peer.proxies
        for proxy in lost:
            self.bus.send(RELAY, self.collector, Lost(worker=proxy, reason="its process exited"))

    def counters(self) -> dict[str, int]:
        steps = self.host.steps.repeated if self.host is not None and self.host.steps else 0
        return {"late": self.late, "lost_workers": self.lost_workers, "store_repeated": steps,
                "workers_joined": len(self.peers), "served": dict(self.served),
                "held_before": dict(self.held_before),
                "delivered": self.bus.stats.delivered}

    def close(self) -> None:
        self._stop.set()
        if self._watch.is_alive():
            self._watch.join(2 * self.heartbeat + 1.0)
        if self.pool is not None:
            for name in self.pool.live_names():
                self.bus.send(RELAY, name, Stop(reason="group finished"))
            self.pool.close(PROCESS_STOP_DEADLINE_S)
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


def _branch_arg(msg: HostCall, order, what: str) -> int:
    """The branch an ``order.*`` call names: one of the group's, or a ValueError naming
    the peer (a peer may only name branches of the group it serves)."""
    j = msg.args[0] if len(msg.args) == 1 else None
    if j.__class__ is not int or not 0 <= j < order.n:
        raise ValueError(f"worker {msg.worker} {what} branch {j!r}, not one of the "
                         f"group's {order.n}")
    return j


def _traced(host, j: int) -> None:
    """A start elsewhere, as the coordinator learns of it, in the group's trace (if kept):
    in the one order the start order is kept in here."""
    if host.trace is not None:
        with host.lock:
            host.trace.append(("start", j))


def _answered(msg: HostCall, serve: Callable[[HostCall], Any]) -> HostReply:
    """``serve(msg)`` as the reply to a worker's HostCall: its value, or the error the
    branch that called raises again (served._Calls)."""
    try:
        return HostReply(call_id=msg.call_id, value=serve(msg))
    except Exception as exc:  # sent back to the caller, never raised here
        return HostReply(call_id=msg.call_id, error=str(exc), error_type=type(exc).__name__)
