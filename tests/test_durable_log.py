"""A log that survives real runs (issue 15): `evobus run` in a subprocess, with rollouts
slow enough (20 ms each, tests/resume_domain.py) to be stopped mid-run, under the
default fsync policy. kill -9 at seeded moments then `evobus resume` gives the
uninterrupted run's artifact and counts; SIGTERM closes the log as Ctrl-C does; a
second run never touches the first one's log; a chain is one run's segments only."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import msgspec
import pytest

from actors import DataParallel, KeyedRules, evolve
from actors.errors import ConfigError
from actors.replay.chain import log_chain
from actors.replay.engine import rebuild
from actors.replay.resume import ResumePoint
from actors.replay.resume import resume as resume_in_process
from actors.runtime.launch import evolve_kwargs, run_scenario
from actors.testing import replay
from bus.log import UNDELIVERED, LogWriter, TornTailWarning, read_header, read_log
from protocol import (Commit, EvalDone, Lease, LeaseBatch, LeaseDone, RoundClosed, RunDone,
                      Start, Tick, decode, encode)
from protocol.scenario import parse_scenario
from scenarios import router

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parent.parent

SCENARIO = """
name = "slow-router"
rounds = 20
seed = 0
held_out_frac = 0.4
log = "{log}"

[domain]
tasks = "scenarios.router:tasks"
reward = "scenarios.router:reward"
agent = "resume_domain:SlowRouterAgent"

[strategy]
kind = "KeyedRules"
categories = ["billing", "shipping", "technical", "account"]

[parallel]
kind = "DataParallel"
per_worker = "shard"   # whole-shard rounds: a run long enough to kill at many moments

[workers]
local = 4
"""

def env_for(delay: str = "0.02") -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                         env.get("PYTHONPATH", "")])
    env.pop("EVOBUS_LOG_FSYNC", None)  # the default policy: what a new user gets
    env["EVOBUS_TEST_ROLLOUT_DELAY"] = delay
    return env


def start_run(tmp_path: Path, log: Path, *extra: str) -> subprocess.Popen:
    scenario = tmp_path / "slow.toml"
    scenario.write_text(SCENARIO.format(log=log))
    return subprocess.Popen([sys.executable, "-m", "actors.cli", "run", str(scenario),
                             "--quiet", *extra], cwd=tmp_path, env=env_for(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def records_on_disk(path: Path) -> int:
    if not path.exists():
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornTailWarning)  # it is being written
        return len(read_log(path).records)


def wait_for_records(path: Path, n: int, proc: subprocess.Popen, deadline_s: float) -> int:
    """Poll the growing log until it holds ``n`` records (bounded)."""
    deadline = time.monotonic() + deadline_s
    have = 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) with {have} records "
                                 f"on disk, before {n}: {proc.stderr.read().decode()[-2000:]}")
        have = records_on_disk(path)
        if have >= n:
            return have
        time.sleep(0.005)  # polling period, not a synchronisation
    raise AssertionError(f"{path} did not reach {n} records within {deadline_s} s ({have})")


def resume(tmp_path: Path, log: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "actors.cli", "resume", str(log), "--json"],
                          cwd=tmp_path, env=env_for(), capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run (in this process, rollouts not slowed: same decisions)."""
    log = tmp_path_factory.mktemp("whole") / "whole.evolog"
    return run_scenario(parse_scenario(SCENARIO.format(log=log), "slow.toml"))


def same_as_whole(resumed: dict, whole) -> None:
    assert resumed["state"] == whole.state
    assert (resumed["version"], resumed["final_reward"]) == (whole.version, whole.final_reward)
    assert (resumed["rollouts"], resumed["calls"]) == (whole.rollouts, whole.calls)
    assert resumed["outcomes"] == whole.outcomes()
    assert resumed["stop_reason"] == whole.stop_reason


def lease_ids(path: Path, kind: type, **where: str) -> set[str]:
    """Ids of the rollout and eval leases in ``kind`` messages from/to whom ``where`` says."""
    return {m.lease_id for r in read_log(path).records
            if all(getattr(r, k) == v for k, v in where.items())
            and isinstance(m := decode(r.body), kind)}


