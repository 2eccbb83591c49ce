"""Multipart send and receive without pyzmq's per-frame enum arithmetic.

``Socket.send_multipart`` combines ``zmq.SNDMORE`` (an enum) with the caller's flags
for every frame, and ``recv_multipart`` asks ``RCVMORE`` through the enum-typed
``getsockopt``; on the broker's hot path that was most of the cost of a message
(measured: 11.5 us -> 3.9 us to send a 5-frame message). These helpers do the same
with plain ints. Same semantics, same exceptions (``zmq.Again``, ``zmq.ZMQError``).

Better still is one frame per message: the single-frame envelopes below carry sender,
receiver (and a delivery's sequence number) in a small header before the body, so a
message costs one send and one receive instead of four or five of each.
"""

from __future__ import annotations

import struct

import zmq

from bus.base import MAX_FRAME_BYTES

SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


def send_frames(sock: zmq.Socket, frames: list[bytes], flags: int = 0) -> None:
    """Send ``frames`` as one multipart message (``flags``: 0 or NOBLOCK).

    With NOBLOCK, only the first frame can raise ``zmq.Again``: ZeroMQ queues the
    parts of a message atomically once its first part is accepted."""
    send = sock.send
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        send(frame, flags | SNDMORE if i < last else flags)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[bytes]:
    """Receive one multipart message as a list of bytes."""
    recv = sock.recv
    parts = [recv(flags)]
    get = sock.get
    while get(_RCVMORE):
        parts.append(recv(flags))
    return parts


#: A message: kind b"m", len(sender), len(receiver), then sender, receiver, body.
_MESSAGE = struct.Struct("<cHH")
#: A delivery: kind b"d", the broker's sequence number, len(sender), len(receiver).
_DELIVERY = struct.Struct("<cQHH")


def envelope(sender: bytes, receiver: bytes, body: bytes) -> bytes:
    """One frame carrying a message (what an endpoint sends the broker)."""
    return b"".join((_MESSAGE.pack(b"m", len(sender), len(receiver)), sender, receiver, body))


def open_envelope(frame: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(sender, receiver, body) of an :func:`envelope`, or None if malformed."""
    if len(frame) < _MESSAGE.size:
        return None
    _, ls, lr = _MESSAGE.unpack_from(frame)
    start = _MESSAGE.size + ls + lr
    if len(frame) < start:
        return None
    return frame[_MESSAGE.size:_MESSAGE.size + ls], frame[_MESSAGE.size + ls:start], frame[start:]


def delivery(seq: int, sender: bytes, receiver: bytes, body: bytes) -> bytes:
    """One frame carrying a stamped message (what the broker sends a remote worker)."""
    return b"".join((_DELIVERY.pack(b"d", seq, len(sender), len(receiver)), sender, receiver,
                     body))


def open_delivery(frame: bytes) -> tuple[int, bytes, bytes, bytes] | None:
    """(seq, sender, receiver, body) of a :func:`delivery`, or None if malformed."""
    if len(frame) < _DELIVERY.size or frame[:1] != b"d":
        return None
    _, seq, ls, lr = _DELIVERY.unpack_from(frame)
    start = _DELIVERY.size + ls + lr
    if len(frame) < start:
        return None
    return seq, frame[_DELIVERY.size:_DELIVERY.size + ls], frame[_DELIVERY.size + ls:start], \
        frame[start:]


_LENGTH = struct.Struct("<I")


def batch(envelopes: list[bytes]) -> bytes:
    """One frame carrying several :func:`envelope` frames, in order (kind b"n"): what an
    actor's outputs cost as one send instead of one each."""
    parts = [b"n"]
    for frame in envelopes:
        parts.append(_LENGTH.pack(len(frame)))
        parts.append(frame)
    return b"".join(parts)


def open_batch(frame: bytes) -> list[bytes] | None:
    """The envelopes of a :func:`batch`, or None if malformed."""
    if frame[:1] != b"n":
        return None
    out, pos, end = [], 1, len(frame)
    while pos < end:
        if pos + _LENGTH.size > end:
            return None
        (n,) = _LENGTH.unpack_from(frame, pos)
        pos += _LENGTH.size
        if pos + n > end:
            return None
        out.append(frame[pos:pos + n])
        pos += n
    return out


#: Connections the kernel queues for a listening socket before the broker's I/O thread
#: accepts them (capped by net.core.somaxconn). ZeroMQ's default is 100: a fleet of 256
#: workers connecting at once to a busy broker overflowed it, and each dropped SYN
#: cost that worker the kernel's 1 s retransmit before it could join.
LISTEN_BACKLOG = 4096


def router_socket(ctx: zmq.Context) -> zmq.Socket:
    """A ROUTER for peers to connect to: no linger, unroutable sends raise, frames
    bounded by MAX_FRAME_BYTES, and a listen queue deep enough for a fleet joining at once."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)
    sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
    return sock
