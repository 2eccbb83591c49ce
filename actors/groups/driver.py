"""Bounded parallel groups: fan a target out over independent items, join the results in
input order (docs/groups.md).

    from actors import parallel
    results = parallel(process_ticket, tickets, max_concurrency=4, max_items=32)

The program declares the target, the items and the bounds; the runtime organises the
branches without giving them any extra rights. A group is a :class:`Collector` (a pure
control actor on the bus) and branch workers (pykka threads owned by the
:class:`~actors.runtime.runtime.Runtime`) that take ``Branch`` leases and answer ``BranchDone``,
``BranchFailed`` or ``Interaction``. Everything that crosses the bus is data: items,
results, answers and effect values are JSON-like (msgpack), never pickled objects.

This module is the edge: the driver (``run_group``), the workers that call the target,
the ``ctx`` object, host limits, budgets, the shared store and checkpoints. Every
decision about which branch runs when lives in :mod:`actors.machines.collector`.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import queue
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import msgspec
import pykka

from actors.machines.collector import Collector
from actors.errors import ConfigError, RunFailed
from actors.runtime.shell import pass_to
from bus.base import MAX_FRAME_BYTES, Delivery
from protocol import GroupCancel, GroupResult, GroupStart, GroupSuspended, Ref, Tick, UserInputs
from actors.errors import (BranchError, BudgetExhausted, HostLimitExceeded, ResultTooLarge,
                           ResumeRefused)
from actors.groups.limits import (CANCEL_DEADLINE_S, MAX_RESULT_BYTES, TICK_S, Budgets, Consumed,
                                  HostLimits, _Ledger, _positive)
from actors.groups.checkpoint import (EffectLog, GroupCheckpoint, _write_checkpoint,
                                      target_fingerprint, target_name)
from actors.groups.fleet import Fleet, start_fleet
from actors.groups.outcome import GroupOutcome, GroupProgress
from actors.groups.pool import _Bind, pool_of, pooled_deliver
from actors.groups.worker import _LeaseBox
from actors.groups.store import _encoder, Store, _Gate, _enter_all
from actors.groups.host import _Host, _StartOrder, _ambient
from actors.groups.types import as_partial, as_results, type_name
from actors.groups.target import (_converter, _measured, _remember, _target_wants_ctx)
from actors.version import PACKAGE_VERSION
from actors.runtime.clock import Ticker
from actors.runtime.runtime import Runtime, make_log_directory


log = logging.getLogger(__name__)


#: Guided leases are kept at least this long (by measured branch time) once the queue
#: runs low: a lease shorter than a bus round trip leaves its worker idle after it.
MIN_LEASE_S = 0.01


#: In input order, several branches go in one lease only once branches are measured
#: cheaper than this (about a round trip through the bus and back).
BATCH_BELOW_S = 0.0005


#: A group whose branches all run on threads here, and whose target's branches were
#: measured on its last completed group at so little that all of them together take
#: less than this (about a round trip through the bus and back), goes in one lease to
#: one worker: one thread woken, not one a branch. Should it still run ``HELP_AFTER_S``
#: after it started (a branch slower than measured), helpers (up to the bound) take its
#: next branches, in input order, as a waiting worker does (GroupWorker._steal).
ONE_LEASE_BELOW_S = BATCH_BELOW_S
HELP_AFTER_S = 0.002
#: A branch is never counted cheaper than this (a measure rounds to microseconds).
_FLOOR_S = 1e-6


#: With every branch in another process, leases are even shares (GroupStart.shares): the
#: first round this fraction of each worker's fair share, later rounds halving, none
#: shorter than a round trip through the broker to another process and back.
FLEET_SHARES = 0.8
FLEET_MIN_LEASE_S = 0.15


#: How often ``on_progress`` hears how far a running group has got.
PROGRESS_S = 1.0


_OPTIONS = {
    "limits": "HostLimits(...): host limits (concurrency, live branches, external calls, depth)",
    "budgets": "Budgets(calls=, seconds=, cost=): run budgets shared with nested groups",
    "store": "dict: the shared store's initial content",
    "approvers": "list of names allowed to approve (ctx.approve) on resume",
    "cancel_deadline": "seconds to wait for cancelled branches after the first error",
    "chunk": "branches per lease (0: guided, shrinking leases)",
    "prefetch": "leases a worker may hold queued behind the one it runs (default 1)",
    "bus": "'zmq' (default) or 'memory', when the group starts its own runtime",
    "log": "path of the message log, when the group starts its own runtime",
    "log_overwrite": "True: replace a log already at `log` (else such a path is refused)",
    "runtime": "an actors.Runtime to run on (not closed by the group)",
    "allow": "module prefixes a target named by import path may come from",
    "trace": "True: record the start/error/cancel/hold decisions in outcome.trace",
    "pass_ctx": "True/False: pass ctx as the second argument (default: from the signature)",
    "on_progress": "a callable given a GroupProgress about once a second and at the end",
    "returns": "the output type R (default: the target's return annotation; object: any)",
    "suspend": "'all' (default): an interaction blocks its own branch, the group suspends "
               "once no branch can go on; 'first': the first interaction stops new starts",
    "workers": "Workers(local=, processes=, remote=, ...): where branches run, as evolve() "
               "takes it (process/remote workers need a target named by import path)",
}


#: The host limits of a group given none (frozen: one value serves every group).
_NO_LIMITS = HostLimits()

#: Budgets of a group given none (frozen).
NO_BUDGETS = Budgets()


_RESUME_ONLY = {"principal": "the resumer's name, checked against the group's approvers"}


_FIXED_AT_START = ("budgets", "store", "approvers")


def _check_options(options: dict[str, Any], allowed: dict[str, str], where: str) -> None:
    for name in options:
        if name not in allowed:
            hint = ""
            if name in _FIXED_AT_START:
                hint = f" ({name} is fixed when the group starts and kept in its checkpoint)"
            raise ConfigError(f"{where}: unknown option {name!r}{hint}; accepted: "
                              f"{', '.join(sorted(allowed))}")


def _check_bounds(max_concurrency, max_items) -> None:
    for name, value in (("max_concurrency", max_concurrency), ("max_items", max_items)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if max_concurrency > max_items:
        raise ConfigError(f"max_concurrency ({max_concurrency}) must be <= max_items "
                          f"({max_items}); lower max_concurrency or raise max_items")


def _take_items(items, max_items: int) -> list[Any]:
    if type(items) is not list and (isinstance(items, (str, bytes, dict))
                                    or not isinstance(items, Iterable)):
        raise ConfigError(f"items must be a list (or another iterable) of inputs, got "
                          f"{type(items).__name__}")
    taken = list(itertools.islice(items, max_items + 1))
    if len(taken) > max_items:
        n = len(items) if hasattr(items, "__len__") else f"more than {max_items}"
        raise ConfigError(f"{n} items for max_items={max_items}: a group never truncates its "
                          "input; raise max_items or split the list")
    return taken


def _check_items(items: list[Any]) -> tuple[int, list[Any]] | None:
    """Items cross the bus: refuse, before the first call, one that cannot or that would
    arrive changed (a tuple would become a list, a dataclass a dict). Their size
    encoded and the items as decoding gives them back, when they all cross."""
    try:
        body = _encoder.encode(items)
        back = msgspec.msgpack.decode(body)
        if back == items:
            return len(body), back
    except (TypeError, ValueError, OverflowError):
        back = None
    for i, item in enumerate(items):
        try:
            got = msgspec.msgpack.decode(_encoder.encode(item))
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(
                f"item {i} ({type(item).__name__}) cannot cross the bus ({exc}): items must be "
                "JSON-like values (None, bool, int, float, str, bytes, lists, dicts with str "
                "keys); pass an id or a path and load the object inside the target") from None
        if got != item and got == got:   # NaN never equals itself: it does travel intact
            raise ConfigError(
                f"item {i} would arrive changed ({type(item).__name__} -> "
                f"{type(got).__name__}): items must be JSON-like values (lists, not tuples; "
                "dicts, not objects); convert it before the group starts")


@dataclass
class _Plan:
    """Everything one run of the driver needs (a fresh start or a resume)."""

    group_id: str
    fn: Callable
    ref: Ref | None
    items: list[Any]
    max_concurrency: int
    max_items: int
    options: dict[str, Any]
    parent: _Host | None
    budgets: Budgets = NO_BUDGETS
    consumed: Consumed | None = None
    store: Store | None = None
    approvers: list[str] | None = None
    resume: GroupCheckpoint | None = None
    inputs: UserInputs | None = None
    checkpoint: Path | None = None
    branches_to_run: int = 0
    #: run_group itself: what ctx.run_group / ctx.parallel call for a nested group.
    nested: Callable | None = None
    #: The output type R (``typing.Any`` or ``object``: any value).
    returns: Any = object
    #: The evolve() call this group was started in (actors.workers.scope.CallScope), or
    #: None; and what a resumed run's log says this group had finished already.
    call: Any = None
    finished: dict[int, Any] | None = None
    #: The items' size encoded, when known (checked at the front door); ``items`` are
    #: then as decoding gives them back (so a GroupStart made of them may go as it is).
    items_bytes: int | None = None


class _Crash:
    def __init__(self, name: str, exc: BaseException) -> None:
        self.name = name
        self.exc = exc


def _execute(plan: _Plan) -> GroupOutcome:
    """Run one group to its end (or its suspension) and tell what happened."""
    parent = plan.parent
    settings = _settings(plan)
    ledger = _Ledger(plan.budgets, plan.consumed,
                     parent=parent.ledger if parent is not None else None,
                     run=plan.call.run if plan.call is not None else None)
    store = plan.store if plan.store is not None else (
        parent.store if parent is not None else Store())
    live, external = _gates(plan, settings.limits)
    fleet = start_fleet(plan)   # None: every branch runs on a thread of this process
    try:
        return _execute_on(plan, settings, ledger, store, live, external, fleet)
    except BaseException:
        if fleet is not None:
            fleet.runtime.close()   # idempotent: a normal end closed it already
        raise


def _execute_on(plan: _Plan, settings: "_Settings", ledger: _Ledger, store: Store, live,
                external, fleet: Fleet | None) -> GroupOutcome:
    opts, parent, gid = plan.options, plan.parent, plan.group_id
    n_local, n_remote = _split(settings, plan, fleet)
    one = _one_lease(plan, settings, fleet)
    names = _Names(gid, 1 if one else n_local, n_remote)
    # Checked before anything starts (the items must fit in one message).
    start, as_is = _group_start(plan, gid, names.driver, names.workers, settings, ledger,
                                one=one)
    runtime, own_runtime = (fleet.runtime, fleet.runtime) if fleet is not None \
        else _runtime_for(plan)
    host = _Host(group_id=gid, target=plan.fn, wants_ctx=settings.wants_ctx,
                 depth=settings.depth, limits=settings.limits, ledger=ledger, store=store,
                 live=live, external=external, parent=parent, trace=bool(opts.get("trace")),
                 runtime=runtime, nested=plan.nested,
                 order=(_StartOrder(len(plan.items), settings.concurrency,
                                    done=start.finished)
                        if plan.resume is None else None),
                 convert=_converter(plan.returns), suspend_all=settings.suspend == "all")
    # A top-level group with a checkpoint writes its effects ahead (EffectLog); a nested
    # one into the same log, under the scope of the branch that started it.
    host.effect_log = EffectLog(plan.checkpoint) \
        if plan.checkpoint is not None and parent is None else \
        parent.effect_log if parent is not None else None
    host.effect_scope = getattr(_ambient, "effect_scope", "") if parent is not None else ""
    if host.effect_log is not None and parent is None:   # budgets spent: written ahead too
        ledger.absorb(host.effect_log.spent)
        ledger.on_charge = host.effect_log.spend
    if fleet is not None:
        fleet.open(host=host, target_ref=plan.ref, wants_ctx=settings.wants_ctx,
                   suspend_all=settings.suspend == "all", returns=plan.returns,
                   collector=names.collector, proxies=names.remote)
        # Liveness of the remote slots is the Collector's (GroupStart.deadline, Ticks).
        # Starts in input order are kept here (_StartOrder) for thread workers and, by
        # messages, for branches elsewhere (Fleet._turn); with every branch elsewhere,
        # leases are even shares instead (results still join in order).
        start = msgspec.structs.replace(start, deadline=fleet.deadline,
                                        max_tries=fleet.workers.max_tries,
                                        ordered=bool(names.local))
        if not names.local:
            start = msgspec.structs.replace(start, shares=FLEET_SHARES,
                                            min_lease_seconds=FLEET_MIN_LEASE_S)
    actors = _Actors(runtime, own_runtime, names,
                     extra=fleet.routes() if fleet is not None else [],
                     lane=_Lane(runtime.bus) if fleet is None else runtime.bus)
    result_msg: GroupResult | GroupSuspended | None = None
    # A branch that waits for its nested group lends its live-branch slots meanwhile.
    lent: tuple[_Gate, ...] = getattr(_ambient, "slots", ()) if parent is not None else ()
    for gate in lent:
        gate.leave()
    _ambient.slots = ()
    progress: Callable[[bool], None] | None = None
    t0 = time.monotonic()
    try:
        boxes = actors.start(host, start, plan.inputs, as_is=as_is and fleet is None)
        if fleet is not None:
            fleet.started()   # the proxies' Hellos, after GroupStart
        actors.phases["start"] = time.monotonic() - t0
        if settings.on_progress is not None:
            # (The boxes themselves: a helper's box joins them once it is bound.)
            progress = _reporter(plan, host, boxes + [fleet] if fleet else boxes,
                                 settings.on_progress, t0)
        result_msg, actors.crash = _drive(actors.lane, actors.inbox, host, names.driver,
                                          names.collector, gid, t0,
                                          ticks=ledger.remaining_seconds() is not None
                                          or fleet is not None,
                                          progress=progress,
                                          helpers=actors.helpers(host, settings.concurrency)
                                          if one and settings.concurrency > 1 else None)
        actors.phases["run"] = time.monotonic() - t0 - actors.phases["start"]
    except BaseException:
        host.cancel()   # Ctrl-C or a driver bug: branches see ctx.cancelled, then teardown
        raise
    finally:
        actors.stop(abandoned=result_msg is None   # interrupted: branches may still run
                    or isinstance(result_msg, GroupResult) and bool(result_msg.abandoned),
                    t0=t0)
        if host.effect_log is not None and parent is None:   # a nested group's is lent
            host.effect_log.close()
        if lent:
            _enter_all(lent, lambda: False)
            _ambient.slots = lent
    if actors.crash is not None:
        _raise_crash(actors.crash, gid)
    if fleet is None and result_msg.status == "completed":
        machine = actors.collector.machine   # the workers' measure of its branches
        if machine.busy_items:
            _remember(plan.fn, machine.busy_seconds / machine.busy_items)
    outcome = _outcome(plan, host, ledger, store, result_msg, time.monotonic() - t0,
                       1 if one else settings.n_workers, settings.concurrency,
                       PACKAGE_VERSION)
    outcome.stats["phases"] = {k: round(v, 6) for k, v in actors.phases.items()}
    if fleet is not None:
        outcome.stats["remote"] = fleet.counters()
    if progress is not None:
        progress(True)
    return outcome


class _Settings(NamedTuple):
    """A group's options, checked, with the limits of the groups above it applied."""

    limits: HostLimits
    depth: int
    cancel_deadline: float
    chunk: int
    prefetch: int
    on_progress: Callable | None
    wants_ctx: bool
    suspend: str
    concurrency: int
    n_workers: int


