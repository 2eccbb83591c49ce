"""Moving bytes: the ZeroMQ broker and endpoints, the in-memory bus, the message log."""

from bus.base import MAX_FRAME_BYTES, Bus, BusStats, Delivery, RunClock
from bus.memory import InMemoryBus
from bus.zmq_bus import Broker, Endpoint, ZmqBus

__all__ = ["MAX_FRAME_BYTES", "Broker", "Bus", "BusStats", "Delivery", "Endpoint",
           "InMemoryBus", "RunClock", "ZmqBus"]
