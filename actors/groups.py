"""Bounded parallel groups: fan a target out over independent items, join the results in
input order (docs/groups.md).

    from actors import parallel
    results = parallel(process_ticket, tickets, max_concurrency=4, max_items=32)

The program declares the target, the items and the bounds; the runtime organises the
branches without giving them any extra rights. A group is a :class:`Collector` (a pure
control actor on the bus) and branch workers (pykka threads owned by the
:class:`~actors.runtime.Runtime`) that take ``Branch`` leases and answer ``BranchDone``,
``BranchFailed`` or ``Interaction``. Everything that crosses the bus is data: items,
results, answers and effect values are JSON-like (msgpack), never pickled objects.

This module is the edge: the driver (``run_group``), the workers that call the target,
the ``ctx`` object, host limits, budgets, the shared store and checkpoints. Every
decision about which branch runs when lives in :mod:`actors.collector`.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
import queue
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import msgspec
import pykka

from actors import refs
from actors.worker import Awaiter
from actors.collector import ENDED, Collector, check_inputs
from actors.errors import ConfigError, EvobusError, RunFailed
from actors.shell import ControlActor, _FastInbox, teller
from bus.base import MAX_FRAME_BYTES, Delivery
from protocol import (Branch, BranchDone, BranchFailed, Cancel, GroupCancel, GroupResult,
                      GroupStart, GroupSuspended, Hold, Interaction, JournalEntry,
                      PendingInteraction, Revoke, Stop, Tick, UserInputs)

log = logging.getLogger(__name__)

__all__ = ["BranchCancelled", "BranchContext", "BranchError", "BudgetExhausted", "Budgets",
           "Consumed", "GroupCheckpoint", "GroupError", "GroupFailed", "GroupOutcome",
           "GroupPaused", "GroupProgress", "HostLimitExceeded", "HostLimits", "ResumeRefused",
           "Store", "load_checkpoint", "parallel", "resume_group", "run_group"]

#: How often the driver sends the Collector the time (seconds budget, cancel deadline).
TICK_S = 0.05
#: Guided leases are kept at least this long (by measured branch time) once the queue
#: runs low: a lease shorter than a bus round trip leaves its worker idle after it.
MIN_LEASE_S = 0.01
#: How often ``on_progress`` hears how far a running group has got.
PROGRESS_S = 1.0
#: How long a group waits, by default, for its cancelled branches to stop.
CANCEL_DEADLINE_S = 5.0
#: How long starting the group's actors may take.
START_DEADLINE_S = 10.0
#: How long the group's actors may take to stop once the group has ended.
STOP_GRACE_S = 5.0
#: The results of one group travel in one message: leave room for the envelope.
MAX_RESULT_BYTES = MAX_FRAME_BYTES - 64 * 1024
CHECKPOINT_FORMAT = "evobus-group-checkpoint"
CHECKPOINT_VERSION = 1

_encoder = msgspec.msgpack.Encoder()
_ambient = threading.local()    # the group host of the branch running on this thread


# -- errors ---------------------------------------------------------------------------


class GroupError(EvobusError):
    """Base of the errors of parallel groups."""


class BudgetExhausted(GroupError):
    """A run budget (calls, seconds, cost units) is used up; an error of the whole group."""


class HostLimitExceeded(GroupError):
    """A host limit refuses the request (a group nested deeper than ``max_depth``)."""


class BranchError(GroupError):
    """A branch's error known only by its text (it was raised where the object could not
    travel back, e.g. in another process)."""


class ResumeRefused(ConfigError):
    """A resume that does not fit its checkpoint: unknown or already-used interaction ids,
    no approval rights, a checkpoint that already ended. Nothing ran."""


class GroupFailed(GroupError):
    """The group failed: ``error`` is the first error (also ``__cause__``); the lists say
    which branches finished, failed, were cancelled, never started or were abandoned."""

    def __init__(self, outcome: "GroupOutcome") -> None:
        self.outcome = outcome
        self.error = outcome.error
        self.finished = outcome.finished
        self.failed = outcome.failed
        self.cancelled = outcome.cancelled
        self.never_started = outcome.never_started
        self.abandoned = outcome.abandoned
        self.effects = outcome.effects
        where = (f" at branch {outcome.error_branch}" if outcome.error_branch is not None
                 else "")
        text = f"{type(self.error).__name__}: {self.error}" if self.error else "unknown error"
        parts = [f"finished {len(self.finished)}", f"failed {len(self.failed)}",
                 f"cancelled {len(self.cancelled)}",
                 f"never started {len(self.never_started)}"]
        if self.abandoned:
            parts.append(f"abandoned {len(self.abandoned)} (still running past the "
                         "cancel deadline)")
        if self.effects:
            parts.append(f"{len(self.effects)} effect(s) already performed, not undone")
        super().__init__(f"parallel group {outcome.group_id} failed{where}: {text} "
                         f"({', '.join(parts)})")


class GroupPaused(GroupError):
    """``parallel()`` cannot return: the group waits on answers or approvals. The
    checkpoint is written; resume it with :func:`resume_group`."""

    def __init__(self, outcome: "GroupOutcome") -> None:
        self.outcome = outcome
        ids = ", ".join(p.id for p in outcome.pending_interactions)
        super().__init__(f"parallel group {outcome.group_id} is paused ({outcome.status}: "
                         f"{ids}); answer with resume_group({str(outcome.checkpoint)!r}, "
                         "user_inputs={id: answer}, approvals={id: True}) or `evobus resume "
                         f"{outcome.checkpoint} --answers FILE`")


class BranchCancelled(BaseException):
    """Raised by ``ctx.raise_if_cancelled()``: the branch stops because the group is
    stopping. A ``BaseException`` (like trio's ``Cancelled``) so ``except Exception`` in
    the target does not swallow it."""


class _Suspend(BaseException):
    """Unwinds a branch at an unanswered ``ask``/``approve``; never seen by the caller."""

    def __init__(self, pending: PendingInteraction, journal: list[JournalEntry]) -> None:
        super().__init__(pending.id)
        self.pending = pending
        self.journal = journal


# -- host limits, budgets, the store --------------------------------------------------


def _positive(name: str, value, *, allow_none: bool = True, number: bool = False) -> None:
    if value is None and allow_none:
        return
    kinds = (int, float) if number else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        what = "a positive number" if number else "a positive integer"
        raise ConfigError(f"{name} must be {what}, got {value!r}")


@dataclass(frozen=True)
class HostLimits:
    """What the host allows, whatever the program asks for (a runtime setting).

    - ``max_concurrency``: caps every group's ``max_concurrency``;
    - ``max_live_branches``: branches running at once across a group and every group
      nested in its branches (a branch waiting for its nested group does not count);
    - ``max_external_calls``: ``ctx.effect`` calls running at once, across the tree;
    - ``max_depth``: how deep groups nest (1: no group inside a branch).

    Nested groups inherit their parent's limits; a nested group may tighten them, never
    loosen them."""

    max_concurrency: int | None = None
    max_live_branches: int | None = None
    max_external_calls: int | None = None
    max_depth: int = 4

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "max_live_branches", "max_external_calls"):
            _positive(f"HostLimits.{name}", getattr(self, name))
        _positive("HostLimits.max_depth", self.max_depth, allow_none=False)

    def tightened(self, other: "HostLimits | None") -> "HostLimits":
        if other is None:
            return self

        def low(a, b):
            return b if a is None else a if b is None else min(a, b)

        return HostLimits(max_concurrency=low(self.max_concurrency, other.max_concurrency),
                          max_live_branches=low(self.max_live_branches, other.max_live_branches),
                          max_external_calls=low(self.max_external_calls,
                                                 other.max_external_calls),
                          max_depth=min(self.max_depth, other.max_depth))


class Budgets(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Run budgets shared by every branch of a group and every group nested in them:
    ``calls`` (branch starts), ``seconds`` (wall time while the group runs; time spent
    paused does not count), ``cost`` (units reported with ``ctx.spend``). Exhausting
    one is an error of the group."""

    calls: int | None = None
    seconds: float | None = None
    cost: float | None = None

    def __post_init__(self) -> None:
        _positive("Budgets.calls", self.calls)
        _positive("Budgets.seconds", self.seconds, number=True)
        _positive("Budgets.cost", self.cost, number=True)


class Consumed(msgspec.Struct, frozen=True, kw_only=True):
    """What a group has used of its budgets so far (kept across a pause and resume)."""

    calls: int = 0
    seconds: float = 0.0
    cost: float = 0.0


class _Ledger:
    """Budget accounting for one group; a nested group's ledger charges its parents too."""

    def __init__(self, budgets: Budgets, consumed: Consumed | None = None,
                 parent: "_Ledger | None" = None) -> None:
        consumed = consumed or Consumed()
        self.lock = threading.Lock()
        self.budgets = budgets
        self.calls = consumed.calls
        self.cost = consumed.cost
        self.seconds_before = consumed.seconds
        self.t0 = time.monotonic()
        self.parent = parent
        chain, ledger = [], self
        while ledger is not None:
            chain.append(ledger)
            ledger = ledger.parent
        self.chain = chain[::-1]     # root first: locks are always taken in this order
        self.limited = any(lg.budgets.calls is not None or lg.budgets.cost is not None
                           or lg.budgets.seconds is not None for lg in self.chain)

    def seconds(self) -> float:
        return self.seconds_before + (time.monotonic() - self.t0)

    def remaining_seconds(self) -> float | None:
        left = [lg.budgets.seconds - lg.seconds() for lg in self.chain
                if lg.budgets.seconds is not None]
        return min(left) if left else None

    def _charge(self, field_: str, amount: float) -> None:
        with contextlib.ExitStack() as stack:
            for lg in self.chain:
                stack.enter_context(lg.lock)
            for lg in self.chain:
                limit = getattr(lg.budgets, field_)
                used = getattr(lg, field_)
                if limit is not None and used + amount > limit:
                    raise BudgetExhausted(
                        f"the {field_} budget ({limit:g}) is used up: {used:g} used, "
                        f"{amount:g} more asked; raise budgets=Budgets({field_}=...) or "
                        "do less per group")
                if lg.budgets.seconds is not None and lg.seconds() >= lg.budgets.seconds:
                    raise BudgetExhausted(
                        f"the seconds budget ({lg.budgets.seconds:g} s) is used up; raise "
                        "budgets=Budgets(seconds=...)")
            for lg in self.chain:
                setattr(lg, field_, getattr(lg, field_) + amount)

    def add_calls(self, n: int) -> None:
        """Count ``n`` branch starts at once (no budget to check: ``limited`` is False)."""
        ledger = self
        while ledger is not None:
            with ledger.lock:
                ledger.calls += n
            ledger = ledger.parent

    def charge_call(self) -> None:
        if not self.limited:
            self.calls += 1   # under the host lock of the branch's group (see _Host.begin)
            parent = self.parent
            while parent is not None:
                with parent.lock:
                    parent.calls += 1
                parent = parent.parent
            return
        self._charge("calls", 1)

    def charge_cost(self, units: float) -> None:
        self._charge("cost", units)

    def snapshot(self) -> Consumed:
        return Consumed(calls=self.calls, seconds=round(self.seconds(), 6), cost=self.cost)


def _encodable(value: Any, what: str) -> bytes:
    try:
        return _encoder.encode(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"{what} is not encodable ({exc}): values that cross the bus or go "
                        "into a checkpoint must be JSON-like (None, bool, int, float, str, "
                        "bytes, lists, dicts with str keys) or msgspec Structs") from None


class Store:
    """A store shared by every branch of a group (and of the groups nested in them).

    Writes are serialized by a runtime lock, so concurrent ``incr`` calls from every
    branch give the exact total. This is *not* a transaction on an external backend: it
    serializes writes inside this process and nothing else. Values are JSON-like; the
    store is kept in the checkpoint when the group pauses."""

    def __init__(self, initial: dict[str, Any] | None = None) -> None:
        self._lock = threading.RLock()
        self._data: dict[str, Any] = {}
        for key, value in (initial or {}).items():
            self.set(key, value)

    def _check(self, key, value) -> None:
        if not isinstance(key, str):
            raise TypeError(f"store keys are str, got {key!r}")
        _encodable(value, f"store value for {key!r}")

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            return self._data.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self._check(key, value)
        with self._lock:
            self._data[key] = value

    def incr(self, key: str, by: int | float = 1) -> int | float:
        with self._lock:
            value = self._data.get(key, 0) + by
            self._data[key] = value
            return value

    def update(self, key: str, fn: Callable[[Any], Any], default: Any = None) -> Any:
        """Read-modify-write one key under the lock; returns the new value."""
        with self._lock:
            value = fn(self._data.get(key, default))
            self._check(key, value)
            self._data[key] = value
            return value

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Any]]:
        """The data itself, under the lock, for a write spanning several keys."""
        with self._lock:
            yield self._data
            for key, value in self._data.items():
                self._check(key, value)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return msgspec.msgpack.decode(_encoder.encode(self._data))

    def __repr__(self) -> str:
        return f"Store({self.snapshot()!r})"


