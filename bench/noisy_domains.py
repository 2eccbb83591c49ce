"""Three noisy learning domains of different shapes, for ``bench/learning.py``.

Each domain has a *noisy model* (it answers at random ``NOISE`` of the time), a
*noisy proposer* (for a failed task: the right edit ``P_RIGHT`` of the time, a
plausible but harmful edit ``P_HARMFUL``, nothing otherwise) and *test items* kept
apart from the tasks the optimisers see, scored with the noise-free model.

- ``router`` (AppendRules): 6 categories x 5 keywords. The model routes a message by
  the first rule (in render order) whose word the message contains. Harmful rules:
  a keyword sent to a wrong category, or a filler word of the failed message sent to
  its category (it fixes that message and breaks the others that hold the word).
- ``settings`` (KeyedRules): 6 settings of 4 values. A task type needs one or two
  settings right at once; a minority of types prefer a value the others do not, so
  the best reachable test accuracy is below 1. Harmful edits: a wrong value for a
  setting the task needs.
- ``instruction`` (SingleSlot): one instruction text, rewritten whole. A phrase per
  task type helps it; "shortcut" phrases fix the failed task's type and break others.

The artifact is rendered by the library's own strategy (evobus's and agentdescent's
render the same text), and the model reads that text: nothing here looks at the
optimiser's internal state.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Callable

from actors.artifacts import AppendRules, KeyedRules, SingleSlot
from protocol import Task

NOISE = 0.10
P_RIGHT = 0.55
P_HARMFUL = 0.30
N_TASKS = 240
N_TEST = 400


@dataclass
class Domain:
    """A domain: its tasks (train + held-out for the optimisers), its test items, the
    noise-free model and the noisy proposer."""

    name: str
    shape: str
    tasks: list[Task]
    test: list[Task]
    strategy: Callable[[], object]          # a fresh evobus strategy
    ad_strategy: Callable[[object], object]  # agentdescent's (given the module)
    answer: Callable[[str, Task], str]       # the noise-free model
    noise: Callable[[Task, random.Random], str]  # a random answer
    right: Callable[[str, Task], str | None]
    harmful: Callable[[str, Task, random.Random], str | None]
    best: float = 1.0
    extra: dict = field(default_factory=dict)

    def reward(self, task: Task, output: str) -> float:
        return 1.0 if output == task.meta["want"] else 0.0

    def run(self, rendered: str, task: Task, rng: random.Random) -> str:
        if rng.random() < NOISE:
            return self.noise(task, rng)
        return self.answer(rendered, task)

    def propose(self, rendered: str, task: Task, rng: random.Random) -> str | None:
        u = rng.random()
        if u < P_RIGHT:
            return self.right(rendered, task)
        if u < P_RIGHT + P_HARMFUL:
            return self.harmful(rendered, task, rng)
        return None

    def test_accuracy(self, rendered: str) -> float:
        return sum(self.reward(t, self.answer(rendered, t)) for t in self.test) / len(self.test)

    def quality(self, rendered: str) -> float:
        """Test accuracy (noise-free model) as a fraction of the best reachable."""
        return self.test_accuracy(rendered) / self.best


# -- router: AppendRules ---------------------------------------------------------------

CATEGORIES = ["billing", "shipping", "returns", "account", "technical", "sales"]
KEYWORDS = {
    "billing": ["invoice", "charge", "receipt", "payment", "bill"],
    "shipping": ["parcel", "courier", "tracking", "delivery", "dispatch"],
    "returns": ["refund", "exchange", "return", "damaged", "faulty"],
    "account": ["password", "login", "username", "profile", "signup"],
    "technical": ["crash", "error", "bug", "freeze", "install"],
    "sales": ["quote", "discount", "pricing", "bulk", "demo"],
}
FILLERS = ["please", "today", "help", "urgent", "again", "thanks", "issue", "need",
           "asap", "hello", "question", "soon"]
_RULE = re.compile(r"route messages containing '(\w+)' to (\w+)")


def _rule(word: str, category: str) -> str:
    return f"route messages containing '{word}' to {category}"


def _router_items(n: int, rng: random.Random, prefix: str) -> list[Task]:
    items = []
    for i in range(n):
        cat = rng.choice(CATEGORIES)
        kw = rng.choice(KEYWORDS[cat])
        words = [kw] + rng.sample(FILLERS, 3)
        rng.shuffle(words)
        items.append(Task(id=f"{prefix}{i}", prompt=" ".join(words),
                          meta={"want": cat, "kw": kw}))
    return items


def _router_answer(rendered: str, task: Task) -> str:
    words = set(task.prompt.split())
    for word, cat in _RULE.findall(rendered):
        if word in words:
            return cat
    return "unknown"


def _router_harmful(rendered: str, task: Task, rng: random.Random) -> str:
    if rng.random() < 0.5:
        wrong = rng.choice([c for c in CATEGORIES if c != task.meta["want"]])
        return _rule(task.meta["kw"], wrong)
    filler = rng.choice([w for w in task.prompt.split() if w in FILLERS])
    return _rule(filler, task.meta["want"])


def router(seed: int = 0) -> Domain:
    rng = random.Random(seed)
    return Domain(
        name="router", shape="AppendRules",
        tasks=_router_items(N_TASKS, rng, "m"), test=_router_items(N_TEST, rng, "t"),
        strategy=AppendRules, ad_strategy=lambda ad: ad.AppendRules(),
        answer=_router_answer, noise=lambda task, r: r.choice(CATEGORIES),
        right=lambda rendered, task: _rule(task.meta["kw"], task.meta["want"]),
        harmful=_router_harmful, extra={"sections": CATEGORIES})


# -- settings: KeyedRules, edits that interact ----------------------------------------

SETTINGS = {
    "tone": ["formal", "casual", "neutral", "terse"],
    "format": ["bullets", "prose", "table", "json"],
    "length": ["short", "medium", "long", "adaptive"],
    "units": ["metric", "imperial", "both", "none"],
    "dates": ["iso", "us", "eu", "words"],
    "citations": ["inline", "footnote", "none", "links"],
}
_SETTING = re.compile(r"## (\w+)\n(\w+)")


def _setting_types(rng: random.Random) -> list[tuple[dict[str, str], float]]:
    """Task types: (requirements, weight). The majority value of each setting is its
    first; three minority types (light weight) want another value."""
    names = list(SETTINGS)
    types = []
    for k in range(12):
        need = rng.sample(names, 1 if k % 2 == 0 else 2)
        types.append(({s: SETTINGS[s][0] for s in need}, 1.0))
    for k in range(3):
        s = names[k * 2]
        types.append(({s: SETTINGS[s][1 + k % 3]}, 0.35))
    return types


def _settings_items(n: int, types, rng: random.Random, prefix: str) -> list[Task]:
    weights = [w for _, w in types]
    items = []
    for i in range(n):
        k = rng.choices(range(len(types)), weights)[0]
        need = types[k][0]
        items.append(Task(id=f"{prefix}{i}", prompt=f"request of type {k}: needs "
                          + ", ".join(sorted(need)), meta={"want": "ok", "need": need,
                                                           "type": k}))
    return items


def _settings_answer(rendered: str, task: Task) -> str:
    have = dict(_SETTING.findall(rendered))
    for s, v in sorted(task.meta["need"].items()):
        if have.get(s) != v:
            return f"wrong {s}"
    return "ok"


def _settings_right(rendered: str, task: Task) -> str | None:
    have = dict(_SETTING.findall(rendered))
    unmet = [s for s, v in sorted(task.meta["need"].items()) if have.get(s) != v]
    if not unmet:
        return None
    return f"{unmet[0]}: {task.meta['need'][unmet[0]]}"


def _settings_harmful(rendered: str, task: Task, rng: random.Random) -> str:
    s = rng.choice(sorted(task.meta["need"]))
    return f"{s}: {rng.choice([v for v in SETTINGS[s] if v != task.meta['need'][s]])}"


def _best_settings(types, test: list[Task]) -> float:
    """The best test accuracy any configuration reaches: the majority configuration,
    or one that trades a majority value for a minority type's (checked both ways)."""
    majority = {s: v[0] for s, v in SETTINGS.items()}
    configs = [majority] + [{**majority, **need} for need, w in types if w < 1.0]
    best = 0.0
    for config in configs:
        ok = sum(all(config.get(s) == v for s, v in t.meta["need"].items()) for t in test)
        best = max(best, ok / len(test))
    return best


