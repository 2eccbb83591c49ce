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
32 bare threads (started per call) and 32 warm threads (started once, woken per call:
the best a Python runner gets here) each taking the next item under a lock, in the same
process (the order alternates call by call), and reports each call's efficiency, ``ideal / elapsed``, and
the process's CPU per item (``--slots``: instead, where each slot's time goes in those
calls, and how many answers, parts, steals and mailbox messages each call made).
Printed: per checkout, the median, mean and range over every
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
timeline = sys.argv[4] == "1"
spans = [None] * N_SLEEP
clock = time.perf_counter


def nap_timed(x: int) -> int:
    # The same sleep, its start and end kept (for every runner alike, with --timeline).
    t = clock()
    time.sleep(SLEEP_S)
    spans[x] = (t, clock())
    return x


target = nap_timed if timeline else nap
parallel(target, items[:2 * SLEEP_BOUND], max_concurrency=SLEEP_BOUND, max_items=N_SLEEP,
         bus=bus)


def group():
    parallel(target, items, max_concurrency=SLEEP_BOUND, max_items=N_SLEEP, bus=bus)


def threads():
    run_threads(target, items, SLEEP_BOUND)


def bare():
    # 32 plain threads taking the next item under one lock: no pool, no futures.
    it, lock = iter(items), threading.Lock()

    def loop():
        while True:
            with lock:
                x = next(it, None)
            if x is None:
                return
            target(x)

    ts = [threading.Thread(target=loop) for _ in range(SLEEP_BOUND)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


class Warm:
    # 32 threads started once, each woken per call to take the next item under one lock
    # until none is left: warm threads (as parallel()'s are) and no coordination at all,
    # the best a Python runner gets here.
    def __init__(self):
        self.go = [threading.Semaphore(0) for _ in range(SLEEP_BOUND)]
        self.done = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.it = iter(())
        for go in self.go:
            threading.Thread(target=self.loop, args=(go,), daemon=True).start()

    def loop(self, go):
        lock = self.lock
        while True:
            go.acquire()
            while True:
                with lock:
                    x = next(self.it, None)
                if x is None:
                    break
                target(x)
            self.done.release()

    def __call__(self):
        self.it = iter(items)
        for go in self.go:
            go.release()
        for _ in self.go:
            self.done.acquire()


def shape(t0, t1):
    # Where the call's time went: the mean sleep as the target measured it, the mean
    # start of the first SLEEP_BOUND branches after the call, the tail after the last
    # one's end, and the mean gap between a slot's end and the next start.
    starts = sorted(s for s, _ in spans)
    ends = sorted(e for _, e in spans)
    slept = sum(e - s for s, e in spans) / N_SLEEP
    gaps = [starts[k] - ends[k - SLEEP_BOUND] for k in range(SLEEP_BOUND, N_SLEEP)]
    return {"sleep_ms": slept * 1e3,
            "ramp_ms": (sum(starts[:SLEEP_BOUND]) / SLEEP_BOUND - t0) * 1e3,
            "tail_ms": (t1 - ends[-1]) * 1e3, "gap_ms": sum(gaps) / len(gaps) * 1e3,
            "vs_sleep": N_SLEEP * slept / SLEEP_BOUND / (t1 - t0)}


runs = {"group": group, "threads": threads, "bare": bare, "warm": Warm()}
effs = {name: [] for name in runs}
cpu = {name: [] for name in runs}
shapes = {name: [] for name in runs}
for k in range(int(sys.argv[2])):
    for name, fn in list(runs.items())[::1 if k % 2 == 0 else -1]:
        c, t = time.process_time(), clock()
        fn()
        t1 = clock()
        effs[name].append(ideal / (t1 - t))
        cpu[name].append((time.process_time() - c) / N_SLEEP)
        if timeline:
            shapes[name].append(shape(t, t1))
print(json.dumps([effs, cpu, shapes]))
"""


_SLOTS = r"""
import collections, json, sys, threading, time
sys.path.insert(0, sys.argv[1])
import pykka
from actors import parallel
from actors.groups import host as H, worker as W
from bench.group import N_SLEEP, SLEEP_BOUND, SLEEP_S
items = list(range(N_SLEEP))
ideal = N_SLEEP * SLEEP_S / SLEEP_BOUND
bus = sys.argv[3]
acc = collections.defaultdict(lambda: collections.defaultdict(float))
count = collections.Counter()
local = threading.local()


def enter(what):   # exclusive time per thread: a nested category pauses its parent
    stack = getattr(local, "stack", None)
    if stack is None:
        stack = local.stack = []
    stack.append([what, time.perf_counter(), 0.0])


def leave():
    what, t, inner = local.stack.pop()
    dt = time.perf_counter() - t
    acc[threading.get_ident()][what] += dt - inner
    if local.stack:
        local.stack[-1][2] += dt
    return t, dt


def timed(what, fn, counted=None):
    def wrapper(*a, **k):
        enter(what)
        try:
            return fn(*a, **k)
        finally:
            t, dt = leave()
            if counted:
                count[counted] += 1
            if what == "lease" and not local.stack:   # a slot's first and last lease
                mine = acc[threading.get_ident()]
                mine.setdefault("first", t)
                mine["last"] = t + dt
    return wrapper


def nap(x: int) -> int:
    enter("sleep")
    time.sleep(SLEEP_S)
    leave()
    return x


W.BranchRunner.run = timed("lease", W.BranchRunner.run, "parts")
W.BranchRunner._answer = timed("answer", W.BranchRunner._answer, "answers")
H._StartOrder.wait = timed("turn", H._StartOrder.wait)
W.GroupWorker._steal = timed("steal", W.GroupWorker._steal, "steal looks")
tell = pykka.ActorRef.tell


def counted_tell(self, msg):
    count["mailbox messages"] += 1
    return tell(self, msg)


pykka.ActorRef.tell = counted_tell
parallel(nap, items[:2 * SLEEP_BOUND], max_concurrency=SLEEP_BOUND, max_items=N_SLEEP, bus=bus)
rows = []
for k in range(int(sys.argv[2])):
    acc.clear()
    count.clear()
    t0 = time.perf_counter()
    parallel(nap, items, max_concurrency=SLEEP_BOUND, max_items=N_SLEEP, bus=bus)
    wall = time.perf_counter() - t0
    slots = SLEEP_BOUND * wall
    total = collections.Counter()
    for mine in acc.values():
        for what, v in mine.items():
            if what not in ("first", "last"):
                total[what] += v
    start = sum(m["first"] - t0 for m in acc.values() if "first" in m) \
        + (SLEEP_BOUND - len(acc)) * wall
    tail = sum(t0 + wall - m["last"] for m in acc.values() if "last" in m)
    share = {"sleep (5 ms each)": N_SLEEP * SLEEP_S / slots,
             "oversleep": (total["sleep"] - N_SLEEP * SLEEP_S) / slots,
             "turn waits": total["turn"] / slots, "looking for a branch": total["steal"] / slots,
             "answer path": total["answer"] / slots, "rest of a lease": total["lease"] / slots,
             "before the first lease": start / slots, "after the last lease": tail / slots}
    share["between leases"] = 1 - sum(share.values())
    rows.append({"efficiency": ideal / wall, "share": share, "count": dict(count)})
print(json.dumps(rows))
"""


def slots(root: str, calls: int, bus: str) -> list[dict]:
    """Where each slot's time goes in ``calls`` latency-bound calls of ``root``'s
    parallel(): per call, the efficiency, each category's share of 32 slots x the wall
    clock (exclusive time per thread), and counts (answers, parts, steals, mailbox
    messages)."""
    out = subprocess.run([sys.executable, "-c", _SLOTS, root, str(calls), bus], cwd=root,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{root}: the child failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_slots(roots: list[str], rounds: int, calls: int, bus: str) -> dict:
    rows: dict[str, list[dict]] = {root: [] for root in roots}
    loads = [os.getloadavg()[0]]
    for r in range(rounds):
        for root in roots if r % 2 == 0 else roots[::-1]:
            rows[root] += slots(root, calls, bus)
        loads.append(os.getloadavg()[0])
    print(f"where each slot's time goes, bus {bus}; load average (1 min) "
          f"{min(loads):.1f}-{max(loads):.1f}; means over {rounds * calls} calls (shares "
          "of 32 slots x the wall clock; efficiency: median and mean)")
    mean = statistics.mean
    for root in roots:
        got = rows[root]
        effs = [r["efficiency"] for r in got]
        print(f"{root}: efficiency {statistics.median(effs):.3f} (mean {mean(effs):.3f})")
        for what in got[0]["share"]:
            print(f"  {what:24s} {mean(r['share'][what] for r in got):7.1%}")
        for what in sorted({k for r in got for k in r["count"]}):
            print(f"  {what:24s} {mean(r['count'].get(what, 0) for r in got):7.0f} a call")
    return rows


RUNNERS = ("group", "threads", "bare", "warm")
LABELS = {"group": "parallel()", "threads": "ThreadPoolExecutor(32)",
          "bare": "32 bare threads", "warm": "32 warm threads"}


def run_one(root: str, calls: int, bus: str = "zmq", timeline: bool = False
            ) -> tuple[dict, dict, dict]:
    """Per runner (``group``: parallel(), ``threads``: the thread pool, ``bare``: 32 plain
    threads started per call, ``warm``: 32 threads started once and woken per call, both
    taking the next item under a lock), the efficiency of each of ``calls`` calls, the
    process's CPU seconds per item and, with ``timeline``, the shape of each call (the
    mean sleep as measured, the ramp, the tail, the mean gap; see ``_CHILD``)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, root, str(calls), bus,
                          "1" if timeline else "0"], cwd=root,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{root}: the child failed:\n{out.stderr}")
    effs, cpu, shapes = json.loads(out.stdout.strip().splitlines()[-1])
    return effs, cpu, shapes