def _settings(plan: _Plan) -> _Settings:
    opts, parent = plan.options, plan.parent
    if parent is None and opts.keys().isdisjoint(_SETTING_OPTIONS):   # the defaults
        concurrency = plan.max_concurrency
        return _Settings(_NO_LIMITS, 1, CANCEL_DEADLINE_S, 0, 1, None,
                         _target_wants_ctx(plan.fn), "all", concurrency,
                         max(1, min(concurrency, plan.branches_to_run)))
    limits = opts.get("limits")
    if limits is not None and not isinstance(limits, HostLimits):
        raise ConfigError(f"limits must be HostLimits(...), got {type(limits).__name__}")
    if parent is not None:
        limits, depth = parent.limits.tightened(limits), parent.depth + 1
    else:
        limits, depth = limits or _NO_LIMITS, 1
    if depth > limits.max_depth:
        raise HostLimitExceeded(f"a group nested {depth} deep is over the host's max_depth "
                                f"({limits.max_depth}); flatten the work or raise "
                                "HostLimits(max_depth=...)")
    cancel_deadline = opts.get("cancel_deadline", CANCEL_DEADLINE_S)
    _positive("cancel_deadline", cancel_deadline, allow_none=False, number=True)
    chunk = opts.get("chunk", 0)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ConfigError(f"chunk must be an integer >= 0 (0: guided), got {chunk!r}")
    prefetch = opts.get("prefetch", 1)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ConfigError(f"prefetch must be an integer >= 0, got {prefetch!r}")
    on_progress = opts.get("on_progress")
    if on_progress is not None and not callable(on_progress):
        raise ConfigError(f"on_progress must be a callable taking a GroupProgress, got "
                          f"{type(on_progress).__name__}")
    for name in ("pass_ctx", "trace"):   # "no" would be true: only True/False mean it
        if opts.get(name) is not None and not isinstance(opts[name], bool):
            raise ConfigError(f"{name} must be True or False, got {opts[name]!r}")
    pass_ctx = opts.get("pass_ctx")
    suspend = opts.get("suspend", "all")
    if suspend not in ("all", "first"):
        raise ConfigError(f"suspend must be 'all' (an interaction blocks its own branch) or "
                          f"'first' (the first one stops new starts), got {suspend!r}")
    concurrency = plan.max_concurrency
    for cap in (limits.max_concurrency, limits.max_live_branches):
        if cap is not None:
            concurrency = min(concurrency, cap)
    return _Settings(limits=limits, depth=depth, cancel_deadline=cancel_deadline,
                     chunk=chunk, prefetch=prefetch, on_progress=on_progress,
                     wants_ctx=_target_wants_ctx(plan.fn) if pass_ctx is None else pass_ctx,
                     suspend=suspend,
                     concurrency=concurrency,
                     n_workers=max(1, min(concurrency, plan.branches_to_run)))


