"""Two checkouts of evobus, one group workload, alternating processes: is a change to the
group runtime better, worse or noise? (Not part of ``python -m bench``: it compares
source trees, not evobus against a baseline.)

    git worktree add /tmp/evobus-base HEAD~1
    python -m bench.group_ab /tmp/evobus-base . [--rounds 8] [--calls 4] [--bus zmq|memory]

Each round runs one process per checkout (the order alternates round by round, so a
burst of load on the machine hits both alike); each process makes one warm-up call,
then ``--calls`` calls of ``parallel()`` over 2,000 items that sleep 5 ms at
``max_concurrency=32`` (bench/group.py's latency-bound workload) on ``--bus`` (default
zmq, parallel()'s), each next to a ``ThreadPoolExecutor(32).map`` of the same items and
32 bare threads taking the next item under a lock, in the same process (the order
alternates call by call), and reports each call's efficiency, ``ideal / elapsed``, and
the process's CPU per item. Printed: per checkout, the median, mean and range over every
call, the thread pool's and the bare threads' medians, the medians of the per-call
ratios to each, the CPU per item of each runner, and the difference of the medians. The load average is printed too: above ~2 on 2 cores the
machine, not the runner, sets most of the figure (time.sleep itself oversleeps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[1])
from actors import parallel
from bench.group import N_SLEEP, SLEEP_BOUND, SLEEP_S, nap, run_threads
items = list(range(N_SLEEP))
ideal = N_SLEEP * SLEEP_S / SLEEP_BOUND
bus = sys.argv[3]
parallel(nap, items[:2 * SLEEP_BOUND], max_concurrency=SLEEP_BOUND, max_items=N_SLEEP, bus=bus)


def group():
    parallel(nap, items, max_concurrency=SLEEP_BOUND, max_items=N_SLEEP, bus=bus)


def threads():
    run_threads(nap, items, SLEEP_BOUND)


def bare():
    # 32 plain threads taking the next item under one lock: no pool, no futures.
    it, lock = iter(items), threading.Lock()

    def loop():
        while True:
            with lock:
                x = next(it, None)
            if x is None:
                return
            nap(x)

    ts = [threading.Thread(target=loop) for _ in range(SLEEP_BOUND)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


runs = {"group": group, "threads": threads, "bare": bare}
effs = {name: [] for name in runs}
cpu = {name: [] for name in runs}
for k in range(int(sys.argv[2])):
    for name, fn in list(runs.items())[::1 if k % 2 == 0 else -1]:
        c, t = time.process_time(), time.perf_counter()
        fn()
        effs[name].append(ideal / (time.perf_counter() - t))
        cpu[name].append((time.process_time() - c) / N_SLEEP)
print(json.dumps([effs, cpu]))
"""


def run_one(root: str, calls: int, bus: str = "zmq") -> tuple[dict, dict]:
    """Per runner (``group``: parallel(), ``threads``: the thread pool, ``bare``: 32 plain
    threads), the efficiency of each of ``calls`` calls and the process's CPU seconds per
    item."""
    out = subprocess.run([sys.executable, "-c", _CHILD, root, str(calls), bus], cwd=root,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{root}: the child failed:\n{out.stderr}")
    effs, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return effs, cpu


def main(argv=None) -> dict[str, list[float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="a checkout of evobus (the baseline)")
    p.add_argument("b", help="another checkout (the change)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--bus", default="zmq", choices=["zmq", "memory"])
    args = p.parse_args(argv)
    roots = [os.path.abspath(args.a), os.path.abspath(args.b)]
    for root in roots:
        if not (os.path.isfile(os.path.join(root, "actors", "groups.py"))
                or os.path.isdir(os.path.join(root, "actors", "groups"))):
            raise SystemExit(f"{root}: not a checkout of evobus (no actors/groups)")
    effs = {root: {"group": [], "threads": [], "bare": []} for root in roots}
    cpu = {root: {"group": [], "threads": [], "bare": []} for root in roots}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for root in roots if r % 2 == 0 else roots[::-1]:
            e, c = run_one(root, args.calls, args.bus)
            for name in effs[root]:
                effs[root][name] += e[name]
                cpu[root][name] += c[name]
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"bus {args.bus}; load average (1 min) {min(loads):.1f}-{max(loads):.1f} over the run")
    med = statistics.median
    for root in roots:
        v, t, b = (effs[root][name] for name in ("group", "threads", "bare"))
        print(f"{root}: efficiency median {med(v):.4f}, mean {statistics.mean(v):.4f}, "
              f"{min(v):.3f}-{max(v):.3f} over {len(v)} calls; ThreadPoolExecutor(32) beside it "
              f"{med(t):.4f}, 32 bare threads {med(b):.4f}; median "
              f"ratio {med(g / p for g, p in zip(v, t)):.3f}x the thread pool, "
              f"{med(g / p for g, p in zip(v, b)):.3f}x bare threads; CPU per item "
              + ", ".join(f"{name} {med(cpu[root][name]) * 1e6:.1f} us"
                          for name in ("group", "threads", "bare")))
    diff = med(effs[roots[1]]["group"]) - med(effs[roots[0]]["group"])
    print(f"b - a: {diff:+.4f} (medians)")
    return {root: effs[root]["group"] for root in roots}


if __name__ == "__main__":
    main()
