"""Workers in other processes: the broker's peer port and the worker's remote endpoint.

A worker process (``evobus worker --connect``, or a process worker the coordinator
spawned) talks to the broker over **one DEALER socket carrying both directions**, owned
by one I/O thread. The broker meets it on a :class:`PeerPort`: a ROUTER of its own, with
CURVE when keys are configured, and a stricter frame policy than the in-process
endpoints get. Frames (after the ROUTER's identity frame)::

    peer -> broker  [b"A", name(, token)]        register a name (answered [b"a", name,
                                                 token], or [b"e", name, why] when
                                                 refused); a name another connection
                                                 holds moves only with the token its
                                                 first registration was given (or, with
                                                 CURVE, from the same public key)
                    [b"D", name]                 forget a name this peer registered
                    [envelope]                   a message, sent as a name it registered:
                                                 b"m", sender, receiver, body in one frame
                                                 (bus.frames.envelope); the four-frame
                                                 [b"M", sender, receiver, body] is accepted
                    [b"P"]                       ping (answered [b"p"])
    broker -> peer  [delivery]                   a message: b"d", seq, sender, receiver,
                                                 body in one frame (bus.frames.delivery)
                    [b"a", name, token], [b"e", name, why], [b"p"]

One frame per message: every frame is a send and a receive through pyzmq, each of
which gives up and takes back the interpreter lock, and a worker process may host
many workers.

Policy at the port (every refusal is counted in ``BusStats.rejected_frames``, per peer
and reason, and logged rate-limited: bus.base.Rejections): a message or ping from a peer
that registered no name, or sent as a name it did not register, is refused; a name held
by an actor of the coordinator's own process, or by a peer of another port, cannot be
taken over, nor a name another connection of this port holds without its token; a
message may only go to a receiver of ``allowed`` and only be of the types allowed there
(a worker's role: answers and heartbeats to the scheduler, join, hello and refusal to
the registry; never a control message); a message that names a worker (``worker=``)
must name the sender; a peer registers at most ``MAX_NAMES_PER_PEER`` names; bodies
that do not decode are refused. A refused frame reaches no actor and is not logged.

Every frame the port lets through is stamped with the peer's identity (its ZeroMQ
routing identity; with CURVE also ``key=`` its public key, as the ZAP handler
authenticated it) and the log records it (``Record.peer``). ZeroMQ itself drops frames over the size limit (``MAXMSGSIZE``) by
disconnecting the peer, and with CURVE a peer without an authorised key never completes
its handshake.

Reconnecting is the Paranoid Pirate pattern: the endpoint pings a line on which
nothing came from the broker for ``ping_interval`` or a third of ``broker_timeout``,
whichever is longer (three pings unanswered before it gives up on a connection, and no
ping at all on a line that hears from the broker often enough: at 10,000 workers a
ping a second each would be 20,000 frames a second at the broker); when nothing at all
has come from the broker for ``broker_timeout`` it closes its socket, waits a backoff
(doubling, capped), connects a new socket (a new identity), registers its names again
and calls ``on_reconnect`` so the worker says hello again.

Heartbeats (:meth:`RemoteEndpoint.keepalive`) go out from the endpoint's I/O thread,
never from a thread that runs rollouts, and only on a quiet line: when nothing was sent
to the heartbeat's receiver for the interval (an answer is as good a sign of life).
"""

from __future__ import annotations

import collections
import logging
import re
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from bus.base import MAX_FRAME_BYTES, BusStats, Deliver
from bus.frames import (
    NOBLOCK,
    envelope,
    open_delivery,
    open_envelope,
    recv_frames,
    router_socket,
    send_frames,
)
from bus.security import (
    ClientKeys,
    key_names,
    loopback_only,
    ServerKeys,
    secure_client,
    secure_server,
    start_authenticator,
)
from bus.zmq_bus import deliver_frames, deliver_one
from protocol import Codec, Message

log = logging.getLogger(__name__)

# Plain ints: pyzmq's enum-typed options cost an enum conversion per call.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_NAME = re.compile(rb"[A-Za-z0-9_.:@+\-]{1,128}")
#: A peer may register at most this many names (a worker needs one).
MAX_NAMES_PER_PEER = 16
#: The port routes at most this many names in all (bounds memory under a flood).
MAX_PEER_ROUTES = 100_000
#: How long attach() waits for the broker's acknowledgement by default.
ATTACH_DEADLINE_S = 10.0
#: How long the port's socket, once closed, still delivers what the broker forwarded
#: (the run's last message to each worker is its Stop; milliseconds).
CLOSE_LINGER_MS = 1000


