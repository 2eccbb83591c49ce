"""An in-memory bus with the same interface as the ZeroMQ one, for unit tests.

Deliveries happen in one total order (like the broker's): ``send`` stamps a sequence
number, appends to the log, and delivers. A delivery that sends again (a handler that
answers) is queued and delivered after the current one returns, so the order is the
same breadth-first order whatever the call depth.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence

import msgspec

from bus.base import MAX_FRAME_BYTES, BusStats, Deliver, Delivery, RunClock
from bus.log import UNDELIVERED
from protocol import Message, decode, encode

log = logging.getLogger(__name__)

#: How often the log's idle flusher looks (the ZeroMQ broker's poll period).
_IDLE_FLUSH_S = 0.2

#: Builds a Delivery without its Python-level ``__new__`` (one frame fewer a message).
_new_tuple = tuple.__new__


class InMemoryBus:
    """``first_seq``: the sequence number of the first delivered message (a resumed run's
    log goes on after the one it continues)."""

    def __init__(self, log_writer=None, *, first_seq: int = 1,
                 sync_on: tuple[type, ...] = ()) -> None:
        if isinstance(first_seq, bool) or not isinstance(first_seq, int) or first_seq < 1:
            raise ValueError(f"first_seq must be an integer >= 1, got {first_seq!r}")
        self.stats = BusStats()
        self._routes: dict[str, Deliver] = {}
        self._lock = threading.RLock()
        # (sender, receiver, body, None), or (sender, receiver, None, msg) for a message
        # handed over as it is (send_inline with copy=False).
        self._queue: collections.deque[tuple] = collections.deque()
        self._draining = False
        self._seq = first_seq - 1  # the last number given
        self._log = log_writer
        self._clock = RunClock()
        self._closed = False
        self._closing = False
        self._sync_on = frozenset(sync_on)  # fsynced at once (LogWriter.append(sync=True))
        self._stop = threading.Event()
        if log_writer is not None:
            # Deliveries run on the senders' threads; this one flushes the log on time
            # when nobody sends (bus/log.py: every record reaches the OS within a second).
            threading.Thread(target=self._flush_on_time, name="evobus-memory-log",
                             daemon=True).start()

    def closing(self) -> None:
        self._closing = True

    def attach(self, name: str, deliver: Deliver) -> None:
        with self._lock:
            self._routes[name] = deliver

    def attach_many(self, pairs: list[tuple[str, Deliver]]) -> None:
        with self._lock:
            self._routes.update(pairs)

    def release_thread(self) -> None:
        """Nothing to release: this bus has no socket per thread."""

    def detach(self, name: str) -> None:
        with self._lock:
            self._routes.pop(name, None)

    def detach_many(self, names: list[str]) -> None:
        """``detach`` for several names at once (a parallel group's, at its end)."""
        with self._lock:
            for name in names:
                self._routes.pop(name, None)

    def send(self, sender: str, receiver: str, msg: Message) -> None:
        self.send_frame(sender, receiver, encode(msg))

    def send_inline(self, sender: str, receiver: str, msg: Message, copy: bool = True) -> None:
        """``send`` (this bus always delivers on the sender's thread); with ``copy=False``
        the sender vouches that decoding would give the message back as it is (a pure
        machine's output made only of what crossed the bus to it) and within the frame
        limit: it is handed over as it is, encoded only for the log (ZmqBus.send_inline
        does the same)."""
        self._enqueue((sender, receiver, encode(msg), None) if copy else
                      (sender, receiver, None, msg))

    def send_frame(self, sender: str, receiver: str, body: bytes) -> None:
        self._enqueue((sender, receiver, bytes(body), None))

    def send_in_order(self, messages: Sequence[tuple[str, str, Message]]) -> None:
        """``send`` each ``(sender, receiver, message)``, in this order, as one lot (see
        ``Bus.send_in_order``): queued together under the lock, then delivered, so neither
        another thread's send nor a handler's answer comes between them."""
        if not messages:
            return
        *head, last = [(sender, receiver, encode(msg), None)
                       for sender, receiver, msg in messages]
        with self._lock:
            if self._closed:
                self.stats.after_close += len(messages)
                return
            self._queue.extend(head)
            self._enqueue(last)   # drains the queue: these first, in order

    def _enqueue(self, entry: tuple) -> None:
        with self._lock:
            if self._closed:
                self.stats.after_close += 1
                return
            self._queue.append(entry)
            if self._draining:
                return
            self._draining = True
            try:
                queue, routes, stats = self._queue, self._routes, self.stats
                while queue:
                    entry = queue.popleft()
                    sender, receiver, body, msg = entry
                    deliver = routes.get(receiver)
                    if body is None and self._log is None and deliver is not None:
                        # Handed over as it is, with no log to encode it for: delivered
                        # here (the most of a warm group's messages), else as below.
                        self._seq += 1
                        stats.delivered += 1
                        deliver(_new_tuple(Delivery, (self._seq, sender, receiver, msg, "")))
                        continue
                    self._deliver_one(*entry)
            finally:
                self._draining = False
            if self._log is not None:  # a commit among these is fsynced now, once
                self._log.flush_if_due()

    def _deliver_one(self, sender: str, receiver: str, body: bytes | None,
                     msg: Message | None) -> None:
        if body is None:   # handed over as it is: encoded only for the log
            body = encode(msg) if self._log is not None else b""
        else:
            if len(body) > MAX_FRAME_BYTES:
                self.stats.reject(sender, f"frame of {len(body)} bytes over the "
                                  f"{MAX_FRAME_BYTES} limit")
                return
            try:
                msg = decode(body)
            except msgspec.DecodeError as exc:
                self.stats.reject(sender, f"does not decode: {exc}")
                return
        deliver = self._routes.get(receiver)
        self._seq += 1
        if deliver is None:
            # Stamped and logged as undelivered, as the broker does (bus/zmq_bus.py).
            self.stats.unroutable += 1
            self.stats.undelivered += 1
            if not self._closing:
                log.warning("bus: no actor named %r (message %s from %r)", receiver,
                            type(msg).__name__, sender)
            if self._log is not None:
                self._log.append(self._seq, self._clock(), sender, receiver, body,
                                 status=UNDELIVERED)
            return
        if self._log is not None:
            self._log.append(self._seq, self._clock(), sender, receiver, body,
                             type(msg) in self._sync_on)
        self.stats.delivered += 1
        deliver(_new_tuple(Delivery, (self._seq, sender, receiver, msg, "")))

    def _flush_on_time(self) -> None:
        while not self._stop.wait(_IDLE_FLUSH_S):
            with self._lock:
                if self._closed:
                    return
                self._log.flush_if_due()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._closed = True
            self._routes.clear()
            if self._log is not None:
                self._log.close()
