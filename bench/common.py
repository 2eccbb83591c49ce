"""Helpers shared by the benchmarks: repeats, min/median/max, a table."""

from __future__ import annotations

import statistics
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
