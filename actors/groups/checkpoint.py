"""A group's checkpoint file: finished results, journals and pending interactions.

File format: ``b"EVOGRP"``, a format byte (``FRAME_VERSION``), the u32 zlib.crc32 of the
payload, then the payload: the msgpack of :class:`GroupCheckpoint`. A damaged file
(a flipped byte anywhere, its magic included) is told apart from a file that is not a
checkpoint at all, by name. Files written before the frame existed (the bare msgpack
payload) still load.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import marshal
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any, Iterator

import msgspec

from protocol import JournalEntry, PendingInteraction, Ref
from actors.groups.limits import CANCEL_DEADLINE_S, Budgets, Consumed
from actors.errors import ResumeRefused


CHECKPOINT_FORMAT = "evobus-group-checkpoint"


CHECKPOINT_VERSION = 1


MAGIC = b"EVOGRP"
FRAME_VERSION = 1
_FRAME = struct.Struct("<6sBI")  # magic, frame version, crc32 of the payload


class GroupCheckpoint(msgspec.Struct, kw_only=True):
    """A paused group, as a file (msgpack; never pickle): finished results, every
    suspended branch's journal, interactions pending and already used, consumed budgets,
    the store, and the target as an import path when it has one."""

    format: str = CHECKPOINT_FORMAT
    version: int = CHECKPOINT_VERSION
    group_id: str
    status: str
    target: Ref | None = None
    items: list[Any] = []
    max_concurrency: int = 1
    max_items: int = 1
    finished: dict[int, Any] = {}
    journals: dict[int, list[JournalEntry]] = {}
    pending: list[PendingInteraction] = []
    used_ids: list[str] = []
    not_started: list[int] = []
    effects: list[tuple[int, str]] = []
    budgets: Budgets = Budgets()
    consumed: Consumed = Consumed()
    store: dict[str, Any] = {}
    approvers: list[str] | None = None
    chunk: int = 0
    cancel_deadline: float = CANCEL_DEADLINE_S
    written_at: str = ""
    package_version: str = ""
    #: The target's code (target_fingerprint): a resume by other code is refused ("":
    #: a checkpoint from before fingerprints, or a target whose code cannot be read).
    fingerprint: str = ""
    target_name: str = ""


def target_fingerprint(fn: Any) -> str:
    """sha256 (16 hex digits) of a target's source, or of its compiled code when the
    source cannot be read; "" when it has neither (a builtin, a C extension)."""
    fn = inspect.unwrap(fn)
    try:
        data = inspect.getsource(fn).encode()
    except (OSError, TypeError):  # no source file: the compiled code stands in for it
        code = getattr(fn, "__code__", None) or getattr(
            getattr(fn, "__call__", None), "__code__", None)
        if code is None:
            return ""
        data = marshal.dumps(code)
    return hashlib.sha256(data).hexdigest()[:16]


def target_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def check_code(path: Path, ckpt: GroupCheckpoint, fn: Any) -> None:
    """Refuse (ResumeRefused, before anything runs) a resume whose target is not the code
    that wrote the checkpoint: a branch replayed by other code can take another path past
    its journal, and effects journaled for one step would answer another."""
    if not ckpt.fingerprint:
        return
    now = target_fingerprint(fn)
    if now == ckpt.fingerprint:
        return
    raise ResumeRefused(
        f"{path}: the target {target_name(fn)} is not the code that paused group "
        f"{ckpt.group_id} ({ckpt.target_name or 'its target'}, fingerprint "
        f"{ckpt.fingerprint}; now {now or 'unreadable'}): resume with the code that wrote "
        "the checkpoint. Nothing ran and the checkpoint is kept as it was")


def _write_checkpoint(path: Path, ckpt: GroupCheckpoint) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = msgspec.msgpack.encode(ckpt)
    data = _FRAME.pack(MAGIC, FRAME_VERSION, zlib.crc32(payload)) + payload
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | os.PathLike) -> GroupCheckpoint:
    """Read a group checkpoint; :class:`ResumeRefused` names what is wrong with it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ResumeRefused(f"{path}: cannot read the checkpoint ({exc.strerror})") from None
    ckpt = _decode(path, _payload(path, data))
    if ckpt.format != CHECKPOINT_FORMAT:
        raise ResumeRefused(f"{path}: not a parallel-group checkpoint (format {ckpt.format!r})")
    if ckpt.version > CHECKPOINT_VERSION:
        raise ResumeRefused(f"{path}: checkpoint version {ckpt.version} is newer than this "
                            f"evobus reads ({CHECKPOINT_VERSION}); upgrade evobus")
    return ckpt


def _payload(path: Path, data: bytes) -> bytes:
    """The checked payload of a checkpoint file (or a bare one from before the frame)."""
    head = data[:_FRAME.size]
    if len(head) == _FRAME.size:
        magic, version, crc = _FRAME.unpack(head)
        intact = zlib.crc32(data[_FRAME.size:]) == crc
        if magic == MAGIC and version != FRAME_VERSION:
            raise ResumeRefused(f"{path}: checkpoint frame version {version} is not one this "
                                f"evobus reads ({FRAME_VERSION}); upgrade evobus")
        if magic == MAGIC and intact:
            return data[_FRAME.size:]
        if magic == MAGIC:
            raise ResumeRefused(
                f"{path}: the checkpoint is damaged: its checksum does not match (stored "
                f"{crc:#010x}, computed {zlib.crc32(data[_FRAME.size:]):#010x}); a byte "
                "changed after it was written; restore the file from a copy")
        if intact:
            raise ResumeRefused(
                f"{path}: the checkpoint is damaged: it starts with {magic!r} instead of "
                f"{MAGIC!r}, though its content checks out; restore the file from a copy "
                f"(or write back its first {len(MAGIC)} bytes)")
    if data[:1] == MAGIC[:1] and sum(a != b for a, b in zip(data[:len(MAGIC)], MAGIC)) <= 2:
        raise ResumeRefused(f"{path}: the checkpoint is damaged: it starts with "
                            f"{data[:len(MAGIC)]!r}, almost {MAGIC!r}, and does not check "
                            "out; restore the file from a copy")
    return data  # a checkpoint from before the frame (bare msgpack), or not one at all


def _decode(path: Path, payload: bytes) -> GroupCheckpoint:
    try:
        ckpt = msgspec.msgpack.decode(payload, type=GroupCheckpoint)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ResumeRefused(f"{path}: not a parallel-group checkpoint (it does not start "
                            f"with {MAGIC!r} and does not decode as one: {exc})") from None
    return ckpt


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """One resumer at a time per checkpoint (an advisory lock, released if we die)."""
    try:  # POSIX only: imported here so the module still loads elsewhere
        import fcntl
    except ImportError:  # not POSIX: no lock; documented
        yield
        return
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ResumeRefused(f"{path}: another process is resuming this checkpoint; "
                                "wait for it to finish") from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