class _Gate:
    """A host-wide counting gate (live branches, external calls)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self.peak = 0
        self.cond = threading.Condition()

    def enter(self, stop: Callable[[], bool]) -> bool:
        with self.cond:
            while self.count >= self.limit:
                if stop():
                    return False
                self.cond.wait(TICK_S)   # bounded: the stop flag is seen within a tick
            self.count += 1
            self.peak = max(self.peak, self.count)
            return True

    def leave(self) -> None:
        with self.cond:
            self.count -= 1
            self.cond.notify()


def _enter_all(gates: tuple[_Gate, ...], stop: Callable[[], bool]) -> bool:
    """Enter every gate of a chain (root first); all or none."""
    for k, gate in enumerate(gates):
        if not gate.enter(stop):
            for entered in gates[:k]:
                entered.leave()
            return False
    return True


# -- the group host: what branches share inside this process ----------------------------


_GO = None
_NOT_NOW = object()


class _Host:
    """The in-process side of one group: the flags workers check before each start, the
    budgets, the store, the gates. The Collector decides from messages; these flags only
    make a decision visible at once to every worker of this process (a worker that sees
    an error stops starting branches before its message reaches the Collector)."""

    def __init__(self, *, group_id: str, target: Callable, wants_ctx: bool, depth: int,
                 limits: HostLimits, ledger: _Ledger, store: Store,
                 live: tuple[_Gate, ...], external: tuple[_Gate, ...],
                 parent: "_Host | None", trace: bool,
                 runtime) -> None:
        self.group_id = group_id
        self.target = target
        self.wants_ctx = wants_ctx
        self.depth = depth
        self.limits = limits
        self.ledger = ledger
        self.store = store
        self.live = live
        self.external = external
        self.parent = parent
        self.runtime = runtime
        self.lock = threading.Lock()
        self.stopping = False      # first error or Cancel: no new start; ctx.cancelled
        self.holding = False       # an interaction: no new start
        self.errors: dict[int, BaseException] = {}
        self.trace: list[tuple[str, int]] | None = [] if trace else None
        # Nothing to check atomically per start (no budget, no trace): a worker reads the
        # flags (one read is atomic) and counts its starts once per lease.
        self.fast = not trace and not ledger.limited

    @property
    def cancelled(self) -> bool:
        host = self
        while host is not None:
            if host.stopping:
                return True
            host = host.parent
        return False

    def begin(self, index: int):
        """May branch ``index`` start now? ``_GO``, ``_NOT_NOW`` (the group is stopping or
        pausing) or the exception that fails it (a budget). Atomic with :meth:`fail`."""
        with self.lock:
            if self.stopping or self.holding or (self.parent is not None
                                                 and self.parent.cancelled):
                return _NOT_NOW
            try:
                self.ledger.charge_call()
            except BudgetExhausted as exc:
                return exc
            if self.trace is not None:
                self.trace.append(("start", index))
        return _GO

    def fail(self, index: int, exc: BaseException) -> bool:
        """Record a branch's error and stop new starts; True if the group was already
        stopping (a secondary error)."""
        with self.lock:
            after = self.stopping
            self.stopping = True
            self.errors.setdefault(index, exc)
            if self.trace is not None:
                self.trace.append(("error", index))
        return after

    def cancel(self) -> None:
        with self.lock:
            if not self.stopping and self.trace is not None:
                self.trace.append(("cancel", -1))
            self.stopping = True

    def hold(self, index: int = -1) -> None:
        with self.lock:
            if not self.holding and self.trace is not None:
                self.trace.append(("hold", index))
            self.holding = True


# -- ctx ----------------------------------------------------------------------------------


class BranchContext:
    """What a target taking ``(item, ctx)`` gets: one per invocation (its own variables).

    - ``ask(question)``: the answer; with none yet, the group pauses (``user_input_pending``)
      and this branch runs again on resume, where the journal returns the answer;
    - ``approve(action) -> bool``: the same for a human validation (``approval_pending``);
    - ``effect(name, fn, *args, **kwargs)``: run an external effect once; its result is
      journaled, so a branch replayed after a pause gets it back without running it again;
    - ``cancelled``: True once the group is stopping; ``raise_if_cancelled()``;
    - ``store``: the shared :class:`Store`; ``spend(units)``: charge the cost budget;
    - ``parallel(...)``/``run_group(...)``: a nested group (shares limits, budgets, store).

    Replay must be deterministic: the same asks, approvals and effects in the same order.
    """

    __slots__ = ("_host", "branch", "item", "_journal", "_pos", "_effects")

    def __init__(self, host: _Host, branch: int, item: Any,
                 journal: list[JournalEntry] | None) -> None:
        self._host = host
        self.branch = branch
        self.item = item
        self._journal: list[JournalEntry] = list(journal) if journal else []
        self._pos = 0
        self._effects: list[tuple[int, str]] = []

    @property
    def group_id(self) -> str:
        return self._host.group_id

    @property
    def depth(self) -> int:
        return self._host.depth

    @property
    def cancelled(self) -> bool:
        return self._host.cancelled

    @property
    def store(self) -> Store:
        return self._host.store

    def raise_if_cancelled(self) -> None:
        if self._host.cancelled:
            raise BranchCancelled(f"branch {self.branch} of group {self.group_id} cancelled")

    def spend(self, units: float) -> None:
        """Charge ``units`` to the cost budget (raises :class:`BudgetExhausted`)."""
        _positive("ctx.spend(units)", units, allow_none=False, number=True)
        self._host.ledger.charge_cost(units)

    def _replay(self, kind: str, key: Any) -> JournalEntry | None:
        pos = self._pos
        self._pos += 1
        if pos < len(self._journal):
            entry = self._journal[pos]
            if entry.kind != kind or entry.key != key:
                raise GroupError(
                    f"branch {self.branch} is not deterministic: on replay, step {pos} is "
                    f"{kind}({key!r}) but the journal holds {entry.kind}({entry.key!r}); a "
                    "branch must ask, approve and run effects in the same order every time")
            return entry
        return None

    def _interact(self, kind: str, prompt: Any):
        if self._host.depth > 1:
            raise HostLimitExceeded(
                f"ctx.{kind}() inside a nested group (depth {self._host.depth}) is not "
                "supported: ask in the top-level branch before starting the nested group")
        prompt = msgspec.msgpack.decode(_encodable(prompt, f"the {kind} prompt"))
        entry = self._replay(kind, prompt)
        if entry is not None:
            return entry.value
        # The answer will take this position in the journal: the id names the occurrence.
        iid = f"{self._host.group_id}.{self.branch}.{len(self._journal)}"
        raise _Suspend(PendingInteraction(id=iid, branch=self.branch, kind=kind, prompt=prompt,
                                          item=self.item), list(self._journal))

    def ask(self, question: Any) -> Any:
        return self._interact("ask", question)

    def approve(self, action: Any) -> bool:
        return bool(self._interact("approve", action))

    def effect(self, name: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run ``fn(*args, **kwargs)`` once for this branch, journaled: on a resume the
        journaled result is returned and ``fn`` does not run again. With an ``async def``
        ``fn`` (in an async target) it returns an awaitable: ``await ctx.effect(...)``,
        one effect at a time."""
        if not isinstance(name, str):
            raise TypeError(f"ctx.effect(name, fn): name must be a str, got {name!r}")
        pos = self._pos
        entry = self._replay("effect", name)
        if inspect.iscoroutinefunction(fn):
            return self._effect_async(name, pos, entry, fn, args, kwargs)
        if entry is not None:
            return entry.value
        gates = self._external_slot()
        try:
            value = fn(*args, **kwargs)
        finally:
            for gate in gates:
                gate.leave()
        return self._journal_effect(name, pos, value)

    async def _effect_async(self, name: str, pos: int, entry: JournalEntry | None, fn,
                            args, kwargs) -> Any:
        if entry is not None:
            return entry.value
        gates = self._external_slot()
        try:
            value = await fn(*args, **kwargs)
        finally:
            for gate in gates:
                gate.leave()
        return self._journal_effect(name, pos, value)

    def _external_slot(self) -> tuple[_Gate, ...]:
        """Wait for a slot under every external-call limit (host limits); the caller
        leaves them once the effect has run."""
        gates = self._host.external
        if gates and not _enter_all(gates, lambda: self._host.cancelled):
            raise BranchCancelled(f"branch {self.branch}: cancelled while waiting for an "
                                  "external-call slot")
        return gates

    def _journal_effect(self, name: str, pos: int, value: Any) -> Any:
        if len(self._journal) != pos:   # effects awaited together, ending out of order
            raise GroupError(f"branch {self.branch}: effect {name!r} (step {pos}) ended out "
                             f"of order ({len(self._journal)} steps journaled so far); await "
                             "each effect before the next ask, approve or effect: the "
                             "journal replays them in order")
        value = msgspec.msgpack.decode(_encodable(value, f"the result of effect {name!r}"))
        self._journal.append(JournalEntry(kind="effect", key=name, value=value))
        self._effects.append((self.branch, name))
        return value

    def parallel(self, target, items, *, max_concurrency: int, max_items: int, **options):
        return parallel(target, items, max_concurrency=max_concurrency, max_items=max_items,
                        _parent=self._host, **options)

    def run_group(self, target, items, *, max_concurrency: int, max_items: int, **options):
        return run_group(target, items, max_concurrency=max_concurrency, max_items=max_items,
                         _parent=self._host, **options)


