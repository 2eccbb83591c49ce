"""The host of one running group: what its branches share on this process.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Callable

from actors.errors import BudgetExhausted
from actors.groups.limits import HostLimits, _Ledger
from actors.groups.store import Store, StoreSteps, _Gate


_ambient = threading.local()    # the group host of the branch running on this thread


_GO = None


_NOT_NOW = object()


#: The longest a worker waiting for its turn sleeps before it looks again for a branch it
#: may take (it is woken sooner by the start that brings its turn or such a branch's).
STEAL_AFTER_S = 0.05


class _StartOrder:
    """Starts in input order across the workers of this process: branch ``j`` starts only
    once every branch up to ``j - bound`` has started, and no branch at or past ``bound``
    starts before the first ``bound`` have. ``started`` is written once per start (one
    atomic store); ``low`` (every branch below it has started) only ever lags behind the
    truth, so reading a stale one can only make a worker look again, never start early.

    Every start is marked, whatever lease it came in (an ``in_order`` one waits for its
    turn, a batched one does not, but a branch that waits may need it to have started),
    and so is every branch ``done`` before this run: a branch marked nowhere would keep
    every later ``in_order`` start waiting.

    A worker that waits is woken by the start that makes its turn come, not by every
    start: each waits on an event of its own, kept in a heap by the count it needs."""

    def __init__(self, n: int, bound: int, done=()) -> None:
        self.started = bytearray(n)
        for j in done:    # finished before this run: they never start again
            self.started[j] = 1
        self.n = n
        self.bound = bound
        self.low = 0
        self.waiting = 0
        self.lock = threading.Lock()
        self.waiters: list[tuple[int, int, threading.Event]] = []   # (need, seq, event)
        self.seq = itertools.count()
        #: branch -> the lease of this process it waits in, not taken yet (the workers'
        #: _Run, registered when it reaches a box): where a waiting worker finds one.
        self.runs: dict[int, object] = {}

    def need(self, j: int) -> int:
        """How many branches from 0 must have started before ``j`` may."""
        bound = self.bound
        return 0 if j < bound else max(j - bound + 1, bound)

    def reached(self, need: int) -> bool:
        low, started, n = self.low, self.started, self.n
        while low < n and started[low]:
            low += 1
        self.low = low
        return low >= need

    def wait(self, j: int, give_up: Callable[[], bool],
             steal: Callable[[int], int | None] | None = None) -> bool:
        """Wait for branch ``j``'s turn; False if ``give_up()`` became true first (the group
        is stopping or pausing: the branches it waits for may never start).

        ``steal(need)`` runs, on this thread, a branch of the group whose turn has come and
        that no worker has taken yet (one queued behind a busy worker's branch), and
        returns None; finding none, it returns the fewest starts that would bring such a
        branch's turn. It is tried before each wait, and this worker is woken by the start
        that brings its own turn or that one, whichever comes first: while it waits, no
        branch that may start waits for a slot."""
        need = self.need(j)
        if self.low >= need or self.reached(need):
            return True
        while True:
            wake = need
            if steal is not None:
                soonest = steal(need)
                if soonest is None:   # it ran one: its own turn may have come meanwhile
                    if self.reached(need):
                        return True
                    if give_up():
                        return False
                    continue
                wake = min(need, soonest)
            event = threading.Event()
            with self.lock:   # counted before looking: mark() sees it or we see the start
                self.waiting += 1
                heapq.heappush(self.waiters, (wake, next(self.seq), event))
            try:
                if self.reached(wake):
                    if wake == need:
                        return True
                    continue   # a branch it may take can start already: look again
                if give_up():
                    return False
                event.wait(STEAL_AFTER_S)  # bounded: steal and give_up are looked at again
            finally:
                with self.lock:
                    self.waiting -= 1
            if self.reached(need):
                return True

    def mark(self, j: int) -> None:
        self.started[j] = 1
        if self.waiting:
            with self.lock:
                self.reached(self.n)
                low, waiters = self.low, self.waiters
                while waiters and waiters[0][0] <= low:
                    heapq.heappop(waiters)[2].set()


class _Host:
    """The in-process side of one group: the flags workers check before each start, the
    budgets, the store, the gates. The Collector decides from messages; these flags only
    make a decision visible at once to every worker of this process (a worker that sees
    an error stops starting branches before its message reaches the Collector)."""

    #: The write-ahead log of ctx.effect (groups.checkpoint.EffectLog), set by the driver
    #: for a group with a checkpoint and lent to its nested groups; ``effect_scope``:
    #: where this group's branches record in it ("" for the top-level group).
    effect_log = None
    effect_scope = ""

    def __init__(self, *, group_id: str, target: Callable, wants_ctx: bool, depth: int,
                 limits: HostLimits, ledger: _Ledger, store: Store,
                 live: tuple[_Gate, ...], external: tuple[_Gate, ...],
                 parent: "_Host | None", trace: bool,
                 runtime, nested: Callable, order: _StartOrder | None = None,
                 convert: Callable | None = None, suspend_all: bool = True) -> None:
        self.group_id = group_id
        self.target = target
        self.wants_ctx = wants_ctx
        self.depth = depth
        self.limits = limits
        self.ledger = ledger
        self.store = store
        #: The store writes of this group's branches and its nested groups', each made
        #: once however often a branch runs: set for a group with workers elsewhere
        #: (actors.groups.fleet), whose lost worker's leases are re-dispatched; None
        #: (nothing numbered, nothing kept) when every branch runs on a thread here,
        #: where a branch runs once while its group runs.
        self.steps: StoreSteps | None = parent.steps if parent is not None else None
        self.live = live
        self.external = external
        self.parent = parent
        self.runtime = runtime
        # The front door a branch's ctx.run_group calls for a nested group (given by the
        # API, which sits above this module).
        self.nested = nested
        #: Starts in input order (a fresh group; a resumed one replays a few branches).
        self.order = order
        #: Every worker's lease box (set by the driver once they exist): a worker waiting
        #: for its turn takes an in-order lease another worker has not started.
        self.boxes: list = []
        #: The check and conversion of a branch's value to the declared output type R
        #: (None: ``returns=object``), raising a TypeError that names the branch.
        self.convert = convert
        #: An interaction blocks its own branch only (``suspend="all"``), or stops every
        #: new start (``"first"``).
        self.suspend_all = suspend_all
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
