"""The router domain (scenarios/router.py) through a real model agent, for the budget and
backend-fault tests (tests/test_budgets.py).

:class:`CountingAgent` is :class:`actors.openai_agent.OpenAIAgent` with a wrapper around
``solve`` and ``propose``: each call appends one line (``solve`` or ``propose`` and the
process id) to the file ``$EVOBUS_TEST_CALLS`` names, *before* it starts, so the count
holds calls made in worker processes too and never depends on our own counters.
:func:`router_reply` is a model for bench.endpoint.SimulatedEndpoint that knows the
router: it routes by the keyword lists in the system message and proposes the missed
message's keyword for its category. :class:`GroupAgent`'s ``solve`` first fans out
through ``parallel()``: one model call per word of the prompt's first three, each
counted (``branch``) by the branch before it starts.
"""

from __future__ import annotations

import os
import re
from typing import Any

import threading

from actors import parallel
from actors.openai_agent import OpenAIAgent
from protocol import Task
from scenarios import router

CALLS_ENV = "EVOBUS_TEST_CALLS"

tasks = router.tasks
reward = router.reward
route = router.route


def _count(what: str) -> None:
    path = os.environ.get(CALLS_ENV)
    if path:
        with open(path, "a") as f:  # one write per line: appends do not interleave
            f.write(f"{what} {os.getpid()}\n")


class CountingAgent(OpenAIAgent):
    def solve(self, rendered: str, task) -> str:
        _count("solve")
        return super().solve(rendered, task)

    def propose(self, rendered: str, task, output: str, reward: float) -> str | None:
        _count("propose")
        return super().propose(rendered, task, output, reward)


_AGENTS: dict[str, OpenAIAgent] = {}
_AGENTS_LOCK = threading.Lock()


def ask_word(item: list[str]) -> str:
    """A group's branch: one counted model call about one word."""
    url, word = item
    _count("branch")
    with _AGENTS_LOCK:
        agent = _AGENTS.get(url)
        if agent is None:
            agent = _AGENTS[url] = OpenAIAgent(model="sim", base_url=url, api_key_env="")
    return agent.chat([{"role": "user", "content": f"What does {word} mean?"}])


class GroupAgent(CountingAgent):
    def solve(self, rendered: str, task) -> str:
        _count("solve")   # counted as it starts, whether its group or its request fails
        words = task.prompt.split()[:3]
        parallel(ask_word, [[self.base_url, w] for w in words], max_concurrency=3,
                 max_items=3)
        return OpenAIAgent.solve(self, rendered, task)


def counted(path: str) -> dict[str, int]:
    """Calls the wrapper saw, by method (``solve``, ``propose``, a group's ``branch``)
    and in all."""
    lines = open(path).read().split() if os.path.exists(path) else []
    kinds = lines[0::2]
    return {"solve": kinds.count("solve"), "propose": kinds.count("propose"),
            "branch": kinds.count("branch"), "total": len(kinds)}


def router_reply(body: dict[str, Any]) -> str:
    system, user = body["messages"][0]["content"], body["messages"][-1]["content"]
    if "improve the instructions" in system:
        prompt = re.search(r"^Task: (.*)$", user, re.MULTILINE).group(1)
        artifact = user.split("---\n")[1]
        kw = next((k for ks in router.KEYWORDS.values() for k in ks if k in prompt), None)
        if kw is None:
            return "NONE"
        category = next(c for c, ks in router.KEYWORDS.items() if kw in ks)
        task = Task(id="x", prompt=prompt, meta={"category": category, "keyword": kw})
        return router.propose(artifact, task, "", 0.0) or "NONE"
    return router.run(system, Task(id="x", prompt=user, meta={}))
