"""What crosses the bus: frozen msgspec messages, domain types, the codec, the scenario schema."""

from protocol.codec import decode, encode, Codec
from protocol.domain import REMOVE, Diff, Ref, RolloutResult, Task, WorkUnit
from protocol.messages import *  # noqa: F401,F403  (the union and every message)
from protocol.messages import Message, __all__ as _messages_all

__all__ = ["Codec", "Diff", "Message", "REMOVE", "Ref", "RolloutResult", "Task", "WorkUnit",
           "decode", "encode",
           *_messages_all]
