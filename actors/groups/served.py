"""A group's branches on a worker in another process (``evobus worker --connect``, or a
process worker): the worker's half of ``GroupOpen``, ``Branch``, ``Revoke``, ``Cancel``,
``Hold`` and ``HostReply`` (docs/remote.md).

:class:`actors.workers.remote.RemoteWorker` runs one loop per slot thread for every kind
of work (``Lease`` and ``Branch``); it hands this service what concerns groups. The
service resolves a group's target (allowlist first, then the source fingerprint, then
the import), runs its branches with the same :class:`~actors.groups.worker.BranchRunner`
a thread worker uses, and reaches what must stay in one place (the store and its lock,
the budget ledger, the effect journal) by messages to the coordinator's relay
(:mod:`actors.groups.fleet`): ``HostCall`` out, ``HostReply`` back.
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
import uuid
from typing import Any, Callable

from actors.errors import (BranchError, BudgetExhausted, ConfigError, EffectInDoubt,
                           GroupError, HostLimitExceeded, describe)
from actors.groups.host import _Host, _ambient
from actors.groups.limits import Consumed, HostLimits
from actors.groups.outcome import GroupOutcome
from actors.groups.types import converter, type_named
from actors.groups.worker import BranchRunner
from actors.workers import code as refs
from actors.workers.code import BUILTIN_ALLOW, code_ref, module_fingerprint, module_of
from actors.workers.core import Awaiter
from actors.workers.remote import process_main as worker_main
from protocol import (Branch, BranchDone, Cancel, GroupOpen, GroupOpened, Hold, HostCall,
                      HostReply, Message, Ref, Revoke)

log = logging.getLogger(__name__)

#: A call to the coordinator (the store, a budget, an effect's journal) not answered
#: this soon fails the branch, by name.
CALL_DEADLINE_S = 30.0

#: Errors a HostReply may carry, raised again on the worker as the same type.
_ERRORS: dict[str, type[BaseException]] = {
    "BudgetExhausted": BudgetExhausted, "EffectInDoubt": EffectInDoubt,
    "HostLimitExceeded": HostLimitExceeded, "TypeError": TypeError,
    "ValueError": ValueError, "KeyError": KeyError, "ConfigError": ConfigError,
    "GroupError": GroupError, "BranchError": BranchError}

#: Groups a worker remembers (a long-lived worker serves many groups, one after another).
KEEP_GROUPS = 16


class _Calls:
    """Calls to the coordinator's relay from slot threads, answered on the I/O thread."""

    def __init__(self, send: Callable[[Message], None], worker: str) -> None:
        self.send = send
        self.worker = worker
        self.lock = threading.Lock()
        self.waiting: dict[str, list] = {}

    def call(self, gid: str, op: str, *args: Any, deadline: float | None = CALL_DEADLINE_S,
             host: _Host | None = None) -> Any:
        """The coordinator's answer; GroupError if none within ``deadline``. With
        ``deadline=None`` (a nested group, as long as it runs) the wait ends with the
        answer, or ``CALL_DEADLINE_S`` after ``host``'s group was cancelled (the
        coordinator cancels the nested group too, and answers at once if it lives)."""
        call_id = uuid.uuid4().hex
        slot = [threading.Event(), None]
        with self.lock:
            self.waiting[call_id] = slot
        try:
            self.send(HostCall(group_id=gid, worker=self.worker, op=op, args=list(args),
                               call_id=call_id))
            if not self._wait(slot[0], deadline, host):
                raise GroupError(f"worker {self.worker}: the coordinator did not answer {op} "
                                 f"for group {gid} within {deadline or CALL_DEADLINE_S:g} s"
                                 f"{' of its cancel' if deadline is None else ''} (is it "
                                 "still running?); this branch fails")
        finally:
            with self.lock:
                self.waiting.pop(call_id, None)
        reply: HostReply = slot[1]
        if reply.error:
            raise _ERRORS.get(reply.error_type, GroupError)(reply.error)
        return reply.value

    def tell(self, gid: str, op: str, *args: Any) -> None:
        """A call that wants no answer (``call_id`` ""): the coordinator logs its failure."""
        self.send(HostCall(group_id=gid, worker=self.worker, op=op, args=list(args)))

    @staticmethod
    def _wait(event: threading.Event, deadline: float | None, host: _Host | None) -> bool:
        if deadline is not None:
            return event.wait(deadline)
        cancelled_at = None
        while not event.wait(0.1):   # bounded: the group's cancellation is looked at again
            if cancelled_at is None and host is not None and host.cancelled:
                cancelled_at = time.monotonic()
            if cancelled_at is not None and time.monotonic() - cancelled_at > CALL_DEADLINE_S:
                return False
        return True

    def on_reply(self, reply: HostReply) -> bool:
        """Hand the reply to its caller; False if no call of these waits for it."""
        with self.lock:
            slot = self.waiting.get(reply.call_id)
        if slot is None:
            return False
        slot[1] = reply
        slot[0].set()
        return True