# -- the branch worker ------------------------------------------------------------------


def _describe(exc: BaseException, limit: int = 500) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _LeaseBox:
    """The leases a worker holds but has not started, in the order they came: the worker
    runs them from here, one after the other, and ``Revoke`` takes one back on the bus
    thread (the worker's own thread may be busy with a long branch).

    Leases may arrive before the worker's thread runs: the box keeps them, and the
    worker takes them when it starts (``ref`` is set then, by the worker itself)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queued: dict[str, Branch] = {}
        self.ref: pykka.ActorRef | None = None
        self.stop = False          # a Stop came before the worker's thread ran
        self.finished = 0          # branches run to a value (written by the worker only)

    def put(self, lease: Branch) -> None:
        with self.lock:
            self.queued[lease.lease_id] = lease

    def take(self, lease_id: str) -> Branch | None:
        """The lease if it had not started (it never will now), else None."""
        with self.lock:
            return self.queued.pop(lease_id, None)

    def next(self) -> Branch | None:
        """The oldest lease not started, taken out of the box, or None."""
        with self.lock:
            if not self.queued:
                return None
            return self.queued.pop(next(iter(self.queued)))


def _worker_deliver(bus, host: _Host, box: _LeaseBox, name: str,
                    collector: str) -> Callable[[Delivery], None]:
    """The bus side of a worker. A lease goes into the worker's box, and the worker is
    woken if its thread runs; one that has not started yet finds the lease when it does
    (``box.ref`` is set by the worker before it looks into the box: nothing is missed)."""

    def tell(delivery: Delivery) -> None:
        ref = box.ref
        if ref is None:   # not started: counted with unroutable messages
            bus.stats.unroutable += 1
            return
        try:
            ref.tell(delivery)
        except pykka.ActorDeadError:  # counted with unroutable messages
            bus.stats.unroutable += 1

    def deliver(delivery: Delivery) -> None:
        match delivery.msg:
            case Branch() as lease:
                box.put(lease)
                if box.ref is not None:
                    tell(delivery)
            case Stop():
                box.stop = True
                if box.ref is not None:
                    tell(delivery)
            case Revoke(lease_id=lease_id):
                lease = box.take(lease_id)
                if lease is not None:
                    bus.send(name, collector, BranchDone(group_id=lease.group_id,
                                                         lease_id=lease_id, worker=name,
                                                         unstarted=list(lease.indices)))
            case Cancel():
                host.cancel()
            case Hold():
                host.hold()
            case _:
                tell(delivery)

    return deliver


class _CollectorActor(ControlActor):
    """The Collector's shell: a ControlActor whose bus name the group's driver attaches
    and detaches (see :class:`GroupWorker`). Once the group has ended it stops by itself
    (nothing it receives after that can change the result), so the driver's teardown
    does not wait for it."""

    def on_start(self) -> None:
        threading.current_thread().name = f"evobus-{self.name}"

    def on_receive(self, message: Delivery) -> None:
        super().on_receive(message)
        if self.machine.phase == ENDED:
            self.actor_ref.stop(block=False)

    def on_stop(self) -> None:
        pass


_WAKE = object()   # a worker's note to itself: look into the box



class GroupWorker(_FastInbox, pykka.ThreadingActor):
    """Runs one group's branches: one lease at a time, one branch at a time, in the
    order the leases came (from its :class:`_LeaseBox`; a message only wakes it).

    The group's driver attaches its bus name (:func:`_worker_deliver`): from one thread,
    one socket, instead of a socket per worker thread. ``Cancel`` and ``Hold`` take
    effect on the bus thread, at once (the worker's own thread is busy running the lease
    they are about). ``Stop`` (the Collector has no more work for it) ends it while the
    other workers finish, instead of at the group's end."""

    use_daemon_thread = True   # a branch stuck in user code must not keep the process alive

    def __init__(self, bus, name: str, host: _Host, collector: str, on_crash,
                 box: "_LeaseBox") -> None:
        super().__init__()
        self.bus = bus
        self.name = name
        self.host = host
        self.collector = collector
        self.on_crash = on_crash
        self.box = box
        self.settle = Awaiter()   # async targets: one event loop for this worker's thread

    def on_start(self) -> None:
        threading.current_thread().name = f"evobus-{self.name}"
        box = self.box
        box.ref = self.actor_ref   # before looking into the box (see _worker_deliver)
        # Leases that came before the thread ran: run them from on_receive (where a
        # failure reaches on_failure, and so the driver), not here.
        self.actor_ref.tell(_WAKE)
        if box.stop:
            self.stop()

    def _drain(self) -> None:
        box = self.box
        lease = box.next()
        while lease is not None:   # a revoked lease is not in the box any more
            self._run(lease)
            lease = box.next()

    def on_receive(self, message) -> None:
        if message is _WAKE:
            return self._drain()
        match message.msg:
            case Branch():
                self._drain()
            case Stop():
                self.stop()   # a tell to itself: no future to make, nobody waits on it
            case other:
                log.warning("%s: unexpected %s", self.name, type(other).__name__)

    def on_failure(self, exception_type, exception_value, traceback) -> None:
        self.on_crash(self.name, exception_value)

    def on_stop(self) -> None:
        self.settle.close()   # the event loop async targets ran on, if any

    def _run(self, lease: Branch) -> None:
        host = self.host
        target = host.target
        wants_ctx = host.wants_ctx
        live = host.live
        journals = lease.journals
        indices = lease.indices
        items = lease.items
        done: list[int] = []
        values: list[Any] = []
        cancelled: list[int] = []
        effects: list[tuple[int, str]] = []
        t0 = time.monotonic()
        previous = getattr(_ambient, "host", None)
        _ambient.host = host
        fast = host.fast
        parent = host.parent
        box = self.box
        settle = self.settle
        starts = 0

        def answer(**kw) -> None:
            # Counted before the answer leaves: the driver reads the ledger at the end.
            if starts:
                host.ledger.add_calls(starts)
            self._answer(lease, done, values, cancelled, effects, t0=t0, **kw)

        try:
            for pos, index in enumerate(indices):
                if live:
                    if not _enter_all(live, lambda: host.cancelled or host.holding):
                        return answer(unstarted=indices[pos:])
                    _ambient.slots = live
                try:
                    if fast:
                        if host.stopping or host.holding or (parent is not None
                                                             and parent.cancelled):
                            verdict = _NOT_NOW
                        else:
                            verdict = _GO
                            starts += 1
                    else:
                        verdict = host.begin(index)
                    if verdict is _NOT_NOW:
                        return answer(unstarted=indices[pos:])
                    if verdict is not _GO:
                        after = host.fail(index, verdict)
                        return answer(unstarted=indices[pos + 1:],
                                      failed=(index, verdict, after))
                    ctx = None
                    try:
                        if wants_ctx:
                            ctx = BranchContext(host, index, items[pos], journals.get(index))
                            value = target(items[pos], ctx)
                        else:
                            value = target(items[pos])
                        if hasattr(value, "__await__"):   # an async target: run it here
                            value = settle(value)
                    except _Suspend as suspend:
                        host.hold(index)
                        if ctx is not None:
                            effects += ctx._effects
                        return answer(unstarted=indices[pos + 1:],
                                      suspended=(index, suspend))
                    except BranchCancelled:
                        cancelled.append(index)
                        if ctx is not None:
                            effects += ctx._effects
                        continue
                    except Exception as exc:  # the branch's error -> Collector: stops the group
                        after = host.fail(index, exc)
                        if ctx is not None:
                            effects += ctx._effects
                        return answer(unstarted=indices[pos + 1:],
                                      failed=(index, exc, after))
                    if ctx is not None and ctx._effects:
                        effects += ctx._effects
                    done.append(index)
                    values.append(value)
                    box.finished += 1
                finally:
                    if live:
                        _ambient.slots = ()
                        for gate in live:
                            gate.leave()
            return answer(unstarted=[])
        finally:
            _ambient.host = previous

    def _answer(self, lease: Branch, done, values, cancelled, effects, *, unstarted, t0,
                failed=None, suspended=None) -> None:
        try:
            nbytes = len(_encoder.encode(values))
        except (TypeError, ValueError, OverflowError):
            # A result that cannot cross the bus fails its branch (and so the group).
            for k, value in enumerate(values):
                try:
                    _encoder.encode(value)
                except (TypeError, ValueError, OverflowError) as exc:
                    bad = done[k]
                    error = TypeError(
                        f"the result of branch {bad} ({type(value).__name__}) cannot cross "
                        f"the bus ({exc}): return JSON-like values (None, bool, int, float, "
                        "str, bytes, lists, dicts with str keys) or msgspec Structs")
                    after = self.host.fail(bad, error)
                    self.box.finished -= 1   # counted when it returned: it failed instead
                    rest = [(i, v) for i, v in zip(done, values) if i != bad]
                    done = [i for i, _ in rest]
                    values = [v for _, v in rest]
                    if failed is None:
                        failed = (bad, error, after)
                        suspended = None
                    break
            else:  # every value encodes alone: not a result's fault; a bug, let it crash
                raise
            return self._answer(lease, done, values, cancelled, effects, unstarted=unstarted,
                                t0=t0, failed=failed, suspended=suspended)
        common = dict(group_id=lease.group_id, lease_id=lease.lease_id, worker=self.name,
                      indices=done, values=values, cancelled=cancelled, unstarted=unstarted,
                      effects=effects, nbytes=nbytes)
        if failed is not None:
            index, exc, after = failed
            msg = BranchFailed(index=index, error=_describe(exc), error_type=type(exc).__name__,
                               after_stop=after, **common)
        elif suspended is not None:
            index, suspend = suspended
            msg = Interaction(index=index, pending=suspend.pending, journal=suspend.journal,
                              **common)
        else:
            msg = BranchDone(elapsed=round(time.monotonic() - t0, 6), **common)
        self.bus.send(self.name, self.collector, msg)


