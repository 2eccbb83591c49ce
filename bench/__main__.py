"""``python -m bench``: every benchmark in bench/, one table.

    python -m bench [--quick] [--only throughput,latency,...] [--markdown]

Each row: the workload, the evobus figure, the baseline run in the same process (or
the same invocation) and its figure, the ratio (how many times better evobus is: > 1
means ahead, whichever way the unit points), agentdescent's figure for the same
workload through its own ``evolve()`` and the ratio to it, the issue's target and
whether this run's medians meet it. Figures are ``median [min-max]`` over repeats.
``--quick`` is a smoke run: fewer repeats, shorter runs, fewer n (its figures are
dominated by start-up costs: read the full run's).

A bench module joins the suite by defining ``suite(quick: bool) -> list[bench.common.Row]``.
Modules are imported lazily: one that is missing, or fails, gives a row saying so and
the rest still runs (a benchmark never stops the suite).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import platform
import re
import sys
import time
import traceback
from typing import Callable

from bench.common import Row, figure, median, ratio, table

#: (key, module, workload label for "missing" rows), in the table's order.
SECTIONS = [
    ("throughput", "bench.throughput", "(1)(2) rollouts/s"),
    ("latency", "bench.latency", "(3) heavy-tailed latency"),
    ("learning", "bench.learning", "(4) learning: router to quality"),
    ("group", "bench.group", "(5) parallel group"),
    ("remote", "bench.remote", "(6) remote workers"),
    ("replay", "bench.replay", "(7) replay speed"),
    ("memory", "bench.memory", "(8) peak memory"),
    ("overhead", "bench.overhead", "overhead vs ThreadPoolExecutor"),
    ("throttle", "bench.throttle", "(9) rate-limited endpoint"),
    ("saturation", "bench.saturation", "saturation: broker CPU per message"),
]


# -- adapters for modules that predate the suite protocol --------------------------------


def _latency(mod, quick: bool) -> list[Row]:
    """Workload 3 from bench/latency.py's ``one()``: efficiency against the packing ideal
    for the same draws. Sync with whole shares is measured against the longest static
    shard of each round (what a barrier round with static shards can reach at best);
    per-task leases (lease_size=1) against LPT, which knows every duration in advance."""
    from actors import Task
    from bench import agentdescent_side as ad

    n_tasks = 100 if quick else 400
    ns = [16] if quick else [1, 2, 4, 8, 16]
    tasks = [Task(f"t{i}", f"task {i}", {"sleep": mod.draw(f"t{i}")}) for i in range(n_tasks)]
    modes = [("sync, whole shares", False, None), ("sync, lease_size=1", False, 1),
             ("async, lease_size=1", True, 1)]
    out = []
    for n in ns:
        # Fewer rounds where a round is long (n = 1, 2: ~6-12 s of sleep a round).
        rounds = 1 if quick else (5 if n >= 8 else 2)
        repeats = 1 if quick or n < 16 else 3
        for mode, asynchronous, lease_size in modes:
            effs, ideals = [], []
            for _ in range(repeats):
                eff, _bound, packing = mod.one(n, asynchronous, tasks, rounds, lease_size)
                effs.append(eff)
                ideals.append(packing)
            theirs, note = None, f"{rounds} round(s) of {n_tasks - max(1, round(n_tasks * 0.1))}"
            if n == 16 and not quick and lease_size == 1:
                if ad.available():
                    train = n_tasks - max(1, round(n_tasks * 0.1))
                    theirs = [ad.latency_efficiency(tasks, n, asynchronous=asynchronous,
                                                    rollouts=train * rounds)
                              for _ in range(repeats)]
                    note += "; agentdescent: wall of the whole call (no log to time from)"
                else:
                    note += "; " + ad.NOT_INSTALLED
            med, ideal = median(effs), median(ideals)
            target, met = "", None
            if n == 16 and asynchronous:
                target, met = ">= 0.92", med >= 0.92
            elif n == 16 and lease_size is None:
                target, met = "within 0.01 of the per-round ideal", med >= ideal - 0.01
            ideal_name = ("static-shard ideal (per round)" if lease_size is None else
                          "LPT ideal" + (" (per round)" if not asynchronous else ""))
            out.append(Row(f"(3) lognormal latency, n={n}, {mode}", "efficiency", effs,
                           ideal_name, ideals, theirs, target=target, met=met, note=note))
    return out


def _group(mod, quick: bool) -> list[Row]:
    """Workload 5 from bench/group.py's ``main()``, which returns its figures: either
    {"noop": {runner: items/s}, "sleep": {runner: efficiency}} or (older) {"runs":
    {"noop parallel"|"noop threads"|...: seconds}}."""
    with contextlib.redirect_stdout(io.StringIO()):
        res = mod.main(["--repeats", "1" if quick else "5"])
    n_noop, n_sleep = mod.N_NOOP, mod.N_SLEEP
    ideal = n_sleep * mod.SLEEP_S / mod.SLEEP_BOUND
    if "noop" in res:
        noop, sleep = res["noop"], res["sleep"]
        threads, aio = "ThreadPoolExecutor.map", "asyncio.gather + Semaphore"
        ours = [k for k in noop if k.startswith("parallel()")]
    else:  # the older shape: seconds per runner
        runs = res["runs"]
        noop = {k: [n_noop / t for t in runs[f"noop {v}"]] for k, v in
                (("parallel()", "parallel"), ("ThreadPoolExecutor.map", "threads"),
                 ("asyncio.gather + Semaphore", "asyncio"))}
        sleep = {k: [ideal / t for t in runs[f"sleep {v}"]] for k, v in
                 (("parallel()", "parallel"), ("ThreadPoolExecutor.map", "threads"))}
        threads, aio, ours = "ThreadPoolExecutor.map", "asyncio.gather + Semaphore", \
            ["parallel()"]
    rows = []
    for label in ours:
        r = ratio(noop[label], noop[threads])
        rows.append(Row(f"(5) {label}, {n_noop:,} no-op items, bound {mod.NOOP_BOUND}",
                        "items/s", noop[label], f"ThreadPoolExecutor({mod.NOOP_BOUND}).map",
                        noop[threads], target=">= 1.0x ThreadPoolExecutor",
                        met=None if r is None else r >= 1.0))
        if aio in noop:
            rows.append(Row(f"(5) {label}, {n_noop:,} no-op items, bound {mod.NOOP_BOUND}",
                            "items/s", noop[label],
                            f"asyncio.gather + Semaphore({mod.NOOP_BOUND})", noop[aio]))
        if label in sleep:
            eff = sleep[label]
            rows.append(Row(f"(5) {label}, {n_sleep:,} items sleeping "
                            f"{mod.SLEEP_S * 1000:g} ms, bound {mod.SLEEP_BOUND}",
                            "efficiency", eff, f"ThreadPoolExecutor({mod.SLEEP_BOUND}).map",
                            sleep.get(threads), target=">= 0.95", met=median(eff) >= 0.95))
        per_call = res.get("per_call", {})
        if label in per_call and threads in per_call:
            spent = [v * 1e6 for v in per_call[label]]
            pool = [v * 1e6 for v in per_call[threads]]
            rows.append(Row(f"(5) {label}, a warm call of {mod.N_PER_CALL} no-op items",
                            "us per call", spent,
                            f"ThreadPoolExecutor({mod.N_PER_CALL}) made per call", pool,
                            target="<= ThreadPoolExecutor",
                            met=median(spent) <= median(pool)))
            if aio in per_call:
                rows.append(Row(f"(5) {label}, a warm call of {mod.N_PER_CALL} no-op items",
                                "us per call", spent, "asyncio.run(gather + Semaphore)",
                                [v * 1e6 for v in per_call[aio]]))
    return rows


def _captured(mod, argv: list[str], label: str) -> list[Row]:
    """A module with only a printing ``main()``: its output goes under the table."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        mod.main(argv)
    APPENDIX.append((label, buf.getvalue().rstrip()))
    return [Row(label, "", note=f"{mod.__name__} has no suite(); its own output is "
                                "printed below the table")]


