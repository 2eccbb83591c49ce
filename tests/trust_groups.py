"""Group targets named by import path, for tests/test_trust.py (checkpoints, effects)."""

from __future__ import annotations

import os
import time


def ask_odd(i, ctx) -> object:
    """Odd items ask a question (the group pauses); even ones finish at once."""
    if i % 2:
        return f"{i}: {ctx.ask(f'question {i}')}"
    return f"{i}: even"


def ask_odd_reordered(i, ctx) -> object:
    """ask_odd with its steps in another order: a different target."""
    if not i % 2:
        return f"{i}: even"
    return f"{i}: {ctx.ask(f'question {i}')}"


def ask_then_check(i, ctx) -> object:
    """Odd items ask; the answer "boom" makes the branch raise (a failed resume)."""
    if i % 2:
        answer = ctx.ask(f"question {i}")
        if answer == "boom":
            raise ValueError(f"branch {i} got {answer!r}")
        return f"{i}: {answer}"
    return f"{i}: even"


def _count(path: str, i: int) -> int:
    """An external effect that can be counted: one line per run, on disk at once."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{i}\n")
        f.flush()
        os.fsync(f.fileno())
    return i


def _hold(i: int) -> None:
    """``$EVOBUS_TEST_HOLD`` = ``DIR:INDEX``: branch INDEX, its effect done, writes
    DIR/held and waits (at most 30 s) for DIR/release: a test kills the process there."""
    hold = os.environ.get("EVOBUS_TEST_HOLD")
    if not hold:
        return
    where, at = hold.rsplit(":", 1)
    if i != int(at):
        return
    with open(os.path.join(where, "held"), "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    end = time.monotonic() + 30
    while not os.path.exists(os.path.join(where, "release")) and time.monotonic() < end:
        time.sleep(0.01)


def counted(i, ctx) -> object:
    """Branch 0 asks first (the group pauses); every branch runs one counted effect."""
    if i == 0:
        ctx.ask("go?")
    ctx.effect("count", _count, os.environ["EVOBUS_TEST_COUNT"], i)
    _hold(i)
    return i * 10


def counted_quiet(i, ctx) -> object:
    """``counted`` without the question: a group that never pauses."""
    ctx.effect("count", _count, os.environ["EVOBUS_TEST_COUNT"], i)
    _hold(i)
    return i * 10


def big_effect_then_ask(i, ctx) -> object:
    """An effect returning 20 MB, then a question: the pause would not fit a message."""
    ctx.effect("fetch", lambda: b"x" * (20 * 1024 * 1024))
    return ctx.ask("and now?")


def _nested_effect(item, ctx) -> object:
    """A nested group's branch: one counted effect (key ``10 * i + j``), then the hold."""
    i, j = item
    key = 10 * i + j
    ctx.effect("count", _count, os.environ["EVOBUS_TEST_COUNT"], key)
    _hold(key)
    return key


def nested_counted(i, ctx) -> object:
    """Each branch starts a nested group of three branches, each with a counted effect."""
    return sum(ctx.parallel(_nested_effect, [[i, j] for j in range(3)], max_concurrency=1,
                            max_items=3))


def nested_counted_then_ask(i, ctx) -> object:
    """nested_counted, then a question: the group pauses after the nested effects ran."""
    total = nested_counted(i, ctx)
    return f"{total}: {ctx.ask(f'question {i}')}"
