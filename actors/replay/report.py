"""What a replay found: per-actor counts, the first divergence, what was never delivered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from protocol import Message

log = logging.getLogger(__name__)


_DIFF_LINES = 20


@dataclass(frozen=True)
class Divergence:
    """The first place where a control actor stopped reproducing the log.

    ``expected`` and ``actual`` are ``(receiver, message)``; one of them is None when
    the log holds a message the machine did not produce, or the reverse (strict mode).
    ``input_seq`` is the input whose handling produced ``actual`` (or the input the
    replay had reached)."""

    log: Path
    seq: int
    actor: str
    expected: tuple[str, Message] | None
    actual: tuple[str, Message] | None
    input_seq: int | None
    diff: tuple[str, ...]
    reason: str

    def format(self) -> str:
        lines = [f"first divergence at seq {self.seq} ({self.log}): {self.actor} {self.reason}"]
        if self.input_seq is not None:
            lines[0] += f" (while handling the input at seq {self.input_seq})"
        lines.append(f"  expected: {_show(self.expected)}")
        lines.append(f"  actual:   {_show(self.actual)}")
        if self.diff:
            lines.append("  difference:")
            lines.extend(f"    {d}" for d in self.diff)
        return "\n".join(lines)

    __str__ = format


@dataclass(frozen=True)
class Unrecorded:
    """A message the replay produced that the log does not hold (see module docstring)."""

    log: Path
    actor: str
    input_seq: int
    receiver: str
    msg: Message


@dataclass
class ActorReport:
    inputs: int = 0
    matched: int = 0
    unrecorded: int = 0
    refused: int = 0  # inputs its admit refused (a peer's message its role does not allow)


@dataclass
class ReplayReport:
    """What one replay found. ``ok`` when no control actor diverged."""

    path: Path
    segments: list[Path]
    records: int
    actors: dict[str, ActorReport]
    divergence: Divergence | None = None
    other_divergences: list[Divergence] = field(default_factory=list)
    unrecorded: list[Unrecorded] = field(default_factory=list)
    resent: list[Unrecorded] = field(default_factory=list)  # lost in a crash, sent on resume
    notes: list[str] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def summary_line(self) -> str:
        compared = sum(a.matched for a in self.actors.values())
        inputs = sum(a.inputs for a in self.actors.values())
        chain = f" (chain of {len(self.segments)} logs)" if len(self.segments) > 1 else ""
        status = "ok" if self.ok else f"DIVERGED at seq {self.divergence.seq}"
        line = (f"{status:<8} {self.path}{chain}: {self.records} records, {inputs} inputs "
                f"replayed, {compared} outputs identical")
        if self.resent:
            line += f", {len(self.resent)} re-sent on resume"
        if self.unrecorded:
            line += f", {len(self.unrecorded)} unrecorded"
        return line

    def format(self, verbose: bool = False) -> str:
        lines = [self.summary_line()]
        per = ", ".join(f"{name} {a.inputs} in / {a.matched} out"
                        + (f" ({a.refused} refused)" if a.refused else "")
                        for name, a in self.actors.items())
        if per:
            lines.append(f"  actors: {per}")
        if self.divergence is not None:
            lines.extend("  " + line for line in self.divergence.format().splitlines())
            for d in self.other_divergences:
                lines.append(f"  also: {d.actor} diverges at seq {d.seq} ({d.reason})")
        if self.unrecorded:
            shown = self.unrecorded if verbose else self.unrecorded[:5]
            lines.append(f"  {len(self.unrecorded)} produced message(s) not in the log "
                         "(receiver had left, or the log ended):")
            for u in shown:
                lines.append(f"    {u.actor} -> {u.receiver} {type(u.msg).__name__} "
                             f"(input seq {u.input_seq})")
            if len(shown) < len(self.unrecorded):
                lines.append(f"    ... {len(self.unrecorded) - len(shown)} more (--verbose)")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    __str__ = format


def _show(item: tuple[str, Message] | None, limit: int = 400) -> str:
    if item is None:
        return "(nothing)"
    receiver, msg = item
    text = f"-> {receiver} {msg!r}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def field_diff(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Readable field-level differences: ``leases[0].lease_id: 'r1.u0' != 'r1.u1'``."""
    out: list[str] = []
    _diff(expected, actual, path, out)
    return out


def _diff(e: Any, a: Any, path: str, out: list[str]) -> None:
    if len(out) > _DIFF_LINES:
        return
    where = path or "message"
    if isinstance(e, msgspec.Struct) or isinstance(a, msgspec.Struct):
        if type(e) is not type(a):
            out.append(f"{where}: {type(e).__name__} != {type(a).__name__}")
            return
        for name in e.__struct_fields__:
            _diff(getattr(e, name), getattr(a, name), f"{path}.{name}" if path else name, out)
        return
    if isinstance(e, dict) and isinstance(a, dict):
        for k in list(e) + [k for k in a if k not in e]:
            sub = f"{path}[{k!r}]"
            if k not in a:
                out.append(f"{sub}: {_short(e[k])} != (missing)")
            elif k not in e:
                out.append(f"{sub}: (missing) != {_short(a[k])}")
            else:
                _diff(e[k], a[k], sub, out)
        if not out and list(e) != list(a):
            out.append(f"{where}: same items, different order")
        return
    if isinstance(e, (list, tuple)) and isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(e, a)):
            _diff(x, y, f"{path}[{i}]", out)
        if len(e) != len(a):
            out.append(f"{where}: {len(e)} items != {len(a)} items")
        return
    if e != a or type(e) is not type(a):
        out.append(f"{where}: {_short(e)} != {_short(a)}")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _cap(lines: list[str]) -> list[str]:
    if len(lines) <= _DIFF_LINES:
        return lines
    return lines[:_DIFF_LINES] + [f"... {len(lines) - _DIFF_LINES} more differences"]
