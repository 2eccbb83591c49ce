"""The ZeroMQ bus: one broker (a ROUTER) per topology and one endpoint per process.

Frames (after the ROUTER's identity frame):

- ``[b"m" + u16 len(sender) + u16 len(receiver) + sender + receiver + body]`` (one
  frame; what endpoints send: multipart frames cost pyzmq far more per frame than the
  bytes they carry), or ``[b"M", sender, receiver, body]`` (the same, in four frames):
  a message; the broker decodes ``body`` with the typed decoder (a frame that does not decode is counted and dropped), stamps a
  sequence number, appends it to the log, and forwards
  ``[b"M", seq(8 bytes), sender, receiver, body]`` to the endpoint that attached
  ``receiver``;
- ``[b"A", name, endpoint_identity]``: route ``name`` to that endpoint (empty
  identity: the sending socket); answered with ``[b"a", name]``;
- ``[b"D", name]``: forget ``name``.

This module is the only one (with its siblings in bus/) that imports zmq.
"""

from __future__ import annotations

import collections
import logging
import struct
import threading
import uuid
from collections.abc import Callable, Sequence

import msgspec
import zmq

from bus.base import MAX_FRAME_BYTES, BusStats, Deliver, Delivery, RunClock
from bus.frames import batch as _batch
from bus.frames import delivery as _delivery
from bus.frames import envelope as _envelope
from bus.frames import open_batch as _open_batch
from bus.frames import open_envelope as _open
from bus.frames import recv_frames as _recv_frames
from bus.frames import router_socket
from bus.frames import send_frames as _send_frames
from bus.log import UNDELIVERED
from bus.security import loopback_only
from protocol import Codec, Message

log = logging.getLogger(__name__)

