"""The message log: an append-only file holding every message of a run, in order.

The broker stamps each message with a sequence number and appends it here before
delivering it, so the log is the total order of the run. The same file serves
``evobus inspect``, ``evobus replay``, ``evobus resume`` and the tests (tests/logs/).
The log keeps message bodies as raw bytes and never imports ``protocol``: decoding a
body is the caller's job.

File format (integers little-endian)::

    b"EVOLOG"                 6 bytes, magic
    version                   1 byte, the format version (FORMAT_VERSION = 1 today)
    header frame              u32 payload length, u32 zlib.crc32 of the payload, payload
    record frame ...          the same framing, one frame per message, until end of file

The magic and the version byte never change; everything after them is defined by the
version. In version 1 the header payload is a msgpack map (`LogHeader`) and each record
payload a msgpack array ``[seq, t, sender, receiver, body]`` (`Record`), where ``t`` is
seconds since the run started on the monotonic clock and ``body`` the encoded message.
Two trailing elements were added later, each with a default, so logs written before
them read unchanged (and older readers skip them): ``peer``, the authenticated identity
of the process that sent the frame (a worker in another process: its ZeroMQ routing
identity, plus ``key=`` its CURVE public key when CURVE is on; ``""`` for the
coordinator's own actors), and ``status`` (`DELIVERED`, or `UNDELIVERED`: the broker
stamped the message but could not hand it to its receiver, a stopped or gone peer). A
record that needs neither is still written as the 5-element array.
Old versions stay readable: `_FORMATS` maps every version this code has ever written
to its decoders, and a file newer than this code is refused by name.

Reading: a torn or corrupt *tail* (a record cut short, or a last record whose checksum
does not match and after which no valid record follows) is what a crash leaves behind;
it is cut back to the last good record with a `TornTailWarning` (and a logged warning)
saying how many bytes and records were dropped, and ``read_log(..., repair=True)`` also
truncates the file on disk. Damage in the *middle* (a bad record followed by valid ones)
cannot come from a crash, so it raises `LogCorrupt` naming the byte offset and the
record index; so does a file that is not an evobus log.

Writing never overwrites: a path that exists is refused (`LogExists`) unless the caller
asks for ``overwrite=True``. The file appears with its header already written: it is
built under a temporary name beside it and linked into place.

Every record reaches the OS (a ``write``, so it survives a ``kill -9`` of the process)
within `FLUSH_EVERY_S` of its append, whatever the record count, provided the writer's
owner calls `LogWriter.flush_if_due` while idle (both buses do, every 0.2 s at most).
An append with ``sync=True`` (the buses pass it for the messages the runtime names:
the run's ``Start``, every ``Commit`` and ``RoundClosed``, the ``RunDone``) is fsynced
at the next `flush_if_due`, so a burst of them (a commit broadcast to every worker)
costs one fsync. What the fsync policy (`LogWriter(fsync=...)`) adds on top, trading
durability against a *machine* crash for speed:

- ``"always"``: flush and ``os.fsync`` after every record. A crash loses nothing that
  `append` returned from; each append waits for the disk.
- ``"batched"`` (default): fsync the header at once, then every ``batch`` records,
  every time the buffer is flushed on time, at every ``sync=True`` record and at
  close. A machine crash loses at most the records of the last second (and nothing
  before the last commit); a process crash at most those not yet flushed on time.
- ``"never"``: no fsync; records are still flushed to the OS on time and at close. A
  process crash loses at most the last `FLUSH_EVERY_S` of records (plus a poll
  period); a machine crash whatever the OS had not written yet.

Measured on a 2-core machine (ext4 on a virtual disk, 120-byte bodies, three runs; the
figures vary a lot with the disk and the load, treat them as orders of magnitude):
``always`` 6,000-10,000 records/s, ``batched`` (256) 190,000-350,000 records/s,
``never`` 440,000-560,000 records/s. Reading back 100,000 records with `read_log` or
`iter_log` takes 0.13-0.26 s (400,000-750,000 records/s), mostly checksum and decode.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import struct
import time
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

import msgspec

__all__ = [
    "FORMAT_VERSION",
    "DELIVERED",
    "FLUSH_EVERY_S",
    "FSYNC_POLICIES",
    "MAGIC",
    "UNDELIVERED",
    "LogContents",
    "LogCorrupt",
    "LogExists",
    "LogHeader",
    "LogVersionError",
    "LogWriter",
    "REPAIR_HINT",
    "Record",
    "TornTailWarning",
    "follow_log",
    "iter_log",
    "read_header",
    "read_log",
]

log = logging.getLogger(__name__)

MAGIC = b"EVOLOG"
FORMAT_VERSION = 1
FSYNC_POLICIES = ("always", "batched", "never")
#: How a torn-tail warning says to repair the file (the CLI says its own verb instead).
REPAIR_HINT = "read_log(path, repair=True) truncates the file there"
#: ``Record.status``: handed to its receiver.
DELIVERED = 0
#: ``Record.status``: stamped, but the receiver could not take it (a peer that stopped
#: reading or left); it is in the log so that replay sees what the sender sent.
UNDELIVERED = 1

_PREFIX_LEN = len(MAGIC) + 1
# Every frame: u32 payload length, u32 crc32 of the payload. Built once, reused.
_FRAME = struct.Struct("<II")
_FRAME_LEN = _FRAME.size
_MAX_PAYLOAD = 0xFFFF_FFFF
# One buffered file object: big enough that "batched" and "never" make few syscalls.
_WRITE_BUFFER = 256 * 1024
#: A record waits at most this long in the writer's buffer before it is handed to the OS
#: (the buses call flush_if_due at least every 0.2 s, so a record reaches the OS within
#: about 0.45 s of its delivery, under a second whatever the record count).
FLUSH_EVERY_S = 0.25
# iter_log reads this much at a time (more when a single record is bigger).
_READ_CHUNK = 4 * 1024 * 1024


class LogHeader(msgspec.Struct, frozen=True, kw_only=True):
    """What the run was: written once, at the start of the log."""

    format_version: int
    package_version: str = ""
    scenario: str = ""
    seed: int = 0
    run_id: str = ""
    started_at: str = ""  # ISO wall-clock time; informational only, never used for ordering
    meta: dict[str, str] = {}


class Record(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One delivered message.

    array_like: a record is a 5-element msgpack array, no field names repeated per record.
    gc=False: only scalars, str and bytes inside, so no reference cycles; skipping the
    garbage collector's tracking makes reading 100,000 records noticeably cheaper.
    """

    seq: int
    t: float  # seconds since the run started, monotonic clock
    sender: str
    receiver: str
    body: bytes  # the encoded message; decoding it is the caller's job
    peer: str = ""  # the sending process's authenticated identity ("": the coordinator)
    status: int = DELIVERED  # or UNDELIVERED