class RemoteLedger:
    """The group's budget ledger, kept by the coordinator: each start asks it first when
    a budget limits starts; otherwise the coordinator's relay counts the starts from each
    lease's answer (no message of its own)."""

    def __init__(self, calls: _Calls, gid: str, limited: bool) -> None:
        self.calls, self.gid, self.limited = calls, gid, limited

    def charge_call(self) -> None:
        self.calls.call(self.gid, "ledger.charge_call")

    def add_calls(self, n: int) -> None:
        pass   # counted by the relay from the answer (actors.groups.fleet.Fleet._on_answer)

    def charge_cost(self, units: float) -> None:
        self.calls.call(self.gid, "ledger.charge_cost", units)


class RemoteStore:
    """The group's shared store, kept (with its lock) by the coordinator. A branch's
    writes go there numbered (``ctx.store`` is a BranchStore around this), so a branch
    run again after its worker was lost gets each write's first answer back instead of
    writing twice (actors.groups.store.StoreSteps, kept with the store)."""

    def __init__(self, calls: _Calls, gid: str) -> None:
        self.calls, self.gid = calls, gid

    def get(self, key: str, default: Any = None) -> Any:
        return self.calls.call(self.gid, "store.get", key, default)

    def write(self, steps, where: tuple, op: str, key: str, *args) -> Any:
        if op == "update":
            raise GroupError(
                f"ctx.store.update({key!r}, fn) runs fn under the store's lock, and the lock "
                "lives with the coordinator: a function cannot travel there. On a worker in "
                "another process use ctx.store.incr/set/get, or run this group on thread "
                "workers")
        scope, branch, n = where
        return self.calls.call(self.gid, "store.write", scope, branch, n, op, key, *args)

    def snapshot(self) -> dict[str, Any]:
        return self.calls.call(self.gid, "store.snapshot")

    def locked(self):
        raise GroupError(
            "ctx.store.locked() holds the store's lock, which lives with the coordinator: "
            "on a worker in another process use ctx.store.incr/set/get, or run this group "
            "on thread workers")


class RemoteEffects:
    """The group's effect journal, kept by the coordinator: an effect's intent is recorded
    there before it runs and its result before the branch goes on, so a branch that runs
    again elsewhere (its worker was lost) gets the result back instead of a second run."""

    def __init__(self, calls: _Calls, gid: str) -> None:
        self.calls, self.gid = calls, gid

    def replayed(self, branch: int, step: int, name: str) -> tuple[bool, Any]:
        ran, value = self.calls.call(self.gid, "effect.replayed", branch, step, name)
        return bool(ran), value

    def intent(self, branch: int, step: int, name: str) -> None:
        self.calls.call(self.gid, "effect.intent", branch, step, name)

    def result(self, branch: int, step: int, name: str, value: Any) -> None:
        self.calls.call(self.gid, "effect.result", branch, step, name, value)

    def failed(self, branch: int, step: int, name: str) -> None:
        self.calls.call(self.gid, "effect.failed", branch, step, name)


