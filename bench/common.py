"""Helpers shared by the benchmarks: repeats, min/median/max, a table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
import time
from typing import Callable


def measure(fn: Callable[[], float], repeats: int) -> list[float]:
    """Run ``fn`` (which returns a figure, e.g. items/s) ``repeats`` times."""
    return [fn() for _ in range(repeats)]


def stats(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def fmt(values: list[float], unit: str = "") -> str:
    lo, med, hi = stats(values)
    return f"{med:,.0f}{unit} (min {lo:,.0f}, max {hi:,.0f})"


def rate(n: int, fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return n / (time.perf_counter() - t)


def table(rows: list[tuple], header: tuple) -> str:
    cols = list(zip(*([header] + [tuple(str(c) for c in r) for r in rows])))
    widths = [max(len(c) for c in col) for col in cols]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


# -- the suite's rows (python -m bench) ---------------------------------------------------


@dataclass
class Row:
    """One line of the suite's table (``python -m bench``).

    A bench module joins the suite by defining ``suite(quick: bool) -> list[Row]``.
    ``evobus``, ``base`` and ``agentdescent`` are the figures of each repeat (medians,
    min and max are printed); ``None`` means not measured, and ``note`` says why (a
    missing module, agentdescent not installed, a failure). ``higher_is_better`` picks
    the ratio's direction: the ratio printed is always "how many times better evobus
    is" (> 1: evobus ahead). ``target`` is the issue's target in words and ``met``
    whether the medians of this run reach it (None: no target)."""

    workload: str
    unit: str
    evobus: list[float] | None = None
    baseline: str = ""
    base: list[float] | None = None
    agentdescent: list[float] | None = None
    higher_is_better: bool = True
    target: str = ""
    met: bool | None = None
    note: str = ""


def median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def ratio(ours: list[float] | None, theirs: list[float] | None,
          higher_is_better: bool = True) -> float | None:
    """How many times better ``ours`` is than ``theirs`` (medians)."""
    a, b = median(ours), median(theirs)
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return a / b if higher_is_better else b / a


def figure(values: list[float] | None, digits: int | None = None) -> str:
    """``median [min-max]`` with a precision that suits the magnitude."""
    if not values:
        return "-"
    lo, med, hi = stats(values)
    if digits is None:
        big = max(abs(lo), abs(hi))
        digits = 0 if big >= 100 else 1 if big >= 10 else 2 if big >= 1 else 3
    f = f"{{:,.{digits}f}}"
    if len(values) == 1 or lo == hi:
        return f.format(med)
    return f"{f.format(med)} [{f.format(lo)}-{f.format(hi)}]"
