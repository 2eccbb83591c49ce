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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from actors.errors import ConfigError
from protocol import REMOVE, Diff
from protocol.domain import FOLDER


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
    found = keys() if keys is not None else None
    return None if found is None else list(found)


def normaliser(strategy: object):
    """The key-normalising function of a strategy (identity when it has none)."""
    return getattr(strategy, "normalise_key", None) or (lambda key: key)


@dataclass
class AppendRules:
    """A deduplicated list of rules, content-addressed; complementary rules fuse.
    ``"remove: <rule>"`` proposes deleting a rule the artifact holds.

    ``sections`` (optional) declares what the rules are about, so that tensor
    parallelism can split them: a rule is filed under the one declared section its
    text names (a whole word, any case; ``section_of(text) -> name | None`` decides
    instead when given), its key becomes ``"name/<rule id>"``, and ``keys()`` declares
    the folders ``"name/"``, each owning every rule filed under it. A rule naming no
    section (or several) keeps its bare content address, outside the declared space:
    under tensor parallelism it is a ``section-violation``. Sections change no rule's
    text nor the render order (rules render by content address, as without them)."""

    title: str = "# Playbook"
    sections: Sequence[str] = ()
    section_of: Callable[[str], str | None] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.sections, str):
            raise ConfigError(f"AppendRules(sections={self.sections!r}): sections is a list "
                              "of section names, not one string")
        names = [self.normalise_section(s) for s in self.sections]
        bad = [s for s in names if not s or FOLDER in s]
        if bad or len(set(names)) != len(names):
            raise ConfigError(
                f"AppendRules(sections={list(self.sections)!r}): section names must be "
                f"distinct (in any case), non-empty and without {FOLDER!r}")
        if self.section_of is not None and not callable(self.section_of):
            raise ConfigError(f"AppendRules(section_of={self.section_of!r}): section_of "
                              "is a function rule text -> section name (or None)")
        if self.section_of is not None and not names:
            raise ConfigError("AppendRules(section_of=...) needs the declared sections= it "
                              "chooses from (the key space tensor parallelism splits)")
        self._names = frozenset(names)
        self._named = (re.compile(r"\b(" + "|".join(map(re.escape, sorted(names, key=len,
                                                                      reverse=True)))
                                  + r")\b", re.IGNORECASE) if names else None)

    @staticmethod
    def normalise_section(name: str) -> str:
        return name.strip().lower()

    def keys(self) -> Sequence[str] | None:
        """The declared folders ``"name/"`` (None: no sections, no key space)."""
        if not self._names:
            return None
        return [self.normalise_section(s) + FOLDER for s in self.sections]

    def normalise_key(self, key: str) -> str:
        """The declared key ``key`` counts as: a section's name, or a rule filed under
        it, is its folder ``"name/"``; any other key is itself."""
        name = self.normalise_section(key.partition(FOLDER)[0])
        return name + FOLDER if name in self._names else key

    def section(self, text: str) -> str | None:
        """The declared section a rule's text is filed under (None: none, or several
        named). A ``section_of`` answer outside the declared sections is refused."""
        if self.section_of is not None:
            found = self.section_of(text)
            if found is None:
                return None
            name = self.normalise_section(str(found))
            if name not in self._names:
                raise ConfigError(
                    f"AppendRules section_of({text!r}) returned {found!r}, which is not a "
                    f"declared section ({sorted(self._names)}): return one of them, or "
                    "None for a rule about no section")
            return name
        if self._named is None:
            return None
        named = {m.lower() for m in self._named.findall(text)}
        return named.pop() if len(named) == 1 else None

    def key_of(self, text: str) -> str:
        """The state key of a rule: its content address, filed under its section."""
        section = self.section(text) if self._names else None
        rid = rule_id(text)
        return rid if section is None else f"{section}{FOLDER}{rid}"

    def initial(self) -> dict[str, str]:
        return {}

    def render(self, state: dict[str, str]) -> str:
        if not state:
            return f"{self.title}\n(empty)"
        order = sorted(state, key=lambda k: (_tail(k), k)) if self._names else sorted(state)
        return "\n".join([self.title] + [f"- {state[k]}" for k in order])

    def to_diff(self, state, proposal, author, base_version) -> Diff | None:
        """A rule to add, or ``"remove: <rule>"``: a diff deleting that rule (None
        when the artifact does not hold it)."""
        text = (proposal or "").strip()
        if not text:
            return None
        removed = _removal(text)
        if removed is not None:
            key = self.key_of(removed)
            if key not in state:
                return None
            return Diff(f"{author}:-{_tail(key)}:{base_version}", author, base_version,
                        {key: REMOVE})
        key = self.key_of(text)
        if key in state:
            return None
        return Diff(f"{author}:{_tail(key)}:{base_version}", author, base_version,
                    {key: text})


def _tail(key: str) -> str:
    """A rule key's content address (the diff id names it as without sections)."""
    return key.rpartition(FOLDER)[2]


@dataclass
class SingleSlot:
    """The artifact is one value; each accepted proposal replaces it.

    Every diff writes the one key, so a merge keeps one of a round's diffs (the first
    proposer's, one gate a merge) and what it can hold is what its lease chained
    (``Lease.chain``): a run that names no parallelism plans ``round_tasks`` tasks a
    round (16 per worker on up to 4 workers; on 4 of them with more), not the default
    four each."""

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
