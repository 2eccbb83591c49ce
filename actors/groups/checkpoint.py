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
import os
import struct
import tempfile
import threading
import types
import zlib
from pathlib import Path
from typing import Any, Iterator

import msgspec

from protocol.scenario import Workers

from protocol import JournalEntry, PendingInteraction, Ref
from actors.groups.limits import CANCEL_DEADLINE_S, Budgets, Consumed
from actors.errors import EffectInDoubt, ResumeRefused


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
    #: The output type R by name (a builtin or ``module:qualname``; "": not nameable).
    returns: str = ""
    suspend: str = "all"
    #: The target's code (target_fingerprint): a resume by other code is refused ("":
    #: a checkpoint from before fingerprints, or a target whose code cannot be read).
    fingerprint: str = ""
    target_name: str = ""
    #: Where the branches ran when not all on threads (a Workers section): a resume
    #: runs them there again (remote workers reconnect to the same address).
    workers: Workers | None = None


def target_fingerprint(fn: Any) -> str:
    """sha256 (16 hex digits) of a target's source, or of its compiled code when the
    source cannot be read; "" when it has neither (a builtin, a C extension)."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None) or getattr(
        getattr(fn, "__call__", None), "__code__", None)
    if code is None:
        return ""
    data = _code_bytes(code)   # no source file (exec'd code): the compiled code
    # Source only from a real file: for code exec'd under a made-up name, linecache may
    # find some other file of that name, and would then answer differently by moments.
    if os.path.isabs(code.co_filename) and os.path.isfile(code.co_filename):
        try:
            data = inspect.getsource(fn).encode()
        except (OSError, TypeError):  # a source file without this object's lines
            pass
    return hashlib.sha256(data).hexdigest()[:16]


def _code_bytes(code: types.CodeType) -> bytes:
    """What a code object does, as bytes that do not change from one moment to the next
    (marshal's output does: it depends on reference counts)."""
    parts = [code.co_code, repr(code.co_names).encode(), repr(code.co_varnames).encode()]
    for const in code.co_consts:
        parts.append(_code_bytes(const) if isinstance(const, types.CodeType)
                     else repr(const).encode())
    return b"\0".join(parts)


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
    path.parent.mkdir(parents=True, exist_ok=True)  # a group's first checkpoint makes it
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


# -- effects, written ahead ---------------------------------------------------------------

_RECORD = struct.Struct("<II")  # payload length, crc32 of the payload


class _EffectRecord(msgspec.Struct, array_like=True, frozen=True):
    kind: str     # "intent" (about to run), "result" (ran; value: what it returned),
    #               "failed" (it raised), "spent" (value: the budgets' totals), or, for
    #               branches on workers elsewhere, "opened" (the group opened on them),
    #               "placed" (value: a lease's branches, sent to ``worker``) and
    #               "answered" (value: the branches of a lease its worker answered)
    branch: int
    step: int     # the effect's position in its branch's journal
    name: str
    value: Any = None
    #: "" for a branch of the group itself; for a nested group's branch, the path of
    #: branches that started it: "B.N/" (the N-th group branch B started), "B.N/b.n/", ...
    scope: str = ""
    #: The worker in another process an intent was recorded from, or a lease placed on
    #: ("": a thread of the coordinator).
    worker: str = ""


_PLACES = ("opened", "placed", "answered")


def effects_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".effects")