#: The options _settings reads: a top-level group given none of them gets the defaults
#: (no host limits, depth 1, ...), with its target's ctx and its bound.
_SETTING_OPTIONS = frozenset({"limits", "cancel_deadline", "chunk", "prefetch", "on_progress",
                              "pass_ctx", "trace", "suspend"})


def _one_lease(plan: _Plan, settings: _Settings, fleet: Fleet | None) -> bool:
    """Does this group go in one lease to one worker (``ONE_LEASE_BELOW_S``)? Only a
    fresh one whose every branch runs on a thread here, with guided leases (no
    ``chunk``), more than one branch, and a target measured cheap."""
    if fleet is not None or plan.resume is not None or settings.chunk \
            or plan.branches_to_run < 2:
        return False
    seconds = _measured(plan.fn)
    return seconds is not None and \
        max(seconds, _FLOOR_S) * plan.branches_to_run < ONE_LEASE_BELOW_S


def _gates(plan: _Plan, limits: HostLimits) -> tuple[tuple[_Gate, ...], tuple[_Gate, ...]]:
    """The live-branch and external-call gates. They chain from the top-level group down:
    a nested group's branches count against every limit above them, and against the
    nested group's own when it sets one."""
    parent = plan.parent
    own = plan.options.get("limits") if parent is not None else limits
    live = (parent.live if parent is not None else ()) + (
        (_Gate(own.max_live_branches),) if own is not None and own.max_live_branches else ())
    external = (parent.external if parent is not None else ()) + (
        (_Gate(own.max_external_calls),) if own is not None and own.max_external_calls else ())
    return live, external


