"""The router domain (scenarios/router.py) with a gate, for tests/test_remote.py.

When ``$EVOBUS_TEST_GATE`` names a directory, the first rollout of each process writes
``started-PID`` there and then waits (at most ``$EVOBUS_TEST_GATE_S`` seconds, default
20) until a file named ``release`` appears. A test can therefore find a worker
*mid-lease* without racing it (kill -9 it, or SIGSTOP it), then let the others go.
When ``$EVOBUS_TEST_DIE`` is set, a process worker (a child of the coordinator) exits
with code 3 on its first rollout, however often it is started again.
Everything else is the deterministic router, so the final artifact can be compared
with a run on threads.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

from protocol import Task
from scenarios import router

_lock = threading.Lock()
_gated = False


def tasks() -> list[Task]:
    return router.tasks()


def reward(task: Task, output: str) -> float:
    return router.reward(task, output)


def propose(rendered: str, task: Task, output: str, score: float) -> str | None:
    return router.propose(rendered, task, output, score)


def run(rendered: str, task: Task) -> str:
    global _gated
    if os.environ.get("EVOBUS_TEST_DIE") and multiprocessing.parent_process() is not None:
        os._exit(3)  # a process worker that dies on its first rollout, every time
    gate = os.environ.get("EVOBUS_TEST_GATE")
    if gate:
        with _lock:
            first, _gated = not _gated, True
        if first:
            with open(os.path.join(gate, f"started-{os.getpid()}"), "w") as f:
                f.write(task.id)
            end = time.monotonic() + float(os.environ.get("EVOBUS_TEST_GATE_S", "20"))
            release = os.path.join(gate, "release")
            # A rollout that waits on the outside world: the lease a test kills or stops.
            while not os.path.exists(release) and time.monotonic() < end:
                time.sleep(0.005)
    return router.run(rendered, task)