def _print_shapes(roots: list[str], shapes: dict) -> None:
    med = statistics.median
    print("where a call's time goes (medians over the calls; the sleep as the target "
          "measured it; against the measured sleep: N x that sleep / 32 / elapsed, a second "
          "figure beside the efficiency against the nominal 5 ms)")
    for root in roots:
        print(root)
        for name in RUNNERS:
            got = shapes[root][name]
            print(f"  {LABELS[name]:24s} sleep {med(g['sleep_ms'] for g in got):.3f} ms, "
                  f"ramp {med(g['ramp_ms'] for g in got):.2f} ms, "
                  f"tail {med(g['tail_ms'] for g in got):.2f} ms, "
                  f"gap {med(g['gap_ms'] for g in got) * 1e3:.0f} us; efficiency against "
                  f"the measured sleep {med(g['vs_sleep'] for g in got):.4f}")


def main(argv=None) -> dict[str, list[float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="a checkout of evobus (the baseline)")
    p.add_argument("b", help="another checkout (the change)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--bus", default="zmq", choices=["zmq", "memory"])
    p.add_argument("--slots", action="store_true",
                   help="instead: where each slot's time goes (sleep, oversleep, turn "
                        "waits, looking for a branch, answers, before the first and after "
                        "the last lease, between leases) and counts per call")
    p.add_argument("--timeline", action="store_true",
                   help="also: each runner's mean sleep as measured in the target, ramp "
                        "(the first 32 starts), tail and gaps, and its efficiency against "
                        "the measured sleep")
    args = p.parse_args(argv)
    roots = [os.path.abspath(args.a), os.path.abspath(args.b)]
    for root in roots:
        if not (os.path.isfile(os.path.join(root, "actors", "groups.py"))
                or os.path.isdir(os.path.join(root, "actors", "groups"))):
            raise SystemExit(f"{root}: not a checkout of evobus (no actors/groups)")
    if args.slots:
        return print_slots(roots, args.rounds, args.calls, args.bus)
    effs = {root: {name: [] for name in RUNNERS} for root in roots}
    cpu = {root: {name: [] for name in RUNNERS} for root in roots}
    shapes = {root: {name: [] for name in RUNNERS} for root in roots}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for root in roots if r % 2 == 0 else roots[::-1]:
            e, c, sh = run_one(root, args.calls, args.bus, args.timeline)
            for name in RUNNERS:
                effs[root][name] += e[name]
                cpu[root][name] += c[name]
                shapes[root][name] += sh[name]
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"bus {args.bus}; load average (1 min) {min(loads):.1f}-{max(loads):.1f} over the run")
    med = statistics.median
    for root in roots:
        v, t, b, w = (effs[root][name] for name in RUNNERS)
        print(f"{root}: efficiency median {med(v):.4f}, mean {statistics.mean(v):.4f}, "
              f"{min(v):.3f}-{max(v):.3f} over {len(v)} calls; ThreadPoolExecutor(32) beside it "
              f"{med(t):.4f}, 32 bare threads {med(b):.4f}, 32 warm threads {med(w):.4f} "
              f"({min(w):.3f}-{max(w):.3f}); median "
              f"ratio {med(g / p for g, p in zip(v, t)):.3f}x the thread pool, "
              f"{med(g / p for g, p in zip(v, b)):.3f}x bare threads, "
              f"{med(g / p for g, p in zip(v, w)):.3f}x warm threads; CPU per item "
              + ", ".join(f"{name} {med(cpu[root][name]) * 1e6:.1f} us" for name in RUNNERS))
    if args.timeline:
        _print_shapes(list(dict.fromkeys(roots)), shapes)
    diff = med(effs[roots[1]]["group"]) - med(effs[roots[0]]["group"])
    print(f"b - a: {diff:+.4f} (medians)")
    return {root: effs[root]["group"] for root in roots}


if __name__ == "__main__":
    main()
