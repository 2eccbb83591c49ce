"""A keyword router that learns offline: the domain behind scenarios/router.toml.

Each task is a customer message to be routed to one of four categories. The
artifact (``KeyedRules`` over the categories) holds, per category, the keywords
that send a message there; it starts empty, so every message routes to
``unknown`` and scores 0. On a failure the "teacher" (``propose``) knows the right
category and proposes that category's keyword list plus the keyword of the failed
message. Two workers that fail on different keywords of one category therefore
propose *different* texts for the same key: a real conflict the merger resolves on
the held-out score, one keyword per category per round at worst.

Deterministic: no randomness, no clock. Each keyword appears in six messages, so a
held-out split very rarely holds a keyword that training never sees (seed 0 never
does; tests pin it).
"""

from __future__ import annotations

import re

from protocol import Task

KEYWORDS: dict[str, list[str]] = {
    "billing": ["refund", "invoice", "charge"],
    "shipping": ["delivery", "parcel", "tracking"],
    "technical": ["crash", "error", "freeze"],
    "account": ["password", "username", "profile"],
}
CATEGORIES = list(KEYWORDS)

TEMPLATES = [
    "Hi, I have a question about my {kw}.",
    "Can someone help me with the {kw} please?",
    "Something is wrong with the {kw} since yesterday.",
    "I wrote twice already about the {kw}, no answer.",
    "Quick one: what happens with my {kw} now?",
    "Urgent: the {kw} needs attention today.",
]

_SECTION = re.compile(r"^## (\S+)\n(.*?)(?=^## |\Z)", re.MULTILINE | re.DOTALL)


def tasks() -> list[Task]:
    """72 routing tasks: 4 categories x 3 keywords x 6 phrasings."""
    out = []
    for category, words in KEYWORDS.items():
        for kw in words:
            for i, template in enumerate(TEMPLATES):
                out.append(Task(id=f"{category}-{kw}-{i}", prompt=template.format(kw=kw),
                                meta={"category": category, "keyword": kw}))
    return out


def rules(rendered: str) -> dict[str, set[str]]:
    """Parse a rendered ``KeyedRules`` artifact into category -> keywords."""
    parsed: dict[str, set[str]] = {}
    for category, body in _SECTION.findall(rendered):
        parsed[category] = {w.strip().lower() for w in body.split(",") if w.strip()}
    return parsed


def run(rendered: str, task: Task) -> str:
    """Route the message: the first category (sorted) with a keyword in it."""
    words = set(re.findall(r"[a-z]+", task.prompt.lower()))
    for category, keywords in sorted(rules(rendered).items()):
        if words & keywords:
            return category
    return "unknown"


def reward(task: Task, output: str) -> float:
    return 1.0 if output.strip() == task.meta["category"] else 0.0


def propose(rendered: str, task: Task, output: str, score: float) -> str | None:
    """The teacher: add this message's keyword to its category's list."""
    category = task.meta["category"]
    known = rules(rendered).get(category, set())
    return f"{category}: {', '.join(sorted(known | {task.meta['keyword']}))}"


def route(task_id: str) -> str:
    """Task id -> the artifact key its edits land in (for TensorParallel(route=...))."""
    return task_id.split("-", 1)[0]


cluster_of = route


class RouterAgent:
    """The same domain as an agent object (``solve`` + ``propose``)."""

    def solve(self, rendered: str, task: Task) -> str:
        return run(rendered, task)

    def propose(self, rendered: str, task: Task, output: str, score: float) -> str | None:
        return propose(rendered, task, output, score)