_REPLAY_LINE = re.compile(r"^\s+(?P<name>\S.*?)\s{2,}(?P<rate>[\d,]+) msg/s.*?\s"
                          r"(?P<ratio>[\d.]+) \([\d.]+-[\d.]+\) of (?P<base>.+?)\s*$")


def _replay(mod, quick: bool) -> list[Row]:
    """bench/replay.py prints its figures: each "... msg/s ... R (lo-hi) of BASE" line
    becomes a row (the baseline figure is the rate divided by the ratio); the whole
    output also goes under the table."""
    import tempfile

    messages = 10_000 if quick else 100_000
    log = os.path.join(tempfile.gettempdir(), f"evobus-bench-replay-{messages}.evolog")
    argv = ["--messages", str(messages), "--repeats", "1" if quick else "5", "--log", log]
    rows = _captured(mod, argv, "(7) replay speed")
    parsed = []
    for line in APPENDIX[-1][1].splitlines():
        m = _REPLAY_LINE.match(line)
        if m and m["name"] not in ("raw decode", "read + decode (file)"):
            rate, r = float(m["rate"].replace(",", "")), float(m["ratio"])
            parsed.append(Row(f"(7) replay, {messages:,}-message log: {m['name']}",
                              "msg/s (CPU)", [rate], m["base"], [rate / r] if r else None,
                              note="figures from bench/replay.py's output (see below)"))
    return parsed or rows