class _Record5(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A `Record` with neither peer nor status, written as the original 5-element array
    (msgspec writes every field of an array-like struct, defaults included)."""

    seq: int
    t: float
    sender: str
    receiver: str
    body: bytes


class LogContents(msgspec.Struct, frozen=True, kw_only=True):
    """A log as read by `read_log`."""

    path: Path
    header: LogHeader
    records: list[Record]
    dropped_tail: int = 0  # bytes cut from a torn or corrupt tail (0: the file was whole)
    dropped_records: int = 0  # records those bytes held, best count (a torn one counts)


class LogCorrupt(Exception):
    """The file is not a readable evobus log, or it is damaged somewhere other than its tail.

    ``position`` is the byte offset of the damage, ``seq_of_last_good`` the sequence
    number of the last record before it (None if there is none), ``index`` the index of
    the bad record (how many good records precede it), when known.
    """

    def __init__(self, path: str | os.PathLike[str], position: int,
                 seq_of_last_good: int | None, *, index: int | None = None,
                 reason: str = "") -> None:
        self.path = Path(path)
        self.position = position
        self.seq_of_last_good = seq_of_last_good
        self.index = index
        self.reason = reason
        if index is None:  # the prefix or the header: the reason says where
            message = f"{self.path}: {reason or f'unreadable at byte offset {position}'}"
        else:
            after = "the first record" if seq_of_last_good is None else f"seq {seq_of_last_good}"
            message = (f"{self.path}: corrupt log at byte offset {position} (record index "
                       f"{index}, after {after}): {reason or 'unreadable'}")
        super().__init__(message)

    def __reduce__(self):  # keyword-only arguments survive pickling (errors crossing processes)
        rebuild = functools.partial(type(self), index=self.index, reason=self.reason)
        return rebuild, (self.path, self.position, self.seq_of_last_good)


class LogVersionError(LogCorrupt):
    """The log's format version is one this code cannot read (usually: newer than it)."""


class TornTailWarning(UserWarning):
    """A torn or corrupt tail was cut back to the last good record."""


# ---------------------------------------------------------------------------
# Per-version decoders


class _Format(NamedTuple):
    """How to read one format version.

    A future version 2 adds an entry and keeps this one: version-1 payloads are then
    decoded by structs frozen at their version-1 shape and converted to today's
    `LogHeader` / `Record`.
    """

    decode_header: Callable[[memoryview], LogHeader]
    decode_record: Callable[[memoryview], Record]
    # Bytes a record payload starts with (v1: a msgpack fixarray of 5, 6 or 7 elements).
    # Used only to skip quickly through damage when looking for a valid record after it.
    record_markers: tuple[bytes, ...]


_FORMATS: dict[int, _Format] = {
    1: _Format(
        decode_header=msgspec.msgpack.Decoder(LogHeader).decode,
        decode_record=msgspec.msgpack.Decoder(Record).decode,
        record_markers=(b"\x95", b"\x96", b"\x97"),
    ),
}


# ---------------------------------------------------------------------------
# Writing


class LogExists(FileExistsError):
    """A log is already at the path a new one was asked for: a log is never overwritten
    unless the caller says so (``LogWriter(..., overwrite=True)``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        super().__init__(
            f"{self.path}: a log is already there, and a log is never overwritten (it may "
            "be the base of a resume chain): write this run's log to a new path, or pass "
            "overwrite=True to replace it")


class LogWriter:
    """Append records to a new log file.

    A path that exists is refused with `LogExists` (the old file's bytes never change)
    unless ``overwrite=True``, which replaces it with a new file. The file appears with
    its header already written and flushed (fsynced unless ``fsync="never"``): it is
    built under a temporary name and linked into place, so a crash at any moment leaves
    either no log or a readable one. See the module docstring for the fsync policies and
    what they cost.

    Every appended record reaches the OS within ``flush_every`` seconds of the append
    that buffered it, if the owner calls `flush_if_due` while idle (the buses do, every
    poll period); an `append` checks the age of the oldest buffered record itself. An
    append with ``sync=True`` (a commit, the run's start) asks for a flush and fsync at
    the next `flush_if_due`, so that several such records in a burst cost one fsync.

    Not thread-safe, by design: the broker is the only writer and appends from its own
    thread, so there is no lock on the hot path. Use it from one thread.
    """

    def __init__(self, path: str | os.PathLike[str], header: LogHeader,
                 fsync: str = "batched", batch: int = 256, *, overwrite: bool = False,
                 flush_every: float = FLUSH_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(
                f"LogWriter(fsync={fsync!r}): unknown fsync policy; choose 'always' "
                "(fsync every record), 'batched' (fsync every `batch` records, every "
                "flush interval, at commits and at close) or 'never' (OS buffering, "
                "flushed every flush interval and at close)")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"LogWriter(batch={batch!r}): batch must be an int >= 1")
        if isinstance(flush_every, bool) or not isinstance(flush_every, (int, float)) \
                or not 0 < flush_every <= 1.0:
            raise ValueError(f"LogWriter(flush_every={flush_every!r}): must be seconds in "
                             "(0, 1]: every record reaches the OS within a second")
        if not isinstance(header, LogHeader):
            raise TypeError(f"LogWriter(header=...): expected a LogHeader, got "
                            f"{type(header).__name__}")
        if header.format_version != FORMAT_VERSION:
            raise ValueError(
                f"LogWriter writes format version {FORMAT_VERSION}, but the header says "
                f"format_version={header.format_version}: build it with "
                "LogHeader(format_version=FORMAT_VERSION, ...)")
        self.path = Path(path)
        self.header = header
        self.fsync = fsync
        self.batch = batch
        self.flush_every = float(flush_every)
        self.count = 0  # records appended so far
        self._clock = clock
        self._sync_every = {"always": 1, "batched": batch, "never": 0}[fsync]
        self._buffered = 0  # records appended since the last flush
        self._oldest = 0.0  # clock() when the oldest of them was appended
        self._sync_wanted = False
        self._closed = False
        self._encode = msgspec.msgpack.Encoder().encode
        payload = self._encode(header)
        head = (MAGIC + bytes((FORMAT_VERSION,))
                + _FRAME.pack(len(payload), zlib.crc32(payload)) + payload)
        self._file = _create(self.path, head, overwrite=overwrite, durable=fsync != "never")
        self._write = self._file.write

    def append(self, seq: int, t: float, sender: str, receiver: str, body: bytes,
               sync: bool = False, *, peer: str = "", status: int = DELIVERED) -> None:
        """Append one record; durable according to the fsync policy. ``sync``: flush
        and fsync (unless "never") at the next `flush_if_due`. ``peer`` and ``status``:
        see `Record` (a record with neither is written as the 5-element array)."""
        if self._closed:
            raise ValueError(f"LogWriter for {self.path} is closed: cannot append seq {seq}")
        if (type(seq) is not int or type(t) is not float or type(sender) is not str
                or type(receiver) is not str or type(body) is not bytes):
            seq, t, sender, receiver, body = _coerce_record(seq, t, sender, receiver, body)
        if peer or status:
            if type(peer) is not str or status not in (DELIVERED, UNDELIVERED):
                raise TypeError(f"LogWriter.append: peer must be a str and status "
                                f"DELIVERED or UNDELIVERED, got {peer!r}, {status!r}")
            payload = self._encode(Record(seq, t, sender, receiver, body, peer, status))
        else:
            payload = self._encode(_Record5(seq, t, sender, receiver, body))
        if len(payload) > _MAX_PAYLOAD:
            raise ValueError(f"record seq {seq} is {len(payload)} bytes; a log record holds "
                             f"at most {_MAX_PAYLOAD} bytes")
        self._write(_FRAME.pack(len(payload), zlib.crc32(payload)) + payload)
        self.count += 1
        if sync:
            self._sync_wanted = True
        now = self._clock()
        if not self._buffered:
            self._oldest = now
        self._buffered += 1
        if self._sync_every and self._buffered >= self._sync_every \
                or now - self._oldest >= self.flush_every:
            self._sync()

    def flush_if_due(self) -> bool:
        """Flush (and fsync unless "never") if a sync was asked for or the oldest
        buffered record is ``flush_every`` seconds old; True if it did. Cheap otherwise:
        call it whenever the writer's thread is idle."""
        if self._closed or not (self._sync_wanted or self._buffered
                                and self._clock() - self._oldest >= self.flush_every):
            return False
        self._sync()
        return True

    def flush(self) -> None:
        """Hand buffered records to the OS, and fsync them unless the policy is "never"."""
        if not self._closed:
            self._sync()

    def close(self) -> None:
        """Flush (and fsync unless "never") and close. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sync()
        finally:
            self._file.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<LogWriter {str(self.path)!r} {state} records={self.count} fsync={self.fsync!r}>"

    def _sync(self) -> None:
        self._file.flush()
        if self.fsync != "never":
            os.fsync(self._file.fileno())
        self._buffered = 0
        self._sync_wanted = False


def _create(path: Path, head: bytes, *, overwrite: bool, durable: bool) -> BinaryIO:
    """Open a new log at ``path`` whose first bytes are ``head``, atomically: the file is
    written under a temporary name in the same directory and linked (or, with
    ``overwrite``, renamed) into place, so no reader ever sees a log without its header
    and an existing file is refused (`LogExists`) without its bytes being touched."""
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "a log is a file, not a directory", str(path))
    if not overwrite and os.path.lexists(path):
        raise LogExists(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
    f = open(tmp, "xb", buffering=_WRITE_BUFFER)  # noqa: SIM115 (the writer closes it)
    try:
        f.write(head)
        f.flush()
        if durable:
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
        if durable:
            _fsync_directory(path.parent)
    except BaseException:  # the half-built log is unusable: close and remove it, re-raise
        f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return f


def _link_new(tmp: Path, path: Path) -> None:
    """Give the file at ``tmp`` the name ``path``, refusing if ``path`` exists."""
    try:
        os.link(tmp, path)  # fails if the path exists: exclusive and atomic
    except FileExistsError:
        raise LogExists(path) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # A filesystem without hard links: a rename could replace a log created
        # meanwhile, so check once more just before it (a race of microseconds).
        if os.path.lexists(path):
            raise LogExists(path) from None
        os.rename(tmp, path)
        return
    os.unlink(tmp)


def _fsync_directory(directory: Path) -> None:
    """Make the new directory entry durable (a machine crash must not lose the file)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _coerce_record(seq: object, t: object, sender: object, receiver: object,
                   body: object) -> tuple[int, float, str, str, bytes]:
    """The slow path of `LogWriter.append`: accept near-misses, refuse what would not
    read back (a record that does not decode would look like corruption)."""
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise TypeError(f"LogWriter.append: seq must be an int, got {type(seq).__name__}")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise TypeError(f"LogWriter.append: t must be a float (seconds since the run "
                        f"started), got {type(t).__name__}")
    for name, value in (("sender", sender), ("receiver", receiver)):
        if not isinstance(value, str):
            raise TypeError(f"LogWriter.append: {name} must be a str, got "
                            f"{type(value).__name__}")
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError(f"LogWriter.append: body must be bytes (the encoded message), got "
                        f"{type(body).__name__}")
    return int(seq), float(t), str(sender), str(receiver), bytes(body)


# ---------------------------------------------------------------------------
# Reading


def read_header(path: str | os.PathLike[str]) -> LogHeader:
    """Read only the header of a log (cheap, whatever the log's size)."""
    path = Path(path)
    with open(path, "rb") as f:
        return _read_header(path, f)[0]


def read_log(path: str | os.PathLike[str], *, repair: bool = False) -> LogContents:
    """Read a whole log into memory.

    A torn or corrupt tail is cut back to the last good record with a
    `TornTailWarning`; with ``repair=True`` the file is also truncated there on disk.
    Raises `LogCorrupt` for damage in the middle, a file that is not an evobus log, or
    a torn header; `LogVersionError` for a format version this code cannot read.
    """
    path = Path(path)
    with open(path, "rb") as f:
        header, fmt, start = _read_header(path, f)
        data = f.read()
    records, pos, _ = _parse(data, 0, fmt.decode_record)
    dropped = len(data) - pos
    dropped_records = 0
    if dropped:
        last_seq = records[-1].seq if records else None
        good_size = start + pos
        dropped_records, why = _judge_bad_tail(path, data, pos, good_size, fmt,
                                               len(records), last_seq)
        if repair:
            with open(path, "r+b") as f:
                f.truncate(good_size)
                f.flush()
                os.fsync(f.fileno())
        message = _tail_message(path, good_size, dropped, dropped_records, len(records),
                                last_seq, why, repaired=repair)
        log.warning("%s", message)
        warnings.warn(message, TornTailWarning, stacklevel=2)
    return LogContents(path=path, header=header, records=records, dropped_tail=dropped,
                       dropped_records=dropped_records)


def iter_log(path: str | os.PathLike[str], *,
             chunk_size: int = _READ_CHUNK) -> Iterator[Record]:
    """Yield the records of a log one by one, reading it in large chunks.

    For logs too big to hold twice in memory (replay of 100,000-record runs). A torn or
    corrupt tail ends the iteration with a `TornTailWarning` (the file is not changed:
    use ``read_log(path, repair=True)`` to repair it). Damage in the middle raises
    `LogCorrupt` when the iteration reaches it, after the good records before it have
    been yielded. Use `read_header` for the header.
    """
    path = Path(path)
    with open(path, "rb") as f:
        _, fmt, base = _read_header(path, f)  # base: file offset of buf[0]
        decode = fmt.decode_record
        buf = b""
        pos = 0
        count = 0
        last_seq: int | None = None
        while True:
            want = chunk_size
            if len(buf) - pos >= _FRAME_LEN:  # a record larger than a chunk: read all of it
                want = max(want, _FRAME_LEN + _FRAME.unpack_from(buf, pos)[0] - (len(buf) - pos))
            more = f.read(want)
            if not more:
                break
            base += pos
            buf = buf[pos:] + more
            records, pos, bad = _parse(buf, 0, decode)
            if records:
                count += len(records)
                last_seq = records[-1].seq
                yield from records
            if bad:
                break
        tail = buf[pos:] + f.read()
    if tail:
        position = base + pos
        dropped_records, why = _judge_bad_tail(path, tail, 0, position, fmt, count, last_seq)
        message = _tail_message(path, position, len(tail), dropped_records, count,
                                last_seq, why, repaired=False)
        log.warning("%s", message)
        warnings.warn(message, TornTailWarning, stacklevel=2)


def _read_header(path: Path, f: BinaryIO) -> tuple[LogHeader, _Format, int]:
    """Read and check the prefix and the header frame from the start of ``f``.

    Returns the header, the format's decoders, and the byte offset of the first record.
    """
    prefix = f.read(_PREFIX_LEN)
    if not prefix:
        raise LogCorrupt(path, 0, None, reason=f"the file is empty, not an evobus log "
                                               f"(an evobus log starts with {MAGIC!r})")
    if prefix[:len(MAGIC)] != MAGIC[:len(prefix)]:
        raise LogCorrupt(path, 0, None, reason=f"not an evobus log: it starts with "
                                               f"{prefix[:len(MAGIC)]!r}, expected {MAGIC!r}")
    if len(prefix) < _PREFIX_LEN:
        raise LogCorrupt(path, len(prefix), None, reason=_torn_header(len(prefix)))
    version = prefix[-1]
    fmt = _FORMATS.get(version)
    if fmt is None:
        readable = ", ".join(str(v) for v in sorted(_FORMATS))
        if version > FORMAT_VERSION:
            reason = (f"log format version {version} is newer than this code reads "
                      f"(format version {FORMAT_VERSION}): upgrade evobus to read this log")
        else:
            reason = (f"log format version {version} is not one this code knows "
                      f"(it reads versions {readable})")
        raise LogVersionError(path, len(MAGIC), None, reason=reason)
    frame = f.read(_FRAME_LEN)
    if len(frame) < _FRAME_LEN:
        raise LogCorrupt(path, _PREFIX_LEN + len(frame), None,
                         reason=_torn_header(_PREFIX_LEN + len(frame)))
    length, crc = _FRAME.unpack(frame)
    payload = f.read(length)
    end = _PREFIX_LEN + _FRAME_LEN + len(payload)
    if len(payload) < length or zlib.crc32(payload) != crc:
        raise _damaged_header(path, f, payload, length, crc, fmt, end)
    try:
        header = fmt.decode_header(payload)
    except msgspec.DecodeError as e:  # reported as corruption, with the decoder's words
        raise LogCorrupt(path, _PREFIX_LEN, None,
                         reason=f"the header does not decode: {e}") from e
    if header.format_version != version:
        raise LogCorrupt(path, _PREFIX_LEN, None,
                         reason=f"the file's version byte says format version {version} but "
                                f"its header says {header.format_version}")
    return header, fmt, end


def _damaged_header(path: Path, f: BinaryIO, payload: bytes, length: int, crc: int,
                    fmt: _Format, end: int) -> LogCorrupt:
    """What is wrong with a header frame that does not check out: torn (the file ends
    inside it, nothing recorded) or damaged (a changed byte, records after it)."""
    if len(payload) < length:
        what = (f"the header frame declares {length} bytes but the file holds "
                f"{len(payload)} after it")
    else:
        what = (f"the header's checksum does not match (stored {crc:#010x}, computed "
                f"{zlib.crc32(payload):#010x})")
    intact = _records_after_damaged_header(payload + f.read(_READ_CHUNK * 16), fmt)
    if not intact and len(payload) < length:
        return LogCorrupt(path, end, None, reason=_torn_header(end))
    if intact:
        what += (f", yet about {intact} intact record(s) follow: the header is damaged, "
                 "not torn (a crash cannot do that); restore the file from a copy")
    return LogCorrupt(path, _PREFIX_LEN, None, reason=what)


def _records_after_damaged_header(rest: bytes, fmt: _Format) -> int:
    """How many valid records follow a header frame that does not check out (0: none,
    so the file really ends inside its header). ``rest``: the bytes after the frame."""
    found = _find_valid_record(rest, -1, fmt)
    if found is None:
        return 0
    records, _, _ = _parse(rest, found, fmt.decode_record)
    return len(records)


def _torn_header(size: int) -> str:
    return (f"the header is torn (the file ends at byte {size}, inside the header), so the "
            "run recorded no messages; there is nothing to recover")


def _parse(data: bytes, pos: int,
           decode: Callable[[memoryview], Record]) -> tuple[list[Record], int, bool]:
    """Decode whole, valid records from ``data[pos:]``.

    Returns the records, the offset just past the last good one, and whether parsing
    stopped at a bad record (True) rather than at the end of the data (False, possibly
    with a partial record left over). The hot loop of every read.
    """
    records: list[Record] = []
    append = records.append
    unpack = _FRAME.unpack_from
    crc32 = zlib.crc32
    view = memoryview(data)
    end = len(data)
    while end - pos >= _FRAME_LEN:
        length, crc = unpack(data, pos)
        start = pos + _FRAME_LEN
        stop = start + length
        if stop > end:
            break
        payload = view[start:stop]
        if crc32(payload) != crc:
            return records, pos, True
        try:
            append(decode(payload))
        except msgspec.DecodeError:  # a checksummed payload that is no Record: the caller judges it
            return records, pos, True
        pos = stop
    return records, pos, False


def _judge_bad_tail(path: Path, data: bytes, pos: int, position: int, fmt: _Format,
                    index: int, last_seq: int | None) -> tuple[int, str]:
    """``data[pos:]`` does not parse; ``position`` is its offset in the file.

    If a valid record follows the bad spot, the damage is in the middle: raise
    `LogCorrupt`. Otherwise it is a torn or corrupt tail: return the best count of
    records it held and what is wrong with it.
    """
    why = _diagnose(data, pos, fmt)
    found = _find_valid_record(data, pos, fmt)
    if found is not None:
        raise LogCorrupt(
            path, position, last_seq, index=index,
            reason=f"{why}, yet a valid record follows at byte offset "
                   f"{position + found - pos}: the damage is in the middle of the log, not "
                   "a torn tail, so it cannot be cut off; restore the file from a copy "
                   "(read_log(repair=True) only repairs tails)")
    return _count_frames(data, pos), why


def _diagnose(data: bytes, pos: int, fmt: _Format) -> str:
    """Say what is wrong with the frame at ``data[pos]``."""
    available = len(data) - pos
    if available < _FRAME_LEN:
        return f"the record is cut short: {available} of its {_FRAME_LEN} frame bytes remain"
    length, crc = _FRAME.unpack_from(data, pos)
    if _FRAME_LEN + length > available:
        return (f"the record is cut short: it declares {length} payload bytes but "
                f"{available - _FRAME_LEN} remain")
    payload = memoryview(data)[pos + _FRAME_LEN:pos + _FRAME_LEN + length]
    actual = zlib.crc32(payload)
    if actual != crc:
        return f"the record's checksum does not match (stored {crc:#010x}, computed {actual:#010x})"
    try:
        fmt.decode_record(payload)
    except msgspec.DecodeError as e:  # described, not raised: the caller decides
        return f"the record's checksum matches but it does not decode: {e}"
    return "the record is unreadable"


def _find_valid_record(data: bytes, pos: int, fmt: _Format) -> int | None:
    """Offset of the first valid record starting after ``pos``, or None.

    Valid means: its frame fits, its checksum matches and it decodes as a Record (which
    rules out runs of zeros, whose empty payloads have a matching checksum).
    """
    view = memoryview(data)
    end = len(data)
    i = _find_marker(data, fmt.record_markers, pos + 1 + _FRAME_LEN)  # a payload's start
    while i >= 0:
        length, crc = _FRAME.unpack_from(data, i - _FRAME_LEN)
        stop = i + length
        if 0 < length and stop <= end and zlib.crc32(view[i:stop]) == crc:
            try:
                fmt.decode_record(view[i:stop])
            except msgspec.DecodeError:  # not a record after all: keep looking
                pass
            else:
                return i - _FRAME_LEN
        i = _find_marker(data, fmt.record_markers, i + 1)
    return None


def _find_marker(data: bytes, markers: tuple[bytes, ...], start: int) -> int:
    """The first offset at or after ``start`` where one of ``markers`` begins (-1: none)."""
    found = [i for i in (data.find(m, start) for m in markers) if i >= 0]
    return min(found) if found else -1


def _count_frames(data: bytes, pos: int) -> int:
    """Best count of the records in ``data[pos:]``, trusting the length fields."""
    count = 0
    end = len(data)
    while pos < end:
        count += 1
        if end - pos < _FRAME_LEN:
            break
        pos += _FRAME_LEN + _FRAME.unpack_from(data, pos)[0]
    return count


def _tail_message(path: Path, good_size: int, dropped: int, dropped_records: int,
                  kept: int, last_seq: int | None, why: str, *, repaired: bool) -> str:
    after = "no record" if last_seq is None else f"seq {last_seq}"
    plural = "" if dropped_records == 1 else "s"
    message = (f"{path}: torn or corrupt tail at byte offset {good_size} ({why}): dropped "
               f"{dropped} bytes, about {dropped_records} record{plural}; kept {kept} "
               f"records, the last good one is {after}")
    if repaired:
        return message + f"; the file was truncated to {good_size} bytes"
    return message + "; " + REPAIR_HINT


def follow_log(path: str | os.PathLike[str], *, poll: float = 0.2,
               stop: Callable[[], bool] = lambda: False) -> Iterator[Record]:
    """Yield the records of a log as they are appended (``evobus inspect --follow``).

    A record still being written (a partial frame at the end) is waited for, never
    warned about; a complete record that fails its checksum raises `LogCorrupt`. Once
    the end of the file is reached, ``stop()`` is asked before each wait of ``poll``
    seconds: the caller owns the deadline.
    """
    path = Path(path)
    with open(path, "rb") as f:
        _, fmt, offset = _read_header(path, f)
        buf = b""
        while True:
            more = f.read(_READ_CHUNK)
            if not more:
                if stop():
                    return
                time.sleep(poll)
                continue
            buf += more
            records, pos, bad = _parse(buf, 0, fmt.decode_record)
            yield from records
            if bad:
                raise LogCorrupt(path, offset + pos, records[-1].seq if records else None,
                                 reason="a record being followed fails its checksum")
            offset += pos
            buf = buf[pos:]
