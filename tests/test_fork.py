"""`evobus resume LOG --from-version N [--scenario FILE]`: a new run, with a new log,
from the artifact the old run committed as version N and what it had spent by then."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from actors.cli.learned import learned_from
from actors.replay.chain import read_chain
from actors.cli.main import main
from actors.replay.verify import replay_log
from bus.log import read_header

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def finished(root, tmp_path, clean_env):
    log = tmp_path / "a.evolog"
    done = subprocess.run([sys.executable, "-m", "actors.cli", "run",
                           str(root / "scenarios" / "router.toml"), "--quiet", "--log",
                           str(log)], cwd=tmp_path, env=clean_env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return log


def test_a_fork_starts_a_new_run_from_the_artifact_at_version_n(finished, capsys):
    v1 = learned_from(read_chain(finished)).at(1)
    assert main(["resume", str(finished), "--from-version", "1", "--json"]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out)   # stdout is the JSON alone
    # The fork's rounds count from v0 again: its first line says so.
    assert f"into {finished.with_name('a.fork-v1.evolog')}, a run of its own: its versions " \
           "count from v0, the old run's v1" in out.err
    fork = finished.with_name("a.fork-v1.evolog")
    assert summary["log"] == str(fork) and summary["from_version"] == 1
    assert summary["spent"] == {"rounds": 1, "rollouts": v1.rollouts, "calls": v1.calls}
    header = read_header(fork)
    assert header.run_id != read_header(finished).run_id
    assert header.meta["forked_from"] == "a.evolog"
    assert header.meta["forked_from_version"] == "1"
    forked = learned_from(read_chain(fork))
    assert forked.at(0).state == v1.state   # the fork's v0 is the old run's v1
    assert forked.at(0).heldout == pytest.approx(v1.heldout)
    assert summary["final_reward"] >= v1.heldout
    assert replay_log(fork).ok   # a run of its own: it replays alone


def test_a_fork_counts_what_was_spent_against_the_budgets(finished, tmp_path, capsys):
    scenario = tmp_path / "tight.toml"
    v1 = learned_from(read_chain(finished)).at(1)
    toml = read_header(finished).meta["scenario_toml"]   # with a cap v1 had reached
    scenario.write_text(toml.replace("[budgets]", f"[budgets]\nmax_rollouts = {v1.rollouts}")
                        if "[budgets]" in toml else
                        toml + f"\n[budgets]\nmax_rollouts = {v1.rollouts}\n")
    assert main(["resume", str(finished), "--from-version", "1", "--scenario",
                 str(scenario)]) == 2
    err = capsys.readouterr().err
    assert f"max_rollouts = {v1.rollouts} was spent by v1" in err


def test_a_fork_from_a_version_the_log_does_not_hold_lists_its_versions(finished, capsys):
    held = [v.version for v in learned_from(read_chain(finished)).versions]
    assert held[0] == 0 and len(held) > 2
    beyond = held[-1] + 1
    assert main(["resume", str(finished), "--from-version", str(beyond)]) == 2
    assert f"its versions: {', '.join(map(str, held))}" in capsys.readouterr().err


def test_scenario_without_from_version_is_refused(finished, tmp_path, capsys):
    assert main(["resume", str(finished), "--scenario", str(tmp_path / "x.toml")]) == 2
    assert "--scenario only applies to a fork" in capsys.readouterr().err
