"""Two checkouts of evobus, one group workload, alternating processes: is a change to the
group runtime better, worse or noise? (Not part of ``python -m bench``: it compares
source trees, not evobus against a baseline.)

    git worktree add /tmp/evobus-base HEAD~1
    python -m bench.group_ab /tmp/evobus-base . [--rounds 8] [--calls 4]

Each round runs one process per checkout (the order alternates round by round, so a
burst of load on the machine hits both alike); each process makes one warm-up call,
then ``--calls`` calls of ``parallel()`` over 2,000 items that sleep 5 ms at
``max_concurrency=32`` (bench/group.py's latency-bound workload) and reports each
call's efficiency, ``ideal / elapsed``. Printed: per checkout, the median, mean and
range over every call, and the difference of the medians.
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
from bench.group import N_SLEEP, SLEEP_BOUND, SLEEP_S, nap
items = list(range(N_SLEEP))
ideal = N_SLEEP * SLEEP_S / SLEEP_BOUND
parallel(nap, items[:2 * SLEEP_BOUND], max_concurrency=SLEEP_BOUND, max_items=N_SLEEP)
effs = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    parallel(nap, items, max_concurrency=SLEEP_BOUND, max_items=N_SLEEP)
    effs.append(ideal / (time.perf_counter() - t))
print(json.dumps(effs))
"""


def run_one(root: str, calls: int) -> list[float]:
    out = subprocess.run([sys.executable, "-c", _CHILD, root, str(calls)], cwd=root,
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
    args = p.parse_args(argv)
    roots = [os.path.abspath(args.a), os.path.abspath(args.b)]
    for root in roots:
        if not (os.path.isfile(os.path.join(root, "actors", "groups.py"))
                or os.path.isdir(os.path.join(root, "actors", "groups"))):
            raise SystemExit(f"{root}: not a checkout of evobus (no actors/groups)")
    effs: dict[str, list[float]] = {root: [] for root in roots}
    for r in range(args.rounds):
        for root in roots if r % 2 == 0 else roots[::-1]:
            effs[root] += run_one(root, args.calls)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    for root in roots:
        v = effs[root]
        print(f"{root}: efficiency median {statistics.median(v):.4f}, mean "
              f"{statistics.mean(v):.4f}, {min(v):.3f}-{max(v):.3f} over {len(v)} calls")
    diff = statistics.median(effs[roots[1]]) - statistics.median(effs[roots[0]])
    print(f"b - a: {diff:+.4f} (medians)")
    return effs


if __name__ == "__main__":
    main()
