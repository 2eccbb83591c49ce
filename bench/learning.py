"""Workload 4: learning. The offline router domain (scenarios/router.py: 72 messages,
4 categories, the artifact starts empty and scores 0) evolved until the held-out reward
reaches the target (1.0 by default), at n = 1, 4, 8, 16 workers, sync and async.

Two figures per configuration: time-to-quality (wall clock of the whole evolve() call
until it stops on ``target_reward``) and rollouts-to-quality (train rollouts; held-out
scoring is not counted, for either library). A run that ends on a budget before the
target is a miss and is shown as such.

Beside each, agentdescent's own ``evolve()`` on the same tasks, the same train/held-out
split and its own ``KeyedRules``. Round sizes differ by design: an evobus synchronous
round rolls out the whole train split (a worker's shard each), an agentdescent round one
task per worker. So the sync rows are given twice for evobus: with its default round,
and with a one-task-per-worker round (``OnePerWorker`` below, a 20-line parallel
strategy), which is agentdescent's round and so the like-for-like rollouts figure.

    python -m bench.learning [--quick] [--ns 1,4,8,16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Sequence

from actors import KeyedRules, evolve
from actors.parallel import shard_round_robin
from actors.planner import split_tasks
from bench import agentdescent_side as ad
from bench.common import Row, figure, median, table
from protocol import WorkUnit
from scenarios import router

TARGET = 1.0
HELD_OUT = 0.4
#: Budgets: a run that has not reached the target by then is a miss.
MAX_ROUNDS = 300
MAX_ROLLOUTS = 20_000
MAX_SECONDS = 60.0


class OnePerWorker:
    """A parallel strategy with agentdescent's synchronous round, task for task: the
    train ids are dealt round-robin into ``n`` shards, worker i takes shard
    ``(i + r) mod n`` at round r (as DataParallel does) and rolls out one task of it,
    the ``r mod len(shard)``-th (agentdescent's RoundRobin pick)."""

    name = "one-per-worker"

    def plan(self, n_workers: int, round_index: int, keys: Sequence[str]) -> list[WorkUnit]:
        shards = shard_round_robin(list(keys), n_workers)
        units = []
        for i in range(n_workers):
            shard = shards[(i + round_index) % len(shards)] if shards else []
            pick = (shard[round_index % len(shard)],) if shard else ()
            units.append(WorkUnit(worker=i, keys=pick))
        return units

    def __repr__(self) -> str:
        return "OnePerWorker()"


def evobus_to_quality(n: int, asynchronous: bool, *, one_per_worker: bool = False,
                      target: float = TARGET) -> tuple[bool, float, int]:
    kw = (dict(max_rollouts=MAX_ROLLOUTS, max_seconds=MAX_SECONDS) if asynchronous
          else dict(rounds=MAX_ROUNDS, max_seconds=MAX_SECONDS))
    t = time.perf_counter()
    result = evolve(router.tasks(), router.reward, run=router.run, propose=router.propose,
                    strategy=KeyedRules(router.CATEGORIES), n_workers=n,
                    held_out_frac=HELD_OUT, seed=0, asynchronous=asynchronous,
                    target_reward=target, parallel=OnePerWorker() if one_per_worker else None,
                    **kw)
    wall = time.perf_counter() - t
    return result.stop_reason == "target_reward", wall, result.rollouts


def agentdescent_to_quality(n: int, asynchronous: bool,
                            target: float = TARGET) -> tuple[bool, float, int]:
    reached, wall, rollouts, _ = ad.to_quality(
        ad.tasks_for(router.tasks(), HELD_OUT), router.reward, router.run, router.propose,
        asynchronous=asynchronous, n_workers=n, strategy=ad.keyed_rules(router.CATEGORIES),
        target=target, max_rollouts=MAX_ROLLOUTS if asynchronous else MAX_ROUNDS * n,
        max_seconds=MAX_SECONDS)
    return reached, wall, rollouts


def _runs(fn, repeats: int) -> tuple[list[float], list[float], int, str]:
    """(seconds, rollouts) of the runs that reached the target, how many missed, note."""
    secs, rolls, missed = [], [], 0
    for _ in range(repeats):
        reached, wall, rollouts = fn()
        if reached:
            secs.append(wall)
            rolls.append(float(rollouts))
        else:
            missed += 1
    return secs, rolls, missed, ""


def rows(ns: Sequence[int], repeats: int) -> list[Row]:
    have_ad = ad.available()
    out: list[Row] = []
    train = len(split_tasks([t.id for t in router.tasks()], HELD_OUT, 0)[0])
    for n in ns:
        for mode, asynchronous in (("sync", False), ("async", True)):
            variants = [("", False)] + ([(", 1 task/worker/round", True)]
                                        if not asynchronous else [])
            theirs = None
            if have_ad:
                theirs = _runs(lambda: agentdescent_to_quality(n, asynchronous), repeats)
            for label, opw in variants:
                ours = _runs(lambda: evobus_to_quality(n, asynchronous, one_per_worker=opw),
                             repeats)
                name = f"(4) router to held-out {TARGET:g}, n={n}, {mode}{label}"
                notes = []
                if ours[2]:
                    notes.append(f"evobus missed the target in {ours[2]}/{repeats} runs")
                if theirs is None:
                    notes.append(ad.NOT_INSTALLED)
                elif theirs[2]:
                    notes.append(f"agentdescent missed the target in {theirs[2]}/{repeats}")
                if not asynchronous and not opw:
                    notes.append(f"evobus round = {train} rollouts")
                # Targets: sync no worse than agentdescent's sync in rollouts; async
                # reaches the target at every n.
                met_r = None
                if not asynchronous and theirs is not None and ours[1] and theirs[1]:
                    met_r = not ours[2] and median(ours[1]) <= median(theirs[1])
                elif asynchronous:
                    met_r = not ours[2]
                out.append(Row(name + ": seconds", "s", ours[0] or None, "", None,
                               theirs[0] or None if theirs else None, higher_is_better=False,
                               note="; ".join(notes)))
                out.append(Row(name + ": rollouts", "rollouts", ours[1] or None, "", None,
                               theirs[1] or None if theirs else None, higher_is_better=False,
                               target=("reaches the target" if asynchronous else
                                       "<= agentdescent sync rollouts"),
                               met=met_r))
    return out


def suite(quick: bool = False) -> list[Row]:
    if quick:
        return rows([4], repeats=1)
    return rows([1, 4, 8, 16], repeats=3)


def main(argv=None) -> list[Row]:
    p = argparse.ArgumentParser(description="learning: router domain to quality")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ns", default="1,4,8,16")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = suite(True) if args.quick else rows([int(x) for x in args.ns.split(",")],
                                                   args.repeats)
    print(table([(r.workload, figure(r.evobus), figure(r.agentdescent), r.note)
                 for r in result], ("workload", "evobus", "agentdescent", "note")))
    return result


if __name__ == "__main__":
    main()
