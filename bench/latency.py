"""Heavy-tailed rollout latency: how well sync and async pack it, against the ideal.

Each rollout sleeps a seeded lognormal duration (median 20 ms, sigma 1, capped at
400 ms; the draw is a function of the task id, so every configuration sleeps the same
draws). For n_workers in 1, 2, 4, 8, 16, sync and async:

    efficiency = (sum of sleep / n_workers) / wall

beside the ideal for the same draws, two ways: the bound (sum / n, or the longest
single rollout if larger; per round for sync, whose rounds end at a barrier) and the
packing a scheduler that knew every duration in advance would reach (longest first,
LPT; over the whole run for async, per round for sync). The wall clock is read
from the message log (first lease batch to last settled lease), so start-up and the
baseline held-out evaluation are not counted.

    python -m bench.latency [--tasks 200] [--rounds 3] [--repeats 1] [--ns 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import tempfile
import time

from actors import AppendRules, DataParallel, Task, evolve
from actors.machines.planner import split_tasks
from bench.common import stats, table
from bus.log import read_log
from protocol import LeaseBatch, LeaseDone, decode

MEDIAN_S, SIGMA, CAP_S = 0.020, 1.0, 0.400


def draw(task_id: str, seed: int = 0) -> float:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{task_id}".encode()).digest()[:8], "big")
    return min(CAP_S, random.Random(h).lognormvariate(math.log(MEDIAN_S), SIGMA))


def sleepy_run(rendered: str, task: Task) -> str:
    time.sleep(task.meta["sleep"])
    return "ok"


def solved(task: Task, output: str) -> float:
    return 1.0


def no_proposal(rendered, task, output, score):
    return None


def wall_from_log(path: str) -> float:
    first = last = None
    for rec in read_log(path).records:
        msg = decode(rec.body)
        if isinstance(msg, LeaseBatch) and first is None:
            first = rec.t
        if isinstance(msg, LeaseDone) and msg.kind == "rollout":
            last = rec.t
    return last - first


def one(n: int, asynchronous: bool, tasks: list[Task], rounds: int, lease_size) -> tuple:
    """(efficiency, bound ideal, packing ideal). The packing ideal is LPT when tasks are
    leased one by one, and the longest DataParallel shard per round when each worker
    gets its whole share (what a barrier round with static shards can reach at best)."""
    train, _ = split_tasks([t.id for t in tasks], 0.1, 0)
    sleeps = {t.id: t.meta["sleep"] for t in tasks}
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "lat.evolog")
        kw = dict(max_rollouts=rounds * len(train)) if asynchronous else dict(rounds=rounds)
        evolve(tasks, solved, run=sleepy_run, propose=no_proposal, strategy=AppendRules(),
               parallel=DataParallel(),  # whole-shard leases: the workload measured
               n_workers=n, held_out_frac=0.1, seed=0, log=log, asynchronous=asynchronous,
               lease_size=lease_size, **kw)
        wall = wall_from_log(log)
    total = sum(sleeps[t] for t in train) * rounds
    longest = max(sleeps[t] for t in train)
    if asynchronous:
        ideal_wall = max(total / n, longest)
        lpt_wall = lpt([sleeps[t] for t in train] * rounds, n)
    elif lease_size is None:
        ideal_wall = max(sum(sleeps[t] for t in train) / n, longest) * rounds
        lpt_wall = sum(max(sum(sleeps[t] for t in unit.keys) for unit in
                           DataParallel().plan(n, r, train)) for r in range(rounds))
    else:
        ideal_wall = max(sum(sleeps[t] for t in train) / n, longest) * rounds
        lpt_wall = lpt([sleeps[t] for t in train], n) * rounds
    return (total / n) / wall, (total / n) / ideal_wall, (total / n) / lpt_wall


def lpt(durations: list[float], n: int) -> float:
    """Makespan of longest-processing-time-first packing: what a scheduler that knew
    every duration in advance would reach (within 4/3 of optimal)."""
    import heapq

    loads = [0.0] * n
    for d in sorted(durations, reverse=True):
        heapq.heapreplace(loads, loads[0] + d)
    return max(loads)


def main(argv=None) -> list[tuple]:
    p = argparse.ArgumentParser(description="latency packing, sync and async")
    p.add_argument("--tasks", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ns", default="1,2,4,8,16")
    p.add_argument("--lease-size", type=int, default=1,
                   help="tasks per lease for the leased rows (the first row always sends "
                        "each worker its whole share)")
    args = p.parse_args(argv)
    tasks = [Task(f"t{i}", f"task {i}", {}) for i in range(args.tasks)]
    tasks = [Task(t.id, t.prompt, {"sleep": draw(t.id)}) for t in tasks]
    rows = []
    modes = [("sync, whole shares", False, None),
             (f"sync, lease_size={args.lease_size}", False, args.lease_size),
             (f"async, lease_size={args.lease_size}", True, args.lease_size)]
    for n in [int(x) for x in args.ns.split(",")]:
        for mode, asynchronous, lease_size in modes:
            effs, ideals, lpts = [], [], []
            for _ in range(args.repeats):
                eff, ideal, lpt_ideal = one(n, asynchronous, tasks, args.rounds, lease_size)
                effs.append(eff)
                ideals.append(ideal)
                lpts.append(lpt_ideal)
            lo, med, hi = stats(effs)
            ideal, lpt_ideal = stats(ideals)[1], stats(lpts)[1]
            rows.append((n, mode, f"{med:.3f} ({lo:.3f}-{hi:.3f})", f"{ideal:.3f}",
                         f"{lpt_ideal:.3f}", f"{med - lpt_ideal:+.3f}"))
    print(f"lognormal rollouts (median 20 ms, sigma 1, cap 400 ms), {args.tasks} tasks, "
          f"{args.rounds} rounds, lease size {args.lease_size}, {args.repeats} repeats")
    print(table(rows, ("n", "mode", "efficiency (min-max)", "bound", "packing ideal",
                       "vs packing ideal")))
    return rows


if __name__ == "__main__":
    main()
