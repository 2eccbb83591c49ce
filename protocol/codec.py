"""The one codec: msgpack bytes <-> the ``Message`` union, with reused encoder/decoder."""

from __future__ import annotations

import msgspec

from protocol.messages import Message

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    """Decode one message; raises ``msgspec.DecodeError`` (a ``ValueError``) on a bad frame."""
    return _decoder.decode(data)


class Codec:
    """Per-thread codec (msgspec encoders are not documented as thread-safe to share)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Message)

    def encode(self, msg: Message) -> bytes:
        return self._enc.encode(msg)

    def decode(self, data: bytes | memoryview) -> Message:
        return self._dec.decode(data)
