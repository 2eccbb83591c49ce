"""The message log: round trips, fsync policies, torn tails, corruption, format versions."""

from __future__ import annotations

import os
import struct
import tempfile
import warnings
import zlib
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.log import (
    FORMAT_VERSION,
    MAGIC,
    LogContents,
    LogCorrupt,
    LogExists,
    LogHeader,
    LogVersionError,
    LogWriter,
    Record,
    TornTailWarning,
    iter_log,
    read_header,
    read_log,
)

pytestmark = pytest.mark.timeout(30)

FRAME = struct.Struct("<II")  # the on-disk frame, written out here independently of bus.log

HEADER = LogHeader(format_version=FORMAT_VERSION, package_version="0.1.0", scenario="demo",
                   seed=7, run_id="r1", started_at="2024-01-01T00:00:00+00:00",
                   meta={"k": "v"})

# A version-1 log written on the day the format was fixed: HEADER, then two records
# (0, 0.0, "planner", "scheduler", b"\x81\xa1a\x01") and (1, 0.25, "scheduler", "worker-0", b"").
# Today's code must read these bytes, and today's writer must still produce them.
GOLDEN_V1 = bytes.fromhex(
    "45564f4c4f470174000000bc5702a787ae666f726d61745f76657273696f6e01"
    "af7061636b6167655f76657273696f6ea5302e312e30a87363656e6172696fa4"
    "64656d6fa47365656407a672756e5f6964a27231aa737461727465645f6174b9"
    "323032342d30312d30315430303a30303a30302b30303a3030a46d65746181a1"
    "6ba17623000000769f6ced9500cb0000000000000000a7706c616e6e6572a973"
    "63686564756c6572c40481a1610120000000e55f50499501cb3fd00000000000"
    "00a97363686564756c6572a8776f726b65722d30c400"
)


def make_records(n: int) -> list[Record]:
    return [Record(i, i * 0.125, f"actor-{i % 3}", f"actor-{(i + 1) % 3}", bytes([i % 256]) * (i % 40))
            for i in range(n)]


def write_log(path: Path, records: list[Record], **writer_options) -> Path:
    with LogWriter(path, HEADER, **writer_options) as writer:
        for r in records:
            writer.append(r.seq, r.t, r.sender, r.receiver, r.body)
    return path


def frame_offsets(path: Path) -> list[int]:
    """Byte offset of every frame after the header, walking the lengths (no checksums)."""
    data = path.read_bytes()
    pos = len(MAGIC) + 1
    pos += FRAME.size + FRAME.unpack_from(data, pos)[0]  # skip the header frame
    offsets = []
    while pos < len(data):
        offsets.append(pos)
        pos += FRAME.size + FRAME.unpack_from(data, pos)[0]
    return offsets


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def hand_made_log(version_byte: int, header_payload: bytes, records: bytes = b"") -> bytes:
    return (MAGIC + bytes([version_byte]) + FRAME.pack(len(header_payload), zlib.crc32(header_payload))
            + header_payload + records)


# --- round trips ---------------------------------------------------------------------


def test_header_and_records_round_trip(tmp_path):
    records = make_records(50)
    path = write_log(tmp_path / "run.evolog", records)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a whole file reads without a warning
        contents = read_log(path)
    assert contents == LogContents(path=path, header=HEADER, records=records)
    assert read_header(path) == HEADER
    assert list(iter_log(path)) == records


def test_a_log_with_no_records_reads_as_just_its_header(tmp_path):
    path = write_log(tmp_path / "empty.evolog", [])
    contents = read_log(path)
    assert contents.header == HEADER
    assert contents.records == []
    assert list(iter_log(path)) == []


def test_append_accepts_near_miss_types_and_refuses_what_would_not_read_back(tmp_path):
    path = tmp_path / "types.evolog"
    with LogWriter(path, HEADER) as writer:
        writer.append(0, 1, "a", "b", bytearray(b"xy"))  # int t and bytearray body: converted
        writer.append(1, 2.5, "a", "b", memoryview(b"z"))
        with pytest.raises(TypeError, match="body must be bytes"):
            writer.append(2, 3.0, "a", "b", "not bytes")
        with pytest.raises(TypeError, match="seq must be an int"):
            writer.append(True, 3.0, "a", "b", b"")
        with pytest.raises(TypeError, match="receiver must be a str"):
            writer.append(2, 3.0, "a", None, b"")
    assert read_log(path).records == [Record(0, 1.0, "a", "b", b"xy"), Record(1, 2.5, "a", "b", b"z")]


