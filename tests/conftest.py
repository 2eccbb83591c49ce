"""Shared fixtures. Seeds are visible in test ids; every wait is bounded."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def router_kwargs():
    """evolve() keyword arguments for the offline router domain."""
    from actors import KeyedRules
    from scenarios import router

    return dict(tasks=router.tasks(), reward=router.reward, run=router.run,
                propose=router.propose, strategy=KeyedRules(router.CATEGORIES))


@pytest.fixture
def clean_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env