def _runtime_for(plan: _Plan) -> tuple[Runtime, Runtime | None]:
    """The runtime the group runs on, and the one it started itself (to close), if any:
    the one given, else its parent's, else a new one."""
    opts, parent = plan.options, plan.parent
    runtime = opts.get("runtime")
    if runtime is not None and not isinstance(runtime, Runtime):
        raise ConfigError(f"runtime must be an actors.Runtime, got {type(runtime).__name__}")
    ignored = [name for name in ("bus", "log") if opts.get(name) is not None]
    if ignored and (runtime is not None or parent is not None or plan.call is not None):
        on = ("on the runtime given as runtime=" if runtime is not None else
              "inside a branch, on its parent's runtime (and in its parent's log)"
              if parent is not None else
              "inside an evolve() run's call, on the run's runtime (and in its log)")
        names = " and ".join(ignored)
        raise ConfigError(f"{names} would be ignored: this group runs {on}; {names} "
                          f"appl{'y' if len(ignored) > 1 else 'ies'} only to a group that "
                          "starts its own runtime; remove "
                          f"{'them' if len(ignored) > 1 else 'it'}")
    if runtime is None and parent is not None:
        runtime = parent.runtime
    if runtime is None and plan.call is not None:
        runtime = plan.call.run.runtime
    if runtime is not None:
        return runtime, None
    log_path = opts.get("log")
    if not log_path:
        return shared_runtime(opts.get("bus", "zmq")), None
    make_log_directory(log_path, "log")
    runtime = Runtime(bus=opts.get("bus", "zmq"), log_path=log_path,
                      log_meta={"scenario": "parallel-group", "run_id": plan.group_id},
                      log_overwrite=bool(opts.get("log_overwrite")))
    return runtime, runtime


