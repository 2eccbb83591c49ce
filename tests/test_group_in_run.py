"""A parallel group started inside an evolve() run (issue 17): it runs on the run's
runtime and in its log, its branch starts count against the run's max_calls, replay
verifies its Collector, and a resumed run does not redo the branches its log had
finished. Deterministic: the subprocess is killed once its log holds finished branches
(a bounded wait on the log's records); the only sleeps are the domain's simulated work.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors import evolve
from actors.replay.verify import replay_log
from bus.log import read_log
from protocol import BranchDone, GroupStart, decode
from tests import group_run_domain as domain

ROOT = Path(__file__).resolve().parent.parent
WAIT = 60.0

pytestmark = pytest.mark.timeout(120)


def _kwargs(**kw):
    return {**dict(tasks=domain.tasks(), reward=domain.reward, run=domain.run,
                   propose=domain.propose, rounds=2, n_workers=2), **kw}


def _group_messages(path: Path):
    return [(r, decode(r.body)) for r in read_log(path).records
            if r.receiver.startswith("collector.") or r.sender.startswith("collector.")]


def test_a_group_in_a_rollout_runs_in_the_runs_log_and_counts_against_its_calls(tmp_path):
    log = tmp_path / "run.evolog"
    result = evolve(**_kwargs(log=str(log), max_calls=10_000))
    assert result.error is None
    # Every call of run fanned out through parallel() once: its 4 branches are counted
    # on top of what the same run makes without the group, for rollouts and held-out
    # scoring alike.
    alone = evolve(**_kwargs(run=domain.run_alone, max_calls=10_000))
    assert (result.rollouts, result.rendered) == (alone.rollouts, alone.rendered)
    assert result.calls == alone.calls + 4 * result.rollouts
    assert result.stats["scoring_calls"] > alone.stats["scoring_calls"]
    starts = [m for _, m in _group_messages(log) if isinstance(m, GroupStart)]
    assert len(starts) >= result.rollouts          # rollouts, plus held-out scoring
    report = replay_log(str(log))
    assert report.ok, report
    assert all(f"collector.{s.group_id}" in report.actors for s in starts)
    out = subprocess.run([sys.executable, "-m", "actors.cli", "replay", str(log)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout + out.stderr


def test_the_runs_max_calls_stops_a_group_inside_it_as_an_error_of_the_group():
    # Held-out scoring counts in max_calls too (docs/budgets.md): the baseline's 3 calls
    # and their groups' 12 branches take 15, so 20 leaves the rollouts' groups short.
    result = evolve(**_kwargs(max_calls=20, rounds=3))
    # Branch starts refused by the budget fail the group; the rollout reports it.
    assert "BudgetExhausted" in (result.error or "")
    assert "max_calls (20) is used up" in result.error


def _records_with_finished_branches(path: Path) -> int:
    try:
        records = read_log(path, repair=False).records
    except Exception:   # still being written: read again on the next look
        return 0
    return sum(1 for r in records if r.receiver.startswith("collector.")
               and isinstance(decode(r.body), BranchDone) and decode(r.body).indices)


@pytest.mark.slow
def test_kill_9_then_evobus_resume_does_not_redo_the_branches_a_group_had_finished(tmp_path):
    scenario = tmp_path / "fanout.toml"
    scenario.write_text(
        'name = "fanout"\nrounds = 3\nseed = 0\nheld_out_frac = 0.4\nlog = "run.evolog"\n\n'
        '[domain]\ntasks = "tests.group_run_domain:tasks"\n'
        'reward = "tests.group_run_domain:reward"\nrun = "tests.group_run_domain:run"\n'
        'propose = "tests.group_run_domain:propose"\n\n[strategy]\nkind = "KeyedRules"\n'
        'categories = ["billing", "shipping", "technical", "account"]\n\n'
        '[workers]\nlocal = 2\n')
    branches = tmp_path / "branches.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), env_path()]),
               EVOBUS_LOG_FSYNC="always", EVOBUS_TEST_BRANCH_LOG=str(branches),
               EVOBUS_TEST_BRANCH_DELAY="0.05", EVOBUS_TEST_PHASE="first")
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "run", str(scenario),
                             "--quiet"], cwd=tmp_path, env=env)
    log = tmp_path / "run.evolog"
    deadline = time.monotonic() + WAIT
    try:
        while _records_with_finished_branches(log) < 6:
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no finished branches in the log in time"
            time.sleep(0.05)   # polling another process's file: bounded by the deadline
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT)
    finished = {(m.group_id, i) for r, m in _group_messages(log)
                if isinstance(m, BranchDone) for i in m.indices}
    assert finished
    env["EVOBUS_TEST_PHASE"] = "resume"
    out = subprocess.run([sys.executable, "-m", "actors.cli", "resume", str(log), "--quiet"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=WAIT)
    assert out.returncode == 0, out.stdout + out.stderr
    again = {(g, int(b)) for phase, g, b in
             (line.split() for line in branches.read_text().splitlines()) if phase == "resume"}
    assert again, "the resumed run ran no branch"
    assert not finished & again, f"finished branches ran again: {sorted(finished & again)}"
    resumed = tmp_path / "run.r1.evolog"
    restarted = [m for _, m in _group_messages(resumed)
                 if isinstance(m, GroupStart) and m.finished]
    assert restarted, "no group of a re-dispatched rollout kept its finished branches"
    replay = subprocess.run([sys.executable, "-m", "actors.cli", "replay", str(resumed)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert replay.returncode == 0, replay.stdout + replay.stderr


def env_path() -> str:
    return os.environ.get("PYTHONPATH", "")


def test_a_group_awaited_with_parallel_async_in_an_async_run_is_part_of_the_run(tmp_path):
    from actors import parallel_async

    async def run(rendered: str, task) -> str:
        sizes = await parallel_async(domain.score_words, domain.CATEGORIES,
                                     max_concurrency=2, max_items=4)
        return domain.CATEGORIES[(int(task.id[1:]) + sum(sizes)) % 4]   # as domain.run

    log = tmp_path / "run.evolog"
    result = evolve(**_kwargs(run=run, log=str(log), max_calls=10_000))
    alone = evolve(**_kwargs(run=domain.run_alone, max_calls=10_000))
    assert result.error is None
    assert result.calls == alone.calls + 4 * result.rollouts   # the branches were counted
    assert replay_log(str(log)).ok


def test_groups_in_one_lease_in_a_run_count_its_calls_land_in_its_log_and_replay(
        tmp_path, monkeypatch):
    """The same, with the branch target taken as measured cheap (held so: each group
    would measure it again): every group goes in one lease to one worker, and its
    branches still count against the run's calls, its messages are in the run's log,
    replay verifies them, and max_calls still stops a group as its error."""
    from actors.groups import driver, target

    facts = target._facts_of(domain.score_words)
    before, facts[3] = facts[3], 1e-6   # seconds a branch
    monkeypatch.setattr(driver, "_remember", lambda fn, seconds: None)
    try:
        _one_lease_in_a_run(tmp_path)
    finally:
        facts[3] = before


def _one_lease_in_a_run(tmp_path):
    log = tmp_path / "run.evolog"
    result = evolve(**_kwargs(log=str(log), max_calls=10_000))
    assert result.error is None
    alone = evolve(**_kwargs(run=domain.run_alone, max_calls=10_000))
    assert result.calls == alone.calls + 4 * result.rollouts
    starts = [m for _, m in _group_messages(log) if isinstance(m, GroupStart)]
    assert len(starts) >= result.rollouts
    assert all(len(s.workers) == 1 and s.chunk == 4 and not s.ordered for s in starts)
    report = replay_log(str(log))
    assert report.ok, report
    stopped = evolve(**_kwargs(max_calls=20, rounds=3))
    assert "max_calls (20) is used up" in (stopped.error or "")
