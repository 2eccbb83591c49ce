"""Bounded parallel groups beside the standard library, in the same process (read the
ratios: the machine is shared and noisy).

    python -m bench.group [--repeats 5] [--bus zmq|memory|both]

Two workloads, each through ``parallel()``, ``ThreadPoolExecutor.map`` and
``asyncio.gather`` under a semaphore:

- no-op: 20,000 items returning themselves, bound 4 (``ThreadPoolExecutor(max_workers=4)``,
  ``asyncio.Semaphore(4)``); the figure is items per second, the target ratio
  ``parallel / ThreadPoolExecutor >= 1.0``;
- latency-bound: 2,000 items that sleep 5 ms, bound 32; the figure is the efficiency
  ``ideal / elapsed`` where ``ideal = 2,000 x 5 ms / 32 = 0.3125 s``, the target
  ``>= 0.95`` for ``parallel``. (asyncio awaits ``asyncio.sleep``: its natural form.)
  Beside it, 32 warm threads (started once, each taking the next item under a lock, no
  coordination): the best a Python runner gets here; and each runner's efficiency
  against the sleep as its targets measured it (each run's mean), a second figure
  labelled as such;
- per call: 4 no-op items, warm (after a first call), 200 calls a repeat, the
  contenders taking turns call by call (a burst of load hits them alike); the figure is
  the median time of one call, against a ``ThreadPoolExecutor(4)`` created per call and
  mapping the same items, and ``asyncio.run`` of a ``gather`` under a semaphore; the
  target: ``parallel`` costs no more than the thread pool. The ZeroMQ contender calls
  ``parallel()`` with no ``bus=``, as a user does: the process-wide runtime's default.
  The CPU of the whole process per call is printed under the table.

Each ``parallel()`` call runs on the process-wide runtime of its bus (started by the
first call, so warm calls start no bus) and starts its own Collector and workers: that
cost is in the figures. In the per-call row, ``noop`` is measured cheap by the calls
before (the warm-up's, or the other rows'), so a warm call goes in one lease to one
worker (actors.groups.driver.ONE_LEASE_BELOW_S): 4 messages and one thread woken, as a
user's repeated call of a cheap target does; the thread pool made per call starts its
threads. ``--bus`` picks the bus: ``zmq`` (the default of
``parallel()``), ``memory``, or ``both`` side by side (default here). ``--only
per-call`` runs the per-call row alone. ``--calls`` (alone, in a fresh process: the
profiler must be on before the first worker thread starts) counts the Python-level
calls, and the C calls they make, of one warm call on every thread, by component, for
``parallel()`` on each bus and for the thread pool made per call.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import statistics
import time

from actors import parallel
from bench.common import stats, table

N_NOOP = 20_000
N_SLEEP = 2_000
SLEEP_S = 0.005
NOOP_BOUND = 4
SLEEP_BOUND = 32
N_PER_CALL = 4
CALLS = 200


def noop(x: int) -> int:
    return x


#: How long each sleep of the latency-bound targets took (seconds), for the figure
#: against the measured sleep (cleared before each run; an append is atomic).
SLEPT: list[float] = []


def nap(x: int) -> int:
    t = time.perf_counter()
    time.sleep(SLEEP_S)
    SLEPT.append(time.perf_counter() - t)
    return x


async def anap(x: int) -> int:
    t = time.perf_counter()
    await asyncio.sleep(SLEEP_S)
    SLEPT.append(time.perf_counter() - t)
    return x


def sleep_run(fn) -> tuple[float, float]:
    """(efficiency against the nominal 5 ms, efficiency against the sleeps as this run's
    targets measured them) of one latency-bound run."""
    SLEPT.clear()
    elapsed = timed(fn)
    ideal = N_SLEEP * SLEEP_S / SLEEP_BOUND
    return ideal / elapsed, N_SLEEP * statistics.mean(SLEPT) / SLEEP_BOUND / elapsed


def timed(fn) -> float:
    t = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - t
    assert len(out) in (N_NOOP, N_SLEEP)
    return elapsed


def run_parallel(target, items, bound: int, bus: str):
    return parallel(target, items, max_concurrency=bound, max_items=len(items), bus=bus)


def run_threads(target, items, bound: int):
    with concurrent.futures.ThreadPoolExecutor(max_workers=bound) as pool:
        return list(pool.map(target, items))


def run_asyncio(target, items, bound: int, is_async: bool):
    async def main():
        sem = asyncio.Semaphore(bound)

        async def one(x):
            async with sem:
                return await target(x) if is_async else target(x)

        return await asyncio.gather(*(one(x) for x in items))

    return asyncio.run(main())


def _one_call(kind: str):
    """One call of ``N_PER_CALL`` no-op items by ``kind``."""
    items = list(range(N_PER_CALL))
    if kind == "threads":
        return lambda: run_threads(noop, items, N_PER_CALL)
    if kind == "asyncio":
        return lambda: run_asyncio(noop, items, N_PER_CALL, False)
    if kind == "zmq":   # no bus=: the default a user gets (the process-wide runtime's)
        return lambda: parallel(noop, items, max_concurrency=N_PER_CALL,
                                max_items=N_PER_CALL)
    return lambda: parallel(noop, items, max_concurrency=N_PER_CALL, max_items=N_PER_CALL,
                            bus=kind)


def per_call(kinds: list[str]) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per call of ``N_PER_CALL`` no-op items, ``CALLS`` warm calls of each kind
    taking turns call by call; and the process's CPU seconds per call of each."""
    calls = {kind: _one_call(kind) for kind in kinds}
    for kind, one in calls.items():
        assert one() == list(range(N_PER_CALL))   # warm: runtime, imports, first threads
    spans: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu = dict.fromkeys(kinds, 0.0)
    for _ in range(CALLS):
        for kind, one in calls.items():
            c, t = time.process_time(), time.perf_counter()
            one()
            spans[kind].append(time.perf_counter() - t)
            cpu[kind] += time.process_time() - c
    return spans, {kind: total / CALLS for kind, total in cpu.items()}


