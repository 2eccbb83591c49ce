"""The layers of DESIGN section 1 hold: checked by import-linter's contracts
(.importlinter) and by what importing a pure machine loads."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import actors

ROOT = Path(__file__).resolve().parent.parent


def test_importing_a_pure_machine_leaves_pykka_and_zmq_unloaded():
    code = ("import sys, actors.machines.collector, actors.machines.scheduler, "
            "actors.policies.parallelism; "
            "print(sorted(m for m in ('pykka', 'zmq', 'threading_actor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_public_names_are_listed_once_and_all_load():
    assert actors.__all__ == sorted(actors._MODULE_OF)
    for name in actors.__all__:
        assert getattr(actors, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        actors.nope  # noqa: B018


@pytest.mark.skipif(shutil.which("lint-imports") is None,
                    reason="import-linter is not installed (pip install -e '.[test]')")
def test_the_import_contracts_are_kept():
    out = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "BROKEN" not in out.stdout
