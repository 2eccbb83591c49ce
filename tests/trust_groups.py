"""Group targets named by import path, for tests/test_trust.py (checkpoints, effects)."""

from __future__ import annotations

import os


def ask_odd(i, ctx):
    """Odd items ask a question (the group pauses); even ones finish at once."""
    if i % 2:
        return f"{i}: {ctx.ask(f'question {i}')}"
    return f"{i}: even"


def ask_odd_reordered(i, ctx):
    """ask_odd with its steps in another order: a different target."""
    if not i % 2:
        return f"{i}: even"
    return f"{i}: {ctx.ask(f'question {i}')}"


def ask_then_check(i, ctx):
    """Odd items ask; the answer "boom" makes the branch raise (a failed resume)."""
    if i % 2:
        answer = ctx.ask(f"question {i}")
        if answer == "boom":
            raise ValueError(f"branch {i} got {answer!r}")
        return f"{i}: {answer}"
    return f"{i}: even"