class WarmThreads:
    """``SLEEP_BOUND`` threads started once and woken per call, each taking the next item
    under one lock until none is left: warm threads (as ``parallel()``'s are) and no
    coordination at all (no order, no cancellation, no results kept), the best a Python
    runner gets on this machine; beside the latency-bound row as its ceiling."""

    def __init__(self, target, bound: int) -> None:
        import threading

        self.target = target
        self.go = [threading.Semaphore(0) for _ in range(bound)]
        self.done = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.it = iter(())
        for go in self.go:
            threading.Thread(target=self._loop, args=(go,), daemon=True).start()

    def _loop(self, go) -> None:
        lock, target = self.lock, self.target
        while True:
            go.acquire()
            while True:
                with lock:
                    x = next(self.it, None)
                if x is None:
                    break
                target(x)
            self.done.release()

    def map(self, items) -> list:
        self.it = iter(items)
        for go in self.go:
            go.release()
        for _ in self.go:
            self.done.acquire()
        return list(items)


def _measure_sleep() -> float:
    """Mean duration of ``time.sleep(SLEEP_S)`` with 32 threads sleeping at once."""
    import threading

    spans: list[float] = []
    lock = threading.Lock()

    def sleeper():
        for _ in range(20):
            t = time.perf_counter()
            time.sleep(SLEEP_S)
            with lock:
                spans.append(time.perf_counter() - t)

    threads = [threading.Thread(target=sleeper) for _ in range(SLEEP_BOUND)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return statistics.mean(spans)


def _label(bus: str) -> str:
    return f"parallel(), bus={bus}" + (" (the default)" if bus == "zmq" else "")


def _print_cpu(cpus: dict[str, list[float]], contenders) -> None:
    base = stats(cpus["ThreadPoolExecutor.map"])[1]
    print("CPU of the process per warm call of 4 no-op items (median of repeats): " + "; ".join(
        f"{label} {stats(cpus[label])[1] * 1e6:,.0f} us "
        f"({stats(cpus[label])[1] / base:.2f}x)" for label, _ in contenders))


def _per_call_only(repeats: int, contenders, buses) -> dict:
    calls: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    for _ in range(repeats):
        spans, cpu = per_call([kind for _, kind in contenders])
        for label, kind in contenders:
            calls.setdefault(label, []).append(statistics.median(spans[kind]))
            cpus.setdefault(label, []).append(cpu[kind])
    base = stats(calls["ThreadPoolExecutor.map"])[1]
    rows = [(f"per call, {N_PER_CALL} no-op items, warm", label, fmt3(calls[label], 1e6) + " us",
             f"{stats(calls[label])[1] / base:.2f}x ThreadPoolExecutor(4) created per call")
            for label, _ in contenders]
    print(f"a warm call of {N_PER_CALL} no-op items, {repeats} repeats of {CALLS} calls "
          "taking turns, median (min-max)")
    print(table(rows, ("workload", "runner", "figure", "read as")))
    _print_cpu(cpus, contenders)
    verdict = {bus: stats(calls[_label(bus)])[1] / base for bus in buses}
    for bus, cost in verdict.items():
        print(f"{_label(bus)}: {cost:.2f}x a ThreadPoolExecutor(4) made per call "
              f"(target <= 1.0: {'met' if cost <= 1.0 else 'NOT met'})")
    return {"per_call": calls, "cpu": cpus, "verdict": verdict}


#: Where a call counted by ``--calls`` is made (the first match of its file's path).
COMPONENTS = (("actors/machines/", "Collector (the pure machine)"),
              ("actors/runtime/shell.py", "Collector shell"),
              ("actors/groups/worker.py", "branch runner"),
              ("actors/groups/host.py", "branch runner"),
              ("actors/usage.py", "branch runner"),
              ("actors/groups/types.py", "branch runner"),
              ("actors/groups/pool.py", "pool binding"),
              ("pykka", "pool binding"),
              ("bus/", "lane (bus)"),
              ("protocol/", "lane (bus)"),
              ("actors/", "driver (front door, setup, outcome)"),
              ("<string>", "driver (front door, setup, outcome)"),
              ("concurrent/futures", "ThreadPoolExecutor"),
              ("threading.py", "threading"),
              ("queue.py", "threading"))


def _component(filename: str) -> str:
    for key, name in COMPONENTS:
        if key in filename:
            return name
    return "other"


def call_counts(kinds: list[str], calls: int = 200) -> dict[str, dict[str, tuple[float, float]]]:
    """(Python-level calls, C calls) per warm call of each kind, by component, counted
    on every thread (sys.setprofile and threading.setprofile: threads started earlier
    are not seen, hence a fresh process)."""
    import sys
    import threading
    counts: dict = {}
    on = [None]

    def profile(frame, event, arg):
        if on[0] is None or event not in ("call", "c_call"):
            return
        key = (_component(frame.f_code.co_filename), event)
        on[0][key] = on[0].get(key, 0) + 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        for kind in kinds:
            one = _one_call(kind)
            for _ in range(3):
                one()   # warm: the runtime, its worker threads (profiled from their start)
            on[0] = counts[kind] = {}
            for _ in range(calls):
                one()
            on[0] = None
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return {kind: {name: (got.get((name, "call"), 0) / calls, got.get((name, "c_call"), 0) / calls)
                   for name in {n for n, _ in got}} for kind, got in counts.items()}


def _print_counts(counts, contenders) -> None:
    labels = {kind: label for label, kind in contenders}
    for kind, by in counts.items():
        py, c = sum(p for p, _ in by.values()), sum(c for _, c in by.values())
        print(f"{labels[kind]}: {py + c:,.0f} calls per warm call ({py:,.0f} Python-level, "
              f"{c:,.0f} C calls made by them)")
        for name, (p, cc) in sorted(by.items(), key=lambda kv: -sum(kv[1])):
            print(f"    {p + cc:7.1f}  {name} ({p:.0f} + {cc:.0f} C)")


def fmt3(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    lo, med, hi = stats([v * scale for v in values])
    f = f"{{:,.{digits}f}}"
    return f"{f.format(med)} ({f.format(lo)}-{f.format(hi)})"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bus", default="both", choices=["zmq", "memory", "both"],
                   help="the bus of the runtime each parallel() call starts (default: both)")
    p.add_argument("--only", choices=["per-call"], default=None,
                   help="run one row alone")
    p.add_argument("--calls", action="store_true",
                   help="count the calls of one warm call by component (alone; a fresh process)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    buses = ["zmq", "memory"] if args.bus == "both" else [args.bus]
    noop_items = list(range(N_NOOP))
    sleep_items = list(range(N_SLEEP))
    ideal = N_SLEEP * SLEEP_S / SLEEP_BOUND

    rates: dict[str, list[float]] = {}
    effs: dict[str, list[float]] = {}
    calls: dict[str, list[float]] = {}
    contenders = [(_label(bus), bus) for bus in buses] + [
        ("ThreadPoolExecutor.map", "threads"), ("asyncio.gather + Semaphore", "asyncio")]
    if args.calls:
        counts = call_counts([kind for _, kind in contenders if kind != "asyncio"])
        _print_counts(counts, contenders)
        return {"calls": counts}
    if args.only == "per-call":
        return _per_call_only(args.repeats, contenders, buses)
    cpus: dict[str, list[float]] = {}
    measured: dict[str, list[float]] = {}   # against the sleeps as measured (see sleep_run)
    warm = WarmThreads(nap, SLEEP_BOUND)
    warm_label = f"{SLEEP_BOUND} warm threads, next item under a lock (no coordination)"
    # Interleaved, so a burst of load on the machine hits every contender alike.
    for _ in range(args.repeats):
        eff, vs = sleep_run(lambda: warm.map(sleep_items))
        effs.setdefault(warm_label, []).append(eff)
        measured.setdefault(warm_label, []).append(vs)
        spans, cpu = per_call([kind for _, kind in contenders])
        for label, kind in contenders:
            calls.setdefault(label, []).append(statistics.median(spans[kind]))
            cpus.setdefault(label, []).append(cpu[kind])
        for label, kind in contenders:
            if kind == "threads":
                n = timed(lambda: run_threads(noop, noop_items, NOOP_BOUND))
                eff, vs = sleep_run(lambda: run_threads(nap, sleep_items, SLEEP_BOUND))
            elif kind == "asyncio":
                n = timed(lambda: run_asyncio(noop, noop_items, NOOP_BOUND, False))
                eff, vs = sleep_run(lambda: run_asyncio(anap, sleep_items, SLEEP_BOUND, True))
            else:
                n = timed(lambda k=kind: run_parallel(noop, noop_items, NOOP_BOUND, k))
                eff, vs = sleep_run(lambda k=kind: run_parallel(nap, sleep_items, SLEEP_BOUND, k))
            rates.setdefault(label, []).append(N_NOOP / n)
            effs.setdefault(label, []).append(eff)
            measured.setdefault(label, []).append(vs)

    base = stats(rates["ThreadPoolExecutor.map"])[1]
    rows = []
    for label, _ in contenders:
        bound = f"({NOOP_BOUND})" if "parallel" not in label else f" max_concurrency={NOOP_BOUND}"
        rows.append(("no-op x 20,000", label + bound, fmt3(rates[label]) + " items/s",
                     f"{stats(rates[label])[1] / base:.2f}x ThreadPoolExecutor(4)"))
    for label, _ in contenders:
        bound = f"({SLEEP_BOUND})" if "parallel" not in label else f" max_concurrency={SLEEP_BOUND}"
        rows.append(("sleep 5 ms x 2,000", label + bound, fmt3(effs[label], 1, 3),
                     "efficiency (ideal / elapsed)"))
    rows.append(("sleep 5 ms x 2,000", warm_label, fmt3(effs[warm_label], 1, 3),
                 "efficiency (ideal / elapsed): the best a Python runner gets here"))
    per_base = stats(calls["ThreadPoolExecutor.map"])[1]
    for label, _ in contenders:
        bound = f"({N_PER_CALL})" if "parallel" not in label else \
            f" max_concurrency={N_PER_CALL}"
        rows.append((f"per call, {N_PER_CALL} no-op items, warm", label + bound,
                     fmt3(calls[label], 1e6) + " us",
                     f"{stats(calls[label])[1] / per_base:.2f}x ThreadPoolExecutor(4) "
                     "created per call"))
    slept = statistics.median(_measure_sleep() for _ in range(3))
    print(f"bounded parallel groups, {args.repeats} repeats, median (min-max); ideal for the "
          f"sleep workload {ideal:.4f} s")
    print(f"time.sleep({SLEEP_S * 1000:g} ms) takes {slept * 1000:.3f} ms here (32 threads): "
          f"no runner can exceed an efficiency of {SLEEP_S / slept:.3f} on this machine")
    print(table(rows, ("workload", "runner", "figure", "read as")))
    print("latency-bound, against the measured sleep (a second figure, not the target's: "
          "2,000 x the mean sleep as each run's targets measured it / 32 / elapsed, what each "
          "runner makes of the sleep the machine gave it): " + "; ".join(
              f"{label} {fmt3(measured[label], 1, 3)}"
              for label in [lb for lb, _ in contenders] + [warm_label]))
    print()
    _print_cpu(cpus, contenders)
    verdict = {}
    for bus in buses:
        label = _label(bus)
        ratio = stats(rates[label])[1] / base
        eff = stats(effs[label])[1]
        cost = stats(calls[label])[1] / per_base
        verdict[bus] = (ratio, eff)
        print(f"{label}: no-op throughput {ratio:.2f}x ThreadPoolExecutor(4) (target >= 1.0: "
              f"{'met' if ratio >= 1.0 else 'NOT met'}); latency-bound efficiency {eff:.3f} "
              f"(target >= 0.95: {'met' if eff >= 0.95 else 'NOT met'}; "
              f"ThreadPoolExecutor(32) {stats(effs['ThreadPoolExecutor.map'])[1]:.3f}, "
              f"{SLEEP_BOUND} warm threads {stats(effs[warm_label])[1]:.3f} here); "
              f"a warm call of {N_PER_CALL} no-op items {cost:.2f}x a ThreadPoolExecutor(4) "
              f"made per call (target <= 1.0: {'met' if cost <= 1.0 else 'NOT met'})")
    return {"noop": rates, "sleep": effs, "per_call": calls, "verdict": verdict}


if __name__ == "__main__":
    main()
