"""Resume: rebuild every control actor from the log of a crashed run and go on
(DESIGN section 5). The final artifact equals an uninterrupted run's; work
whose result is in the log is never done again; consumed budgets stay consumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from actors import DataParallel, KeyedRules, evolve
from actors.replay.verify import replay_log
from actors.replay.resume import ResumePoint, next_log_path, resume
from actors.testing import replay
from bus.log import LogWriter, TornTailWarning, read_log
from protocol import Lease, LeaseDone, RunDone, decode
from scenarios import router

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent


def router_kwargs(**extra):
    kw = dict(tasks=router.tasks(), reward=router.reward, run=router.run,
              propose=router.propose, strategy=KeyedRules(router.CATEGORIES), rounds=2,
              n_workers=4, seed=0, bus="memory", parallel=DataParallel(),
              conflicts="score", chain=False)   # each variant scored, one edit a proposal:
                                                # a run long enough to cut anywhere
    kw.update(extra)
    return kw


def cut(src: Path, dst: Path, keep: int) -> Path:
    """What a kill -9 with fsync="always" leaves: the first ``keep`` records."""
    contents = read_log(src)
    with LogWriter(dst, contents.header, fsync="never") as w:
        for r in contents.records[:keep]:
            w.append(r.seq, r.t, r.sender, r.receiver, r.body)
    return dst


def answered_rollouts(path: Path) -> set[str]:
    return {m.lease_id for r in read_log(path).records
            if r.receiver == "scheduler" and isinstance(m := decode(r.body), LeaseDone)
            and m.kind == "rollout"}


def dispatched_rollouts(path: Path) -> list[str]:
    return [m.lease_id for r in read_log(path).records
            if r.sender == "scheduler" and isinstance(m := decode(r.body), Lease)
            and m.kind == "rollout"]


def before_the_result(path: Path) -> int:
    """How many records precede the RunDone (a cut after it is a finished run)."""
    return next(i for i, r in enumerate(read_log(path).records)
                if isinstance(decode(r.body), RunDone))


def same_run(a, b) -> None:
    assert a.state == b.state
    assert (a.version, a.final_reward, a.stop_reason) == (b.version, b.final_reward,
                                                           b.stop_reason)
    assert (a.rollouts, a.calls) == (b.rollouts, b.calls)
    assert a.outcomes() == b.outcomes()
    assert [(h.round, h.version, h.committed, h.heldout_reward, h.rollouts)
            for h in a.history] == [(h.round, h.version, h.committed, h.heldout_reward,
                                     h.rollouts) for h in b.history]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("full") / "full.evolog"
    result = evolve(**router_kwargs(), log=str(path))
    return path, result


# --- resuming from any point ------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_resuming_a_cut_chained_run_gives_the_uninterrupted_result(tmp_path, fraction):
    full_path = tmp_path / "full.evolog"
    full = evolve(**router_kwargs(chain=True), log=str(full_path))
    killed = cut(full_path, tmp_path / "run.evolog",
                 max(1, int(before_the_result(full_path) * fraction)))
    result = resume(ResumePoint(killed), **router_kwargs(chain=True))
    same_run(result, full)
    assert not answered_rollouts(killed) & set(dispatched_rollouts(Path(result.log_path)))
    assert all(lease.chain for lease in map(decode, (
        r.body for r in read_log(Path(result.log_path)).records))
        if isinstance(lease, Lease) and lease.kind == "rollout")


@pytest.mark.parametrize("fraction", [0.02, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.98])
def test_resuming_a_cut_log_gives_the_uninterrupted_result(full_run, tmp_path, fraction):
    full_path, full = full_run
    n = before_the_result(full_path)
    killed = cut(full_path, tmp_path / "run.evolog", max(1, int(n * fraction)))
    point = ResumePoint(killed)
    result = resume(point, **router_kwargs())
    same_run(result, full)
    new_log = Path(result.log_path)
    assert new_log == tmp_path / "run.r1.evolog"
    # Never redo a rollout whose result is in the log; every in-flight lease is re-issued
    # under its original id.
    done_before = answered_rollouts(killed)
    again = dispatched_rollouts(new_log)
    assert not done_before & set(again)
    for lease_id in point.reissued:
        assert lease_id in again or lease_id.startswith("e"), (lease_id, again)
    # The chain replays: the re-sent messages are exactly what the crash left undelivered.
    report = replay(new_log)
    assert len(report.segments) == 2 and len(report.resent) == len(point.pending)
    # Sequence numbers go on where the old log stopped.
    assert read_log(new_log).records[0].seq == read_log(killed).records[-1].seq + 1


def test_eval_leases_in_flight_are_reissued_under_their_ids(full_run, tmp_path):
    full_path, full = full_run
    records = read_log(full_path).records
    # Cut right after the first eval chunk of a round's merge went out.
    first_eval = next(i for i, r in enumerate(records)
                      if r.sender == "scheduler" and isinstance(m := decode(r.body), Lease)
                      and m.kind == "eval" and m.lease_id != "e1.0")
    killed = cut(full_path, tmp_path / "run.evolog", first_eval + 1)
    point = ResumePoint(killed)
    same_run(resume(point, **router_kwargs()), full)
    lease = decode(records[first_eval].body)
    assert lease.lease_id in point.reissued


def test_scheduler_reopen_forgets_workers_and_requeues_held_leases_evals_first():
    from actors.machines.scheduler import Scheduler
    from protocol import EvalRequest, Hello, LeaseBatch

    s = Scheduler(3)
    s.handle(Hello(worker="w0"))
    s.handle(Hello(worker="w1"))
    s.handle(LeaseBatch(round=0, leases=[Lease(lease_id=f"r0.u{u}", round=0, unit=u,
                                               task_ids=[f"t{u}"]) for u in range(4)]))
    s.handle(EvalRequest(eval_id="e1", state={}, task_ids=["h0"]))  # queued: workers busy
    assert sorted(s.holder) == ["r0.u0", "r0.u1"]
    assert [q.lease_id for q in s.queue] == ["e1.0", "r0.u2", "r0.u3"]
    assert s.reopen() == ["r0.u0", "r0.u1"]
    assert [q.lease_id for q in s.queue] == ["e1.0", "r0.u0", "r0.u1", "r0.u2", "r0.u3"]
    assert not s.workers and not s.holder and s.running == 0
    # New workers (one lease each) take them under the same ids, the eval first.
    out = s.handle(Hello(worker="n0")) + s.handle(Hello(worker="n1"))
    assert [(to, m.lease_id) for to, m in out if isinstance(m, Lease)] == \
        [("n0", "e1.0"), ("n1", "r0.u0")]


def test_a_resumed_run_that_crashes_again_resumes_from_the_chain(full_run, tmp_path):
    full_path, full = full_run
    n = len(read_log(full_path).records)
    first = cut(full_path, tmp_path / "run.evolog", n // 3)
    r1 = Path(resume(first, **router_kwargs()).log_path)
    # Crash the resumed run too, half-way through what it logged.
    r1_records = read_log(r1).records
    crashed = cut(r1, tmp_path / "run.r1.evolog.tmp", len(r1_records) // 2)
    os.replace(crashed, r1)
    result = resume(r1, **router_kwargs())
    assert Path(result.log_path) == tmp_path / "run.r2.evolog"
    same_run(result, full)
    report = replay(result.log_path)
    assert [p.name for p in report.segments] == ["run.evolog", "run.r1.evolog",
                                                 "run.r2.evolog"]


def test_a_torn_tail_is_cut_on_disk_before_resuming(full_run, tmp_path):
    full_path, full = full_run
    n = len(read_log(full_path).records)
    killed = cut(full_path, tmp_path / "run.evolog", n // 2)
    whole = killed.stat().st_size
    with open(killed, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02\x03\x04half a record")
    with pytest.warns(TornTailWarning, match="truncated"):
        point = ResumePoint(killed)
    assert killed.stat().st_size == whole and point.dropped_records == 1
    same_run(resume(point, **router_kwargs()), full)


def test_consumed_budgets_stay_consumed(tmp_path):
    kw = router_kwargs(rounds=50, max_rollouts=100)
    full = evolve(**kw, log=str(tmp_path / "full.evolog"))
    assert full.stop_reason == "max_rollouts" and full.rollouts == 100
    n = len(read_log(tmp_path / "full.evolog").records)
    killed = cut(tmp_path / "full.evolog", tmp_path / "run.evolog", n // 2)
    result = resume(killed, **kw)
    same_run(result, full)
    assert result.rollouts == 100


@pytest.mark.parametrize("fraction", [0.15, 0.5, 0.85])
def test_an_asynchronous_run_resumes_and_keeps_its_rollout_budget(tmp_path, fraction):
    kw = router_kwargs(asynchronous=True, max_rollouts=120, rounds=None)
    evolve(**kw, log=str(tmp_path / "full.evolog"))
    n = len(read_log(tmp_path / "full.evolog").records)
    killed = cut(tmp_path / "full.evolog", tmp_path / "run.evolog", int(n * fraction))
    result = resume(killed, **kw)
    # Async merges depend on arrival order, so the artifact may differ from the
    # uninterrupted run's; the budget may not.
    assert result.stop_reason == "max_rollouts" and result.rollouts == 120
    assert not answered_rollouts(killed) & set(dispatched_rollouts(result.log_path))
    replay(result.log_path)


def test_a_finished_run_is_not_run_again(full_run, tmp_path):
    full_path, full = full_run
    result = resume(full_path, **router_kwargs())
    assert result.state == full.state and result.rollouts == full.rollouts
    assert not next_log_path(full_path).exists()


def test_a_log_killed_before_the_run_began_starts_it_again(full_run, tmp_path):
    full_path, full = full_run
    records = read_log(full_path).records
    before_start = next(i for i, r in enumerate(records) if r.sender == "driver")
    killed = cut(full_path, tmp_path / "run.evolog", before_start)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = resume(killed, **router_kwargs())
    same_run(result, full)
    meta = read_log(result.log_path).header.meta
    assert "resumed_from" not in meta and meta["restarted_from"] == "run.evolog"
    assert replay_log(result.log_path).ok


def test_next_log_path_numbers_the_chain(tmp_path):
    assert next_log_path(tmp_path / "a.evolog") == tmp_path / "a.r1.evolog"
    assert next_log_path(tmp_path / "a.r1.evolog") == tmp_path / "a.r2.evolog"
    (tmp_path / "a.r2.evolog").touch()
    assert next_log_path(tmp_path / "a.r1.evolog") == tmp_path / "a.r3.evolog"


def test_resuming_a_log_that_does_not_replay_is_refused(full_run, tmp_path):
    from actors.errors import RunFailed
    from actors.policies.parallelism import TensorParallel

    full_path, _ = full_run
    n = len(read_log(full_path).records)
    killed = cut(full_path, tmp_path / "run.evolog", n // 2)
    with pytest.raises(RunFailed, match="do not reproduce the log"):
        resume(killed, **router_kwargs(parallel=TensorParallel(4)))


# --- kill -9 as a real subprocess --------------------------------------------------------

SLOW_SCENARIO = """
name = "slow-router"
rounds = 12
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


