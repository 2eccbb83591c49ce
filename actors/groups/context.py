"""``ctx``: what a branch may do besides compute (ask, approve, effect, the store, budgets).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import msgspec

from protocol import JournalEntry, PendingInteraction
from actors.errors import BranchCancelled, GroupError, HostLimitExceeded, _Suspend
from actors.groups.store import BranchStore, _Gate, _encodable, _enter_all
from actors.groups.host import _Host, _ambient
from actors.groups.limits import _positive
from actors.groups.outcome import results_of


class BranchContext:
    """What a target taking ``(item, ctx)`` gets: one per invocation (its own variables).

    - ``ask(question)``: the answer; with none yet, the group pauses (``user_input_pending``)
      and this branch runs again on resume, where the journal returns the answer;
    - ``approve(action) -> bool``: the same for a human validation (``approval_pending``);
    - ``effect(name, fn, *args, **kwargs)``: run an external effect once; its result is
      journaled, so a branch replayed after a pause gets it back without running it again
      (with a checkpoint path, intent and result are on disk before the branch goes on,
      so a crash never makes a finished effect run twice);
    - ``cancelled``: True once the group is stopping; ``raise_if_cancelled()``;
    - ``store``: the shared :class:`Store`; ``spend(units)``: charge the cost budget;
    - ``parallel(...)``/``run_group(...)``: a nested group (shares limits, budgets, store).

    Replay must be deterministic: the same asks, approvals and effects in the same order.
    """

    __slots__ = ("_host", "branch", "item", "_journal", "_pos", "_effects", "_nested",
                 "_store")

    def __init__(self, host: _Host, branch: int, item: Any,
                 journal: list[JournalEntry] | None) -> None:
        self._host = host
        self.branch = branch
        self.item = item
        self._journal: list[JournalEntry] = list(journal) if journal else []
        self._pos = 0
        self._effects: list[tuple[int, str]] = []
        self._nested = 0   # nested groups started so far (they name their effects' scope)
        self._store: BranchStore | None = None

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
    def store(self) -> BranchStore:
        """The shared store, as this branch writes it: in a group with workers elsewhere
        each write is made once for the branch, however often it runs
        (:class:`~actors.groups.store.BranchStore`)."""
        store = self._store
        if store is None:
            host = self._host
            scope = host.effect_scope
            if not scope and host.parent is not None:
                # A group nested by a plain parallel() call: no branch path names it, so
                # its writes are numbered under its own id (made once within this run).
                scope = f"{host.group_id}/"
            store = self._store = BranchStore(host.store, host.steps, scope, self.branch)
        return store

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
        ran, value = self._ahead(name, pos)
        if ran:
            return self._journal_effect(name, pos, value)
        gates = self._external_slot()
        try:
            value = fn(*args, **kwargs)
        except BaseException:
            self._effect_failed(name, pos)
            raise
        finally:
            for gate in gates:
                gate.leave()
        return self._journal_effect(name, pos, value, record=True)

    async def _effect_async(self, name: str, pos: int, entry: JournalEntry | None, fn,
                            args, kwargs) -> Any:
        if entry is not None:
            return entry.value
        ran, value = self._ahead(name, pos)
        if ran:
            return self._journal_effect(name, pos, value)
        gates = self._external_slot()
        try:
            value = await fn(*args, **kwargs)
        except BaseException:
            self._effect_failed(name, pos)
            raise
        finally:
            for gate in gates:
                gate.leave()
        return self._journal_effect(name, pos, value, record=True)

    def _effect_failed(self, name: str, pos: int) -> None:
        effects = getattr(self._host, "effect_log", None)
        if effects is not None:
            effects.failed(self.branch, pos, name, *self._scope())

    def _ahead(self, name: str, pos: int) -> tuple[bool, Any]:
        """With a checkpoint (its effects written ahead: EffectLog): the result of this
        effect if it ran before a crash, else its intent is recorded now, before it runs
        (raises EffectInDoubt for one that started and never recorded its result)."""
        effects = getattr(self._host, "effect_log", None)
        if effects is None:
            return False, None
        ran, value = effects.replayed(self.branch, pos, name, *self._scope())
        if not ran:
            effects.intent(self.branch, pos, name, *self._scope())
        return ran, value

    def _scope(self) -> tuple[str, ...]:
        """Where a nested group's branch records its effects (nothing for a top-level
        branch, whose effect log may be one that only knows branches: RemoteEffects)."""
        scope = self._host.effect_scope
        return (scope,) if scope else ()

    def _external_slot(self) -> tuple[_Gate, ...]:
        """Wait for a slot under every external-call limit (host limits); the caller
        leaves them once the effect has run."""
        gates = self._host.external
        if gates and not _enter_all(gates, lambda: self._host.cancelled):
            raise BranchCancelled(f"branch {self.branch}: cancelled while waiting for an "
                                  "external-call slot")
        return gates

    def _journal_effect(self, name: str, pos: int, value: Any, record: bool = False) -> Any:
        if len(self._journal) != pos:   # effects awaited together, ending out of order
            raise GroupError(f"branch {self.branch}: effect {name!r} (step {pos}) ended out "
                             f"of order ({len(self._journal)} steps journaled so far); await "
                             "each effect before the next ask, approve or effect: the "
                             "journal replays them in order")
        value = msgspec.msgpack.decode(_encodable(value, f"the result of effect {name!r}"))
        effects = getattr(self._host, "effect_log", None)
        if record and effects is not None:  # on disk before the branch goes on
            effects.result(self.branch, pos, name, value, *self._scope())
        self._journal.append(JournalEntry(kind="effect", key=name, value=value))
        self._effects.append((self.branch, name))
        return value

    def parallel(self, target, items, *, max_concurrency: int, max_items: int, **options):
        return results_of(self.run_group(target, items, max_concurrency=max_concurrency,
                                         max_items=max_items, **options))

    def run_group(self, target, items, *, max_concurrency: int, max_items: int, **options):
        # The nested group writes its effects ahead under this branch's scope: the same
        # one each time the branch runs, as its groups start in the same order.
        self._nested += 1
        outer = getattr(_ambient, "effect_scope", "")
        _ambient.effect_scope = f"{self._host.effect_scope}{self.branch}.{self._nested}/"
        try:
            return self._host.nested(target, items, max_concurrency=max_concurrency,
                                     max_items=max_items, _parent=self._host, **options)
        finally:
            _ambient.effect_scope = outer
