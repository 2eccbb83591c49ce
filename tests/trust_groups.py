"""Group targets named by import path, for tests/test_trust.py (checkpoints, effects)."""

from __future__ import annotations

import os


def ask_odd(i, ctx):
    """Odd items ask a question (the group pauses); even ones finish at once."""
    if i % 2:
        return f"{i}: {ctx.ask(f'question {i}')}"
    return f"{i}: even"
