"""What every bus offers: attach an actor name, send a message, count what was refused.

Two implementations share this interface and one conformance suite
(tests/test_bus_conformance.py): :class:`bus.memory.InMemoryBus` for unit tests and
:class:`bus.zmq_bus.ZmqBus` for real runs.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

from protocol import Message

log = logging.getLogger(__name__)

#: Frames larger than this are refused by the broker (counted, never fatal).
MAX_FRAME_BYTES = 16 * 1024 * 1024


class Delivery(NamedTuple):
    """A message as delivered: stamped with the broker's sequence number and, when it
    came from another process, that process's authenticated identity (``peer``: its
    ZeroMQ routing identity, plus ``key=`` its CURVE public key with CURVE; ``""`` for
    the coordinator's own actors). ``sender`` is a name that peer registered."""

    seq: int
    sender: str
    receiver: str
    msg: Message
    peer: str = ""


#: A rejection is logged the first time for each (peer, reason), then again each time
#: its count reaches a power of ten: a flood of 10**6 bad frames costs 7 lines.
_LOG_AT = frozenset(10 ** k for k in range(19))
#: Distinct (peer, reason) pairs counted one by one; past it, in one overflow entry (a
#: peer that changes identity per frame must not grow memory without bound).
MAX_REJECTION_KEYS = 10_000
_OVERFLOW = ("(other peers)", "(other reasons)")
_DIGITS = re.compile(r"\d+")
_QUOTED = re.compile("b?'[^']*'|b?\"[^\"]*\"")


def reason_of(why: str) -> str:
    """The kind of a rejection, for counting: quoted names and numbers replaced, and
    the text cut at its first colon (``"a body of 17000000 bytes (limit 16777216)"`` ->
    ``"a body of N bytes (limit N)"``; ``"does not decode: ..."`` -> ``"does not
    decode"``)."""
    return _DIGITS.sub("N", _QUOTED.sub("Q", why).split(":", 1)[0])[:120]


class Rejections:
    """Counts of refused frames or messages per (peer, reason), logged rate-limited.

    Shared by the bus (frames a port refuses) and the control machines (messages a
    peer's role does not allow): one rule for what is said about a refusal and when."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self._log = logger
        self._what = what
        self._lock = threading.Lock()

    def add(self, peer: str, why: str) -> int:
        """Count one refusal; returns the running count for its (peer, reason)."""
        key = (peer, reason_of(why))
        with self._lock:
            if key not in self.counts and len(self.counts) >= MAX_REJECTION_KEYS:
                key = _OVERFLOW
            n = self.counts[key] = self.counts.get(key, 0) + 1
        if n in _LOG_AT:
            self._log.warning("%s from %r: %s (%d so far from this peer for this reason; "
                              "logged again at %d)", self._what, peer, why, n, n * 10)
        return n

    def summary(self, top: int = 5) -> str:
        """The ``top`` (peer, reason) pairs by count, one per line ("" when none)."""
        pairs = sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
        return "\n".join(f"  {n} from {peer}: {reason}" for (peer, reason), n in pairs)

    def by_peer(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (peer, _), n in list(self.counts.items()):
            out[peer] = out.get(peer, 0) + n
        return out

    def total(self) -> int:
        return sum(self.counts.values())


Deliver = Callable[[Delivery], None]


@dataclass
class BusStats:
    """Counters the user can see (DESIGN section 7: nothing is dropped silently)."""

    delivered: int = 0
    rejected_frames: int = 0        # did not decode, too large, or malformed envelope
    unroutable: int = 0             # addressed to a name nobody attached
    after_close: int = 0            # sent after the bus closed (shutdown stragglers)
    undelivered: int = 0            # stamped and logged, but the receiver could not take it
    refused: int = 0                # delivered, but a control actor's admit refused it
    rejected_by_sender: dict[str, int] = field(default_factory=dict)
    rejections: Rejections = field(
        default_factory=lambda: Rejections(log, "bus: dropped a frame"), repr=False)
    refusals: Rejections = field(
        default_factory=lambda: Rejections(log, "refused a message"), repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def refuse(self, peer: str, why: str) -> None:
        """A control actor refused a message its sender's role does not allow."""
        with self._lock:
            self.refused += 1
        self.refusals.add(peer, why)

    def reject(self, sender: str, why: str) -> None:
        with self._lock:
            self.rejected_frames += 1
            self.rejected_by_sender[sender] = self.rejected_by_sender.get(sender, 0) + 1
        self.rejections.add(sender, why)

    def as_dict(self) -> dict[str, int]:
        return {"delivered": self.delivered, "rejected_frames": self.rejected_frames,
                "unroutable": self.unroutable, "after_close": self.after_close,
                "undelivered": self.undelivered, "refused": self.refused}


class Bus(Protocol):
    """The interface the actors use; they never see sockets."""

    stats: BusStats

    def attach(self, name: str, deliver: Deliver) -> None:
        """Route messages addressed to ``name`` to ``deliver`` (called on a bus thread)."""

    def detach(self, name: str) -> None: ...

    def send(self, sender: str, receiver: str, msg: Message) -> None:
        """Send from any thread; delivery order is FIFO per (sender thread, receiver)."""

    def send_in_order(self, messages: Sequence[tuple[str, str, Message]]) -> None:
        """Send ``(sender, receiver, message)`` triples, each from its own sender, stamped
        in this order with nothing another thread ``send``s between them (an actor's
        answer to one of them comes after them all): a resume's re-sent messages, which
        would race if each sender's thread sent its own."""

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
