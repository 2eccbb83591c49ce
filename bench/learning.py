"""Workload 4: learning. The offline router domain (scenarios/router.py: 72 messages,
4 categories, the artifact starts empty and scores 0) evolved until the held-out reward
reaches the target (1.0 by default), at n = 1, 4, 8, 16 workers, sync and async.

Two figures per configuration: time-to-quality (wall clock of the whole evolve() call
until it stops on ``target_reward``) and rollouts-to-quality (train rollouts; held-out
scoring is not counted, for either library). A run that ends on a budget before the
target is a miss and is shown as such.

Beside each, agentdescent's own ``evolve()`` on the same tasks, the same train/held-out
split and its own ``KeyedRules``. An agentdescent synchronous round rolls out one task
per worker (``DataParallel(per_worker=1)`` in evobus, task for task); evobus's default
round is ``DataParallel(per_worker=4)`` (a round of 16 tasks shared by more than 4
workers); the sync rows are given again with ``DataParallel()``, the whole train split
a round (one gate per pass), with the model declared deterministic (scores of identical
(state, task) pairs reused, actors/machines/reuse.py), and with ``retire=True`` with and
without that declaration (its probes repeat pairs).

A third figure per configuration counts every ``run()`` call, train rollouts and held-out
scoring alike (a counting wrapper around the same ``run`` for both libraries): what
the learning cost in model calls, gate included.

    python -m bench.learning [--quick] [--ns 1,4,8,16] [--repeats 3]

``--noisy`` instead measures quality per model call on three noisy domains of
different shapes (bench/noisy_domains.py) for evobus, agentdescent and GEPA, every
call counted by one wrapper (bench/curves.py has the details and the options, which
follow ``--noisy``):

    python -m bench.learning --noisy [--quick] [--seeds 3] [--png docs/learning_curves.png]
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from typing import Sequence

from actors import DataParallel, KeyedRules, evolve
from actors.machines.planner import split_tasks
from bench import agentdescent_side as ad
from bench import curves
from bench.common import Row, figure, median, table
from scenarios import router

TARGET = 1.0
HELD_OUT = 0.4
#: Budgets: a run that has not reached the target by then is a miss.
MAX_ROUNDS = 300
MAX_ROLLOUTS = 20_000
MAX_SECONDS = 60.0


class CountingRun:
    """``router.run`` that counts its calls (train and held-out alike); thread-safe."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, rendered, task):
        with self._lock:
            self.calls += 1
        return router.run(rendered, task)


def evobus_to_quality(n: int, asynchronous: bool, *, whole_shard: bool = False,
                      target: float = TARGET, **rules) -> tuple[bool, float, int, int]:
    kw = (dict(max_rollouts=MAX_ROLLOUTS, max_seconds=MAX_SECONDS) if asynchronous
          else dict(rounds=MAX_ROUNDS, max_seconds=MAX_SECONDS))
    run = CountingRun()
    t = time.perf_counter()
    result = evolve(router.tasks(), router.reward, run=run, propose=router.propose,
                    strategy=KeyedRules(router.CATEGORIES), n_workers=n,
                    held_out_frac=HELD_OUT, seed=0, asynchronous=asynchronous,
                    target_reward=target,
                    parallel=DataParallel() if whole_shard else None, **kw, **rules)
    wall = time.perf_counter() - t
    return result.stop_reason == "target_reward", wall, result.rollouts, run.calls


def agentdescent_to_quality(n: int, asynchronous: bool,
                            target: float = TARGET) -> tuple[bool, float, int, int]:
    run = CountingRun()
    reached, wall, rollouts, _ = ad.to_quality(
        ad.tasks_for(router.tasks(), HELD_OUT), router.reward, run, router.propose,
        asynchronous=asynchronous, n_workers=n, strategy=ad.keyed_rules(router.CATEGORIES),
        target=target, max_rollouts=MAX_ROLLOUTS if asynchronous else MAX_ROUNDS * n,
        max_seconds=MAX_SECONDS)
    return reached, wall, rollouts, run.calls


def _runs(fn, repeats: int) -> tuple[list[float], list[float], int, list[float]]:
    """(seconds, train rollouts) of the runs that reached the target, how many missed,
    and their run() calls (train + held-out)."""
    secs, rolls, missed, calls = [], [], 0, []
    for _ in range(repeats):
        reached, wall, rollouts, n_calls = fn()
        if reached:
            secs.append(wall)
            rolls.append(float(rollouts))
            calls.append(float(n_calls))
        else:
            missed += 1
    return secs, rolls, missed, calls


def rows(ns: Sequence[int], repeats: int) -> list[Row]:
    have_ad = ad.available()
    out: list[Row] = []
    train = len(split_tasks([t.id for t in router.tasks()], HELD_OUT, 0)[0])
    for n in ns:
        for mode, asynchronous in (("sync", False), ("async", True)):
            variants = [("", False, {})] + ([
                (", DataParallel() (whole shard)", True, {}),
                (", deterministic=True", False, {"deterministic": True}),
                (", retire=True", False, {"retire": True}),
                (", retire=True, deterministic=True", False,
                 {"retire": True, "deterministic": True})] if not asynchronous else [])
            theirs = None
            if have_ad:
                theirs = _runs(lambda: agentdescent_to_quality(n, asynchronous), repeats)
            for label, whole, rules in variants:
                ours = _runs(lambda: evobus_to_quality(n, asynchronous, whole_shard=whole,
                                                       **rules), repeats)
                name = f"(4) router to held-out {TARGET:g}, n={n}, {mode}{label}"
                notes = []
                if ours[2]:
                    notes.append(f"evobus missed the target in {ours[2]}/{repeats} runs")
                if theirs is None:
                    notes.append(ad.NOT_INSTALLED)
                elif theirs[2]:
                    notes.append(f"agentdescent missed the target in {theirs[2]}/{repeats}")
                if whole:
                    notes.append(f"evobus round = {train} rollouts")
                # Targets: sync no worse than agentdescent's sync in rollouts; async
                # reaches the target at every n.
                met_r = None
                met_c = None
                if not asynchronous and theirs is not None and ours[1] and theirs[1]:
                    met_r = not ours[2] and median(ours[1]) <= median(theirs[1])
                    met_c = not ours[2] and median(ours[3]) <= median(theirs[3])
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
                out.append(Row(name + ": run() calls, held-out included", "calls",
                               ours[3] or None, "", None,
                               theirs[3] or None if theirs else None,
                               higher_is_better=False,
                               target=None if asynchronous else "<= agentdescent sync calls",
                               met=met_c))
    return out


def suite(quick: bool = False) -> list[Row]:
    if quick:
        return rows([4], repeats=1)
    return rows([1, 4, 8, 16], repeats=3)


def main(argv=None) -> list[Row]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--noisy"]:
        return curves.main(argv[1:])
    p = argparse.ArgumentParser(description="learning: router domain to quality "
                                "(--noisy: quality per call on noisy domains)")
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