KILL_SEEDS = [0, 1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("seed", KILL_SEEDS, ids=lambda s: f"seed{s}")
def test_kill_9_at_a_seeded_moment_then_resume_gives_the_uninterrupted_run(tmp_path, seed,
                                                                           whole):
    # Records on disk at the kill: one draw in each fifth of the first 250 records, so
    # the five moments go from the run's first messages to its last round.
    moment = random.Random(seed).randint(1 + 50 * seed, 50 * (seed + 1))
    log = tmp_path / "run.evolog"
    proc = start_run(tmp_path, log)
    try:
        wait_for_records(log, moment, proc, deadline_s=30)
        proc.send_signal(signal.SIGKILL)  # no cleanup, no flush, no goodbye
    finally:
        proc.kill()
        proc.wait(timeout=10)
    at_kill = records_on_disk(log)
    assert at_kill >= moment, f"seed {seed}: killed with {at_kill} records, wanted {moment}"
    started = any(isinstance(decode(r.body), Start) for r in read_log(log).records)
    resumed = resume(tmp_path, log)
    assert not resumed.get("already_finished"), f"seed {seed}: finished before the kill"
    same_as_whole(resumed, whole)
    new_log = Path(resumed["log"])
    if not started:  # killed before its Start reached the disk: begun again, nothing lost
        assert "restarted_from" in read_header(new_log).meta
        return
    # Only work in flight is done again: no lease (rollout or eval) answered on disk is
    # handed out anew.
    again = (lease_ids(log, LeaseDone, receiver="scheduler")
             & lease_ids(new_log, Lease, sender="scheduler"))
    assert not again, f"seed {seed} (killed at {at_kill} records): {sorted(again)} redone"
    assert read_log(new_log).records[0].seq == read_log(log).records[-1].seq + 1
    assert replay(new_log).ok


@pytest.mark.slow
def test_sigterm_closes_the_log_like_ctrl_c_and_exits_143(tmp_path, whole):
    log = tmp_path / "run.evolog"
    proc = start_run(tmp_path, log)
    try:
        wait_for_records(log, 60, proc, deadline_s=30)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == 143, err.decode()[-2000:]
    assert f"evobus resume {log}" in err.decode()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # closed properly: no torn tail
        records = read_log(log).records
    assert len(records) >= 60
    assert not any(isinstance(decode(r.body), RunDone) for r in records)
    same_as_whole(resume(tmp_path, log), whole)


def test_a_message_a_stopping_actor_never_had_is_sent_again_by_resume(tmp_path, whole):
    # What a SIGTERM can leave: the run's actors stop one by one while messages still
    # fly, so the Merger may be gone when the Scheduler's EvalDone reaches the broker,
    # which logs it UNDELIVERED; nothing follows it. Built here from the whole run's
    # log (its first 60+ records, then that EvalDone marked UNDELIVERED).
    src = read_log(whole.log_path)
    cut = next(i for i, r in enumerate(src.records) if i >= 60 and r.receiver == "merger"
               and isinstance(decode(r.body), EvalDone))
    log = tmp_path / "run.evolog"
    writer = LogWriter(log, src.header, fsync="never")
    for r in src.records[:cut]:
        writer.append(r.seq, r.t, r.sender, r.receiver, r.body, peer=r.peer, status=r.status)
    last = src.records[cut]
    writer.append(last.seq, last.t, last.sender, last.receiver, last.body, status=UNDELIVERED)
    writer.close()
    report, engine = rebuild([log], [read_log(log)], strict=False, machines=None, specs={})
    assert report.ok, report.format()
    assert ("scheduler", "merger", decode(last.body)) in engine.pending
    # Without it the Merger would wait for that EvalDone forever: the resume would hang.
    kwargs = evolve_kwargs(parse_scenario(SCENARIO.format(log=log), "slow.toml"))
    kwargs.pop("log", None)
    resumed = resume_in_process(log, **kwargs)
    same_as_whole({"state": resumed.state, "version": resumed.version,
                   "final_reward": resumed.final_reward, "rollouts": resumed.rollouts,
                   "calls": resumed.calls, "outcomes": resumed.outcomes(),
                   "stop_reason": resumed.stop_reason}, whole)


class _MergerThreadLast(ResumePoint):
    """A resume whose rebuilt Merger's thread runs last: its first handle() call waits
    (bounded) until the Scheduler has taken a LeaseBatch. A loaded machine may schedule
    the actors' threads so; resume must not depend on the order they run in."""

    def prepare(self, rt, machines) -> None:
        super().prepare(rt, machines)
        planned = threading.Event()
        scheduler, merger = machines["scheduler"], machines["merger"]
        scheduler_handle, merger_handle = scheduler.handle, merger.handle

        def scheduler_takes(msg):
            out = scheduler_handle(msg)
            if isinstance(msg, LeaseBatch):
                planned.set()
            return out

        def merger_takes(msg):
            planned.wait(timeout=10)  # bounded: a resume that never plans goes on anyway
            return merger_handle(msg)

        scheduler.handle, merger.handle = scheduler_takes, merger_takes


def test_messages_a_stop_left_undelivered_are_sent_again_in_the_logs_order(tmp_path, whole):
    # What a SIGTERM can leave (seen once in CI: the resumed run ended at version 3, the
    # uninterrupted one at 2, same state): the Scheduler stopped before the Merger's Commit
    # of round 0 reached it (UNDELIVERED), while the Planner still took the RoundClosed
    # the Merger sent next, so the Planner's LeaseBatch for round 1 is pending too. Each
    # rebuilt actor re-sent its own on its own thread: the LeaseBatch could reach the
    # Scheduler before the Commit it follows from, and round 1 went out on version 0.
    src = read_log(whole.log_path)
    commit = next(i for i, r in enumerate(src.records)
                  if r.sender == "merger" and isinstance(decode(r.body), Commit))
    closed = commit + 1
    assert isinstance(decode(src.records[closed].body), RoundClosed)
    log = tmp_path / "run.evolog"
    writer = LogWriter(log, src.header, fsync="never")
    for i, r in enumerate(src.records[:closed + 1]):
        writer.append(r.seq, r.t, r.sender, r.receiver, r.body, peer=r.peer,
                      status=UNDELIVERED if i == commit else r.status)
    writer.close()
    point = _MergerThreadLast(log)
    kwargs = evolve_kwargs(parse_scenario(SCENARIO.format(log=log), "slow.toml"))
    kwargs.pop("log", None)
    resumed = resume_in_process(point, **kwargs)
    kinds = [(s, r, type(m).__name__) for s, r, m in point.pending]
    assert kinds.index(("merger", "scheduler", "Commit")) \
        < kinds.index(("planner", "scheduler", "LeaseBatch")), kinds
    # The new log opens with them, as the old run's order had them, before anything else.
    first = [(r.sender, r.receiver, decode(r.body))
             for r in read_log(resumed.log_path).records[:len(point.pending)]]
    assert first == point.pending
    same_as_whole({"state": resumed.state, "version": resumed.version,
                   "final_reward": resumed.final_reward, "rollouts": resumed.rollouts,
                   "calls": resumed.calls, "outcomes": resumed.outcomes(),
                   "stop_reason": resumed.stop_reason}, whole)
    assert replay(resumed.log_path).ok


def cut_log(whole, log: Path, upto: int, undelivered: int | None = None,
            then: tuple = ()) -> None:
    """``log``: the whole run's header, with the scenario text as `evobus run` records it
    (so `evobus resume` can rebuild it), its first ``upto`` records, the one at
    ``undelivered`` marked UNDELIVERED, then ``then``'s (sender, receiver, message)."""
    src = read_log(whole.log_path)
    header = msgspec.structs.replace(src.header, meta={
        **src.header.meta, "scenario_toml": SCENARIO.format(log=log)})
    writer = LogWriter(log, header, fsync="never")
    seq, t = 0, 0.0
    for i, r in enumerate(src.records[:upto]):
        writer.append(r.seq, r.t, r.sender, r.receiver, r.body, peer=r.peer,
                      status=UNDELIVERED if i == undelivered else r.status)
        seq, t = r.seq, r.t
    for sender, receiver, msg in then:
        seq += 1
        writer.append(seq, t, sender, receiver, encode(msg))
    writer.close()


def start_index(whole) -> int:
    return next(i for i, r in enumerate(read_log(whole.log_path).records)
                if isinstance(decode(r.body), Start))


def test_a_run_stopped_before_its_start_reached_the_planner_resumes_from_the_beginning(
        tmp_path, whole):
    # What a SIGTERM in a run's first moments can leave: the Planner stopped before the
    # driver's Start reached it, so the log holds Start UNDELIVERED and nothing after it.
    # Resume rebuilt a Planner that had received nothing, re-sent nothing (only control
    # actors' messages were re-sent) and `evobus resume` waited forever. Start is now
    # pending like them, sent first as the driver: the run begins, in the same chain.
    at = start_index(whole)
    log = tmp_path / "run.evolog"
    cut_log(whole, log, at + 1, undelivered=at)
    start = decode(read_log(log).records[at].body)
    report, engine = rebuild([log], [read_log(log)], strict=False, machines=None, specs={})
    assert report.ok, report.format()
    assert engine.pending == [("driver", "planner", start)]
    # End to end, bounded: before the fix this subprocess hung until its timeout.
    resumed = resume(tmp_path, log)
    same_as_whole(resumed, whole)
    new_log = Path(resumed["log"])
    header = read_header(new_log)
    assert header.meta["resumed_from"] == log.name
    assert header.run_id == read_header(log).run_id == start.run_id
    first = read_log(new_log).records[0]
    assert (first.sender, first.receiver, decode(first.body)) == ("driver", "planner", start)
    assert first.seq == read_log(log).records[-1].seq + 1
    assert replay(new_log).ok
    # The in-process function takes the same path.
    kwargs = evolve_kwargs(parse_scenario(SCENARIO.format(log=log), "slow.toml"))
    kwargs.pop("log", None)
    again = resume_in_process(log, log=tmp_path / "again.evolog", **kwargs)
    assert (again.state, again.version, again.rollouts) == \
        (whole.state, whole.version, whole.rollouts)


@pytest.mark.parametrize("kept", ["header_only", "records_before_start"])
def test_a_log_whose_start_was_never_written_is_run_again_from_scratch_by_evobus_resume(
        tmp_path, whole, kept):
    log = tmp_path / "run.evolog"
    cut_log(whole, log, 0 if kept == "header_only" else start_index(whole))
    resumed = resume(tmp_path, log)
    same_as_whole(resumed, whole)
    assert read_header(Path(resumed["log"])).meta["restarted_from"] == log.name


def test_resume_refuses_at_once_a_log_whose_start_can_never_reach_the_planner(
        tmp_path, whole):
    # A Start UNDELIVERED with a message delivered to the Planner after it (no run writes
    # this; a log edited by hand): it is not re-sent, nothing would begin the run, so
    # `evobus resume` says so and what to do, instead of waiting.
    at = start_index(whole)
    log = tmp_path / "run.evolog"
    cut_log(whole, log, at + 1, undelivered=at,
            then=[("driver", "planner", Tick(elapsed=0.0))])
    done = subprocess.run([sys.executable, "-m", "actors.cli", "resume", str(log)],
                          cwd=tmp_path, env=env_for(), capture_output=True, timeout=60)
    assert done.returncode != 0
    assert "the run never started; run it again" in done.stderr.decode(), \
        done.stderr.decode()[-2000:]


def test_a_second_run_refuses_the_log_path_and_never_changes_the_first_log(tmp_path):
    log = tmp_path / "runs" / "run.evolog"
    scenario = tmp_path / "fast.toml"
    scenario.write_text(SCENARIO.format(log=log))
    cmd = [sys.executable, "-m", "actors.cli", "run", str(scenario), "--quiet"]
    first = subprocess.run(cmd, cwd=tmp_path, env=env_for("0"), capture_output=True,
                           timeout=60)
    assert first.returncode == 0, first.stderr.decode()[-2000:]
    digest = hashlib.sha256(log.read_bytes()).hexdigest()
    again = subprocess.run(cmd, cwd=tmp_path, env=env_for("0"), capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 2
    assert "`$.log`" in again.stderr and "--log PATH" in again.stderr
    assert "--overwrite" in again.stderr and "Traceback" not in again.stderr
    assert hashlib.sha256(log.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in log.parent.iterdir()) == ["run.evolog"]
    replaced = subprocess.run(cmd + ["--overwrite"], cwd=tmp_path, env=env_for("0"),
                              capture_output=True, timeout=60)
    assert replaced.returncode == 0, replaced.stderr.decode()[-2000:]
    assert read_header(log).run_id != ""  # a new run's log, readable, in its place


def router_kwargs(**extra):
    kw = dict(tasks=router.tasks(), reward=router.reward, run=router.run,
              propose=router.propose, strategy=KeyedRules(router.CATEGORIES), rounds=2,
              n_workers=4, seed=0, bus="memory", parallel=DataParallel())
    kw.update(extra)
    return kw


def test_evolve_refuses_an_existing_log_unless_told_to_overwrite(tmp_path):
    log = tmp_path / "run.evolog"
    evolve(**router_kwargs(), log=str(log))
    before = log.read_bytes()
    with pytest.raises(ConfigError, match="never overwritten.*log_overwrite=True"):
        evolve(**router_kwargs(), log=str(log))
    assert log.read_bytes() == before
    evolve(**router_kwargs(), log=str(log), log_overwrite=True)
    assert log.read_bytes() != before


def test_a_chain_segment_of_another_run_is_refused_by_replay_and_resume_naming_it(tmp_path):
    logs = ROOT / "tests" / "logs"
    base, resumed = tmp_path / "resumed_after_kill.evolog", tmp_path / "resumed_after_kill.r1.evolog"
    resumed.write_bytes((logs / resumed.name).read_bytes())
    base.write_bytes((logs / base.name).read_bytes())
    assert len(log_chain(resumed)) == 2  # the recorded chain is one run
    other = read_log(base)
    base.unlink()  # another run takes the name (what --overwrite of the base would do)
    header = msgspec.structs.replace(other.header, run_id="another-run")
    with LogWriter(base, header, fsync="never") as w:
        for r in other.records:
            w.append(r.seq, r.t, r.sender, r.receiver, r.body)
    want = f"{base} belongs to run another-run, but {resumed} resumes run "
    with pytest.raises(ConfigError, match="belongs to run another-run"):
        replay(resumed)
    with pytest.raises(ConfigError) as refused:
        ResumePoint(resumed)
    assert want in str(refused.value)
    out = subprocess.run([sys.executable, "-m", "actors.cli", "replay", str(resumed)],
                         cwd=tmp_path, env=env_for("0"), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and want in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=lambda s: signal.Signals(s).name)
def test_each_stop_signal_interrupts_the_run_like_ctrl_c_and_gives_128_plus_it(signum):
    from actors.cli.progress import exit_code, interrupt_guard

    inherited = signal.getsignal(signum)
    # As run from a terminal: a test process started under nohup inherits SIGHUP
    # ignored, which the guard rightly leaves ignored (the test below).
    if inherited is signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
    try:
        before = signal.getsignal(signum)
        with pytest.raises(KeyboardInterrupt) as stopped:
            with interrupt_guard():
                os.kill(os.getpid(), signum)
                deadline = time.monotonic() + 5  # the handler runs between bytecodes
                while time.monotonic() < deadline:
                    time.sleep(0.01)
        assert exit_code(stopped.value) == 128 + signum
        assert signal.getsignal(signum) == before  # the guard puts the old handler back
    finally:
        signal.signal(signum, inherited)


def test_a_hangup_ignored_by_the_parent_stays_ignored_as_under_nohup():
    from actors.cli.progress import interrupt_guard

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with interrupt_guard():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing is raised
    finally:
        signal.signal(signal.SIGHUP, before)


def record_ends(path: Path) -> list[int]:
    """The byte offset just past each record of a log (walking the frame lengths)."""
    import struct

    data = path.read_bytes()
    frame = struct.Struct("<II")
    pos = 7 + frame.size + frame.unpack_from(data, 7)[0]  # magic, version, header frame
    ends = []
    while pos < len(data):
        pos += frame.size + frame.unpack_from(data, pos)[0]
        ends.append(pos)
    return ends


def test_under_the_default_policy_start_and_every_commit_are_fsynced_at_once(tmp_path,
                                                                            monkeypatch):
    from protocol import Commit, RoundClosed, Start

    log = tmp_path / "run.evolog"
    synced: list[int] = []  # the log's size on disk at each fsync of it
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if os.path.exists(log) and os.fstat(fd).st_ino == os.stat(log).st_ino:
            synced.append(os.fstat(fd).st_size)

    monkeypatch.delenv("EVOBUS_LOG_FSYNC", raising=False)
    monkeypatch.setattr(os, "fsync", fsync)
    evolve(**router_kwargs(rounds=3), log=str(log))
    records, ends = read_log(log).records, record_ends(log)
    durable = [i for i, r in enumerate(records)
               if isinstance(decode(r.body), (Start, Commit, RoundClosed))]
    assert len(durable) > 3 and len(records) < 256 * 2  # not the batch's doing
    for i in durable:  # fsynced with it, or with the few records delivered in its burst
        window = ends[i], ends[min(i + 8, len(ends) - 1)]
        assert any(window[0] <= size <= window[1] for size in synced), (
            f"record {i} ({type(decode(records[i].body)).__name__}, ends at byte "
            f"{ends[i]}) was not fsynced at once; fsyncs at sizes {synced}")
