"""The shared store of a group: JSON-like values behind a lock, and the gates branches wait on.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import msgspec

from actors.errors import GroupError
from actors.groups.limits import TICK_S

_encoder = msgspec.msgpack.Encoder()


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

    def write(self, steps: "StoreSteps", where: tuple, op: str, key: str, *args) -> Any:
        """One write of a branch (``op``: set, incr or update), made once: ``where`` (the
        branch's scope, index and write number) already written answers what it got
        then, without writing again. Atomic with every other write (the store's lock)."""
        if steps is None:   # nothing to number against
            return getattr(self, op)(key, *args)
        with self._lock:
            done = steps.first(where, op, key)
            if done is not _NEW:
                return done
            value = getattr(self, op)(key, *args)
            steps.record(where, op, key, value)
            return value

    def __repr__(self) -> str:
        return f"Store({self.snapshot()!r})"


_NEW = object()   # a write not made before


class StoreSteps:
    """The store writes a group's branches made, by where each was made: (scope, branch,
    n) for the n-th write of a branch (scope: "" for the group's own branches, the path
    of branches that started it for a nested group's), with what it answered.

    A branch runs again when the worker running it was lost (its lease re-dispatched to
    another worker, the first copy perhaps still running): it makes the same writes in
    the same order, and each gets its first answer back instead of being applied a
    second time, so ``ctx.store.incr`` counts once per branch whatever ran twice. Kept
    where the store lives (the coordinator), for one run of a group with workers
    elsewhere (its top-level host and every nested one share it)."""

    def __init__(self) -> None:
        self.done: dict[tuple, tuple[str, str, Any]] = {}
        self.repeated = 0   # writes answered from here (a branch that ran again)

    def first(self, where: tuple, op: str, key: str) -> Any:
        """What this write answered the first time, or ``_NEW``; raises GroupError if the
        branch made another write at this step (it is not deterministic). Called under
        the store's lock."""
        rec = self.done.get(where)
        if rec is None:
            return _NEW
        if rec[0] != op or rec[1] != key:
            scope, branch, n = where
            at = f" of the nested group at {scope!r}" if scope else ""
            raise GroupError(
                f"branch {branch}{at} is not deterministic: running again (its first worker "
                f"was lost), its store write {n} is {op}({key!r}) but the first run's was "
                f"{rec[0]}({rec[1]!r}); a branch must write the store in the same order "
                "every time (or write inside ctx.effect)")
        self.repeated += 1
        return rec[2]

    def record(self, where: tuple, op: str, key: str, value: Any) -> None:
        self.done[where] = (op, key, value)


class BranchStore:
    """``ctx.store``: the group's store as one branch writes it. Reads go to the store;
    each write (``set``, ``incr``, ``update``) is numbered and made once per branch
    (:class:`StoreSteps`; ``steps`` None: a group on threads only, nothing numbered),
    wherever the store lives (``backend.write``: this process's :class:`Store`, or a
    worker's link to the coordinator's). ``locked()`` (several keys under the lock, in
    this process only) is not numbered: code in it runs again with the branch."""

    __slots__ = ("_store", "_steps", "_scope", "_branch", "_n")

    def __init__(self, store, steps: StoreSteps | None, scope: str, branch: int) -> None:
        self._store, self._steps, self._scope, self._branch = store, steps, scope, branch
        self._n = 0

    def _write(self, op: str, key: str, *args) -> Any:
        where = (self._scope, self._branch, self._n)
        self._n += 1
        return self._store.write(self._steps, where, op, key, *args)

    def get(self, key: str, default: Any = None) -> Any:
        return self._store.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self._write("set", key, value)

    def incr(self, key: str, by: int | float = 1) -> int | float:
        return self._write("incr", key, by)

    def update(self, key: str, fn: Callable[[Any], Any], default: Any = None) -> Any:
        """Read-modify-write one key under the lock; returns the new value (``fn`` is not
        called again for a branch that runs again: its first result is returned)."""
        return self._write("update", key, fn, default)

    def locked(self):
        return self._store.locked()

    def snapshot(self) -> dict[str, Any]:
        return self._store.snapshot()

    def __repr__(self) -> str:
        return f"BranchStore(branch={self._branch}, {self._store!r})"


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
