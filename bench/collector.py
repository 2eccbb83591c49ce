"""The pure Collector's own CPU, per group and per lease: the machine fed the messages a
group of workers would send, no bus, no threads.

    python -m bench.collector                  # both workloads, best of --repeats
    python -m bench.collector --profile small  # cProfile of the 4-item group, top 25

Workloads (as ``parallel()`` starts them: ordered starts, prefetch 1, suspend "all"):

- ``small``: 4 no-op items on 4 workers, run ``--groups`` times (the warm-call case);
- ``latency``: 2,000 items of 5 ms at bound 32 (the latency-bound case), each worker
  answering the lease it got first.

``--module`` names another Collector (``pkg.mod``, or a file path) to compare against.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import importlib
import importlib.util
import pstats
import sys
import time

from protocol import Branch, BranchDone, GroupResult, GroupStart


def _load(module: str):
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_bench_collector", module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.Collector
    return importlib.import_module(module).Collector


def _start(n: int, bound: int, gid: str) -> GroupStart:
    return GroupStart(group_id=gid, items=list(range(n)),
                      workers=[f"w{i}" for i in range(bound)], max_concurrency=bound,
                      max_items=n, driver="d", prefetch=1, min_lease_seconds=0.01,
                      ordered=True, batch_below=0.0005, suspend="all",
                      waves=WAVES)


def run_group(collector_cls, n: int, bound: int, seconds: float, gid: str = "g") -> tuple:
    """One group to its end; returns (leases, result). Each worker answers its leases in
    the order it got them; workers take turns (a stand-in for equal latencies)."""
    c = collector_cls("c")
    held: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    turn: collections.deque[str] = collections.deque()
    result = None

    def take(out) -> None:
        nonlocal result
        for to, msg in out:
            if type(msg) is Branch:
                if not held[to]:
                    turn.append(to)
                held[to].append(msg)
            elif type(msg) is GroupResult:
                result = msg

    take(c.handle(_start(n, bound, gid)))
    for _ in range(10 * n + 10):   # bounded: every answer settles one lease
        if not turn:
            break
        worker = turn.popleft()
        lease = held[worker].popleft()
        if held[worker]:
            turn.append(worker)
        take(c.handle(BranchDone(group_id=gid, lease_id=lease.lease_id, worker=worker,
                                 indices=lease.indices, values=lease.items,
                                 elapsed=seconds * len(lease.indices))))
    assert result is not None and result.status == "completed", result
    assert result.results == list(range(n))
    return result.leases, result


WAVES = True
WORKLOADS = {"small": (4, 4, 0.0), "latency": (2000, 32, 0.005)}


def measure(collector_cls, workload: str, groups: int) -> tuple[float, float, int]:
    """CPU seconds per group, per lease, and the leases of a group."""
    n, bound, seconds = WORKLOADS[workload]
    leases = 0
    t0 = time.process_time()
    for g in range(groups):
        leases, _ = run_group(collector_cls, n, bound, seconds, gid=f"g{g}")
    cpu = (time.process_time() - t0) / groups
    return cpu, cpu / max(1, leases), leases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", default="actors.machines.collector")
    ap.add_argument("--groups", type=int, default=2000, help="small groups per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", choices=sorted(WORKLOADS))
    args = ap.parse_args(argv)
    cls = _load(args.module)
    counts = {"small": args.groups, "latency": max(1, args.groups // 200)}
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        measure(cls, args.profile, counts[args.profile])
        prof.disable()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
        return 0
    for workload in WORKLOADS:
        runs = [measure(cls, workload, counts[workload]) for _ in range(args.repeats)]
        cpu, per_lease, leases = min(runs)
        print(f"{workload:8s} {cpu * 1e6:10.1f} us/group  {per_lease * 1e6:7.2f} us/lease  "
              f"{leases} leases/group  (best of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