def test_a_log_is_never_overwritten_and_its_bytes_do_not_change(tmp_path):
    path = write_log(tmp_path / "run.evolog", make_records(10))
    before = path.read_bytes()
    with pytest.raises(LogExists, match="never overwritten.*new path.*overwrite=True"):
        LogWriter(path, HEADER)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.evolog"]  # no leftovers


def test_overwrite_true_replaces_the_log_with_a_new_file(tmp_path):
    path = write_log(tmp_path / "run.evolog", make_records(10))
    with open(path, "rb") as old:  # a reader of the old log keeps the old bytes
        write_log(path, make_records(2), overwrite=True)
        assert len(old.read()) > path.stat().st_size
    assert read_log(path).records == make_records(2)


def test_the_file_appears_with_its_header_already_on_disk(tmp_path):
    path = tmp_path / "run.evolog"
    with LogWriter(path, HEADER, fsync="never"):
        assert read_log(path).header == HEADER  # before any flush or close
        assert [p.name for p in tmp_path.iterdir()] == ["run.evolog"]


def test_close_is_idempotent_and_append_after_close_is_refused(tmp_path):
    path = tmp_path / "run.evolog"
    writer = LogWriter(path, HEADER)
    writer.append(0, 0.0, "a", "b", b"")
    writer.close()
    writer.close()
    assert writer.closed
    with pytest.raises(ValueError, match="is closed"):
        writer.append(1, 0.0, "a", "b", b"")
    assert len(read_log(path).records) == 1


def test_writer_refuses_a_header_of_another_format_version(tmp_path):
    header = msgspec.structs.replace(HEADER, format_version=FORMAT_VERSION + 1)
    with pytest.raises(ValueError, match="format_version=FORMAT_VERSION"):
        LogWriter(tmp_path / "run.evolog", header)


def test_yesterdays_bytes_still_read_and_the_writer_still_produces_them(tmp_path):
    path = tmp_path / "golden.evolog"
    path.write_bytes(GOLDEN_V1)
    expected = [Record(0, 0.0, "planner", "scheduler", b"\x81\xa1a\x01"),
                Record(1, 0.25, "scheduler", "worker-0", b"")]
    assert read_log(path) == LogContents(path=path, header=HEADER, records=expected)
    rewritten = write_log(tmp_path / "today.evolog", expected)
    assert rewritten.read_bytes() == GOLDEN_V1


# --- fsync policies ------------------------------------------------------------------


@pytest.mark.parametrize("policy, expected_fsyncs", [
    ("always", 2 + 7 + 1),   # header and its directory entry, every record, close
    ("batched", 2 + 2 + 1),  # header and its directory entry, every 3rd record, close
    ("never", 0),
])
def test_every_fsync_policy_writes_a_readable_log(tmp_path, monkeypatch, policy, expected_fsyncs):
    fsyncs = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
    records = make_records(7)
    path = write_log(tmp_path / f"{policy}.evolog", records, fsync=policy, batch=3)
    assert len(fsyncs) == expected_fsyncs
    assert read_log(path).records == records


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("policy", ["batched", "never"])
def test_a_buffered_record_reaches_the_os_once_it_is_due_whatever_the_count(tmp_path, policy):
    clock = FakeClock()
    path = tmp_path / "run.evolog"
    with LogWriter(path, HEADER, fsync=policy, batch=256, flush_every=0.25,
                   clock=clock) as writer:
        writer.append(0, 0.0, "a", "b", b"x")
        assert not writer.flush_if_due() and read_log(path).records == []  # buffered
        clock.now += 0.25
        assert writer.flush_if_due()  # what the bus calls when idle
        assert len(read_log(path).records) == 1
        assert not writer.flush_if_due()  # nothing left to flush