_shared: dict[str, Runtime] = {}
_shared_lock = threading.Lock()


def shared_runtime(bus: str = "zmq") -> Runtime:
    """The process-wide runtime standalone groups run on (one per kind of bus): started
    by the first group that needs it and closed when the process exits, so a call of
    ``parallel()`` starts no bus of its own. A group with ``log=`` starts its own
    runtime (its log is its own); ``runtime=`` names another one."""
    with _shared_lock:
        runtime = _shared.get(bus)
        if runtime is None or runtime._closed:
            if not _shared:
                atexit.register(close_shared_runtimes)
            runtime = _shared[bus] = Runtime(bus=bus)
        return runtime


def close_shared_runtimes() -> None:
    """Close the process-wide runtimes (at exit; a later group starts a new one)."""
    with _shared_lock:
        runtimes = list(_shared.values())
        _shared.clear()
    for runtime in runtimes:
        runtime.close()


def _split(settings: "_Settings", plan: _Plan, fleet: Fleet | None) -> tuple[int, int]:
    """(thread workers, remote slots) the Collector leases to: every remote slot first,
    then the section's ``local`` threads, within the group's bound."""
    workers = plan.options.get("workers")
    if workers is None:
        return settings.n_workers, 0
    slots = fleet.slot_count() if fleet is not None else 0
    n = max(1, min(settings.concurrency, plan.branches_to_run, slots + workers.local))
    remote = min(slots, n)
    return n - remote, remote


class _Names:
    """The bus names of one group's actors: thread workers, and the proxies of remote
    slots (actors.groups.fleet); the Collector sees both as its workers."""

    def __init__(self, gid: str, n_workers: int, n_remote: int = 0) -> None:
        self.gid = gid
        self.collector = f"collector.{gid}"
        self.driver = f"group-driver.{gid}"
        self.local = [f"branch-worker.{gid}.{i}" for i in range(n_workers)]
        self.remote = [f"remote.{gid}.{k}" for k in range(n_remote)]
        self.workers = self.remote + self.local


def _report_crash(put: Callable[[Any], None], name: str, exc: BaseException) -> None:
    put(_Crash(name, exc))