def settings(seed: int = 0) -> Domain:
    rng = random.Random(seed)
    types = _setting_types(rng)
    test = _settings_items(N_TEST, types, random.Random(seed + 1), "t")
    return Domain(
        name="settings", shape="KeyedRules",
        tasks=_settings_items(N_TASKS, types, rng, "q"), test=test,
        strategy=lambda: KeyedRules(list(SETTINGS)),
        ad_strategy=lambda ad: ad.KeyedRules(categories=list(SETTINGS)),
        answer=_settings_answer,
        noise=lambda task, r: "ok" if r.random() < 0.5 else "wrong",
        right=_settings_right, harmful=_settings_harmful,
        best=_best_settings(types, test), extra={"keys": list(SETTINGS)})


# -- instruction: SingleSlot, a text rewritten whole -----------------------------------

TOPICS = ["travel", "cooking", "finance", "health", "law", "sports", "music", "garden"]
HELP = {t: f"For {t} questions, name the key fact first." for t in TOPICS}
#: Shortcut phrases: (phrase, topics it fixes, topics it breaks).
SHORTCUTS = [
    ("Answer in one word.", {"travel", "sports"}, {"law", "health", "finance"}),
    ("Always add a disclaimer.", {"health", "law"}, {"music", "sports"}),
    ("Use a numbered list.", {"cooking", "garden"}, {"travel", "finance"}),
    ("Quote a price.", {"finance", "travel"}, {"cooking", "garden", "music"}),
    ("Be playful.", {"music", "sports"}, {"law", "health"}),
    ("Mention the season.", {"garden", "cooking"}, {"finance", "law"}),
]