def test_an_append_flushes_the_buffer_when_its_oldest_record_is_due(tmp_path):
    clock = FakeClock()
    path = tmp_path / "run.evolog"
    with LogWriter(path, HEADER, batch=256, flush_every=0.25, clock=clock) as writer:
        for i in range(3):
            writer.append(i, 0.0, "a", "b", b"")
            clock.now += 0.13
        assert len(read_log(path).records) == 3  # the third append found the first due


def test_sync_records_are_fsynced_at_the_next_check_once_per_burst(tmp_path, monkeypatch):
    fsyncs = []
    real_fsync = os.fsync
    path = tmp_path / "run.evolog"
    with LogWriter(path, HEADER, batch=256, clock=FakeClock()) as writer:
        monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
        writer.append(0, 0.0, "merger", "worker-0", b"", sync=True)
        writer.append(1, 0.0, "merger", "worker-1", b"", sync=True)
        assert fsyncs == []
        assert writer.flush_if_due()
        assert len(fsyncs) == 1 and len(read_log(path).records) == 2
        assert not writer.flush_if_due()


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_a_flush_interval_outside_zero_to_one_second_is_refused(tmp_path, every):
    with pytest.raises(ValueError, match=r"flush_every.*\(0, 1\]"):
        LogWriter(tmp_path / "run.evolog", HEADER, flush_every=every)
    assert not (tmp_path / "run.evolog").exists()


def test_unknown_fsync_policy_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="'always'.*'batched'.*'never'"):
        LogWriter(tmp_path / "run.evolog", HEADER, fsync="sometimes")
    assert not (tmp_path / "run.evolog").exists()


def test_batch_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        LogWriter(tmp_path / "run.evolog", HEADER, batch=0)


# --- torn and corrupt tails ----------------------------------------------------------


def test_torn_tail_is_cut_back_with_a_warning(tmp_path):
    records = make_records(10)
    path = write_log(tmp_path / "run.evolog", records)
    last = frame_offsets(path)[-1]
    size = path.stat().st_size
    os.truncate(path, size - 3)
    with pytest.warns(TornTailWarning, match=rf"dropped {size - 3 - last} bytes, about 1 record;"):
        contents = read_log(path)
    assert contents.records == records[:-1]
    assert contents.dropped_tail == size - 3 - last
    assert contents.dropped_records == 1
    assert path.stat().st_size == size - 3  # read_log without repair leaves the file alone


def test_tail_torn_inside_a_frame_header_is_cut_back(tmp_path):
    records = make_records(5)
    path = write_log(tmp_path / "run.evolog", records)
    last = frame_offsets(path)[-1]
    os.truncate(path, last + 3)
    with pytest.warns(TornTailWarning, match="3 of its 8 frame bytes remain"):
        contents = read_log(path)
    assert (contents.records, contents.dropped_tail, contents.dropped_records) == (records[:-1], 3, 1)


def test_corrupt_checksum_in_the_last_record_is_cut_back(tmp_path):
    records = make_records(10)
    path = write_log(tmp_path / "run.evolog", records)
    flip_byte(path, path.stat().st_size - 1)
    with pytest.warns(TornTailWarning, match="checksum does not match"):
        contents = read_log(path)
    assert contents.records == records[:-1]
    assert contents.dropped_records == 1


def test_a_zero_filled_tail_is_cut_back_not_mistaken_for_records(tmp_path):
    records = make_records(4)
    path = write_log(tmp_path / "run.evolog", records)
    with open(path, "ab") as f:
        f.write(bytes(4096))  # what some filesystems leave after a crash
    with pytest.warns(TornTailWarning, match="dropped 4096 bytes"):
        contents = read_log(path)
    assert contents.records == records


def test_repair_truncates_the_file_and_a_second_read_has_no_warning(tmp_path):
    records = make_records(10)
    path = write_log(tmp_path / "run.evolog", records)
    last = frame_offsets(path)[-1]
    os.truncate(path, path.stat().st_size - 5)
    with pytest.warns(TornTailWarning, match=f"truncated to {last} bytes"):
        repaired = read_log(path, repair=True)
    assert path.stat().st_size == last
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = read_log(path)
    assert again.records == repaired.records == records[:-1]
    assert again.dropped_tail == 0


