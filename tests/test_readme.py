"""The README's two opening commands work (DESIGN: every README command is run by a test)."""

from __future__ import annotations

import re
import subprocess

import pytest


def readme_commands(root) -> list[str]:
    text = (root / "README.md").read_text()
    return re.findall(r"^\$ (.+)$", text, re.MULTILINE)


def test_readme_opens_with_a_setup_and_run_command_then_a_test_command(root):
    commands = readme_commands(root)
    assert commands[0].startswith("pip install -e ") and "evobus run scenarios/" in commands[0]
    assert commands[1] == "python -m pytest -q"


@pytest.mark.timeout(300)
def test_the_readme_main_job_runs_and_learns(root, tmp_path):
    # The log goes to the test's own directory, so the test leaves nothing in the checkout
    # (without --log, each run of the README's command writes runs/router-DATE-TIME.evolog).
    command = readme_commands(root)[0] + f" --log {tmp_path / 'router.evolog'}"
    out = subprocess.run(command, shell=True, cwd=root, capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "held-out reward 0.000 -> 1.000" in out.stdout
    assert "## billing" in out.stdout


def test_the_readme_test_command_collects_the_suite(root):
    command = readme_commands(root)[1] + " --collect-only"
    out = subprocess.run(command, shell=True, cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-2000:]
    count = int(re.search(r"(\d+) tests? collected", out.stdout).group(1))
    assert count > 50