def _instruction_items(n: int, rng: random.Random, prefix: str) -> list[Task]:
    return [Task(id=f"{prefix}{i}", prompt=f"a {topic} question #{i}",
                 meta={"want": "good", "topic": topic})
            for i, topic in ((i, rng.choice(TOPICS)) for i in range(n))]


def _instruction_answer(rendered: str, task: Task) -> str:
    topic = task.meta["topic"]
    helped = HELP[topic] in rendered
    for phrase, fixes, breaks in SHORTCUTS:
        if phrase in rendered:
            if topic in breaks:
                return "bad"
            helped = helped or topic in fixes
    return "good" if helped else "bad"


def _text(rendered: str) -> str:
    return "" if rendered == SingleSlot().empty_render else rendered


def _instruction_right(rendered: str, task: Task) -> str | None:
    """The right rewrite: add the topic's phrase, or drop a phrase that breaks it."""
    text, topic = _text(rendered), task.meta["topic"]
    for phrase, _, breaks in SHORTCUTS:
        if phrase in text and topic in breaks:
            return " ".join(text.replace(phrase, "").split())
    if HELP[topic] not in text:
        return (text + " " + HELP[topic]).strip()
    return None


def _instruction_harmful(rendered: str, task: Task, rng: random.Random) -> str | None:
    text, topic = _text(rendered), task.meta["topic"]
    fixing = [p for p, fixes, _ in SHORTCUTS if topic in fixes and p not in text]
    if not fixing:
        return None
    return (text + " " + rng.choice(fixing)).strip()


def instruction(seed: int = 0) -> Domain:
    rng = random.Random(seed)
    return Domain(
        name="instruction", shape="SingleSlot",
        tasks=_instruction_items(N_TASKS, rng, "i"),
        test=_instruction_items(N_TEST, rng, "t"),
        strategy=SingleSlot, ad_strategy=lambda ad: ad.SingleSlot(),
        answer=_instruction_answer,
        noise=lambda task, r: "good" if r.random() < 0.5 else "bad",
        right=_instruction_right, harmful=_instruction_harmful)


DOMAINS = {"router": router, "settings": settings, "instruction": instruction}
