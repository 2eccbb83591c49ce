"""The router domain, slowed down, for the kill -9 + resume test (tests/test_resume.py).

``EVOBUS_TEST_ROLLOUT_DELAY`` (seconds, default 0) is how long each rollout waits, so
that a run started as a subprocess is still going when the test kills it. The wait
only slows the domain down; nothing is synchronised on it.
"""

from __future__ import annotations

import os
import time

from protocol import Task
from scenarios.router import RouterAgent


class SlowRouterAgent(RouterAgent):
    def __init__(self) -> None:
        self.delay = float(os.environ.get("EVOBUS_TEST_ROLLOUT_DELAY", "0"))

    def solve(self, rendered: str, task: Task) -> str:
        if self.delay:
            time.sleep(self.delay)
        return super().solve(rendered, task)
