"""What a group's effect log keeps about workers in other processes: the worker an
effect's intent came from (named when it is in doubt after a crash), and which branches
workers held when the coordinator stopped (actors.groups.checkpoint.EffectLog)."""

from __future__ import annotations

import struct
import zlib

import msgspec
import pytest

from actors.errors import EffectInDoubt
from actors.groups.checkpoint import EffectLog, effects_path


def test_an_effect_in_doubt_after_a_crash_names_the_worker_it_started_on(tmp_path):
    ckpt = tmp_path / "g.ckpt"
    log = EffectLog(ckpt)
    log.intent(4, 0, "charge", worker="w1")
    log.close()
    with pytest.raises(EffectInDoubt, match=r"branch 4: effect 'charge' \(step 0\) started on "
                                            r"worker w1 before the group stopped"):
        EffectLog(ckpt).replayed(4, 0, "charge")


def test_the_branches_workers_held_are_read_back_until_the_group_opens_again(tmp_path):
    ckpt = tmp_path / "g.ckpt"
    log = EffectLog(ckpt)
    log.opened()
    log.placed("w0", [0, 1])
    log.placed("w1", [2])
    log.answered([0, 1])
    log.placed("w1", [0, 1])   # the same branches again (the group ran them twice)
    log.answered([0])
    log.close()
    again = EffectLog(ckpt)
    assert again.held == {1: "w1", 2: "w1"}
    again.opened()
    assert again.held == {}
    again.close()
    assert EffectLog(ckpt).held == {}


def test_an_effect_log_written_before_records_named_workers_still_loads(tmp_path):
    ckpt = tmp_path / "g.ckpt"
    old = msgspec.msgpack.encode(["result", 2, 0, "send", "ok", ""])   # six fields, no worker
    effects_path(ckpt).write_bytes(struct.pack("<II", len(old), zlib.crc32(old)) + old)
    assert EffectLog(ckpt).replayed(2, 0, "send") == (True, "ok")
