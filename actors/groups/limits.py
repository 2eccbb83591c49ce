"""Host limits (what one machine lets a group use) and budgets (what a group may spend).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import msgspec

from bus.base import MAX_FRAME_BYTES

from actors.errors import ConfigError
from actors.errors import BudgetExhausted
from actors import usage


#: The most a branch's result (and all of a group's results together) may take encoded:
#: a frame, less room for the message around it.
MAX_RESULT_BYTES = MAX_FRAME_BYTES - 64 * 1024

#: How often the driver sends the Collector the time (seconds budget, cancel deadline).
TICK_S = 0.05
#: How long a group waits, by default, for its cancelled branches to stop.
CANCEL_DEADLINE_S = 5.0


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
                 parent: "_Ledger | None" = None, run=None) -> None:
        consumed = consumed or Consumed()
        self.lock = threading.Lock()
        self.budgets = budgets
        self.calls = consumed.calls
        self.cost = consumed.cost
        self.seconds_before = consumed.seconds
        self.t0 = time.monotonic()
        self.parent = parent
        #: Called with the totals after each charge (a top-level group with a checkpoint
        #: records them, so a group killed while running still counts them on resume).
        self.on_charge = None
        #: The evolve() run this group is part of (actors.workers.scope.RunScope): its
        #: max_calls caps the branch starts of this group and of every group under it.
        self.run = run if parent is None else parent.run
        #: The usage meter of the call that started the group (actors.usage): its branches'
        #: model calls report into it, so they count in the run's token and cost budgets.
        self.meter = usage.current()
        #: The ledgers above this one, root first (not this one: a ledger that held
        #: itself would live on in a reference cycle until the garbage collector ran).
        self.above: list[_Ledger] = [*parent.above, parent] if parent is not None else []
        if parent is None:   # a top-level group's (most of them): no chain to walk
            self.limited = budgets.calls is not None or budgets.cost is not None \
                or budgets.seconds is not None or (run is not None and run.limited)
            return
        self.limited = any(lg.budgets.calls is not None or lg.budgets.cost is not None
                           or lg.budgets.seconds is not None for lg in self.chain) or (
            self.run is not None and self.run.limited)

    @property
    def chain(self) -> list[_Ledger]:
        """This ledger and those above it, root first: locks are always taken in this
        order."""
        return [*self.above, self]

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
            if field_ == "calls" and self.run is not None and not self.run.take(amount):
                raise BudgetExhausted(
                    f"the run's max_calls ({self.run.max_calls}) is used up: every call to "
                    "run/propose/an agent counts, and so does every branch of a group "
                    "started inside one; raise max_calls or start fewer branches")
            for lg in self.chain:
                setattr(lg, field_, getattr(lg, field_) + amount)
            root = self.chain[0]
            if root.on_charge is not None:   # written ahead (a checkpoint's effect log)
                root.on_charge(root.snapshot())

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

    def absorb(self, spent: list[float] | None) -> None:
        """Count at least ``spent`` ([calls, cost, seconds], what a run killed while it ran
        had recorded) as consumed already."""
        if spent:
            self.calls = max(self.calls, int(spent[0]))
            self.cost = max(self.cost, float(spent[1]))
            self.seconds_before = max(self.seconds_before, float(spent[2]))

    def snapshot(self) -> Consumed:
        return Consumed(calls=self.calls, seconds=round(self.seconds(), 6), cost=self.cost)
