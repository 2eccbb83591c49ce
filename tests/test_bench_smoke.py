"""`python -m bench --quick` runs every benchmark and prints one table (a smoke test:
no figure is checked, the machine is shared and noisy)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)  # every benchmark once: its own subprocess bound (240 s) governs
def test_python_m_bench_quick_prints_one_table(root, clean_env):
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick"], cwd=root, env=clean_env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    header = next(line for line in out.splitlines() if line.startswith("workload"))
    for column in ("evobus", "baseline", "ratio", "agentdescent", "target"):
        assert column in header, header
    lines = out.splitlines()
    for workload in ("(1) no-op rollouts", "(2) a proposal every rollout", "(3) lognormal",
                     "(4) router", "(8) peak RSS", "(8) log bytes",
                     "(9) rate-limited endpoint"):
        rows = [line for line in lines if line.startswith(workload)]
        assert rows, f"no {workload!r} row in:\n{out}"
        # A benchmark that fails is a row saying so, never a crash of the suite.
        assert not any("failed:" in row for row in rows), "\n".join(rows)


def test_a_missing_bench_module_is_a_row_not_a_crash():
    from bench.__main__ import run_section

    rows = run_section("nothing", "bench.no_such_module", "(9) nothing", quick=True)
    assert len(rows) == 1 and "not present" in rows[0].note


def test_group_ab_compares_two_checkouts_in_alternating_processes(root, tmp_path, capsys):
    from bench import group_ab

    with pytest.raises(SystemExit, match="not a checkout of evobus"):
        group_ab.main([str(tmp_path), str(root)])
    effs = group_ab.main([str(root), str(root), "--rounds", "2", "--calls", "1", "--timeline"])
    # One key per checkout (here the same one twice: one key), a call per round each.
    assert list(effs) == [str(root)] and len(effs[str(root)]) == 4
    assert all(0 < e < 1 for e in effs[str(root)])
    out = capsys.readouterr().out
    assert "b - a:" in out and "ThreadPoolExecutor(32) beside it" in out and "load average" in out
    assert "32 bare threads" in out and "CPU per item" in out and "32 warm threads" in out
    assert "efficiency against the measured sleep" in out and "ramp" in out
    rows = group_ab.main([str(root), str(root), "--slots", "--rounds", "1", "--calls", "1"])
    assert len(rows[str(root)]) == 2   # (the same checkout twice: one key)
    call = rows[str(root)][0]
    assert abs(sum(call["share"].values()) - 1) < 1e-9 and 0 < call["share"]["sleep (5 ms each)"] < 1
    assert call["count"]["answers"] >= 1 and "turn waits" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_noisy_learning_curves_quick_prints_quality_per_call(root, clean_env):
    """`python -m bench.learning --noisy --quick`: the router domain at 500 calls, one
    seed, each library through the same counting wrapper (a library not installed is
    a cell saying so)."""
    proc = subprocess.run([sys.executable, "-m", "bench.learning", "--noisy", "--quick"],
                          cwd=root, env=clean_env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    header, _, row = proc.stdout.splitlines()[:3]
    for column in ("budget", "evobus", "agentdescent", "gepa"):
        assert column in header, header
    assert row.startswith("router (AppendRules)"), row
    # Every cell that ran spent its budget: at most 500 calls, and all but the few still
    # in flight when the wrapper stopped answering (evobus stops at a round's edge).
    spent = [int(n) for n in re.findall(r"@ (\d+)", row)]
    assert spent and all(450 <= n <= 500 for n in spent), row