_SEQ = struct.Struct("<Q")
#: Builds a Delivery without its Python-level ``__new__`` (one frame fewer a message
#: on the in-process lane).
_new_tuple = tuple.__new__
_get_ident = threading.get_ident
# Plain ints: pyzmq's enum flags cost an enum operation per frame.
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def _readable(sock: zmq.Socket) -> bool:
    """Another message is waiting (~1.6 us; a recv that raises zmq.Again costs ~6 us)."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


#: How long attach() waits for the broker's acknowledgement.
ATTACH_DEADLINE_S = 10.0
#: Poll period of the bus threads: bounds how long a stop request can go unseen.
_POLL_MS = 200


def _wake(ctx: zmq.Context, addr: str) -> None:
    """Wake a bus thread blocked in poll so it sees its stop flag at once."""
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send(b"", zmq.NOBLOCK)
    except zmq.ZMQError:  # the thread is already gone: nothing to wake
        pass
    finally:
        sock.close(0)


def deliver_frames(handlers: dict[str, Deliver], stats: BusStats, codec: Codec,
                   frames: list[bytes], who: str, *, count: bool = False) -> None:
    """Hand a delivery ``[M, seq, sender, receiver, body]`` to the local actor it names.

    Shared by this process's endpoint and a remote worker's: a name nobody attached is
    counted unroutable, a body that does not decode is counted and dropped, and a
    handler that raises is logged without stopping the I/O thread."""
    _, seq, sender, receiver, body = frames
    deliver_one(handlers, stats, codec, _SEQ.unpack(seq)[0], sender, receiver, body, who,
                count=count)


def deliver_one(handlers: dict[str, Deliver], stats: BusStats, codec: Codec, seq: int,
                sender: bytes, receiver: bytes, body: bytes, who: str, *,
                count: bool = False) -> None:
    """:func:`deliver_frames` for a delivery already taken apart (a one-frame delivery)."""
    name = receiver.decode("utf-8", "replace")
    deliver = handlers.get(name)
    if deliver is None:
        stats.unroutable += 1
        return
    try:
        msg = codec.decode(body)
    except msgspec.DecodeError as exc:
        stats.reject(sender.decode("utf-8", "replace"), f"does not decode: {exc}")
        return
    if count:
        stats.delivered += 1
    try:
        deliver(Delivery(seq, sender.decode("utf-8", "replace"), name, msg))
    except Exception:  # a handler bug must not kill the I/O thread; logged here
        log.exception("%s: delivering %s to %r failed", who, type(msg).__name__, name)


class Broker:
    """The ROUTER that gives the run its total order. Runs on a thread of its own."""

    def __init__(self, ctx: zmq.Context, binds: list[str], *, log_writer=None,
                 stats: BusStats | None = None, clock: RunClock | None = None,
                 peers: tuple = (), first_seq: int = 1, sync_on: tuple[type, ...] = ()) -> None:
        if isinstance(first_seq, bool) or not isinstance(first_seq, int) or first_seq < 1:
            raise ValueError(f"first_seq must be an integer >= 1, got {first_seq!r}")
        self.ctx = ctx
        self.stats = stats or BusStats()
        self._log = log_writer
        # Message types whose record is fsynced before the broker waits for more input
        # (LogWriter.append(sync=True); the runtime names Start, Commit, ...).
        self._sync_on = frozenset(sync_on)
        self._clock = clock or RunClock()
        self._routes: dict[bytes, bytes] = {}
        # Names attached by this process's own bus (ZmqBus.attach): the broker calls
        # their handler itself instead of forwarding over inproc to the endpoint's
        # thread (one thread hop, one socket round and one decode less per message).
        self._local: dict[bytes, Deliver] = {}
        self._local_names: dict[str, Deliver] = {}   # the same, by name (inline sends)
        # Sends made by a handler while the broker thread runs it: forwarded right after
        # the current delivery, in order, without a socket (see post()).
        self._posted: collections.deque[tuple[bytes, bytes, bytes]] = collections.deque()
        self._posted_by: dict[bytes, int] = {}   # sender -> its messages in _posted
        self._draining = False
        # The one order: held while a message is stamped, logged and handed to a local
        # name, on the broker thread (forward) or on a sender's own (inline).
        self.order = threading.RLock()
        self._inline: collections.deque[tuple[str, str, Message]] = collections.deque()
        self._inline_draining = False
        self._inline_codec = Codec()   # used under ``order`` only
        self.ident: int | None = None
        # Peer ports (bus/remote.py PeerPort), one ROUTER each for remote and
        # process workers, with their own frame policy; routed to through _route().
        self._peers = list(peers)
        self._router: zmq.Socket | None = None
        # The last sequence number given: the first message gets ``first_seq`` (a resumed
        # run's log goes on after the one it continues).
        self._seq = first_seq - 1
        self.closing = False
        self._stop = threading.Event()
        #: ``_stop`` as a plain flag, for inline sends (Event.is_set is a Python call).
        self._stopped = False
        #: Where :meth:`send_inline` hands what it cannot deliver inline (ZmqBus.send).
        self.otherwise: Callable[[str, str, Message], None] | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.addresses: list[str] = []
        self._binds = binds
        self._ctl_addr = f"inproc://evobus-broker-ctl-{uuid.uuid4().hex}"
        #: Where this process's endpoint pushes messages (a PULL socket): one frame, one
        #: recv per message, where the ROUTER costs two recvs and two RCVMORE queries
        #: (~6.5 us against ~1.5 us). Attach, detach and other processes use the ROUTER.
        self.intake_addr = f"inproc://evobus-intake-{uuid.uuid4().hex}"
        self._thread = threading.Thread(target=self._run, name="evobus-broker", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(ATTACH_DEADLINE_S):
            raise RuntimeError("evobus broker did not start within its deadline")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        self.ident = threading.get_ident()
        router = router_socket(self.ctx)
        try:
            for addr in self._binds:
                router.bind(addr)
                self.addresses.append(router.getsockopt_string(zmq.LAST_ENDPOINT))
            for port in self._peers:  # remote/process worker ports
                port.open(self)
                self.addresses.extend(port.addresses)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            router.close(0)
            for port in self._peers:
                port.close()
            return
        self._router = router
        ctl = self.ctx.socket(zmq.PAIR)
        ctl.bind(self._ctl_addr)
        intake = self.ctx.socket(zmq.PULL)
        intake.setsockopt(zmq.LINGER, 0)
        intake.bind(self.intake_addr)
        self._ready.set()
        codec = Codec()
        poller = zmq.Poller()
        poller.register(intake, zmq.POLLIN)
        poller.register(router, zmq.POLLIN)
        poller.register(ctl, zmq.POLLIN)
        for port in self._peers:
            poller.register(port.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if not ready:
                    if self._log is not None:  # records reach the OS on time when idle too
                        with self.order:
                            self._log.flush_if_due()
                    continue
                # Drain what is there before polling again, reading only the sockets
                # the poll found readable and asking for more with EVENTS, not with a
                # recv that fails (zmq.Again costs ~6 us a time, twice a cycle).
                if intake in ready:
                    for _ in range(1024):
                        self._on_intake(codec, intake.recv(_NOBLOCK))
                        if not _readable(intake):
                            break
                if router in ready:
                    for _ in range(1024):
                        self._on_frames(router, codec, _recv_frames(router, _NOBLOCK))
                        if not _readable(router):
                            break
                for port in self._peers:  # peer frames go through the port's policy
                    if port.socket is not None and port.socket in ready:
                        port.drain(codec)
                if self._log is not None:  # a commit in this batch is fsynced now, once
                    with self.order:
                        self._log.flush_if_due()
            self._last_drain(codec, intake, router)
        finally:
            router.close(0)
            intake.close(0)
            ctl.close(0)
            for port in self._peers:
                port.close()
            if self._log is not None:
                with self.order:
                    self._log.close()

    def _last_drain(self, codec: Codec, intake: zmq.Socket, router: zmq.Socket) -> None:
        """Forward what was sent before stop() (the runtime's last Stop to each worker):
        a loop that saw the stop flag mid-batch leaves it unread, and a worker in another
        process would wait for its give_up instead of leaving. Bounded: nothing new can
        come once the endpoints refuse sends (ZmqBus.close closes them first)."""
        for sock, on in ((intake, lambda: self._on_intake(codec, intake.recv(_NOBLOCK))),
                         (router, lambda: self._on_frames(router, codec,
                                                          _recv_frames(router, _NOBLOCK)))):
            for _ in range(100_000):
                if not _readable(sock):
                    break
                on()

    def _on_frames(self, router: zmq.Socket, codec: Codec, frames: list[bytes]) -> None:
        ident = frames[0]
        kind = frames[1] if len(frames) > 1 else b""
        single = len(frames) == 2 and kind[:1] == b"m"
        if single or kind == b"M" and len(frames) == 5:
            if single:
                opened = _open(kind)
                if opened is None:
                    self.stats.reject(repr(ident), "malformed single-frame envelope")
                    return
                sender, receiver, body = opened
            else:
                _, _, sender, receiver, body = frames
            self._check_and_forward(codec, sender, receiver, body)
        elif kind == b"A" and len(frames) == 4:
            self._routes[frames[2]] = frames[3] or ident
            try:
                router.send_multipart([ident, b"a", frames[2]])
            except zmq.ZMQError:  # the asker is gone; nothing to acknowledge
                pass
        elif kind == b"D" and len(frames) == 3:
            self._routes.pop(frames[2], None)
        else:
            self.stats.reject(repr(ident), f"malformed envelope ({len(frames)} frames, kind {kind!r})")

    def _on_intake(self, codec: Codec, frame: bytes) -> None:
        """A single-frame message pushed by an endpoint of this process, or a batch of
        them (one actor's outputs, forwarded in order)."""
        if frame[:1] == b"n":
            envelopes = _open_batch(frame)
            if envelopes is None:
                self.stats.reject("intake", f"malformed batch ({len(frame)} bytes)")
                return
        else:
            envelopes = (frame,)
        for one in envelopes:
            opened = _open(one) if one[:1] == b"m" else None
            if opened is None:
                self.stats.reject("intake", f"malformed envelope ({len(one)} bytes)")
                continue
            self._check_and_forward(codec, *opened)

    def _check_and_forward(self, codec: Codec, sender: bytes, receiver: bytes,
                           body: bytes) -> None:
        """Decode with the typed decoder (a body that does not decode is counted and
        dropped, never fatal), then stamp, deliver and log it."""
        try:
            msg = codec.decode(body)
        except msgspec.DecodeError as exc:
            self.stats.reject(sender.decode("utf-8", "replace"), f"does not decode: {exc}")
            return
        self.forward(codec, sender, receiver, body, msg)

    def forward(self, codec: Codec, sender: bytes, receiver: bytes, body: bytes,
                msg: Message | None = None, peer: str = "") -> None:
        """:meth:`_forward` in the one order (see :meth:`inline`)."""
        with self.order:
            self._forward(codec, sender, receiver, body, msg, peer)

    def send_inline(self, sender: str, receiver: str, msg: Message, copy: bool = True) -> None:
        """Stamp, log and deliver ``msg`` on the calling thread, as :meth:`forward` does
        on the broker's, when ``receiver`` is attached by this process; otherwise (a
        receiver elsewhere, a send from the broker's own thread, a broker stopping) hand
        it to ``otherwise`` (the bus's ``send``). Under the one order lock: the broker's
        messages and every sender's inline ones get one sequence and one log. A message
        sent inline by the handler it reaches is delivered after that handler returns,
        in order (breadth-first, as on the in-memory bus). The body is encoded and
        decoded as on the way through the broker, so what arrives is what the log holds;
        with ``copy=False`` the sender vouches that decoding would give the message back
        as it is (a pure machine's output made only of what crossed the bus to it) and
        within the frame limit: it is handed over as it is, encoded only for the log.
        (One call for the lot: a warm group sends 13 messages so.)"""
        if _get_ident() != self.ident:
            with self.order:
                if not self._stopped and receiver in self._local_names:
                    self._inline.append((sender, receiver, msg, copy))
                    if self._inline_draining:
                        return
                    self._inline_draining = True
                    try:
                        self._drain_inline()
                    finally:
                        self._inline_draining = False
                    if self._log is not None:   # a commit among these is fsynced now, once
                        self._log.flush_if_due()
                    return
        self.otherwise(sender, receiver, msg)

    def stop_inline(self) -> None:
        """Inline sends go to ``otherwise`` from now on (the bus is closing)."""
        self._stopped = True

    def _drain_inline(self) -> None:
        codec, queue, local, stats, log_ = (self._inline_codec, self._inline,
                                            self._local_names, self.stats, self._log)
        while queue:
            sender, receiver, msg, copy = queue.popleft()
            deliver = local.get(receiver)
            body = codec.encode(msg) if copy or log_ is not None or deliver is None else b""
            if copy:
                if len(body) > MAX_FRAME_BYTES:
                    stats.reject(sender, f"frame of {len(body)} bytes over the "
                                 f"{MAX_FRAME_BYTES} limit")
                    continue
                msg = codec.decode(body)
            if deliver is None:   # detached meanwhile (or never here): as forward() does
                self._forward(codec, sender.encode(), receiver.encode(), body, msg)
                continue
            self._seq += 1
            if log_ is not None:
                log_.append(self._seq, self._clock(), sender, receiver, body,
                            type(msg) in self._sync_on)
            stats.delivered += 1
            try:
                deliver(_new_tuple(Delivery, (self._seq, sender, receiver, msg, "")))
            except Exception:  # a handler bug must not stop the sender; logged here
                log.exception("bus: delivering %s to %r failed", type(msg).__name__, receiver)

    def _forward(self, codec: Codec, sender: bytes, receiver: bytes, body: bytes,
                 msg: Message | None = None, peer: str = "") -> None:
        """Stamp, deliver and log one message whose body decoded (broker thread only).
        ``msg`` is the decoded body when the caller has it (else it is decoded here if a
        local handler needs it); ``peer`` the sending process's authenticated identity
        (a peer port's frame; "" for this process's actors), recorded with it.

        A message that cannot be handed over (no route, a peer that stopped reading or
        left) still gets its sequence number and is logged as ``UNDELIVERED``: the log
        then holds everything every actor sent, so replay sees what the sender did."""
        deliver = self._local.get(receiver)
        if deliver is not None:
            self._seq += 1
            if msg is None:
                msg = codec.decode(body)
            if self._log is not None:
                self._log.append(self._seq, self._clock(), sender.decode(), receiver.decode(),
                                 body, type(msg) in self._sync_on, peer=peer)
            self.stats.delivered += 1
            try:
                deliver(Delivery(self._seq, sender.decode(), receiver.decode(), msg, peer))
            except Exception:  # a handler bug must not kill the broker; logged here
                log.exception("broker: delivering %s to %r failed", type(msg).__name__,
                              receiver.decode())
            if self._posted and not self._draining:
                self._drain_posted(codec)
            return
        sock, dest, flags = self._route(receiver)
        self._seq += 1
        if dest is None:
            self.stats.unroutable += 1
            # During shutdown actors leave while the last messages fly: counted only.
            if not self.closing:
                log.warning("broker: no actor named %r (%s from %r)", receiver.decode(),
                            type(codec.decode(body)).__name__, sender.decode())
            self._undelivered(sender, receiver, body, peer)
            return
        try:
            if sock is self._router:
                _send_frames(sock, [dest, b"M", _SEQ.pack(self._seq), sender, receiver, body],
                             int(flags))
            else:  # a peer port's worker gets one frame (bus/remote.py)
                _send_frames(sock, [dest, _delivery(self._seq, sender, receiver, body)],
                             int(flags))
        except zmq.ZMQError:  # the endpoint went away (or a stuck peer is full): counted
            self.stats.unroutable += 1
            self._undelivered(sender, receiver, body, peer)
            return
        if self._log is not None:
            self._log.append(self._seq, self._clock(), sender.decode(), receiver.decode(),
                             body, type(msg) in self._sync_on, peer=peer)
        self.stats.delivered += 1

    def _undelivered(self, sender: bytes, receiver: bytes, body: bytes, peer: str) -> None:
        self.stats.undelivered += 1
        if self._log is not None:
            self._log.append(self._seq, self._clock(), sender.decode(), receiver.decode(),
                             body, peer=peer, status=UNDELIVERED)

    # -- routing to peer ports (bus/remote.py) ----------------------------------

    def _route(self, receiver: bytes) -> tuple[zmq.Socket | None, bytes | None, int]:
        dest = self._routes.get(receiver)
        if dest is not None:
            return self._router, dest, 0
        for port in self._peers:
            dest = port.routes.get(receiver)
            if dest is not None:
                # Never block the broker on a peer that stopped reading (SIGSTOP, a full
                # pipe): the frame is dropped and counted; liveness re-dispatches the work.
                return port.socket, dest, zmq.NOBLOCK
        return None, None, 0

    def is_local(self, name: bytes) -> bool:
        """A name attached by an endpoint of this process (a peer may not take it over)."""
        return name in self._routes or name in self._local

    def held_elsewhere(self, name: bytes, port) -> bool:
        """A name a peer of another port holds (a remote peer may not take a process
        worker's name, nor the reverse)."""
        return any(name in other.routes for other in self._peers if other is not port)

    # -- local delivery (names attached by this process's ZmqBus) --------------------------

    def deliver_locally(self, name: str, deliver: Deliver) -> None:
        """Messages to ``name`` are handed to ``deliver`` on the broker thread, after they
        are stamped and logged (``deliver`` must not block: an actor's ``tell``)."""
        self._local[name.encode()] = deliver
        self._local_names[name] = deliver

    def deliver_many(self, pairs: list[tuple[str, Deliver]]) -> None:
        local, by_name = self._local, self._local_names
        for name, deliver in pairs:
            local[name.encode()] = deliver
            by_name[name] = deliver

    def forget_local(self, name: str) -> None:
        self._local.pop(name.encode(), None)
        self._local_names.pop(name, None)

    def forget_many(self, names: list[str]) -> None:
        local, by_name = self._local, self._local_names
        for name in names:
            local.pop(name.encode(), None)
            by_name.pop(name, None)

    def post(self, sender: str, receiver: str, body: bytes) -> None:
        """A send from a handler running on the broker thread: it is forwarded after the
        current delivery returns. A socket would do, until it fills: then the broker
        would wait on itself."""
        name = sender.encode()
        self._posted.append((name, receiver.encode(), body))
        self._posted_by[name] = self._posted_by.get(name, 0) + 1

    def _drain_posted(self, codec: Codec) -> None:
        """Forward what handlers sent, depth first where order allows: what a delivery's
        handler sends goes before the rest of what was sent before it, unless one of its
        senders still has an earlier message waiting (each sender's messages leave in
        the order sent). So a Collector's 512 leases each reach their worker right after
        the relay hands it on, not after the 511 others have crossed the relay."""
        self._draining = True
        posted, by = self._posted, self._posted_by
        try:
            while posted:
                before = len(posted) - 1
                item = posted.popleft()
                left = by[item[0]] - 1
                if left:
                    by[item[0]] = left
                else:
                    del by[item[0]]
                self._forward_posted(codec, *item)
                new = len(posted) - before
                if new > 0 and before and self._first_of_their_senders(new):
                    posted.rotate(new)   # the handler's sends, in order, to the front
        finally:
            self._draining = False

    def _first_of_their_senders(self, new: int) -> bool:
        """Are the last ``new`` posted messages the only ones waiting of their senders?"""
        posted, by = self._posted, self._posted_by
        tally: dict[bytes, int] = {}
        for k in range(len(posted) - new, len(posted)):
            name = posted[k][0]
            tally[name] = tally.get(name, 0) + 1
        return all(by[name] == n for name, n in tally.items())

    def _forward_posted(self, codec: Codec, sender: bytes, receiver: bytes,
                        body: bytes) -> None:
        if len(body) > MAX_FRAME_BYTES:
            self.stats.reject(sender.decode("utf-8", "replace"),
                              f"frame of {len(body)} bytes over the {MAX_FRAME_BYTES} "
                              "limit")
            return
        self._check_and_forward(codec, sender, receiver, body)

    def stop(self) -> None:
        self._stopped = True
        self._stop.set()
        _wake(self.ctx, self._ctl_addr)
        self._thread.join(timeout=5)


#: How long a released thread's socket still delivers what it sent (milliseconds).
RELEASE_LINGER_MS = 1000


class Endpoint:
    """A process's door to the broker: delivers to local names, sends from any thread.

    Receiving: one DEALER owned by the endpoint's thread, which decodes and calls the
    ``deliver`` callback registered for the receiver (an actor's ``tell``). With
    ``receive=False`` there is neither: the broker of a :class:`ZmqBus` delivers its own
    process's messages itself, so its endpoint only sends (a frame routed to it anyway
    is refused by the broker's ROUTER and counted unroutable).
    Sending: each sending thread gets its own DEALER (ZeroMQ sockets are not shared
    between threads); all of them are closed by :meth:`close`.
    """

    def __init__(self, ctx: zmq.Context, broker_addr: str, *, stats: BusStats | None = None,
                 name: str = "local", intake: str | None = None,
                 receive: bool = True) -> None:
        self.ctx = ctx
        self.broker_addr = broker_addr
        # The broker's intake (same process only): messages go there, one frame each.
        self.intake = intake
        self.stats = stats or BusStats()
        self.identity = f"ep-{name}-{uuid.uuid4().hex[:8]}".encode()
        self._handlers: dict[str, Deliver] = {}
        self._local = threading.local()
        self._senders: list[zmq.Socket] = []
        self._senders_lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._ctl_addr = f"inproc://evobus-endpoint-ctl-{uuid.uuid4().hex}"
        self._thread: threading.Thread | None = None
        if not receive:
            return
        self._thread = threading.Thread(target=self._run, name=f"evobus-endpoint-{name}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(ATTACH_DEADLINE_S):
            raise RuntimeError("evobus endpoint did not start within its deadline")

    def _run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.connect(self.broker_addr)
        ctl = self.ctx.socket(zmq.PAIR)
        ctl.bind(self._ctl_addr)
        self._ready.set()
        # Built at the first delivery (a typed Decoder takes ~80 us): the endpoint of a
        # ZmqBus gets none, its broker hands this process's messages over itself.
        codec: Codec | None = None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(ctl, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                for _ in range(1024):
                    try:
                        frames = _recv_frames(sock, _NOBLOCK)
                    except zmq.Again:
                        break
                    if codec is None:
                        codec = Codec()
                    self._on_frames(codec, frames)
        finally:
            sock.close(0)
            ctl.close(0)

    def _on_frames(self, codec: Codec, frames: list[bytes]) -> None:
        if len(frames) != 5 or frames[0] != b"M":
            self.stats.reject("broker", f"malformed delivery ({len(frames)} frames)")
            return
        deliver_frames(self._handlers, self.stats, codec, frames, "endpoint")

    def _sender(self) -> tuple[zmq.Socket, msgspec.msgpack.Encoder]:
        # A sending thread only encodes: an Encoder (~1 us to make) rather than a Codec,
        # whose typed Decoder takes ~80 us to build, on every thread's first send.
        pair = getattr(self._local, "pair", None)
        if pair is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.broker_addr)
            with self._senders_lock:
                self._senders.append(sock)
            pair = self._local.pair = (sock, msgspec.msgpack.Encoder())
        return pair

    def _pusher(self) -> tuple[zmq.Socket, msgspec.msgpack.Encoder]:
        """This thread's socket for messages: a PUSH to the broker's intake when the
        broker is in this process, else the thread's DEALER."""
        push = getattr(self._local, "push", None)
        if push is None:
            if self.intake is None:
                push = self._sender()
            else:
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(self.intake)
                with self._senders_lock:
                    self._senders.append(sock)
                push = (sock, msgspec.msgpack.Encoder())
            self._local.push = push
        return push

    def attach(self, name: str, deliver: Deliver) -> None:
        self._handlers[name] = deliver
        sock, _ = self._sender()
        sock.send_multipart([b"A", name.encode(), self.identity])
        if not sock.poll(int(ATTACH_DEADLINE_S * 1000)):
            raise TimeoutError(f"the broker at {self.broker_addr} did not acknowledge "
                               f"actor {name!r} within {ATTACH_DEADLINE_S} s")
        sock.recv_multipart()

    def detach(self, name: str) -> None:
        self._handlers.pop(name, None)
        if self._stop.is_set():
            return
        try:
            sock, _ = self._sender()
            sock.send_multipart([b"D", name.encode()])
        except zmq.ZMQError:
            if not self._stop.is_set():
                raise
            # close() ran between the check above and the send (an actor whose on_stop
            # runs while the runtime closes the bus): the broker forgets every name anyway.

    def send(self, sender: str, receiver: str, msg: Message) -> None:
        if self._stop.is_set():
            self.stats.after_close += 1
            return
        sock, codec = self._pusher()
        self._push(sock, _envelope(sender.encode(), receiver.encode(), codec.encode(msg)))

    def send_many(self, sender: str, out: list[tuple[str, Message]]) -> None:
        """Send several messages from ``sender``, in order, as one frame to the broker."""
        if self._stop.is_set():
            self.stats.after_close += len(out)
            return
        sock, codec = self._pusher()
        if self.intake is None:  # a broker in another process reads one message a frame
            for receiver, msg in out:
                self._push(sock, _envelope(sender.encode(), receiver.encode(),
                                           codec.encode(msg)))
            return
        name = sender.encode()
        self._push(sock, _batch([_envelope(name, receiver.encode(), codec.encode(msg))
                                 for receiver, msg in out]))

    def send_in_order(self, messages: Sequence[tuple[str, str, Message]]) -> None:
        """Send ``(sender, receiver, message)`` triples, in order, as one frame: the
        broker forwards all of them before it reads another (a broker in another process
        reads one message a frame: they go one after another from this thread)."""
        if self._stop.is_set():
            self.stats.after_close += len(messages)
            return
        sock, codec = self._pusher()
        envelopes = [_envelope(sender.encode(), receiver.encode(), codec.encode(msg))
                     for sender, receiver, msg in messages]
        if self.intake is None:
            for frame in envelopes:
                self._push(sock, frame)
            return
        self._push(sock, _batch(envelopes))

    def send_frame(self, sender: str, receiver: str, body: bytes) -> None:
        if self._stop.is_set():
            self.stats.after_close += 1
            return
        sock, _ = self._pusher()
        self._push(sock, _envelope(sender.encode(), receiver.encode(), bytes(body)))


    def _push(self, sock: zmq.Socket, frame: bytes) -> None:
        try:
            sock.send(frame)
        except zmq.ZMQError:
            if not self._stop.is_set():
                raise
            # close() closed this thread's socket between the check above and the send:
            # a straggler of the shutdown, counted like any send after close.
            self.stats.after_close += 1

    def release_thread(self) -> None:
        """This thread sends no more (it is ending): close its sockets now instead of at
        the bus's close, so a bus that outlives many threads does not run out of file
        descriptors. Messages already sent are still delivered (a linger, not 0)."""
        socks = [pair[0] for pair in (getattr(self._local, "push", None),
                                      getattr(self._local, "pair", None)) if pair]
        self._local.push = self._local.pair = None
        with self._senders_lock:
            for sock in dict.fromkeys(socks):
                if sock in self._senders:
                    self._senders.remove(sock)
                    sock.close(RELEASE_LINGER_MS)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            _wake(self.ctx, self._ctl_addr)
            self._thread.join(timeout=5)
        with self._senders_lock:
            for sock in self._senders:
                sock.close(0)
            self._senders.clear()


class ZmqBus:
    """A broker and this process's endpoint, over ``inproc://`` (plus any ``binds``).

    ``binds`` adds ``ipc://`` or ``tcp://`` addresses for actors in other processes.
    A tcp address that is not loopback is refused unless ``insecure=True`` (remote
    workers over other interfaces must use CURVE keys: docs/remote.md). ``first_seq``
    is the sequence number of the first delivered message (default 1). ``sync_on``:
    message types whose log record is fsynced at once (bus/log.py)."""

    def __init__(self, log_writer=None, binds: tuple[str, ...] | list[str] = (), *,
                 insecure: bool = False, peers: tuple = (), first_seq: int = 1,
                 sync_on: tuple[type, ...] = ()) -> None:
        if isinstance(first_seq, bool) or not isinstance(first_seq, int) or first_seq < 1:
            raise ValueError(f"first_seq must be an integer >= 1, got {first_seq!r}")
        for addr in binds:
            if not insecure and not loopback_only(addr):
                raise ValueError(
                    f"refusing to bind {addr!r} without CURVE keys: the broker binds to "
                    "loopback only unless keys are configured; pass insecure=True (CLI: "
                    "--insecure) to accept unauthenticated peers on that interface")
        self.ctx = zmq.Context()
        self.stats = BusStats()
        self.clock = RunClock()
        inproc = f"inproc://evobus-{uuid.uuid4().hex}"
        # ``peers`` are bus.remote.PeerPort objects (remote and process workers:
        # one DEALER per process, CURVE when keys are configured); see docs/remote.md.
        self.broker = Broker(self.ctx, [inproc, *binds], log_writer=log_writer,
                             stats=self.stats, clock=self.clock, peers=tuple(peers),
                             first_seq=first_seq, sync_on=sync_on)
        self.broker.start()
        self.address = inproc
        # The broker hands this process's messages to their actors itself (attach):
        # the endpoint only sends, and needs no receiving thread.
        self.endpoint = Endpoint(self.ctx, inproc, stats=self.stats,
                                 intake=self.broker.intake_addr, receive=False)
        # Encodes on the broker thread only (see send); an Encoder, not a Codec: no
        # typed Decoder to build (~80 us) for a bus that may never need one here.
        self._codec = msgspec.msgpack.Encoder()
        self._closed = False
        # ``send_inline(sender, receiver, msg, copy=True)``: ``send`` between two actors of
        # this process, handed over on the calling thread rather than the broker's:
        # stamped, logged and delivered in the one order all the same; a receiver
        # elsewhere, or a send from the broker's own thread, goes as ``send``. (A thread
        # keeps FIFO to a receiver only among sends of one kind: a parallel group's
        # actors send each other every message so.) See Broker.send_inline (``copy``).
        self.broker.otherwise = self.send
        self.send_inline = self.broker.send_inline

    @property
    def addresses(self) -> list[str]:
        return list(self.broker.addresses)

    def attach(self, name: str, deliver: Deliver) -> None:
        # The broker hands this process's messages to ``deliver`` itself, and counts the
        # name as taken (Broker.is_local: a peer cannot claim it). No route through the
        # endpoint (it has no receiving socket), so no round trip to the broker thread
        # (~0.1-0.4 ms each).
        self.broker.deliver_locally(name, deliver)

    def attach_many(self, pairs: list[tuple[str, Deliver]]) -> None:
        """``attach`` for several names at once (a parallel group's workers)."""
        self.broker.deliver_many(pairs)

    def detach(self, name: str) -> None:
        self.broker.forget_local(name)

    def detach_many(self, names: list[str]) -> None:
        """``detach`` for several names at once (a parallel group's, at its end)."""
        self.broker.forget_many(names)

    def release_thread(self) -> None:
        """The calling thread will send no more: its sockets close now."""
        self.endpoint.release_thread()

    def send(self, sender: str, receiver: str, msg: Message) -> None:
        if threading.get_ident() == self.broker.ident:  # a handler, on the broker thread
            if self._closed:
                self.stats.after_close += 1
                return
            self.broker.post(sender, receiver, self._codec.encode(msg))
            return
        self.endpoint.send(sender, receiver, msg)

    def send_many(self, sender: str, out: list[tuple[str, Message]]) -> None:
        """``send`` for an actor's outputs, in order: one frame to the broker for them all
        (one hand-over between the actor's thread and the broker's, not one each)."""
        if threading.get_ident() == self.broker.ident:
            for receiver, msg in out:
                self.send(sender, receiver, msg)
            return
        self.endpoint.send_many(sender, out)

    def send_in_order(self, messages: Sequence[tuple[str, str, Message]]) -> None:
        """Send each ``(sender, receiver, message)`` from its own sender, in this order,
        as one frame (see ``Bus.send_in_order``): the broker forwards it whole before it
        reads another, so no other thread's ``send`` comes between them (an inline send,
        which only a parallel group's actors make, or a handler answering on the broker's
        own thread, as no actor does, may)."""
        if not messages:
            return
        if threading.get_ident() == self.broker.ident:  # posted: forwarded in order
            for sender, receiver, msg in messages:
                self.send(sender, receiver, msg)
            return
        self.endpoint.send_in_order(messages)

    def send_frame(self, sender: str, receiver: str, body: bytes) -> None:
        if threading.get_ident() == self.broker.ident:

            self.broker.post(sender, receiver, bytes(body))
            return
        self.endpoint.send_frame(sender, receiver, body)

    def closing(self) -> None:
        """The topology is shutting down: unroutable messages are expected, not warned."""
        self.broker.closing = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.broker.stop_inline()
        self.endpoint.close()
        self.broker.stop()
        self.ctx.destroy(linger=0)
