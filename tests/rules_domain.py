"""A rule-list router for the sectioned ``AppendRules`` tests: scenarios/router.py's
72 messages, routed by rules ``"send '<keyword>' to <category>"`` (the first rule, in
render order, whose keyword the message holds). Deterministic.

The teacher proposes the right rule, except on a message's fourth phrasing (``-3``):
there it sends the keyword to the next category, a rule about another section than
the task's, so a worker that owns the task's category may not write it."""

from __future__ import annotations

import re

from protocol import Task
from scenarios import router

CATEGORIES = router.CATEGORIES
_RULE = re.compile(r"send '(\w+)' to (\w+)")


def tasks() -> list[Task]:
    return router.tasks()


def reward(task: Task, output: str) -> float:
    return router.reward(task, output)


def run(rendered: str, task: Task) -> str:
    words = set(re.findall(r"[a-z]+", task.prompt.lower()))
    for keyword, category in _RULE.findall(rendered):
        if keyword in words:
            return category
    return "unknown"


def propose(rendered: str, task: Task, output: str, score: float) -> str:
    category, keyword = task.meta["category"], task.meta["keyword"]
    if task.id.endswith("-3"):
        category = CATEGORIES[(CATEGORIES.index(category) + 1) % len(CATEGORIES)]
    return f"send '{keyword}' to {category}"


def route(task_id: str) -> str:
    """The section a task's right rule is filed under: its category."""
    return task_id.split("-")[0]


def section_of(text: str) -> str | None:
    """The category a rule sends its keyword to (the last word), or None."""
    found = _RULE.search(text)
    return found.group(2) if found else None
