"""Targets for groups on process and remote workers (tests/test_remote_groups.py): named
by import path, so a worker in another process imports them (``--allow tests``)."""

from __future__ import annotations

import os
import time

from actors.errors import ConfigError
from actors.groups import parallel


def square(x: int) -> int:
    return x * x


def slow_square(x: int) -> int:
    time.sleep(0.05)
    return x * x


def _append(path: str, line: str) -> int:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    return 1


def counted(item: dict, ctx) -> int:
    """One effect per item (a line in ``item["log"]``). With EVOBUS_TEST_HANG=1, the first
    worker to run branch ``item["hang_at"]`` writes its pid into ``item["marker"]`` after
    the effect (journaled with the coordinator) and hangs there: the test kills it."""
    ctx.effect("count", _append, item["log"], f"{item['i']}")
    if item.get("hang_at") == item["i"] and os.environ.get("EVOBUS_TEST_HANG") == "1":
        try:
            fd = os.open(item["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:   # run again elsewhere: go on
            pass
        else:
            os.write(fd, f"{os.getpid()}\n".encode())
            os.close(fd)
            time.sleep(60)   # killed meanwhile (the test's SIGKILL)
    ctx.store.incr("done")
    return item["i"] * 10


def asking(item: int, ctx) -> str:
    """Branch 1 asks a question; the others answer at once."""
    if item == 1:
        answer = ctx.ask(f"what for {item}?")
        return f"{item}:{answer}"
    return f"{item}:auto"


def fails_first(x: int, ctx) -> int:
    """Branch 0 raises; the others wait (bounded) until the group is cancelled."""
    if x == 0:
        raise ValueError("item 0 is bad")
    for _ in range(6000):  # 60 s unless cancelled: far past any startup on a loaded machine
        ctx.raise_if_cancelled()
        time.sleep(0.01)
    return x


def spends(x: int, ctx) -> int:
    ctx.spend(1.0)
    return x


def dies_once(item: dict) -> int:
    """The first process to run branch ``item["die_at"]`` exits hard (as a crash does)."""
    if item["i"] == item.get("die_at"):
        try:
            fd = os.open(item["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.close(fd)
            os._exit(9)
    return item["i"]


def _first_here(marker: str) -> bool:
    """True in the first process to get here for ``marker`` (it writes its pid there)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:   # run again elsewhere: go on
        return False
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    return True


def tallied(item: dict, ctx) -> int:
    """Store writes before and after the moment a worker may die: ``ctx.store.incr`` of
    "before" and a ``set`` of this branch's key, then, in the first process to run branch
    ``item["hang_at"]``, a hang (the test kills it with SIGKILL) or, with ``item["exit"]``,
    a hard exit; then "after"."""
    ctx.store.incr("before")
    ctx.store.set(f"b{item['i']}", ctx.store.incr("seen"))
    if item.get("hang_at") == item["i"] and _first_here(item["marker"]):
        if item.get("exit"):
            os._exit(9)
        time.sleep(60)   # killed meanwhile
    ctx.store.incr("after", 2)
    return item["i"]


def gated(item: dict) -> int:
    """Says it started (a file ``started-I`` holding its pid), then waits (bounded) for
    the file ``go`` in ``item["dir"]``."""
    here = os.path.join(item["dir"], f"started-{item['i']}")
    with open(here, "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    go = os.path.join(item["dir"], "go")
    for _ in range(6000):   # 60 s at most
        if os.path.exists(go):
            break
        time.sleep(0.01)
    return item["i"]


def inner(x: int, ctx) -> int:
    """A nested group's branch: one effect (a line in the log file named by the store's
    "log" key, when set) and one store write."""
    path = ctx.store.get("log")
    if path:
        ctx.effect("inner", _append, path, f"{ctx.group_id}:{x}")
    ctx.store.incr("inner")
    return x * x


def fans_out(item: dict, ctx) -> int:
    """A branch on a worker elsewhere that starts a nested group of three (run by the
    coordinator); the first process to run branch ``item["hang_at"]`` hangs after it
    (the test kills it), so the branch and its nested group run again elsewhere."""
    i = item["i"]
    squares = ctx.parallel(inner, [3 * i, 3 * i + 1, 3 * i + 2], max_concurrency=2,
                           max_items=3, **item.get("options", {}))
    if item.get("hang_at") == i and _first_here(item["marker"]):
        time.sleep(60)   # killed meanwhile
    ctx.store.incr("outer")
    return sum(squares)


def nested_outcome(item: str, ctx) -> dict:
    """ctx.run_group on a worker elsewhere: the nested group's outcome, as data ("fails"),
    or the refusal of an option that cannot travel ("refused") or of a nested group not
    started through ctx ("plain")."""
    if item in ("refused", "plain"):
        try:
            if item == "plain":   # not through ctx: no branch names the nested group
                parallel(square, [1], max_concurrency=1, max_items=1)
            else:
                ctx.parallel(square, [1], max_concurrency=1, max_items=1, log_overwrite=True)
        except ConfigError as exc:
            return {"refused": str(exc)}
        return {"refused": ""}
    out = ctx.run_group("tests.group_remote_domain:fails_on_two", [0, 1, 2, 3],
                        max_concurrency=2, max_items=4)
    return {"status": out.status, "error": type(out.error).__name__,
            "error_branch": out.error_branch, "finished": out.finished}


def fails_on_two(x: int) -> int:
    if x == 2:
        raise KeyError("two")
    return x


def stamped(item: dict) -> int:
    """Writes ``i`` as one line of ``item["log"]`` as it starts (one O_APPEND write, in
    whichever process runs it), then works ``item["ms"]`` milliseconds."""
    fd = os.open(item["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{item['i']}\n".encode())
    finally:
        os.close(fd)
    time.sleep(item["ms"] / 1000)   # simulated work, not synchronisation
    return item["i"]
