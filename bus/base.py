"""What every bus offers: attach an actor name, send a message, count what was refused.

Two implementations share this interface and one conformance suite
(tests/test_bus_conformance.py): :class:`bus.memory.InMemoryBus` for unit tests and
:class:`bus.zmq_bus.ZmqBus` for real runs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol

from protocol import Message

log = logging.getLogger(__name__)

#: Frames larger than this are refused by the broker (counted, never fatal).
MAX_FRAME_BYTES = 16 * 1024 * 1024


class Delivery(NamedTuple):
    """A message as delivered: stamped with the broker's sequence number."""

    seq: int
    sender: str
    receiver: str
    msg: Message


Deliver = Callable[[Delivery], None]


@dataclass
class BusStats:
    """Counters the user can see (DESIGN section 7: nothing is dropped silently)."""

    delivered: int = 0
    rejected_frames: int = 0        # did not decode, too large, or malformed envelope
    unroutable: int = 0             # addressed to a name nobody attached
    after_close: int = 0            # sent after the bus closed (shutdown stragglers)
    rejected_by_sender: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reject(self, sender: str, why: str) -> None:
        with self._lock:
            self.rejected_frames += 1
            self.rejected_by_sender[sender] = self.rejected_by_sender.get(sender, 0) + 1
        log.warning("bus: dropped a frame from %r: %s", sender, why)

    def as_dict(self) -> dict[str, int]:
        return {"delivered": self.delivered, "rejected_frames": self.rejected_frames,
                "unroutable": self.unroutable, "after_close": self.after_close}


class Bus(Protocol):
    """The interface the actors use; they never see sockets."""

    stats: BusStats

    def attach(self, name: str, deliver: Deliver) -> None:
        """Route messages addressed to ``name`` to ``deliver`` (called on a bus thread)."""

    def detach(self, name: str) -> None: ...

    def send(self, sender: str, receiver: str, msg: Message) -> None:
        """Send from any thread; delivery order is FIFO per (sender thread, receiver)."""

    def send_frame(self, sender: str, receiver: str, body: bytes) -> None:
        """Send raw bytes as a message body (tests and fuzzing: bad frames are counted)."""

    def release_thread(self) -> None:
        """The calling thread sends no more: free what it held (its sockets)."""

    def closing(self) -> None:
        """Shutdown has begun: messages to actors that already left are counted quietly."""

    def close(self) -> None: ...


class RunClock:
    """Seconds since the run began, on the monotonic clock (the log's ``t``)."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self._t0