# -- the outcome, the checkpoint ------------------------------------------------------------


@dataclass(frozen=True)
class GroupProgress:
    """What ``on_progress`` receives: about once a second while a group runs
    (``PROGRESS_S``), and once more when it has ended (``done``), on the caller's thread.

    ``total``: the group's items; ``finished``: branches that returned a value, those a
    resumed group had finished before (``finished_before``) included; ``failed``:
    branches that raised (the group stops at the first); ``elapsed``: seconds since this
    call started."""

    group_id: str
    total: int
    finished: int
    failed: int
    elapsed: float
    done: bool = False
    finished_before: int = 0


@dataclass
class GroupOutcome:
    """What :func:`run_group` and :func:`resume_group` return.

    ``status``: ``completed`` (``results`` in input order), ``failed`` (``error`` is the
    first error), ``user_input_pending`` or ``approval_pending`` (``pending_interactions``
    to answer, ``checkpoint`` the file to resume from)."""

    status: str
    group_id: str
    results: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    error_branch: int | None = None
    pending_interactions: list[PendingInteraction] = field(default_factory=list)
    checkpoint: Path | None = None
    finished: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    never_started: list[int] = field(default_factory=list)
    abandoned: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    effects: list[tuple[int, str]] = field(default_factory=list)
    consumed: Consumed = field(default_factory=Consumed)
    store: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    trace: list[tuple[str, int]] | None = None
    partial: dict[int, Any] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "completed"


