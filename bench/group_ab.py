"""Two checkouts of evobus, one group workload, alternating processes: is a change to the
group runtime better, worse or noise? (Not part of ``python -m bench``: it compares
source trees, not evobus against a baseline.)

    git worktree add /tmp/evobus-base HEAD~1
    python -m bench.group_ab /tmp/evobus-base . [--rounds 8] [--calls 4] [--bus zmq|memory]

Each round runs one process per checkout (the order alternates round by round, so a
burst of load on the machine hits both alike); each process makes one warm-up call,
then ``--calls`` calls of ``parallel()`` over 2,000 items that sleep 5 ms at
``max_concurrency=32`` (bench/group.py's latency-bound workload) on ``--bus`` (default
zmq, parallel()'s), each next to a ``ThreadPoolExecutor(32).map`` of the same items in
the same process (which goes first alternates), and reports each call's efficiency,
``ideal / elapsed``. Printed: per checkout, the median, mean and range over every call,
the thread pool's median, the median of the per-call ratios to the thread pool, and the
difference of the medians. The load average is printed too: above ~2 on 2 cores the
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
import json, sys, time
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


effs, pool = [], []
for k in range(int(sys.argv[2])):
    for fn, into in ((group, effs), (threads, pool))[::1 if k % 2 == 0 else -1]:
        t = time.perf_counter()
        fn()
        into.append(ideal / (time.perf_counter() - t))
print(json.dumps([effs, pool]))
"""


def run_one(root: str, calls: int, bus: str = "zmq") -> tuple[list[float], list[float]]:
    """(parallel()'s efficiency, the thread pool's) for each of ``calls`` calls."""
    out = subprocess.run([sys.executable, "-c", _CHILD, root, str(calls), bus], cwd=root,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{root}: the child failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    effs: dict[str, list[float]] = {root: [] for root in roots}
    pool: dict[str, list[float]] = {root: [] for root in roots}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for root in roots if r % 2 == 0 else roots[::-1]:
            group, threads = run_one(root, args.calls, args.bus)
            effs[root] += group
            pool[root] += threads
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"bus {args.bus}; load average (1 min) {min(loads):.1f}-{max(loads):.1f} over the run")
    for root in roots:
        v, t = effs[root], pool[root]
        ratio = statistics.median(g / p for g, p in zip(v, t))
        print(f"{root}: efficiency median {statistics.median(v):.4f}, mean "
              f"{statistics.mean(v):.4f}, {min(v):.3f}-{max(v):.3f} over {len(v)} calls; "
              f"ThreadPoolExecutor(32) beside it {statistics.median(t):.4f}; median ratio "
              f"{ratio:.3f}x it")
    diff = statistics.median(effs[roots[1]]) - statistics.median(effs[roots[0]])
    print(f"b - a: {diff:+.4f} (medians)")
    return effs


if __name__ == "__main__":
    main()