class RemoteOrder:
    """Starts in input order, kept by the coordinator with its thread workers' (the group
    has workers in both places; only then are leases cut ``in_order``): a branch of an
    in-order lease asks for its turn there (``HostCall`` ``order.turn``) and, once it has
    begun, says so (``order.mark``, one way), so a thread there waiting for it starts
    after it, never before. A lease that does not wait was marked as it left the
    coordinator (actors.groups.fleet.Fleet._started): nothing to say for it."""

    def __init__(self, calls: _Calls, gid: str) -> None:
        self.calls, self.gid = calls, gid
        self.granted: set[int] = set()   # turns given, their starts not yet reported

    def wait(self, j: int, give_up: Callable[[], bool],
             steal: Callable[[int], bool] | None = None) -> bool:
        """True once ``j``'s turn came; False ("not now": the lease's rest goes back
        unstarted) when the coordinator waited long enough or the group stops."""
        if give_up() or not self.calls.call(self.gid, "order.turn", j):
            return False
        self.granted.add(j)
        return True

    def mark(self, j: int) -> None:
        if j in self.granted:
            self.granted.discard(j)
            self.calls.tell(self.gid, "order.mark", j)


#: Options a nested group started on a worker may carry to the coordinator (plain data;
#: ``limits`` and ``budgets`` as their fields). Anything else is refused by name.
NESTED_OPTIONS = ("limits", "budgets", "chunk", "prefetch", "cancel_deadline", "trace",
                  "pass_ctx", "suspend", "returns")


def _nested_options(options: dict[str, Any]) -> dict[str, Any]:
    """A nested group's options as data for the coordinator, or ConfigError naming the one
    that cannot travel."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name not in NESTED_OPTIONS:
            raise ConfigError(
                f"ctx.parallel()/ctx.run_group() on a worker in another process: option "
                f"{name!r} cannot travel to the coordinator, where the nested group runs "
                f"(it takes {', '.join(NESTED_OPTIONS)}); a nested group shares its parent's "
                "store, runtime and log")
        if name == "limits" and value is not None:
            value = {f: getattr(value, f) for f in ("max_concurrency", "max_live_branches",
                                                    "max_external_calls", "max_depth")}
        elif name == "budgets" and value is not None:
            value = {"calls": value.calls, "seconds": value.seconds, "cost": value.cost}
        elif name == "returns" and value is not None:
            if not isinstance(value, type) or getattr(builtins, value.__name__, None) is not value:
                raise ConfigError(
                    f"ctx.parallel(returns={value!r}) on a worker in another process: only a "
                    "builtin type (int, str, float, bool, dict, list, object) travels to the "
                    "coordinator; check other types in the branch")
            value = value.__name__
        out[name] = value
    return out


def _nested_outcome(value: dict[str, Any]) -> GroupOutcome:
    """The GroupOutcome of a nested group the coordinator ran for a branch here."""
    error = None
    if value.get("error_type"):
        kind = _ERRORS.get(value["error_type"])
        error = kind(value["error"]) if kind is not None else \
            BranchError(f"{value['error_type']}: {value['error']}")
    consumed = value.get("consumed") or {}
    return GroupOutcome(
        status=value["status"], group_id=value["group_id"], results=value.get("results", []),
        error=error, error_branch=value.get("error_branch"),
        finished=value.get("finished", []), failed=value.get("failed", []),
        cancelled=value.get("cancelled", []), never_started=value.get("never_started", []),
        abandoned=value.get("abandoned", []),
        errors={int(k): v for k, v in (value.get("errors") or {}).items()},
        effects=[tuple(e) for e in value.get("effects", [])],
        consumed=Consumed(**consumed), store=value.get("store", {}),
        stats=value.get("stats", {}))


def _nested(calls: "_Calls", gid: str):
    """What ``ctx.run_group``/``ctx.parallel`` call in a branch here: the nested group runs
    on the coordinator (``HostCall`` ``group.run``), as a group nested in this branch's
    group there: on the same runtime and log, its budgets and store shared, its effects
    journaled under this branch's scope. It comes back as a GroupOutcome."""

    def run(target, items, *, max_concurrency: int, max_items: int, _parent=None,
            **options) -> GroupOutcome:
        ref = refs.parse(target) if isinstance(target, (str, Ref)) else \
            code_ref(target, "ctx.parallel() target on a worker in another process")
        scope = getattr(_ambient, "effect_scope", "")
        if not scope:
            raise ConfigError(
                "parallel()/run_group() called directly in a branch on a worker in another "
                "process: call ctx.parallel()/ctx.run_group() there (the nested group runs "
                "on the coordinator, its effects and store writes recorded under the branch "
                "that started it, so a branch run again does not make them twice)")
        items = list(items) if not isinstance(items, list) else items
        value = calls.call(gid, "group.run", scope, ref.ref, items, max_concurrency,
                           max_items, _nested_options(options),
                           module_fingerprint(module_of(ref)), deadline=None,
                           host=_parent)
        return _nested_outcome(value)

    return run