class GroupCheckpoint(msgspec.Struct, kw_only=True):
    """A paused group, as a file (msgpack; never pickle): finished results, every
    suspended branch's journal, interactions pending and already used, consumed budgets,
    the store, and the target as an import path when it has one."""

    format: str = CHECKPOINT_FORMAT
    version: int = CHECKPOINT_VERSION
    group_id: str
    status: str
    target: refs.Ref | None = None
    items: list[Any] = []
    max_concurrency: int = 1
    max_items: int = 1
    finished: dict[int, Any] = {}
    journals: dict[int, list[JournalEntry]] = {}
    pending: list[PendingInteraction] = []
    used_ids: list[str] = []
    not_started: list[int] = []
    effects: list[tuple[int, str]] = []
    budgets: Budgets = Budgets()
    consumed: Consumed = Consumed()
    store: dict[str, Any] = {}
    approvers: list[str] | None = None
    chunk: int = 0
    cancel_deadline: float = CANCEL_DEADLINE_S
    written_at: str = ""
    package_version: str = ""


def _write_checkpoint(path: Path, ckpt: GroupCheckpoint) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = msgspec.msgpack.encode(ckpt)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | os.PathLike) -> GroupCheckpoint:
    """Read a group checkpoint; :class:`ResumeRefused` names what is wrong with it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ResumeRefused(f"{path}: cannot read the checkpoint ({exc.strerror})") from None
    try:
        ckpt = msgspec.msgpack.decode(data, type=GroupCheckpoint)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ResumeRefused(f"{path}: not a parallel-group checkpoint ({exc})") from None
    if ckpt.format != CHECKPOINT_FORMAT:
        raise ResumeRefused(f"{path}: not a parallel-group checkpoint (format {ckpt.format!r})")
    if ckpt.version > CHECKPOINT_VERSION:
        raise ResumeRefused(f"{path}: checkpoint version {ckpt.version} is newer than this "
                            f"evobus reads ({CHECKPOINT_VERSION}); upgrade evobus")
    return ckpt


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """One resumer at a time per checkpoint (an advisory lock, released if we die)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock; documented
        yield
        return
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ResumeRefused(f"{path}: another process is resuming this checkpoint; "
                                "wait for it to finish") from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.unlink(lock_path)


# -- the driver --------------------------------------------------------------------------


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
    "runtime": "an actors.Runtime to run on (not closed by the group)",
    "allow": "module prefixes a target named by import path may come from",
    "trace": "True: record the start/error/cancel/hold decisions in outcome.trace",
    "pass_ctx": "True/False: pass ctx as the second argument (default: from the signature)",
    "on_progress": "a callable given a GroupProgress about once a second and at the end",
}
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


def _wants_ctx(fn: Callable) -> bool:
    """Pass ``ctx`` when the target has a parameter named ``ctx`` or at least two
    positional parameters without defaults."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: item only
        return False
    if "ctx" in sig.parameters:
        return True
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    return len(positional) >= 2


def _infer_ref(fn: Callable) -> refs.Ref | None:
    """The import path of a module-level function or class, if it names this object."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        return None
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return refs.Ref(ref=f"{module}:{qualname}", call=False) if obj is fn else None