class _Actors:
    """The Collector and branch workers of one group: started together, stopped
    together, and the first crash among them."""

    def __init__(self, runtime: Runtime, own_runtime: Runtime | None, names: _Names,
                 extra: list | None = None, lane=None) -> None:
        self.runtime = runtime
        #: What the group's actors send on: the bus, or its in-process lane (_Lane).
        self.lane = lane if lane is not None else runtime.bus
        self.extra = list(extra or [])   # (name, deliver): the proxies of remote slots
        self.own_runtime = own_runtime
        self.names = names
        self.inbox: "queue.SimpleQueue[Delivery | _Crash]" = queue.SimpleQueue()
        self.workers: list[pykka.ActorRef] = []
        self.boxes: list[_LeaseBox] = []
        self.attached: list[str] = []
        self.phases: dict[str, float] = {}
        self.crash: _Crash | None = None
        #: A crash of the Collector or a worker, reported to the driver (a function of the
        #: inbox alone: nothing it is handed to holds the group's actors in a cycle, so
        #: they are freed when the group ends, not by the garbage collector).
        self.on_crash = functools.partial(_report_crash, self.inbox.put)
        self.pool = pool_of(runtime)   # the runtime's warm worker threads
        self.collector = _CollectorShell(
            (self.lane.as_is or self.lane) if isinstance(self.lane, _Lane) else self.lane,
            names.collector, self.on_crash)

    def start(self, host: _Host, start: GroupStart, inputs: UserInputs | None,
              as_is: bool = False) -> list[_LeaseBox]:
        # The driver attaches every name itself, one after the other from one socket (a
        # socket per actor thread costs ~10x more). Attach returns once the broker routes
        # the name; pykka queues what arrives before the actor's thread has started.
        runtime, names = self.runtime, self.names
        bus, lane = runtime.bus, self.lane
        # Every name routes before any work flows, in one round trip to the broker.
        boxes = host.boxes = [_LeaseBox(name) for name in names.local]
        routes = [(names.driver, self.inbox.put), (names.collector, self.collector.deliver)] + [
            (name, pooled_deliver(lane, host, box, name, names.collector))
            for name, box in zip(names.local, boxes)] + self.extra
        attach_many = getattr(bus, "attach_many", None)
        if attach_many is not None:
            attach_many(routes)
            self.attached.extend([name for name, _ in routes])
        else:
            for name, deliver in routes:
                bus.attach(name, deliver)
                self.attached.append(name)
        # Leases go out at once, into the workers' boxes; then each worker's thread (a
        # warm one of the runtime's pool, or a new one) is bound to its name and finds
        # its leases waiting: none waits for a Hello to make a round trip.
        (lane.send_as_is if as_is else lane.send)(names.driver, names.collector, start)
        if inputs is not None:
            lane.send(names.driver, names.collector, inputs)
        self.boxes = boxes
        self.workers = self.pool.bind(
            [_Bind(name, host, names.collector, self.on_crash, box, lane)
             for name, box in zip(names.local, boxes)])
        return boxes

    def helpers(self, host: _Host, bound: int) -> Callable[[], bool]:
        """Bind helpers (``HELP_AFTER_S``) to the group of one lease: as many as there
        are branches not started, with the worker and the helpers still at it within the
        bound; False once none is left to start (or the group stops). A helper holds
        no lease and has no bus name: it takes the next branch of the lease while its
        worker runs one, answered as that worker's (a part of its lease), until none is
        left, then goes back to the pool."""
        order, names = host.order, self.names

        def bind() -> bool:
            if host.stopping:
                return False
            left = order.started.count(0)   # branches not started yet
            busy = sum(1 for box in self.boxes[1:] if not box.returned)
            k = min(bound - 1 - busy, left)
            if k <= 0:
                return left > 0
            first = len(self.boxes) - 1
            boxes = [_LeaseBox(f"branch-helper.{names.gid}.{first + j}") for j in range(k)]
            self.boxes.extend(boxes)
            self.workers.extend(self.pool.bind(
                [_Bind(box.owner, host, names.collector, self.on_crash, box, self.lane,
                       helps=True) for box in boxes]))
            return True
        return bind

    def stop(self, *, abandoned: bool, t0: float) -> None:
        runtime = self.runtime
        if self.own_runtime is None:   # a shared runtime goes on: give the names back
            detach_many = getattr(runtime.bus, "detach_many", None)
            if detach_many is not None:
                detach_many(self.attached)
            else:
                for name in self.attached:
                    runtime.bus.detach(name)
        # Workers the Collector let go are back in the pool already; the others go back
        # now (every lease has answered) or, still running user code past a cancel
        # deadline, once it returns.
        stuck = sum(1 for box in self.boxes if box.running) if abandoned or self.crash else 0
        if stuck:
            log.warning("group %s: %d worker(s) still running user code past the deadline; "
                        "left behind (each rejoins its pool once its branch returns)",
                        self.names.gid, stuck)
        self.pool.release(self.workers, self.boxes, left_behind=bool(abandoned or self.crash))
        if self.own_runtime is not None:
            self.own_runtime.close()
        self.phases["stop"] = (time.monotonic() - t0 - self.phases.get("start", 0)
                               - self.phases.get("run", 0))


def _reporter(plan: _Plan, host: _Host, boxes: list[_LeaseBox], on_progress: Callable,
              t0: float) -> Callable[[bool], None]:
    before = len(plan.resume.finished) if plan.resume is not None else 0

    def report(done: bool) -> None:
        on_progress(GroupProgress(
            group_id=plan.group_id, total=len(plan.items),
            finished=before + sum(box.finished for box in boxes),
            failed=len(host.errors), elapsed=round(time.monotonic() - t0, 3),
            done=done, finished_before=before))
    return report


def _raise_crash(crash: _Crash, gid: str) -> None:
    if isinstance(crash.exc, (ConfigError, ValueError, TypeError)):
        raise crash.exc
    raise RunFailed(f"group {gid}: actor {crash.name!r} crashed: "
                    f"{type(crash.exc).__name__}: {crash.exc}") from crash.exc