class EffectLog:
    """A group's effects, written ahead beside its checkpoint (``CKPT.effects``).

    ``ctx.effect`` records its intent, fsynced, before the effect runs, and its result,
    fsynced, before the branch goes on. A branch that runs again after a crash (the
    group resumed from its checkpoint) gets a recorded result back without running the
    effect again; an intent with no result (the crash came while the effect ran) fails
    that branch with :class:`EffectInDoubt` rather than run it a second time. Records
    are framed and checksummed; a torn last record (a crash mid-append) is ignored.
    Nested groups write into their top-level group's log, each branch under its
    ``scope`` (the branches that started it, in order): a top-level branch that runs
    again starts its nested groups again in the same order, and their branches find
    their effects where they left them."""

    def __init__(self, checkpoint: Path) -> None:
        self.path = effects_path(checkpoint)
        self._lock = threading.Lock()
        self.recorded: dict[tuple[str, int, int], _EffectRecord] = {}
        #: What the group had consumed when it last charged a budget (a "spent" record:
        #: [calls, cost, seconds], totals), so a run killed while running still counts.
        self.spent: list[float] | None = None
        #: Branches held by workers elsewhere (running or queued there) when the log was
        #: last written (branch -> worker): placed there and not answered since the
        #: group last opened on them.
        self.held: dict[int, str] = {}
        if self.path.exists():
            self._load(self.path.read_bytes())
        self._file = open(self.path, "ab")  # noqa: SIM115 (closed in close())
        self._encode = msgspec.msgpack.Encoder().encode

    def _load(self, data: bytes) -> None:
        decode = msgspec.msgpack.Decoder(_EffectRecord).decode
        pos = 0
        while pos + _RECORD.size <= len(data):
            length, crc = _RECORD.unpack_from(data, pos)
            payload = data[pos + _RECORD.size:pos + _RECORD.size + length]
            if len(payload) < length or zlib.crc32(payload) != crc:
                break  # a torn tail: the crash came while this record was written
            rec = decode(payload)
            pos += _RECORD.size + length
            if rec.kind in _PLACES:
                self._place(rec)
                continue
            if rec.kind == "spent":
                self.spent = list(rec.value)
                continue
            key = (rec.scope, rec.branch, rec.step)
            old = self.recorded.get(key)
            if old is None or old.kind != "result":
                self.recorded[key] = rec

    def replayed(self, branch: int, step: int, name: str,
                 scope: str = "") -> tuple[bool, Any]:
        """(True, value) if this effect ran before and its result is recorded; (False,
        None) if it never started. Raises EffectInDoubt if it started and its result was
        never recorded."""
        with self._lock:
            rec = self.recorded.get((scope, branch, step))
        if rec is None or rec.name != name or rec.kind == "failed":
            return False, None  # never started, or raised (it said it failed): run it
        if rec.kind == "result":
            return True, rec.value
        where = f" of the nested group at {scope!r}" if scope else ""
        on = f" on worker {rec.worker}" if rec.worker else ""
        raise EffectInDoubt(
            f"branch {branch}{where}: effect {name!r} (step {step}) started{on} before the "
            f"group stopped (a crash or a kill) and its result was never recorded in "
            f"{self.path}, so it may or may not have run; it is not run a second time. "
            "Check its outcome by hand; this branch fails")

    def intent(self, branch: int, step: int, name: str, scope: str = "",
               worker: str = "") -> None:
        self._append(_EffectRecord("intent", branch, step, name, scope=scope, worker=worker))

    def result(self, branch: int, step: int, name: str, value: Any, scope: str = "") -> None:
        self._append(_EffectRecord("result", branch, step, name, value, scope=scope))

    def failed(self, branch: int, step: int, name: str, scope: str = "") -> None:
        """The effect raised: it ran and said it failed; a branch run again retries it."""
        self._append(_EffectRecord("failed", branch, step, name, scope=scope))

    def spend(self, consumed) -> None:
        """The group's budgets were charged: its totals (``Consumed``), on disk before the
        branch or the spend that charged them goes on."""
        self._append(_EffectRecord("spent", -1, -1, "",
                                   [consumed.calls, consumed.cost, consumed.seconds]))

    def opened(self) -> None:
        """The group opened on workers elsewhere: what ran there before is not running."""
        self._append(_EffectRecord("opened", -1, -1, ""), sync=False)

    def placed(self, worker: str, branches: list[int]) -> None:
        """A lease's branches went to ``worker`` (in another process). Written, not
        fsynced: what it tells (where branches ran when the coordinator died) is worth
        no disk flush per lease; a crash of this process never loses it, only the OS's."""
        self._append(_EffectRecord("placed", -1, -1, "", list(branches), worker=worker),
                     sync=False)

    def answered(self, branches: list[int]) -> None:
        self._append(_EffectRecord("answered", -1, -1, "", list(branches)), sync=False)

    def _place(self, rec: _EffectRecord) -> None:
        if rec.kind == "opened":
            self.held.clear()
        elif rec.kind == "placed":
            self.held.update(dict.fromkeys(rec.value, rec.worker))
        else:
            for branch in rec.value:
                self.held.pop(branch, None)

    def _append(self, rec: _EffectRecord, sync: bool = True) -> None:
        payload = self._encode(rec)
        with self._lock:
            self._file.write(_RECORD.pack(len(payload), zlib.crc32(payload)) + payload)
            self._file.flush()
            if sync:
                os.fsync(self._file.fileno())
            if rec.kind in _PLACES:
                self._place(rec)
            elif rec.kind == "spent":
                self.spent = list(rec.value)
            else:
                self.recorded[(rec.scope, rec.branch, rec.step)] = rec

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def remove(self) -> None:
        """The group completed: nothing is left to replay."""
        self.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def running_checkpoint(*, group_id: str, target: Ref | None, fn: Any, items: list[Any],
                       max_concurrency: int, max_items: int, budgets: Budgets,
                       consumed: Consumed | None, store: dict[str, Any],
                       approvers: list[str] | None, chunk: int, cancel_deadline: float,
                       package_version: str, written_at: str, returns: str = "",
                       suspend: str = "all", workers: Workers | None = None
                       ) -> GroupCheckpoint:
    """What a group with a checkpoint path writes before its first branch starts (status
    ``running``): a crash at any moment leaves a checkpoint to resume from."""
    return GroupCheckpoint(
        group_id=group_id, status="running", target=target, items=items,
        max_concurrency=max_concurrency, max_items=max_items,
        not_started=list(range(len(items))), budgets=budgets,
        consumed=consumed or Consumed(), store=store, approvers=approvers, chunk=chunk,
        cancel_deadline=cancel_deadline, written_at=written_at,
        package_version=package_version, fingerprint=target_fingerprint(fn),
        target_name=target_name(fn), returns=returns, suspend=suspend, workers=workers)