def _resolve_target(target, allow) -> tuple[Callable, refs.Ref | None]:
    if isinstance(target, (str, refs.Ref)):
        ref = refs.parse(target)
        fn = refs.resolve(ref, allow, what="target")
        if not callable(fn):
            raise ConfigError(f"target {ref.ref!r} names a {type(fn).__name__}, not a callable")
        return fn, ref
    if not callable(target):
        raise ConfigError(f"target must be a callable taking item or (item, ctx), or an "
                          f"import path 'package.module:function'; got {type(target).__name__}")
    if allow is not None:
        raise ConfigError("allow would be ignored: it checks a target named by import path "
                          "('package.module:function'), and this target is a callable; "
                          "remove allow, or name the target by its path")
    return target, _infer_ref(target)


def _check_bounds(max_concurrency, max_items) -> None:
    for name, value in (("max_concurrency", max_concurrency), ("max_items", max_items)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if max_concurrency > max_items:
        raise ConfigError(f"max_concurrency ({max_concurrency}) must be <= max_items "
                          f"({max_items}); lower max_concurrency or raise max_items")


def _take_items(items, max_items: int) -> list[Any]:
    if isinstance(items, (str, bytes, dict)) or not isinstance(items, Iterable):
        raise ConfigError(f"items must be a list (or another iterable) of inputs, got "
                          f"{type(items).__name__}")
    taken = list(itertools.islice(items, max_items + 1))
    if len(taken) > max_items:
        n = len(items) if hasattr(items, "__len__") else f"more than {max_items}"
        raise ConfigError(f"{n} items for max_items={max_items}: a group never truncates its "
                          "input; raise max_items or split the list")
    return taken


def _check_items(items: list[Any]) -> None:
    """Items cross the bus: refuse, before the first call, one that cannot or that would
    arrive changed (a tuple would become a list, a dataclass a dict)."""
    try:
        back = msgspec.msgpack.decode(_encoder.encode(items))
        if back == items:
            return
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
    ref: refs.Ref | None
    items: list[Any]
    max_concurrency: int
    max_items: int
    options: dict[str, Any]
    parent: _Host | None
    budgets: Budgets = Budgets()
    consumed: Consumed | None = None
    store: Store | None = None
    approvers: list[str] | None = None
    resume: GroupCheckpoint | None = None
    inputs: UserInputs | None = None
    checkpoint: Path | None = None
    branches_to_run: int = 0


class _Crash:
    def __init__(self, name: str, exc: BaseException) -> None:
        self.name = name
        self.exc = exc


def _execute(plan: _Plan) -> GroupOutcome:
    from actors.runtime import PACKAGE_VERSION, Runtime

    opts = plan.options
    parent = plan.parent
    limits = opts.get("limits")
    if limits is not None and not isinstance(limits, HostLimits):
        raise ConfigError(f"limits must be HostLimits(...), got {type(limits).__name__}")
    if parent is not None:
        limits = parent.limits.tightened(limits)
        depth = parent.depth + 1
    else:
        limits = limits or HostLimits()
        depth = 1
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
    pass_ctx = opts.get("pass_ctx")
    for name in ("pass_ctx", "trace"):   # "no" would be true: only True/False mean it
        if opts.get(name) is not None and not isinstance(opts[name], bool):
            raise ConfigError(f"{name} must be True or False, got {opts[name]!r}")
    wants_ctx = _wants_ctx(plan.fn) if pass_ctx is None else pass_ctx
    concurrency = plan.max_concurrency
    for cap in (limits.max_concurrency, limits.max_live_branches):
        if cap is not None:
            concurrency = min(concurrency, cap)
    n_workers = max(1, min(concurrency, plan.branches_to_run))

    ledger = _Ledger(plan.budgets, plan.consumed,
                     parent=parent.ledger if parent is not None else None)
    store = plan.store if plan.store is not None else (
        parent.store if parent is not None else Store())
    # Gates chain from the top-level group down: a nested group's branches count against
    # every limit above them, and against the nested group's own when it sets one.
    own = opts.get("limits") if parent is not None else limits
    live = (parent.live if parent is not None else ()) + (
        (_Gate(own.max_live_branches),) if own is not None and own.max_live_branches else ())
    external = (parent.external if parent is not None else ()) + (
        (_Gate(own.max_external_calls),) if own is not None and own.max_external_calls else ())

    gid = plan.group_id
    collector_name = f"collector.{gid}"
    driver_name = f"group-driver.{gid}"
    worker_names = [f"branch-worker.{gid}.{i}" for i in range(n_workers)]
    # Checked before anything starts (the items must fit in one message).
    start = _group_start(plan, gid, driver_name, worker_names, concurrency, chunk, prefetch,
                         cancel_deadline, ledger)

    own_runtime = None
    runtime = opts.get("runtime")
    if runtime is not None and not isinstance(runtime, Runtime):
        raise ConfigError(f"runtime must be an actors.Runtime, got {type(runtime).__name__}")
    ignored = [name for name in ("bus", "log") if opts.get(name) is not None]
    if ignored and (runtime is not None or parent is not None):
        on = ("on the runtime given as runtime=" if runtime is not None else
              "inside a branch, on its parent's runtime (and in its parent's log)")
        names = " and ".join(ignored)
        raise ConfigError(f"{names} would be ignored: this group runs {on}; {names} "
                          f"appl{'y' if len(ignored) > 1 else 'ies'} only to a group that "
                          "starts its own runtime; remove "
                          f"{'them' if len(ignored) > 1 else 'it'}")
    if runtime is None and parent is not None:
        runtime = parent.runtime
    if runtime is None:
        bus = opts.get("bus", "zmq")
        log_path = opts.get("log")
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        own_runtime = runtime = Runtime(bus=bus, log_path=log_path,
                                        log_meta={"scenario": "parallel-group",
                                                  "run_id": plan.group_id})
    host = _Host(group_id=gid, target=plan.fn, wants_ctx=wants_ctx, depth=depth, limits=limits,
                 ledger=ledger, store=store, live=live, external=external, parent=parent,
                 trace=bool(opts.get("trace")), runtime=runtime)
    inbox: "queue.SimpleQueue[Delivery | _Crash]" = queue.SimpleQueue()

    def on_crash(name: str, exc: BaseException) -> None:
        inbox.put(_Crash(name, exc))

    result_msg: GroupResult | GroupSuspended | None = None
    crash: _Crash | None = None
    # A branch that waits for its nested group lends its live-branch slots meanwhile.
    lent: tuple[_Gate, ...] = getattr(_ambient, "slots", ()) if parent is not None else ()
    for gate in lent:
        gate.leave()
    _ambient.slots = ()
    started: list[pykka.ActorRef] = []
    attached: list[str] = []
    phases: dict[str, float] = {}
    progress: Callable[[bool], None] | None = None
    t0 = time.monotonic()
    try:
        # The driver attaches every name itself, one after the other from one socket (a
        # socket per actor thread costs ~10x more). Attach returns once the broker routes
        # the name; pykka queues what arrives before the actor's thread has started.
        bus = runtime.bus
        ref = runtime.start_actor(_CollectorActor, bus, collector_name,
                                  Collector(collector_name), on_crash)
        started.append(ref)
        # Every name routes before any work flows, in one round trip to the broker.
        boxes = [_LeaseBox() for _ in worker_names]
        names = [(driver_name, inbox.put), (collector_name, teller(bus, ref))] + [
            (name, _worker_deliver(bus, host, box, name, collector_name))
            for name, box in zip(worker_names, boxes)]
        attach_many = getattr(bus, "attach_many", None)
        if attach_many is not None:
            attach_many(names)
            attached.extend(name for name, _ in names)
        else:
            for name, deliver in names:
                bus.attach(name, deliver)
                attached.append(name)
        # Leases go out at once, into the workers' boxes; each worker's thread starts
        # after that and finds its leases waiting: the first ones work while the others
        # start, and none waits for a Hello to make a round trip through the Collector.
        bus.send(driver_name, collector_name, start)
        if plan.inputs is not None:
            bus.send(driver_name, collector_name, plan.inputs)
        for name, box in zip(worker_names, boxes):
            started.append(runtime.start_actor(GroupWorker, bus, name, host, collector_name,
                                               on_crash, box))
        phases["start"] = time.monotonic() - t0
        if on_progress is not None:
            before = len(plan.resume.finished) if plan.resume is not None else 0

            def report(done: bool) -> None:
                on_progress(GroupProgress(
                    group_id=gid, total=len(plan.items),
                    finished=before + sum(box.finished for box in boxes),
                    failed=len(host.errors), elapsed=round(time.monotonic() - t0, 3),
                    done=done, finished_before=before))
            progress = report
        result_msg, crash = _drive(runtime, inbox, host, driver_name, collector_name, gid, t0,
                                   ticks=ledger.remaining_seconds() is not None,
                                   progress=progress)
        phases["run"] = time.monotonic() - t0 - phases["start"]
    except BaseException:
        host.cancel()   # Ctrl-C or a driver bug: branches see ctx.cancelled, then teardown
        raise
    finally:
        abandoned_workers = bool(result_msg is not None and
                                 isinstance(result_msg, GroupResult) and result_msg.abandoned)
        # Workers the Collector let go, and the Collector once the group ended, have
        # stopped already: asking a dead actor to stop costs an exception (~20 us each).
        alive = [ref for ref in started if ref.is_alive()]
        stuck = runtime.stop_actors(alive, 0.2 if abandoned_workers or crash else
                                    STOP_GRACE_S)
        if len(alive) < len(started):   # the runtime forgets the dead ones too
            dead = {id(ref) for ref in started} - {id(ref) for ref in alive}
            runtime.refs = [ref for ref in runtime.refs if id(ref) not in dead]
        if stuck:
            log.warning("group %s: %d actor(s) still running user code past the deadline; "
                        "left behind (daemon threads)", gid, len(stuck))
        if own_runtime is None:   # a shared runtime goes on: give the names back
            for name in attached:
                runtime.bus.detach(name)
        if own_runtime is not None:
            own_runtime.close()
        phases["stop"] = time.monotonic() - t0 - phases.get("start", 0) - phases.get("run", 0)
        if lent:
            _enter_all(lent, lambda: False)
            _ambient.slots = lent
    if crash is not None:
        if isinstance(crash.exc, (ConfigError, ValueError, TypeError)):
            raise crash.exc
        raise RunFailed(f"group {gid}: actor {crash.name!r} crashed: "
                        f"{type(crash.exc).__name__}: {crash.exc}") from crash.exc
    outcome = _outcome(plan, host, ledger, store, result_msg, time.monotonic() - t0,
                       n_workers, concurrency, PACKAGE_VERSION)
    outcome.stats["phases"] = {k: round(v, 6) for k, v in phases.items()}
    if progress is not None:
        progress(True)
    return outcome


def _group_start(plan: _Plan, gid: str, driver: str, workers: list[str], concurrency: int,
                 chunk: int, prefetch: int, cancel_deadline: float,
                 ledger: _Ledger) -> GroupStart:
    ckpt = plan.resume
    start = GroupStart(
        group_id=gid, items=plan.items, workers=workers, max_concurrency=concurrency,
        max_items=plan.max_items, driver=driver, chunk=chunk, prefetch=prefetch,
        min_lease_seconds=MIN_LEASE_S, announce=False,
        max_seconds=ledger.remaining_seconds(), cancel_deadline=cancel_deadline,
        max_result_bytes=MAX_RESULT_BYTES, resume=ckpt is not None,
        finished=ckpt.finished if ckpt else {}, journals=ckpt.journals if ckpt else {},
        pending=ckpt.pending if ckpt else [], used_ids=ckpt.used_ids if ckpt else [],
        approvers=plan.approvers, effects=ckpt.effects if ckpt else [])
    size = len(_encoder.encode(start))
    if size > MAX_FRAME_BYTES:
        raise ConfigError(f"the group's items take {size} bytes, over the {MAX_FRAME_BYTES}-"
                          "byte message limit: pass ids or paths as items and load the data "
                          "inside the target")
    return start


def _drive(runtime, inbox, host: _Host, driver: str, collector: str, gid: str, t0: float,
           ticks: bool, progress: Callable[[bool], None] | None = None):
    """Wait for the group's end, sending the time as ``Tick`` and a parent's cancellation
    as ``GroupCancel``, and calling ``progress`` every ``PROGRESS_S``. Every wait is
    bounded (one tick); a crashed actor ends it.

    The Collector needs the time only for a seconds budget and for the cancel deadline
    once the group is stopping, so ticks go out only then."""
    bus = runtime.bus
    next_tick = t0 + TICK_S
    next_progress = t0 + PROGRESS_S
    cancel_sent = False
    while True:
        timeout = max(0.0, next_tick - time.monotonic())
        try:
            item = inbox.get(timeout=timeout)
        except queue.Empty:
            item = None
        now = time.monotonic()
        if now >= next_tick:
            if ticks or host.stopping:
                bus.send(driver, collector, Tick(elapsed=round(now - t0, 6)))
            next_tick = now + TICK_S
            if not cancel_sent and host.parent is not None and host.parent.cancelled:
                cancel_sent = True
                host.cancel()
                bus.send(driver, collector, GroupCancel(group_id=gid,
                                                        reason="the parent branch was cancelled"))
            if progress is not None and now >= next_progress:
                next_progress = now + PROGRESS_S
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
             "ResumeRefused": ResumeRefused}
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
            cancel_deadline=plan.options.get("cancel_deadline", CANCEL_DEADLINE_S),
            written_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), package_version=package_version)
        _write_checkpoint(path, ckpt)
        return GroupOutcome(status=msg.status, pending_interactions=list(msg.pending),
                            checkpoint=path, finished=sorted(msg.finished),
                            never_started=list(msg.not_started),
                            partial=dict(msg.finished), **common)
    if msg.status == "refused":
        raise ResumeRefused(msg.error)
    if msg.status == "completed":
        return GroupOutcome(status="completed", results=list(msg.results),
                            finished=list(range(len(msg.results))), **common)
    return GroupOutcome(status="failed", error=_error_of(host, msg),
                        error_branch=msg.error_branch, finished=sorted(msg.finished),
                        failed=list(msg.failed), cancelled=list(msg.cancelled),
                        never_started=list(msg.never_started), abandoned=list(msg.abandoned),
                        errors=dict(msg.errors), partial=dict(msg.finished), **common)