def _group_start(plan: _Plan, gid: str, driver: str, workers: list[str],
                 settings: "_Settings", ledger: _Ledger,
                 one: bool = False) -> tuple[GroupStart, bool]:
    """The group's GroupStart, checked against the frame limit, and whether it may go
    on the lane as it is (``_Lane.send_as_is``). With ``one``, every branch in one
    lease (``_one_lease``): its branches start in input order on the one worker it goes
    to, and on helpers that take them from it one at a time, in that order."""
    ckpt = plan.resume
    start = GroupStart(
        group_id=gid, items=plan.items, workers=workers,
        max_concurrency=settings.concurrency, max_items=plan.max_items, driver=driver,
        chunk=plan.branches_to_run if one else settings.chunk, prefetch=settings.prefetch,
        min_lease_seconds=MIN_LEASE_S, announce=False, ordered=not one,
        batch_below=BATCH_BELOW_S, waves=True,
        suspend=settings.suspend, max_seconds=ledger.remaining_seconds(),
        cancel_deadline=float(settings.cancel_deadline),   # as decoding gives it back
        max_result_bytes=MAX_RESULT_BYTES, resume=ckpt is not None,
        finished=ckpt.finished if ckpt else dict(plan.finished or {}),
        journals=ckpt.journals if ckpt else {},
        pending=ckpt.pending if ckpt else [], used_ids=ckpt.used_ids if ckpt else [],
        approvers=plan.approvers, effects=ckpt.effects if ckpt else [])
    if plan.items_bytes is not None and ckpt is None and not plan.finished \
            and plan.items_bytes + 256 * (len(workers) + 16) < MAX_FRAME_BYTES:
        # Far below the limit: no need to encode it to know. Made of decoded items,
        # names, numbers and defaults, it would decode back as it is.
        return start, plan.approvers is None
    size = len(_encoder.encode(start))
    if size > MAX_FRAME_BYTES:
        raise ConfigError(f"the group's items take {size} bytes, over the {MAX_FRAME_BYTES}-"
                          "byte message limit: pass ids or paths as items and load the data "
                          "inside the target")
    return start, False


class _Lane:
    """The bus as a group whose actors all live in this process sends on it: each
    message is handed over on the sending thread (``send_inline``: stamped, logged and
    delivered in the bus's one order, as the in-memory bus always does) rather than
    through the broker's thread, so a warm group's messages cross no thread but the
    ones its branches run on. A group with branches in other processes sends on the
    bus itself."""

    def __init__(self, bus, copy: bool = True) -> None:
        self.stats = bus.stats
        inline = getattr(bus, "send_inline", None)
        if inline is None:
            self.send = self.send_as_is = bus.send
            self.as_is = None
            return
        #: For a message its sender vouches would decode back as it is, within the frame
        #: limit (``send_inline(copy=False)``): handed over as it is, encoded only for
        #: the log.
        self.send_as_is = functools.partial(inline, copy=False)
        self.send = inline if copy else self.send_as_is
        #: The lane for the Collector's messages (None: this one): a pure machine's
        #: output made only of what crossed the bus to it, so nothing in it would change
        #: on the way; handed over as it is (``copy=False``), encoded only for the log.
        self.as_is = _Lane(bus, copy=False) if copy else None

    def send_many(self, sender: str, out: list) -> None:
        send = self.send
        for receiver, msg in out:
            send(sender, receiver, msg)


class _CollectorShell:
    """The group's Collector, run where the bus delivers its messages (the broker's
    thread, or the sender's on the in-memory bus: either way one delivery at a time, in
    the bus's order), as a ControlActor would on a thread of its own: its answer to a
    worker leaves at once, without two hand-overs between threads. Its messages cross
    the bus and the log as before. A bug in the machine ends the group (``on_crash``);
    nothing more is handed to it after that."""

    def __init__(self, bus, name: str, on_crash: Callable[[str, BaseException], None]) -> None:
        self.bus = bus
        self.name = name
        self.machine = Collector(name)
        self._admit = self.machine.admit
        self._send_many = getattr(bus, "send_many", None)
        self.on_crash = on_crash
        self.crashed = False

    def deliver(self, delivery: Delivery) -> None:
        if self.crashed:
            self.bus.stats.unroutable += 1   # counted, as a message to a stopped actor
            return
        try:
            pass_to(self, delivery)
        except Exception as exc:  # a bug in the machine: the driver raises it
            self.crashed = True
            self.on_crash(self.name, exc)


