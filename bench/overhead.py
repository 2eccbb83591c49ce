"""No-op rollouts per second through the full synchronous topology (4 workers), beside
the same ``run()`` fanned out by ``concurrent.futures.ThreadPoolExecutor`` in the same
process (the ratio is what to read: the machine is shared and noisy).

    python -m bench.overhead [--tasks 4000] [--rounds 5] [--repeats 3]

Two workloads: no proposals (every rollout solves its task), and a proposal on every
rollout (every rollout fails and proposes a distinct rule, AppendRules fuses them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging

from actors import AppendRules, DataParallel, Task, evolve
from bench.common import fmt, measure, stats, table


def make_tasks(n: int) -> list[Task]:
    return [Task(f"t{i}", f"task {i}") for i in range(n)]


def run(rendered: str, task: Task) -> str:
    return task.id


def solved(task: Task, output: str) -> float:
    return 1.0


def failed(task: Task, output: str) -> float:
    return 0.0


def propose_nothing(rendered, task, output, score):
    return None


def propose_rule(rendered, task, output, score):
    return f"rule for {task.id}"


def evobus_rate(tasks, reward, propose, rounds: int, n_workers: int, bus: str) -> float:
    result = evolve(tasks, reward, run=run, propose=propose, strategy=AppendRules(),
                    parallel=DataParallel(),  # whole-shard leases: the workload measured
                    rounds=rounds, n_workers=n_workers, seed=0, bus=bus)
    return result.rollouts / result.elapsed


def threadpool_rate(tasks, reward, rounds: int, n_workers: int) -> float:
    import time

    def one(task):
        return reward(task, run("", task))

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=n_workers) as pool:
        n = 0
        for _ in range(rounds):
            n += sum(1 for _ in pool.map(one, tasks))
    return n / (time.perf_counter() - t)


def main(argv=None) -> list[tuple]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bus", default="zmq", choices=["zmq", "memory"])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    tasks = make_tasks(args.tasks)
    train = int(args.tasks * 0.6)
    rows = []
    for label, reward, propose in [("no proposals", solved, propose_nothing),
                                   ("a proposal every rollout", failed, propose_rule)]:
        ours = measure(lambda: evobus_rate(tasks, reward, propose, args.rounds, args.workers,
                                           args.bus), args.repeats)
        base = measure(lambda: threadpool_rate(tasks[:train], reward, args.rounds,
                                               args.workers), args.repeats)
        ratio = stats(ours)[1] / stats(base)[1]
        rows.append((label, fmt(ours, "/s"), fmt(base, "/s"), f"{ratio:.2f}"))
    print(f"no-op rollouts, {args.workers} workers, {args.tasks} tasks, {args.rounds} rounds, "
          f"bus={args.bus}, {args.repeats} repeats (median, min, max)")
    print(table(rows, ("workload", "evobus rollouts/s", "ThreadPoolExecutor rollouts/s",
                       "ratio")))
    return rows


if __name__ == "__main__":
    main()