def _ambient_parent(explicit: _Host | None) -> _Host | None:
    return explicit if explicit is not None else getattr(_ambient, "host", None)


# -- the API ------------------------------------------------------------------------------


def run_group(target, items, *, max_concurrency: int, max_items: int,
              checkpoint: str | os.PathLike | None = None, _parent: _Host | None = None,
              **options) -> GroupOutcome:
    """Run ``target`` over ``items`` as a bounded parallel group; never raises for the
    group's own errors or pauses: read ``outcome.status``.

    ``target``: a callable taking ``item`` or ``(item, ctx)``, or an import path
    ``"package.module:function"`` (then a checkpoint can be resumed without it).
    ``checkpoint``: where to write the checkpoint if the group pauses (default: a new
    temporary file, ``outcome.checkpoint``). ``options``: ``limits``, ``budgets``,
    ``store``, ``approvers``, ``cancel_deadline``, ``chunk``, ``bus``, ``log``,
    ``runtime``, ``allow``, ``trace``, ``pass_ctx``, ``on_progress`` (docs/groups.md).
    Called inside a branch, it runs as a nested group sharing the branch's limits,
    budgets and store."""
    _check_options(options, _OPTIONS, "run_group()")
    _check_bounds(max_concurrency, max_items)
    taken = _take_items(items, max_items)
    fn, ref = _resolve_target(target, options.get("allow"))
    gid = uuid.uuid4().hex[:12]
    parent = _ambient_parent(_parent)
    budgets = options.get("budgets") or Budgets()
    if not isinstance(budgets, Budgets):
        raise ConfigError(f"budgets must be Budgets(calls=, seconds=, cost=), got "
                          f"{type(budgets).__name__}")
    store = options.get("store")
    if store is not None and not isinstance(store, (dict, Store)):
        raise ConfigError(f"store must be a dict (its initial content), got {type(store).__name__}")
    if isinstance(store, dict):
        try:
            store = Store(store)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None
    approvers = options.get("approvers")
    if approvers is not None:
        if isinstance(approvers, str) or not all(isinstance(a, str) for a in approvers):
            raise ConfigError(f"approvers must be a list of names, got {approvers!r}")
        approvers = list(approvers)
    if not taken:   # an empty list: an empty result, the target is never called
        return GroupOutcome(status="completed", group_id=gid, results=[])
    _check_items(taken)
    plan = _Plan(group_id=gid, fn=fn, ref=ref, items=taken, max_concurrency=max_concurrency,
                 max_items=max_items, options=options, parent=parent, budgets=budgets,
                 store=store, approvers=approvers,
                 checkpoint=Path(checkpoint) if checkpoint is not None else None,
                 branches_to_run=len(taken))
    return _execute(plan)


