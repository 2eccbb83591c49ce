"""A domain whose ``run`` fans every rollout out through ``parallel()`` (tests/
test_group_in_run.py): four branches per rollout, each appending ``PHASE group branch``
to the file ``EVOBUS_TEST_BRANCH_LOG`` names, then waiting ``EVOBUS_TEST_BRANCH_DELAY``
seconds (simulated work, so a run started as a subprocess is still going when the test
kills it; nothing is synchronised on it).
"""

from __future__ import annotations

import os
import time

from actors import parallel
from protocol import Task

CATEGORIES = ["billing", "shipping", "technical", "account"]


def tasks() -> list[Task]:
    return [Task(id=f"t{i}", prompt=f"ticket {i}", meta={"label": CATEGORIES[i % 4]})
            for i in range(8)]


def reward(task: Task, output: str) -> float:
    return 1.0 if output.startswith(task.meta["label"]) else 0.0


def score_words(word: str, ctx) -> int:
    path = os.environ.get("EVOBUS_TEST_BRANCH_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.environ.get('EVOBUS_TEST_PHASE', 'run')} {ctx.group_id} "
                    f"{ctx.branch}\n")
    delay = float(os.environ.get("EVOBUS_TEST_BRANCH_DELAY", "0"))
    if delay:
        time.sleep(delay)
    return len(word)


def run(rendered: str, task: Task) -> str:
    lengths = parallel(score_words, CATEGORIES, max_concurrency=2, max_items=4)
    return CATEGORIES[(int(task.id[1:]) + sum(lengths)) % 4]


def run_alone(rendered: str, task: Task) -> str:
    """What ``run`` returns, without the group: the same outputs, so the same scores,
    proposals and calls, but for the branches."""
    return CATEGORIES[(int(task.id[1:]) + sum(len(c) for c in CATEGORIES)) % 4]


def propose(rendered: str, task: Task, output: str, score: float) -> str | None:
    return None