def test_iter_log_cuts_a_torn_tail_with_a_warning(tmp_path):
    records = make_records(10)
    path = write_log(tmp_path / "run.evolog", records)
    os.truncate(path, path.stat().st_size - 2)
    with pytest.warns(TornTailWarning, match="about 1 record"):
        streamed = list(iter_log(path, chunk_size=64))
    assert streamed == records[:-1]


# --- corruption in the middle --------------------------------------------------------


def test_corruption_in_the_middle_raises_log_corrupt_naming_the_offset(tmp_path):
    records = make_records(10)
    path = write_log(tmp_path / "run.evolog", records)
    bad = frame_offsets(path)[3]
    flip_byte(path, bad + FRAME.size)  # first payload byte of record index 3
    with pytest.raises(LogCorrupt, match=rf"at byte offset {bad} \(record index 3, after seq 2\)") as info:
        read_log(path)
    assert (info.value.position, info.value.index, info.value.seq_of_last_good) == (bad, 3, 2)
    assert "valid record follows" in str(info.value)


def test_a_corrupt_length_in_the_middle_is_not_mistaken_for_a_torn_tail(tmp_path):
    records = make_records(10)
    path = write_log(tmp_path / "run.evolog", records)
    bad = frame_offsets(path)[0]
    data = bytearray(path.read_bytes())
    data[bad:bad + 4] = struct.pack("<I", 10**9)  # a length running far past the end
    path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match=rf"at byte offset {bad} \(record index 0, after the first"):
        read_log(path)


def test_iter_log_raises_on_middle_corruption_after_yielding_the_good_records(tmp_path):
    records = make_records(10)
    path = write_log(tmp_path / "run.evolog", records)
    bad = frame_offsets(path)[6]
    flip_byte(path, bad + FRAME.size + 2)
    streamed = []
    with pytest.raises(LogCorrupt, match=rf"at byte offset {bad} \(record index 6"):
        for record in iter_log(path, chunk_size=50):
            streamed.append(record)
    assert streamed == records[:6]


# --- not a log, torn header, versions ------------------------------------------------


def test_a_file_that_is_not_an_evobus_log_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"hello, this is not a log at all")
    with pytest.raises(LogCorrupt, match=r"not an evobus log: it starts with b'hello,', expected b'EVOLOG'"):
        read_log(path)
    path.write_bytes(b"")
    with pytest.raises(LogCorrupt, match="the file is empty, not an evobus log"):
        read_log(path)


@pytest.mark.parametrize("keep", [3, len(MAGIC) + 1, len(MAGIC) + 1 + 5, 30])
def test_a_torn_header_is_refused_saying_nothing_was_recorded(tmp_path, keep):
    path = write_log(tmp_path / "run.evolog", [])
    os.truncate(path, keep)
    with pytest.raises(LogCorrupt, match="the header is torn"):
        read_log(path)


def test_a_newer_format_version_is_refused_naming_both_versions(tmp_path):
    newer = FORMAT_VERSION + 1
    path = tmp_path / "future.evolog"
    path.write_bytes(hand_made_log(newer, msgspec.msgpack.encode({"format_version": newer})))
    with pytest.raises(LogVersionError,
                       match=rf"format version {newer} is newer than this code reads "
                             rf"\(format version {FORMAT_VERSION}\)"):
        read_log(path)
    with pytest.raises(LogCorrupt):  # a LogVersionError is a LogCorrupt to callers that only catch that
        list(iter_log(path))


def test_version_dispatch_accepts_version_one_and_refuses_an_unknown_older_one(tmp_path):
    path = tmp_path / "v1.evolog"
    record = msgspec.msgpack.encode(Record(5, 1.5, "a", "b", b"body"))
    path.write_bytes(hand_made_log(1, msgspec.msgpack.encode({"format_version": 1, "seed": 3}),
                                   FRAME.pack(len(record), zlib.crc32(record)) + record))
    contents = read_log(path)
    assert contents.header == LogHeader(format_version=1, seed=3)
    assert contents.records == [Record(5, 1.5, "a", "b", b"body")]
    path.write_bytes(hand_made_log(0, msgspec.msgpack.encode({"format_version": 0})))
    with pytest.raises(LogVersionError, match="format version 0 is not one this code knows"):
        read_log(path)