def parallel(target, items, *, max_concurrency: int, max_items: int,
             _parent: _Host | None = None, **options) -> list[Any]:
    """The results of ``target`` over ``items``, in input order.

    Raises :class:`GroupFailed` (the first error, and which branches finished, failed,
    were cancelled or never started) or :class:`GroupPaused` (a branch asked a question
    or an approval: resume the checkpoint with :func:`resume_group`)."""
    outcome = run_group(target, items, max_concurrency=max_concurrency, max_items=max_items,
                        _parent=_parent, **options)
    if outcome.status == "completed":
        return outcome.results
    if outcome.status == "failed":
        raise GroupFailed(outcome) from outcome.error
    raise GroupPaused(outcome)


def resume_group(checkpoint: str | os.PathLike, *, target=None,
                 user_inputs: dict[str, Any] | None = None,
                 approvals: dict[str, bool] | None = None, **options) -> GroupOutcome:
    """Resume a paused group from its checkpoint file (this process or another one).

    ``user_inputs`` answers questions and ``approvals`` decides actions, by interaction
    id; each id is consumed once. Approvals need ``principal=`` among the group's
    approvers. Finished branches are never dispatched again, consumed budgets stay
    consumed, suspended branches replay their journal. ``target`` may be omitted when
    the group's target was named by import path. The checkpoint file is rewritten with
    the new state (a later pause, or the end)."""
    _check_options(options, {**_OPTIONS, **_RESUME_ONLY}, "resume_group()")
    for name in _FIXED_AT_START:
        if name in options:
            raise ConfigError(f"resume_group(): {name} is fixed when the group starts and "
                              "kept in its checkpoint; it cannot change on resume")
    path = Path(checkpoint)
    ckpt = load_checkpoint(path)
    if ckpt.status not in ("user_input_pending", "approval_pending"):
        raise ResumeRefused(f"{path}: the group {ckpt.group_id} already ended "
                            f"({ckpt.status}); there is nothing to resume")
    user_inputs = dict(user_inputs or {})
    approvals = dict(approvals or {})
    principal = options.pop("principal", None)
    pending = {p.id: p for p in ckpt.pending}
    problem = check_inputs(pending, ckpt.used_ids, user_inputs, approvals, principal,
                           ckpt.approvers)
    if problem is not None:
        raise ResumeRefused(f"{path}: {problem}")
    if target is None:
        if ckpt.target is None:
            raise ConfigError(f"{path}: the group's target was not named by import path, so "
                              "the checkpoint cannot name it: pass target=the same callable")
        target = ckpt.target
    fn, ref = _resolve_target(target, options.get("allow"))
    answered = {pending[i].branch for i in [*user_inputs, *approvals]}
    answered |= {i for i in ckpt.not_started if i in ckpt.journals}
    left = len(pending) - len(user_inputs) - len(approvals)
    to_run = len(answered) + (len(ckpt.not_started) if left == 0 else 0)
    try:
        store = Store(ckpt.store)
    except TypeError as exc:
        raise ResumeRefused(f"{path}: the checkpoint's store does not load: {exc}") from None
    with _exclusive(path):
        ckpt = load_checkpoint(path)   # re-read under the lock: another resumer may have won
        if ckpt.status not in ("user_input_pending", "approval_pending"):
            raise ResumeRefused(f"{path}: the group {ckpt.group_id} already ended "
                                f"({ckpt.status}); there is nothing to resume")
        problem = check_inputs({p.id: p for p in ckpt.pending}, ckpt.used_ids, user_inputs,
                               approvals, principal, ckpt.approvers)
        if problem is not None:
            raise ResumeRefused(f"{path}: {problem}")
        options = {**options, "chunk": options.get("chunk", ckpt.chunk),
                   "cancel_deadline": options.get("cancel_deadline", ckpt.cancel_deadline)}
        plan = _Plan(group_id=ckpt.group_id, fn=fn, ref=ref or ckpt.target, items=ckpt.items,
                     max_concurrency=ckpt.max_concurrency, max_items=ckpt.max_items,
                     options=options, parent=_ambient_parent(None), budgets=ckpt.budgets,
                     consumed=ckpt.consumed, store=store, approvers=ckpt.approvers,
                     resume=ckpt, checkpoint=path, branches_to_run=max(1, to_run),
                     inputs=UserInputs(group_id=ckpt.group_id, answers=user_inputs,
                                       approvals=approvals, principal=principal))
        outcome = _execute(plan)
        if outcome.status in ("completed", "failed"):
            # The checkpoint is spent: a second resume of it is refused, by name.
            used = [*ckpt.used_ids, *user_inputs, *approvals]
            _write_checkpoint(path, msgspec.structs.replace(
                ckpt, status=outcome.status, pending=[], used_ids=used,
                consumed=outcome.consumed, store=outcome.store, effects=outcome.effects,
                written_at=time.strftime("%Y-%m-%dT%H:%M:%S%z")))
        # A new pause rewrote the file in _outcome already.
    # Finished results from before the pause are part of the join.
    return outcome
