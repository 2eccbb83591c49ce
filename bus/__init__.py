"""Moving bytes: the ZeroMQ broker and endpoints, the in-memory bus, the message log.

The names below are loaded on first use (as ``actors``'s are), so reading a log
(``bus.log``) does not import ZeroMQ.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "bus.base": ["MAX_FRAME_BYTES", "Bus", "BusStats", "Delivery", "RunClock"],
    "bus.memory": ["InMemoryBus"],
    "bus.zmq_bus": ["Broker", "Endpoint", "ZmqBus"],
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = ["MAX_FRAME_BYTES", "Broker", "Bus", "BusStats", "Delivery", "Endpoint",
           "InMemoryBus", "RunClock", "ZmqBus"]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'bus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what a type checker and an IDE see: the same names, eagerly
    from bus.base import MAX_FRAME_BYTES, Bus, BusStats, Delivery, RunClock
    from bus.memory import InMemoryBus
    from bus.zmq_bus import Broker, Endpoint, ZmqBus