def bind_refusal(addr: str, *, keys: bool, insecure: bool) -> str | None:
    """Why the broker may not bind ``addr`` (None: it may): without CURVE keys, loopback
    only, unless the caller accepts unauthenticated peers."""
    if keys or insecure or loopback_only(addr):
        return None
    return (f"refusing to bind {addr!r} without CURVE keys: without keys the broker binds "
            "to loopback only. Create keys with `evobus keys DIR` and set [workers] keys = "
            "\"DIR\", or pass --insecure (insecure=True) to accept unauthenticated, "
            "unencrypted peers on that interface")


def _metadata(frame: zmq.Frame, key: str) -> str:
    """A property of a received frame (ZeroMQ's metadata), or "" when it has none."""
    try:
        return frame.get(key) or ""
    except zmq.ZMQError:  # no such property on this frame: unknown
        return ""


class PeerPort:
    """The broker's ROUTER for workers in other processes (runs on the broker thread).

    ``keys``: CURVE server keys (bus.security); without them a non-loopback address is
    refused unless ``insecure=True``. ``receivers``: the only names peers may send to
    (None: any)."""

    def __init__(self, binds: Iterable[str], *, keys: ServerKeys | None = None,
                 insecure: bool = False, receivers: Iterable[str] | None = None,
                 allowed: Mapping[str, tuple[type, ...]] | None = None,
                 label: str = "remote") -> None:
        self.binds = list(binds)
        for addr in self.binds:
            refusal = bind_refusal(addr, keys=keys is not None, insecure=insecure)
            if refusal is not None:
                raise ValueError(refusal)
        self.keys = keys
        self.insecure = insecure
        # ``allowed``: receiver -> the message types a peer may send it (a worker's role);
        # ``receivers`` alone allows any type to those names (tests of the wire).
        if allowed is not None:
            self.allowed: dict[bytes, tuple[type, ...]] | None = {
                r.encode(): tuple(types) for r, types in allowed.items()}
            self.receivers: set[bytes] | None = set(self.allowed)
        else:
            self.allowed = None
            self.receivers = None if receivers is None else {r.encode() for r in receivers}
        self.label = label
        self.routes: dict[bytes, bytes] = {}
        self.owned: dict[bytes, set[bytes]] = {}
        # name -> the token its registration was given (a reconnect presents it)
        self.tokens: dict[bytes, bytes] = {}
        # routing identity -> the identity stamped on its frames (with CURVE: its key)
        self.peers: dict[bytes, str] = {}
        # routing identity -> where it connects from (origin()), read from the metadata
        # of its first frame on a port that may hear other machines (CURVE, --insecure)
        self.origins: dict[bytes, str] = {}
        self._metadata = keys is not None or insecure
        self._key_names: dict[str, str] = {}   # a client's public key (z85) -> its file's name
        self._local = all(loopback_only(a) for a in self.binds)
        self.addresses: list[str] = []
        self.socket: zmq.Socket | None = None
        self._auth = None
        self._broker = None
        self.stats = BusStats()

    # -- called by the Broker (bus/zmq_bus.py) on its thread ------------------------------

    def open(self, broker) -> None:
        self._broker = broker
        self.stats = broker.stats
        if self.keys is not None:
            self._auth = start_authenticator(broker.ctx, self.keys)
            self._key_names = key_names(self.keys)
        sock = router_socket(broker.ctx)
        if self.keys is not None:
            secure_server(sock, self.keys)
        self.socket = sock
        for addr in self.binds:
            sock.bind(addr)
            self.addresses.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def close(self) -> None:
        """Close the port: what the broker already forwarded (a worker's Stop) still
        leaves for up to CLOSE_LINGER_MS; a closed socket with linger 0 would drop the
        frames its I/O thread had not written yet, and the worker would never hear it."""
        if self.socket is not None:
            self.socket.close(CLOSE_LINGER_MS)
            self.socket = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def drain(self, codec: Codec) -> None:
        if self.socket is None:
            return
        sock = self.socket
        for _ in range(1024):
            try:
                frames = self._recv(sock)
            except zmq.Again:  # the poll's readiness was stale
                return
            self.on_frames(codec, frames)
            if not sock.get(_EVENTS) & _POLLIN:  # drained (cheaper than a failing recv)
                return

    def _recv(self, sock: zmq.Socket) -> list[bytes]:
        """One message; on a port that may hear other machines (CURVE, --insecure) the
        first from a connection also says where it comes from (its address) and, with
        CURVE, whose key it is (the ZAP handler's User-Id), read from a frame's metadata.
        A loopback port without keys reads bytes alone (the fast path)."""
        if not self._metadata:
            return recv_frames(sock, NOBLOCK)
        parts = sock.recv_multipart(NOBLOCK, copy=False)
        frames = [p.bytes for p in parts]
        ident = frames[0]
        if ident not in self.origins and len(self.origins) < MAX_PEER_ROUTES:
            key, address = _metadata(parts[-1], "User-Id"), _metadata(parts[-1], "Peer-Address")
            name = self._key_names.get(key, "")
            self.origins[ident] = address + (f" with key {name}" if name else "")
            if self.keys is not None and ident not in self.peers:
                self.peers[ident] = f"{self._identity(ident)} key={key}"
        return frames

    def origin(self, name: str) -> str | None:
        """Where the connection that registered ``name`` comes from, as far as the port
        knows: its address (and, with CURVE, the name of the client key it authenticated
        with: ``10.0.0.7 with key laptop``) on a port that may hear other machines; ``this
        machine`` on a loopback or ipc port; ``""`` when not known; None when no
        connection of this port holds ``name``. For display (a wait for workers says who
        joined from where): read from another thread, one dict lookup at a time."""
        ident = self.routes.get(name.encode())
        if ident is None:
            return None
        return self.origins.get(ident) or ("this machine" if self._local else "")

    def peer_of(self, ident: bytes) -> str:
        """The identity stamped on this connection's frames and named in refusals (kept
        for connections that hold a name: one dict lookup per message)."""
        peer = self.peers.get(ident)
        if peer is None:
            peer = self._identity(ident)
            if ident in self.owned:
                self.peers[ident] = peer
        return peer

    def _identity(self, ident: bytes) -> str:
        name = ident.decode("ascii", "replace") if _NAME.fullmatch(ident) else ident.hex()[:40]
        return f"{self.label}:{name}"

    # -- the policy --------------------------------------------------------------------

    def _reject(self, ident: bytes, why: str) -> None:
        self.stats.reject(self.peer_of(ident), why)

    def on_frames(self, codec: Codec, frames: list[bytes]) -> None:
        ident = frames[0]
        kind = frames[1] if len(frames) > 1 else b""
        names = self.owned.get(ident)
        if len(frames) == 2 and kind[:1] == b"m" or kind == b"M" and len(frames) == 5:
            opened = open_envelope(kind) if len(frames) == 2 else frames[2:]
            if opened is None:
                self._reject(ident, f"a malformed one-frame envelope ({len(kind)} bytes)")
                return
            sender, receiver, body = opened
            if names is None or sender not in names:
                self._reject(ident, f"a message sent as {sender[:64]!r}, a name this peer has "
                                    "not registered (unregistered peer)")
                return
            if self.receivers is not None and receiver not in self.receivers:
                self._reject(ident, f"a message to {receiver[:64]!r}: peers may only write to "
                                    f"{sorted(r.decode() for r in self.receivers)}")
                return
            if len(body) > MAX_FRAME_BYTES:
                self._reject(ident, f"a body of {len(body)} bytes (limit {MAX_FRAME_BYTES})")
                return
            try:
                msg = codec.decode(body)
            except msgspec.DecodeError as exc:
                self._reject(ident, f"does not decode: {exc}")
                return
            why = self._role(sender, receiver, msg)
            if why is not None:
                self._reject(ident, why)
                return
            self._broker.forward(codec, sender, receiver, body, msg, self.peer_of(ident))
        elif kind == b"P" and len(frames) == 2:
            if names is None:
                self._reject(ident, "a ping from an unregistered peer")
                return
            self._send(ident, [b"p"])
        elif kind == b"A" and len(frames) in (3, 4):
            self._attach(ident, frames[2], names, frames[3] if len(frames) == 4 else b"")
        elif kind == b"D" and len(frames) == 3:
            name = frames[2]
            if names is None or name not in names:
                self._reject(ident, f"forgetting {name[:64]!r}, a name this peer does not hold")
                return
            names.discard(name)
            self.routes.pop(name, None)
            self.tokens.pop(name, None)
            if not names:
                del self.owned[ident]
                self.peers.pop(ident, None)
                self.origins.pop(ident, None)
        else:
            self._reject(ident, f"malformed envelope ({len(frames)} frames, kind {kind[:8]!r})")

    def _role(self, sender: bytes, receiver: bytes, msg: Message) -> str | None:
        """What a worker's role forbids in this message, or None."""
        if self.allowed is not None:
            types = self.allowed[receiver]
            if not isinstance(msg, types):
                return (f"a {type(msg).__name__} to {receiver.decode()!r}: a worker may send "
                        f"it only {', '.join(sorted(t.__name__ for t in types))}")
        worker = getattr(msg, "worker", None)
        if worker is not None and worker.encode() != sender:
            return (f"a {type(msg).__name__} on behalf of worker {worker[:64]!r}, sent as "
                    f"{sender[:64].decode('utf-8', 'replace')!r}: a peer speaks only for "
                    "the names it registered")
        return None

    def _attach(self, ident: bytes, name: bytes, names: set[bytes] | None,
                token: bytes) -> None:
        why = None
        previous = self.routes.get(name)
        if not _NAME.fullmatch(name):
            why = (f"registering {name[:64]!r}: a name is 1-128 characters of letters, "
                   "digits and _.:@+-")
        elif self._broker.is_local(name):
            why = f"registering {name.decode()!r}, the name of a coordinator actor"
        elif self._broker.held_elsewhere(name, self):
            why = f"registering {name.decode()!r}, a name a worker on another port holds"
        elif previous is not None and previous != ident \
                and not self._may_move(name, previous, ident, token):
            why = (f"registering {name.decode()!r}, a name another connection holds (a "
                   "reconnecting worker presents the token its first registration got)")
        elif names is not None and name not in names and len(names) >= MAX_NAMES_PER_PEER:
            why = f"registering more than {MAX_NAMES_PER_PEER} names"
        elif name not in self.routes and len(self.routes) >= MAX_PEER_ROUTES:
            why = f"registering a name past the port's {MAX_PEER_ROUTES} routes"
        if why is not None:
            self._reject(ident, why)
            self._send(ident, [b"e", name[:128], why.encode()])  # the peer learns why
            return
        if previous is not None and previous != ident:
            # The same worker reconnected with a new socket (Paranoid Pirate): move it.
            held = self.owned.get(previous)
            if held is not None:
                held.discard(name)
                if not held:
                    del self.owned[previous]
        self.routes[name] = ident
        self.owned.setdefault(ident, set()).add(name)
        token = self.tokens.setdefault(name, secrets.token_hex(16).encode())
        self._send(ident, [b"a", name, token])

    def _may_move(self, name: bytes, previous: bytes, ident: bytes, token: bytes) -> bool:
        """A name held by another connection moves to this one: the same worker came back
        on a new socket. It proves it with the name's token, or (CURVE) the same key."""
        if token and secrets.compare_digest(token, self.tokens.get(name, b"")):
            return True
        if self.keys is None:
            return False
        old, new = self.peers.get(previous, ""), self.peers.get(ident, "")
        return bool(old) and old.split(" key=", 1)[-1] == new.split(" key=", 1)[-1]

    def _send(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            send_frames(self.socket, [ident, *frames], NOBLOCK)
        except zmq.ZMQError:  # the peer left or stopped reading: nothing to answer
            self.stats.unroutable += 1


class RemoteEndpoint:
    """A worker process's door to a broker's :class:`PeerPort` (tcp:// or ipc://).

    One DEALER carries both directions and is owned by the I/O thread; :meth:`send` may
    be called from any thread (the message is encoded there, queued, and the I/O thread
    is woken). Deliveries run on the I/O thread: handlers must hand long work to other
    threads."""

    def __init__(self, address: str, *, keys: ClientKeys | None = None,
                 ping_interval: float = 1.0, broker_timeout: float = 5.0,
                 backoff: float = 0.25, backoff_max: float = 8.0,
                 on_reconnect: Callable[[], None] | None = None,
                 name: str = "worker", ctx: zmq.Context | None = None) -> None:
        if broker_timeout <= ping_interval:
            raise ValueError(f"broker_timeout ({broker_timeout}) must exceed ping_interval "
                             f"({ping_interval}): the broker answers each ping")
        self.address = address
        self.keys = keys
        self.ping_interval = ping_interval
        self.broker_timeout = broker_timeout
        self.backoff0 = backoff
        self.backoff_max = backoff_max
        self.on_reconnect = on_reconnect
        self.stats = BusStats()
        # Many endpoints in one process (a benchmark's workers) may share a context.
        self._own_ctx = ctx is None
        self.ctx = ctx if ctx is not None else zmq.Context()
        self.reconnects = 0
        self.auth_error: str | None = None
        self.refused: dict[str, str] = {}  # name -> why the broker refused to route it
        self.tokens: dict[str, bytes] = {}  # name -> the token to present on a reconnect
        self.last_heard = time.monotonic()
        # When a frame last came from the broker; unlike last_heard it is not reset by a
        # reconnect, so a worker's give_up counts from the broker's last word.
        self.last_frame = time.monotonic()
        self._flush_s = 0.0
        self.heard = threading.Event()  # the broker has answered at least once
        # What the transport saw, for a worker that never heard from the broker to say
        # why: a TCP (or ipc) connection made at least once, and connects that failed
        # (refused: nothing listens there) and were retried.
        self.transport_connected = False
        self.connect_failures = 0
        self._handlers: dict[str, Deliver] = {}
        self._acks: dict[str, threading.Event] = {}
        # Queued frames: bytes (a one-frame message) or a list of frames (control).
        self._out: collections.deque[bytes | list[bytes]] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._codecs = threading.local()  # senders encode in their own thread
        # The keepalive (receiver, frame, interval) and when the receiver last got a frame.
        self._keepalive: tuple[str, bytes, float] | None = None
        self.kept_alive = time.monotonic()
        self.keepalives = 0  # heartbeats sent by the keepalive
        self.pings = 0       # pings sent, and when the last one went (monotonic)
        self.last_ping = 0.0
        # A wake-up byte is on its way to the I/O thread: later sends need not write one.
        self._wake_pending = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"evobus-remote-io-{name}",
                                        daemon=True)
        self._thread.start()

    # -- any thread ----------------------------------------------------------------------

    def attach(self, name: str, deliver: Deliver, timeout: float = ATTACH_DEADLINE_S) -> None:
        """Register ``name`` at the broker; raises TimeoutError (naming a refused key,
        if that is what happened) when no acknowledgement comes within ``timeout``."""
        ack = threading.Event()
        with self._lock:
            self._handlers[name] = deliver
            self._acks[name] = ack
        self._enqueue([b"A", name.encode()])
        acked = ack.wait(timeout)
        if name in self.refused:
            with self._lock:
                self._handlers.pop(name, None)
            raise ConnectionRefusedError(f"the broker at {self.address} refused the name "
                                         f"{name!r}: {self.refused[name]}")
        if not acked:
            why = (f"the broker refused this worker's key ({self.auth_error}): ask the "
                   "coordinator's operator to authorise its public key (evobus keys DIR "
                   "--client NAME), or check --server-key" if self.auth_error else
                   "is the coordinator running, and are the address and keys right?")
            raise TimeoutError(f"no answer from the broker at {self.address} within "
                               f"{timeout:g} s; {why}")

    @property
    def ping_quiet(self) -> float:
        """How long nothing must have come from the broker before a ping: ``ping_interval``,
        or a third of ``broker_timeout`` if that is longer."""
        return max(self.ping_interval, self.broker_timeout / 3)

    def send(self, sender: str, receiver: str, msg: Message) -> None:
        if self._stop.is_set():
            self.stats.after_close += 1
            return
        codec = getattr(self._codecs, "codec", None)
        if codec is None:
            codec = self._codecs.codec = Codec()
        keepalive = self._keepalive
        if keepalive is not None and receiver == keepalive[0]:
            self.kept_alive = time.monotonic()  # as good as a heartbeat
        self._enqueue(envelope(sender.encode(), receiver.encode(), codec.encode(msg)))

    def keepalive(self, sender: str, receiver: str, msg: Message, interval: float) -> None:
        """Send ``msg`` (a heartbeat) from ``sender`` to ``receiver`` whenever nothing was
        sent to ``receiver`` for ``interval`` seconds. The I/O thread sends it, so it
        never waits behind work running in other threads; a message sent through
        :meth:`send` to ``receiver`` restarts the interval. Replaces an earlier one."""
        if interval <= 0:
            raise ValueError(f"keepalive interval must be > 0, got {interval}")
        self.kept_alive = time.monotonic()
        self._keepalive = (receiver, envelope(sender.encode(), receiver.encode(),
                                              Codec().encode(msg)), interval)
        self._wakeup()  # the I/O thread's next wait must see the new deadline

    def send_frames(self, frames: list[bytes]) -> None:
        """Raw frames (tests: a misbehaving peer)."""
        self._enqueue(list(frames))

    def close(self, flush: float = 0.0) -> None:
        """Stop the I/O thread; with ``flush`` > 0, queued frames get that many seconds
        to leave first (a worker's last answer, its refusal)."""
        self._flush_s = flush
        self._stop.set()
        self._wakeup()
        self._thread.join(timeout=5)
        if self._own_ctx:
            self.ctx.destroy(linger=0)
        self._wake_r.close()
        self._wake_w.close()

    def _enqueue(self, item: bytes | list[bytes]) -> None:
        self._out.append(item)
        if not self._wake_pending:  # one wake-up byte covers every frame queued before
            self._wake_pending = True  # the I/O thread reads it (see _run)
            self._wakeup()

    def _wakeup(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):  # the pipe is full (a wake-up is pending) or closed
            pass

    # -- the I/O thread --------------------------------------------------------------------

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"rw-{uuid.uuid4().hex[:12]}".encode())
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)
        if self.keys is not None:
            secure_client(sock, self.keys)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                          | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                          | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED)
        sock.connect(self.address)
        with self._lock:
            names = list(self._handlers)
        for name in names:  # register again (first connect: attach() queued them already)
            if self.reconnects:
                token = self.tokens.get(name)
                sock.send_multipart([b"A", name.encode()] + ([token] if token else []))
        return sock, monitor

    def _poller(self, sock: zmq.Socket, monitor: zmq.Socket) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        return poller

    def _close_socket(self, sock: zmq.Socket, monitor: zmq.Socket, linger: int = 0) -> None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:  # already gone
            pass
        monitor.close(0)
        sock.close(linger)

    def _run(self) -> None:
        codec = Codec()
        sock, monitor = self._connect()
        poller = self._poller(sock, monitor)
        backoff = self.backoff0
        next_ping = time.monotonic()
        self.last_heard = time.monotonic()
        wake = self._wake_r.fileno()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                due = min(next_ping, self.last_heard + self.broker_timeout)
                keepalive = self._keepalive
                if keepalive is not None:
                    due = min(due, self.kept_alive + keepalive[2])
                events = dict(poller.poll(max(0, int((due - now) * 1000)) + 1))
                if self._stop.is_set():
                    break
                if wake in events or self._wake_r in events:
                    # Read the wake-up bytes, then clear the flag, then flush: a send that
                    # saw the flag set is flushed below; one that comes later writes a byte
                    # that stays for the next poll (clearing first could lose it).
                    self._drain_wake()
                    self._wake_pending = False
                self._flush(sock)
                if sock in events:
                    self._receive(sock, codec)
                    backoff = self.backoff0
                if monitor in events:
                    self._on_monitor(monitor)
                now = time.monotonic()
                if keepalive is not None and now >= self.kept_alive + keepalive[2]:
                    # Heartbeat a quiet line only: anything sent to the receiver counts.
                    self.kept_alive = now
                    self._out.append(keepalive[1])
                    self.keepalives += 1
                    self._flush(sock)
                if now >= next_ping:
                    # Ping only a quiet line: any frame from the broker proves it is there.
                    self._flush(sock)  # a queued registration goes before the ping
                    quiet = self.ping_quiet
                    if self._handlers and not self._out and now - self.last_heard >= quiet \
                            and self._send_now(sock, [b"P"]):
                        self.pings += 1
                        self.last_ping = now
                    next_ping = max(now, self.last_heard) + quiet
                if now - self.last_heard > self.broker_timeout:
                    # Paranoid Pirate: the broker went quiet; a new socket after a backoff.
                    # Never heard: no broker yet, which the worker says in its own words.
                    (log.warning if self.heard.is_set() else log.info)(
                        "remote endpoint: nothing from %s for %.1f s; reconnecting in "
                        "%.2f s", self.address, now - self.last_heard, backoff)
                    self._close_socket(sock, monitor)
                    if self._stop.wait(backoff):
                        return
                    backoff = min(backoff * 2, self.backoff_max)
                    self.reconnects += 1
                    sock, monitor = self._connect()
                    poller = self._poller(sock, monitor)
                    self.last_heard = time.monotonic()
                    next_ping = self.last_heard
                    if self.on_reconnect is not None:
                        try:
                            self.on_reconnect()
                        except Exception:  # a callback bug must not kill the I/O thread
                            log.exception("remote endpoint: on_reconnect failed")
        finally:
            linger = 0
            if self._flush_s > 0:
                self._flush(sock)
                linger = int(self._flush_s * 1000)
            self._close_socket(sock, monitor, linger)

    def _drain_wake(self) -> None:
        try:
            self._wake_r.recv(4096)  # senders write one byte per wake-up: one read drains
        except (BlockingIOError, OSError):  # nothing there (a spurious wake-up) or closed
            pass

    def _send_now(self, sock: zmq.Socket, frames: list[bytes]) -> bool:
        try:
            send_frames(sock, frames, NOBLOCK)
            return True
        except zmq.Again:  # the pipe is full: keep it for later
            return False

    def _flush(self, sock: zmq.Socket) -> None:
        out = self._out
        while out:
            item = out[0]
            try:
                if type(item) is bytes:  # a one-frame message, encoded by its sender
                    sock.send(item, NOBLOCK)
                else:
                    send_frames(sock, item, NOBLOCK)
            except zmq.Again:  # the pipe is full: keep it for later
                return
            out.popleft()

    def _receive(self, sock: zmq.Socket, codec: Codec) -> None:
        for _ in range(1024):
            try:
                frames = recv_frames(sock, NOBLOCK)
            except zmq.Again:  # the poll's readiness was stale
                return
            self.last_heard = self.last_frame = time.monotonic()
            if not self.heard.is_set():
                self.heard.set()
            kind = frames[0]
            if len(frames) == 1 and kind[:1] == b"d":  # a delivery, in one frame
                opened = open_delivery(kind)
                if opened is None:
                    self.stats.reject("broker", f"malformed delivery ({len(kind)} bytes)")
                else:
                    deliver_one(self._handlers, self.stats, codec, *opened, "remote endpoint",
                                count=True)
            elif kind == b"M" and len(frames) == 5:
                self._deliver(codec, frames)
            elif kind == b"a" and len(frames) in (2, 3):
                if len(frames) == 3:
                    self.tokens[frames[1].decode("utf-8", "replace")] = frames[2]
                ack = self._acks.get(frames[1].decode("utf-8", "replace"))
                if ack is not None:
                    ack.set()
            elif kind == b"e" and len(frames) == 3:  # a registration refused, and why
                name = frames[1].decode("utf-8", "replace")
                self.refused[name] = frames[2].decode("utf-8", "replace")
                ack = self._acks.get(name)
                if ack is not None:
                    ack.set()
            elif kind == b"p" and len(frames) == 1:
                pass
            else:
                self.stats.reject("broker", f"malformed frame ({len(frames)} parts)")
            if not sock.get(_EVENTS) & _POLLIN:  # drained (cheaper than a failing recv)
                return

    def _deliver(self, codec: Codec, frames: list[bytes]) -> None:
        deliver_frames(self._handlers, self.stats, codec, frames, "remote endpoint", count=True)

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.auth_error = f"CURVE handshake refused, status {event['value']}"
                log.error("remote endpoint: %s by %s", self.auth_error, self.address)
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self.auth_error = "the security handshake failed (keys or CURVE settings differ)"
                log.error("remote endpoint: %s with %s", self.auth_error, self.address)
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.auth_error = None
            elif event["event"] == zmq.EVENT_CONNECTED:
                self.transport_connected = True
            elif event["event"] == zmq.EVENT_CONNECT_RETRIED:
                self.connect_failures += 1