def _drive(bus, inbox, host: _Host, driver: str, collector: str, gid: str, t0: float,
           ticks: bool, progress: Callable[[bool], None] | None = None,
           helpers: Callable[[], bool] | None = None):
    """Wait for the group's end, sending the time as ``Tick`` and a parent's cancellation
    as ``GroupCancel``, calling ``progress`` every ``PROGRESS_S`` and ``helpers`` after
    ``HELP_AFTER_S`` (then twice as long each time, up to a tick) until it says no
    branch is left to start. Every wait is bounded (one tick); a crashed actor (the
    Collector included) ends it.

    The Collector needs the time only for a seconds budget and for the cancel deadline
    once the group is stopping, so ticks go out only then."""
    ticker = Ticker(TICK_S, first=t0 + TICK_S)
    reporting = Ticker(PROGRESS_S, first=t0 + PROGRESS_S)
    helping = Ticker(HELP_AFTER_S, first=t0 + HELP_AFTER_S) if helpers is not None else None
    cancel_sent = False
    while True:
        now = time.monotonic()
        timeout = ticker.wait(now)
        if helping is not None and helping.due(now):
            # Looked at again later and later (up to a tick) while branches are left.
            helping.period = min(2 * helping.period, TICK_S)
            if not helpers():
                helping = None
        if helping is not None:
            timeout = min(timeout, helping.wait(now))
        try:
            item = inbox.get(timeout=timeout)
        except queue.Empty:
            item = None
        now = time.monotonic()
        if ticker.due(now):
            if ticks or host.stopping:
                bus.send(driver, collector, Tick(elapsed=round(now - t0, 6)))
            if not cancel_sent and host.parent is not None and host.parent.cancelled:
                cancel_sent = True
                host.cancel()
                bus.send(driver, collector, GroupCancel(group_id=gid,
                                                        reason="the parent branch was cancelled"))
            if progress is not None and reporting.due(now):
                progress(False)
        if item is None:
            continue
        if isinstance(item, _Crash):
            host.cancel()
            return None, item
        msg = item.msg
        if isinstance(msg, (GroupResult, GroupSuspended)) and msg.group_id == gid:
            return msg, None
        log.warning("group %s: driver got an unexpected %s", gid, type(msg).__name__)


def _error_of(host: _Host, msg: GroupResult) -> BaseException:
    if msg.error_branch is not None and msg.error_branch in host.errors:
        return host.errors[msg.error_branch]
    kinds = {"BudgetExhausted": BudgetExhausted, "HostLimitExceeded": HostLimitExceeded,
             "ResumeRefused": ResumeRefused, "ResultsTooLarge": ResultTooLarge}
    return kinds.get(msg.error_type, BranchError)(
        f"{msg.error_type}: {msg.error}" if msg.error_type not in kinds else msg.error)


def _outcome(plan: _Plan, host: _Host, ledger: _Ledger, store: Store, msg, elapsed: float,
             n_workers: int, concurrency: int, package_version: str) -> GroupOutcome:
    stats = {"elapsed": round(elapsed, 6), "workers": n_workers, "concurrency": concurrency,
             "leases": msg.leases, "peak_leases": msg.peak_leases,
             "peak_live_branches": host.live[0].peak if host.live else None}
    common = dict(group_id=plan.group_id, consumed=ledger.snapshot(), store=store.snapshot(),
                  stats=stats, trace=host.trace, effects=[tuple(e) for e in msg.effects])
    if isinstance(msg, GroupSuspended):
        path = plan.checkpoint
        if path is None:
            fd, name = tempfile.mkstemp(prefix=f"evobus-group-{plan.group_id}-", suffix=".ckpt")
            os.close(fd)
            path = Path(name)
        ckpt = GroupCheckpoint(
            group_id=plan.group_id, status=msg.status, target=plan.ref, items=plan.items,
            max_concurrency=plan.max_concurrency, max_items=plan.max_items,
            finished=msg.finished, journals=msg.journals, pending=msg.pending,
            used_ids=msg.used_ids, not_started=msg.not_started, effects=msg.effects,
            budgets=plan.budgets, consumed=ledger.snapshot(), store=store.snapshot(),
            approvers=plan.approvers, chunk=plan.options.get("chunk", 0),
            returns=type_name(plan.returns), suspend=plan.options.get("suspend", "all"),
            cancel_deadline=plan.options.get("cancel_deadline", CANCEL_DEADLINE_S),
            written_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), package_version=package_version,
            fingerprint=target_fingerprint(plan.fn), target_name=target_name(plan.fn),
            workers=plan.options.get("workers"))
        _write_checkpoint(path, ckpt)
        return GroupOutcome(status=msg.status, pending_interactions=list(msg.pending),
                            checkpoint=path, finished=sorted(msg.finished),
                            never_started=list(msg.not_started),
                            partial=as_partial(plan.returns, dict(msg.finished)), **common)
    if msg.status == "refused":
        raise ResumeRefused(msg.error)
    if msg.status == "completed":
        return GroupOutcome(status="completed", results=as_results(plan.returns, msg.results),
                            finished=list(range(len(msg.results))), **common)
    return GroupOutcome(status="failed", error=_error_of(host, msg),
                        error_branch=msg.error_branch, finished=sorted(msg.finished),
                        failed=list(msg.failed), cancelled=list(msg.cancelled),
                        never_started=list(msg.never_started), abandoned=list(msg.abandoned),
                        errors=dict(msg.errors),
                        partial=as_partial(plan.returns, dict(msg.finished)), **common)


def _ambient_parent(explicit: _Host | None) -> _Host | None:
    return explicit if explicit is not None else getattr(_ambient, "host", None)