def test_a_version_byte_that_disagrees_with_the_header_is_corrupt(tmp_path):
    path = tmp_path / "mixed.evolog"
    path.write_bytes(hand_made_log(1, msgspec.msgpack.encode({"format_version": 2})))
    with pytest.raises(LogCorrupt, match="version byte says format version 1 but its header says 2"):
        read_log(path)


def test_a_header_with_a_bad_checksum_is_corrupt(tmp_path):
    path = write_log(tmp_path / "run.evolog", make_records(2))
    flip_byte(path, len(MAGIC) + 1 + FRAME.size + 1)
    with pytest.raises(LogCorrupt, match="header's checksum does not match"):
        read_log(path)


# --- streaming -----------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1 << 20])
def test_iter_log_streams_the_same_records_whatever_the_chunk_size(tmp_path, chunk_size):
    records = make_records(40)
    path = write_log(tmp_path / "run.evolog", records)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(iter_log(path, chunk_size=chunk_size)) == records


# --- properties ----------------------------------------------------------------------

record_fields = st.tuples(
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.text(max_size=12),
    st.binary(max_size=200),
)
PROPERTY_SETTINGS = settings(derandomize=True, database=None, max_examples=150, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


def write_random_log(directory: str, fields: list) -> tuple[Path, list[Record], list[int]]:
    """Write the records; return the path, the records, and every record boundary."""
    records = [Record(seq, t, sender, receiver, body)
               for seq, (t, sender, receiver, body) in enumerate(fields)]
    path = write_log(Path(directory) / "run.evolog", records, fsync="never")
    boundaries = [*frame_offsets(path), path.stat().st_size]
    return path, records, boundaries


@PROPERTY_SETTINGS
@given(fields=st.lists(record_fields, max_size=25), cut=st.floats(0, 1))
def test_a_log_truncated_anywhere_after_its_header_reads_as_a_prefix(fields, cut):
    with tempfile.TemporaryDirectory() as directory:
        path, records, boundaries = write_random_log(directory, fields)
        size = boundaries[0] + round(cut * (boundaries[-1] - boundaries[0]))
        os.truncate(path, size)
        kept = max(i for i, b in enumerate(boundaries) if b <= size)  # whole records left
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            contents = read_log(path)
            streamed = list(iter_log(path, chunk_size=97))
        assert contents.records == streamed == records[:kept]
        assert contents.dropped_tail == size - boundaries[kept]
        assert contents.dropped_records == (1 if size > boundaries[kept] else 0)
        torn = [w for w in caught if issubclass(w.category, TornTailWarning)]
        assert len(torn) == (2 if size > boundaries[kept] else 0)


@PROPERTY_SETTINGS
@given(fields=st.lists(record_fields, min_size=1, max_size=15), where=st.floats(0, 1),
       xor=st.integers(1, 255))
def test_one_damaged_byte_is_a_cut_tail_in_the_last_record_and_an_error_elsewhere(fields, where, xor):
    with tempfile.TemporaryDirectory() as directory:
        path, records, boundaries = write_random_log(directory, fields)
        offset = boundaries[0] + min(int(where * (boundaries[-1] - boundaries[0])),
                                     boundaries[-1] - boundaries[0] - 1)
        data = bytearray(path.read_bytes())
        data[offset] ^= xor
        path.write_bytes(bytes(data))
        damaged = max(i for i, b in enumerate(boundaries) if b <= offset)
        if damaged == len(records) - 1:
            with pytest.warns(TornTailWarning):
                assert read_log(path).records == records[:-1]
        else:
            with pytest.raises(LogCorrupt) as info:
                read_log(path)
            assert (info.value.position, info.value.index) == (boundaries[damaged], damaged)