class _Finished:
    """What BranchRunner counts per box (the coordinator counts from the answers)."""

    finished = 0


def check_target(msg: GroupOpen, allow: list[str]) -> Callable:
    """The group's target, or ConfigError naming why not: the allowlist is checked before
    anything is imported, then the source fingerprint, then the import."""
    allowlist = sorted(set(allow) | set(BUILTIN_ALLOW))
    module = module_of(msg.target)
    if not refs.allowed(module, allowlist):
        raise ConfigError(f"group {msg.group_id}: target module {module!r} is not in this "
                          f"worker's allowlist {allowlist}; if you trust the coordinator's "
                          f"code, start the worker with --allow {module.split('.')[0]}")
    if msg.fingerprint and module_fingerprint(module) != msg.fingerprint:
        raise ConfigError(f"group {msg.group_id}: this worker's copy of {module!r} differs "
                          "from the coordinator's (source fingerprints do not match): install "
                          "the same version here")
    fn = refs.resolve(msg.target, allowlist, what="target")
    if not callable(fn):
        raise ConfigError(f"group {msg.group_id}: target {msg.target.ref!r} names a "
                          f"{type(fn).__name__}, not a callable")
    return fn


class BranchService:
    """One worker process's groups: their hosts, the leases not started yet, the calls
    out. ``send(receiver, msg)`` sends as this worker."""

    def __init__(self, worker: str, allow: list[str], send: Callable[[str, Message], None]
                 ) -> None:
        self.worker = worker
        self.allow = list(allow)
        self.send = send
        self.hosts: dict[str, _Host] = {}
        self.relays: dict[str, str] = {}
        self.lock = threading.Lock()
        self.unstarted: dict[str, Branch] = {}   # lease id -> lease queued on a slot
        self.groups: dict[str, str] = {}         # lease id -> its group, until it ends
        self.calls: dict[str, _Calls] = {}

    # -- the I/O thread (must not block) ------------------------------------------------

    def on_open(self, msg: GroupOpen) -> None:
        try:
            fn = check_target(msg, self.allow)
            convert = converter(type_named(msg.returns, "returns")) \
                if msg.returns and ":" not in msg.returns else None
        except ConfigError as exc:
            log.error("worker %s: refusing group %s: %s", self.worker, msg.group_id, exc)
            self.send(msg.relay, GroupOpened(group_id=msg.group_id, worker=self.worker,
                                             error=str(exc)))
            return
        relay = msg.relay
        calls = _Calls(lambda m: self.send(relay, m), self.worker)
        host = _Host(group_id=msg.group_id, target=fn, wants_ctx=msg.wants_ctx, depth=1,
                     limits=HostLimits(), ledger=RemoteLedger(calls, msg.group_id, msg.limited),
                     store=RemoteStore(calls, msg.group_id), live=(), external=(),
                     parent=None, trace=False, runtime=None,
                     nested=_nested(calls, msg.group_id),
                     order=RemoteOrder(calls, msg.group_id),
                     convert=convert, suspend_all=msg.suspend_all)
        host.effect_log = RemoteEffects(calls, msg.group_id)
        with self.lock:
            self.hosts[msg.group_id] = host
            self.relays[msg.group_id] = relay
            self.calls[msg.group_id] = calls
            for old in list(self.hosts)[:-KEEP_GROUPS]:
                self.hosts.pop(old)
                self.relays.pop(old, None)
                self.calls.pop(old, None)
        self.send(relay, GroupOpened(group_id=msg.group_id, worker=self.worker))

    def queued(self, lease: Branch) -> bool:
        """A lease arrived (to be put on a slot's queue): False if its group is unknown
        here (it is answered as not started: the relay gives it to another worker)."""
        with self.lock:
            known = lease.group_id in self.hosts
            if known:
                self.unstarted[lease.lease_id] = lease
                self.groups[lease.lease_id] = lease.group_id
        if not known:
            self._unstarted(lease, relay=None)
        return known

    def on_message(self, msg: Message) -> bool:
        """Cancel, Hold, Revoke or HostReply for a group; False if not a group's."""
        match msg:
            case HostReply(call_id=call_id):
                with self.lock:
                    groups = list(self.calls.values())
                if not any(calls.on_reply(msg) for calls in groups):
                    # its caller gave up (the deadline): nobody waits for it
                    log.warning("worker %s: a late reply to call %s, dropped", self.worker,
                                call_id)
                return True
            case Revoke(lease_id=lease_id):
                with self.lock:
                    lease = self.unstarted.pop(lease_id, None)
                    self.groups.pop(lease_id, None)
                if lease is not None:
                    self._unstarted(lease, self.relays.get(lease.group_id))
                return True
            case Cancel(lease_id=lease_id) | Hold(lease_id=lease_id):
                host = self._host_of(lease_id)
                if host is None:
                    return False
                if isinstance(msg, Cancel):
                    host.cancel()
                else:
                    host.hold()
                return True
        return False

    def _host_of(self, lease_id: str) -> _Host | None:
        with self.lock:
            return self.hosts.get(self.groups.get(lease_id, ""))

    def _unstarted(self, lease: Branch, relay: str | None) -> None:
        self.send(relay or "groups", BranchDone(group_id=lease.group_id,
                                                lease_id=lease.lease_id, worker=self.worker,
                                                unstarted=list(lease.indices)))

    # -- a slot thread ------------------------------------------------------------------

    def run(self, lease: Branch, settle: Awaiter) -> None:
        with self.lock:
            if self.unstarted.pop(lease.lease_id, None) is None:
                return   # revoked meanwhile: answered on the I/O thread
            host = self.hosts.get(lease.group_id)
            relay = self.relays.get(lease.group_id, "groups")
        if host is None:
            return self._unstarted(lease, relay)
        runner = BranchRunner(lambda name, msg: self.send(relay, msg), self.worker, host,
                              _Finished(), settle)
        try:
            runner.run(lease)
        except Exception as exc:  # a bug here, not in the target: the relay fails the group
            log.exception("worker %s: lease %s failed", self.worker, lease.lease_id)
            self.send(relay, GroupOpened(group_id=lease.group_id, worker=self.worker,
                                         error=f"worker {self.worker} crashed running lease "
                                               f"{lease.lease_id}: {describe(exc)}"))
        finally:
            with self.lock:
                self.groups.pop(lease.lease_id, None)


def process_main(*, address: str, worker_id: str, allow: list[str],
                 broker_timeout: float = 5.0) -> None:
    """Entry point of a process worker that also serves groups (multiprocessing 'spawn'
    target): :func:`actors.workers.remote.process_main` with this service plugged in."""
    worker_main(address=address, worker_id=worker_id, allow=allow,
                broker_timeout=broker_timeout, branches=BranchService)