def wait_for_seq(path: Path, seq: int, proc: subprocess.Popen, deadline_s: float) -> int:
    """Poll the growing log until it holds a record with ``seq`` (bounded)."""
    deadline = time.monotonic() + deadline_s
    last = 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before seq {seq}; "
                                 f"it reached {last}: {proc.stderr.read().decode()[-2000:]}")
        if path.exists():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TornTailWarning)  # it is being written
                try:
                    records = read_log(path).records
                except Exception:  # noqa: BLE001 - header not written yet: poll again
                    records = []
            if records:
                last = records[-1].seq
                if last >= seq:
                    return last
        time.sleep(0.01)  # polling period, not a synchronisation
    raise AssertionError(f"{path} did not reach seq {seq} within {deadline_s} s (at {last})")


def test_kill_9_mid_run_then_evobus_resume_gives_the_uninterrupted_artifact(tmp_path):
    from actors.runtime.launch import run_scenario
    from protocol.scenario import parse_scenario

    log = tmp_path / "run.evolog"
    scenario = tmp_path / "slow.toml"
    scenario.write_text(SLOW_SCENARIO.format(log=log))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                         env.get("PYTHONPATH", "")])
    env["EVOBUS_LOG_FSYNC"] = "always"  # every record the broker logged is on disk
    env["EVOBUS_TEST_ROLLOUT_DELAY"] = "0.004"
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "run", str(scenario),
                             "--quiet"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        reached = wait_for_seq(log, 60, proc, deadline_s=30)   # of ~216: mid-run
        proc.kill()  # SIGKILL: no cleanup, no flush, no goodbye
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -9
    killed = read_log(log, repair=False)
    assert not any(isinstance(decode(r.body), RunDone) for r in killed.records), (
        "the run finished before the kill: raise EVOBUS_TEST_ROLLOUT_DELAY")
    assert killed.records[-1].seq >= reached

    done = subprocess.run([sys.executable, "-m", "actors.cli", "resume", str(log), "--json"],
                          cwd=tmp_path, env=env, capture_output=True, timeout=45)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    resumed = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert resumed["resumed"] == str(log) and not resumed["already_finished"]

    text = SLOW_SCENARIO.format(log=tmp_path / "whole.evolog")
    whole = run_scenario(parse_scenario(text, "slow.toml"))
    assert resumed["state"] == whole.state
    assert (resumed["version"], resumed["final_reward"]) == (whole.version,
                                                             whole.final_reward)
    assert (resumed["rollouts"], resumed["calls"]) == (whole.rollouts, whole.calls)
    assert resumed["outcomes"] == whole.outcomes()

    new_log = Path(resumed["log"])
    assert new_log.name == "run.r1.evolog"
    # The repaired old log and the new one number the run's messages without a gap.
    assert read_log(new_log).records[0].seq == read_log(log).records[-1].seq + 1
    assert not answered_rollouts(log) & set(dispatched_rollouts(new_log))
    report = replay(new_log)  # standalone: the scenario is in the header
    assert len(report.segments) == 2