def _overhead(mod, quick: bool) -> list[Row]:
    """bench/overhead.py: the full sync topology beside ThreadPoolExecutor.map."""
    tasks = mod.make_tasks(1000 if quick else 4000)
    train = int(len(tasks) * 0.6)
    rounds, repeats = (2, 1) if quick else (5, 3)
    out = []
    for label, reward, propose in [("no proposals", mod.solved, mod.propose_nothing),
                                   ("a proposal every rollout", mod.failed, mod.propose_rule)]:
        ours, base = [], []
        for _ in range(repeats):
            ours.append(mod.evobus_rate(tasks, reward, propose, rounds, 4, "zmq"))
            base.append(mod.threadpool_rate(tasks[:train], reward, rounds, 4))
        out.append(Row(f"overhead, sync, {len(tasks)} tasks, {label}", "rollouts/s", ours,
                       "ThreadPoolExecutor(4).map", base,
                       note="held-out gate work is not in the baseline"
                       if propose is mod.propose_rule else ""))
    return out


ADAPTERS: dict[str, Callable] = {"latency": _latency, "group": _group, "replay": _replay,
                                 "overhead": _overhead}
APPENDIX: list[tuple[str, str]] = []


# -- the suite --------------------------------------------------------------------------


def run_section(key: str, module: str, label: str, quick: bool) -> list[Row]:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return [Row(label, "", note=f"{module.replace('.', '/')}.py not present yet")]
        return [Row(label, "", note=f"import failed: {exc}")]
    except Exception as exc:  # a broken module is a row, never a crash of the suite
        return [Row(label, "", note=f"import failed: {type(exc).__name__}: {exc}")]
    try:
        if hasattr(mod, "suite"):
            return list(mod.suite(quick))
        adapter = ADAPTERS.get(key)
        if adapter is None:
            return [Row(label, "", note=f"{module} defines no suite(quick)")]
        return adapter(mod, quick)
    except Exception as exc:  # reported in the table (and the traceback on stderr)
        traceback.print_exc(file=sys.stderr)
        return [Row(label, "", note=f"failed: {type(exc).__name__}: {exc}")]


def machine() -> str:
    try:
        load = "load average %.1f %.1f %.1f" % os.getloadavg()
    except OSError:  # not available on this platform
        load = "load unknown"
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        mem = f", {kb / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):  # not Linux: leave it out
        pass
    return (f"{os.cpu_count()} cores{mem}, Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}, {load}")


def render(rows: list[Row], markdown: bool = False) -> str:
    header = ("workload", "unit", "evobus", "baseline", "baseline figure", "ratio",
              "agentdescent", "vs agentdescent", "target", "met", "note")
    lines = []
    for r in rows:
        rb = ratio(r.evobus, r.base, r.higher_is_better)
        ra = ratio(r.evobus, r.agentdescent, r.higher_is_better)
        met = "" if r.met is None else ("yes" if r.met else "NO")
        lines.append((r.workload, r.unit, figure(r.evobus), r.baseline or "-",
                      figure(r.base), "-" if rb is None else f"{rb:.2f}x",
                      figure(r.agentdescent), "-" if ra is None else f"{ra:.2f}x",
                      r.target or "-", met or "-", r.note))
    if not markdown:
        return table(lines, header)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for line in lines:
        out.append("| " + " | ".join(str(c).replace("|", "/") for c in line) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a fast smoke run")
    p.add_argument("--only", default="",
                   help="comma-separated sections: " + ",".join(k for k, _, _ in SECTIONS))
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - {k for k, _, _ in SECTIONS}
    if unknown:
        p.error(f"unknown section(s) {sorted(unknown)}; choose from "
                f"{', '.join(k for k, _, _ in SECTIONS)}")
    from bench import agentdescent_side as ad

    started = time.perf_counter()
    header = (f"evobus benchmark suite{' (--quick)' if args.quick else ''}; machine: "
              f"{machine()}; agentdescent: "
              f"{ad.version() if ad.available() else 'not installed'}")
    print(header, file=sys.stderr, flush=True)
    rows: list[Row] = []
    for key, module, label in SECTIONS:
        if only and key not in only:
            continue
        t = time.perf_counter()
        got = run_section(key, module, label, args.quick)
        print(f"  {key}: {len(got)} row(s) in {time.perf_counter() - t:.1f} s",
              file=sys.stderr, flush=True)
        rows += got
    print(header)
    print(f"figures: median [min-max] over repeats; ratio: times better than the "
          f"baseline (> 1: evobus ahead); {time.perf_counter() - started:.0f} s in all")
    print(render(rows, args.markdown))
    for label, text in APPENDIX:
        print(f"\n{label}:\n{text}")
    missed = [r.workload for r in rows if r.met is False]
    if missed:
        print(f"\ntargets missed in this run: {len(missed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
