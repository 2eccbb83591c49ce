"""The shared store of a group: JSON-like values behind a lock, and the gates branches wait on.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import msgspec

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
