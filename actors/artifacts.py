"""Artifact strategies: what an artifact is (a flat key -> text map), how it renders,
and how a proposal becomes a :class:`~protocol.Diff`.

The key space is the design decision, because it is what can be merged concurrently:
content-addressed rules fuse almost everything (``AppendRules``), a single slot makes
every round a tournament (``SingleSlot``), declared categories sit in between
(``KeyedRules``). A strategy that knows every key it can write declares it with
``keys()``; that declared space is what tensor parallelism partitions.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, Sequence, runtime_checkable

from protocol import REMOVE, Diff


def rule_id(text: str) -> str:
    """Content address of a rule: identical proposals (up to case and edges) dedupe."""
    return "r" + hashlib.sha1(text.strip().lower().encode()).hexdigest()[:10]


@runtime_checkable
class ArtifactStrategy(Protocol):
    """What evolves. Optional: ``keys()`` (the declared key space),
    ``normalise_key(key)`` (how a proposal's key is spelled in the state) and
    ``round_tasks`` (tasks a round, over all workers, when the run names no
    parallelism)."""

    def initial(self) -> dict[str, str]: ...

    def render(self, state: dict[str, str]) -> str: ...

    def to_diff(self, state: dict[str, str], proposal: str, author: str,
                base_version: int) -> Diff | None: ...


def round_tasks(strategy: object) -> int | None:
    """Tasks a round (over all workers) the strategy asks for when the run names no
    parallelism (``round_tasks``; None: the default round)."""
    return getattr(strategy, "round_tasks", None)


def declared_keys(strategy: object) -> list[str] | None:
    """The strategy's declared key space, normalised; None when it declares none."""
    keys = getattr(strategy, "keys", None)
    if keys is None:
        return None
    return list(keys())


def normaliser(strategy: object):
    """The key-normalising function of a strategy (identity when it has none)."""
    return getattr(strategy, "normalise_key", None) or (lambda key: key)


@dataclass
class AppendRules:
    """A deduplicated list of rules, content-addressed; complementary rules fuse.
    ``"remove: <rule>"`` proposes deleting a rule the artifact holds."""

    title: str = "# Playbook"

    def initial(self) -> dict[str, str]:
        return {}

    def render(self, state: dict[str, str]) -> str:
        if not state:
            return f"{self.title}\n(empty)"
        return "\n".join([self.title] + [f"- {state[k]}" for k in sorted(state)])

    def to_diff(self, state, proposal, author, base_version) -> Diff | None:
        """A rule to add, or ``"remove: <rule>"``: a diff deleting that rule (None
        when the artifact does not hold it)."""
        text = (proposal or "").strip()
        if not text:
            return None
        removed = _removal(text)
        if removed is not None:
            rid = rule_id(removed)
            if rid not in state:
                return None
            return Diff(f"{author}:-{rid}:{base_version}", author, base_version,
                        {rid: REMOVE})
        rid = rule_id(text)
        if rid in state:
            return None
        return Diff(f"{author}:{rid}:{base_version}", author, base_version, {rid: text})


@dataclass
class SingleSlot:
    """The artifact is one value; each accepted proposal replaces it.

    Every diff writes the one key, so a merge keeps one of a round's diffs (the first
    proposer's, one gate a merge) and what it can hold is what its lease chained
    (``Lease.chain``): a run that names no parallelism plans ``round_tasks`` tasks a
    round over its workers (16 per worker with 4 workers), not the default four each."""

    #: Tasks a round, over all workers, when the run names no parallelism.
    round_tasks: ClassVar[int] = 64

    initial_value: str = ""
    key: str = "value"
    empty_render: str = "(no instruction yet)"
    min_chars: int = 1

    def keys(self) -> Sequence[str]:
        return [self.key]

    def initial(self) -> dict[str, str]:
        return {self.key: self.initial_value} if self.initial_value else {}

    def render(self, state: dict[str, str]) -> str:
        return state.get(self.key) or self.empty_render

    def to_diff(self, state, proposal, author, base_version) -> Diff | None:
        text = (proposal or "").strip()
        if len(text) < self.min_chars or state.get(self.key) == text:
            return None
        return Diff(f"{author}:{self.key}:{base_version}:{rule_id(text)}", author, base_version,
                    {self.key: text})


_KEYED = re.compile(r"\s*([\w\- ]+?)\s*:\s*(.+)", re.DOTALL)
_REMOVE = re.compile(r"remove\s*:\s*(.+)", re.DOTALL | re.IGNORECASE)


def _removal(text: str) -> str | None:
    """What ``"remove: <what>"`` names (None: the text is not a removal)."""
    m = _REMOVE.fullmatch(text)
    return m.group(1).strip() if m else None


@dataclass
class KeyedRules:
    """One entry per category; a proposal ``"category: text"`` overwrites its category,
    ``"remove: category"`` deletes it (unless "remove" is itself a category).

    Categories match case-insensitively and are stored folded to lower case, which is
    also how ``keys()`` declares them. A proposal naming no known category falls back
    to a content-addressed key (outside the declared space: under tensor parallelism
    it is a ``section-violation``)."""

    categories: Sequence[str] = field(default_factory=list)
    title: str = "# Config (by category)"

    def __post_init__(self) -> None:
        self._known = {c.strip().lower() for c in self.categories}

    @staticmethod
    def normalise_key(key: str) -> str:
        return key.strip().lower()

    def keys(self) -> Sequence[str]:
        return [self.normalise_key(c) for c in self.categories]

    def initial(self) -> dict[str, str]:
        return {}

    def render(self, state: dict[str, str]) -> str:
        if not state:
            return f"{self.title}\n(empty)"
        return "\n".join([self.title] + [f"## {k}\n{state[k]}" for k in sorted(state)])

    def to_diff(self, state, proposal, author, base_version) -> Diff | None:
        text = (proposal or "").strip()
        if not text:
            return None
        m = _KEYED.match(text)
        removed = _removal(text) if "remove" not in self._known else None
        if removed is not None:
            key = self.normalise_key(removed)
            key = key if key in self._known else rule_id(removed)
            if key not in state:
                return None
            return Diff(f"{author}:-{key}:{base_version}", author, base_version,
                        {key: REMOVE})
        if m and self.normalise_key(m.group(1)) in self._known:
            key, value = self.normalise_key(m.group(1)), m.group(2).strip()
        else:
            key, value = rule_id(text), text
        if state.get(key) == value:
            return None
        return Diff(f"{author}:{key}:{base_version}:{rule_id(value)}", author, base_version,
                    {key: value})
