"""The same workloads through agentdescent's own ``evolve()`` (the reference library:
threads in one process), for the side-by-side columns of ``python -m bench``.

agentdescent is never a dependency of evobus: install it into the bench environment
(``pip install agentdescent``). When it is not importable every function here raises
:class:`NotInstalled` and the suite's rows say "agentdescent not installed".

Adapting the workloads: agentdescent's ``Task`` is its own dataclass (same ``id``,
``prompt``, ``meta``), and ``run``/``reward``/``propose`` take the same shapes, so the
benchmark's callables are passed unchanged. Its held-out split is *positional* (the
last ``held_out_frac`` of the list), so tasks are handed over ordered as evobus's seeded
split orders them (train first, then held out): both libraries train on the same tasks
and gate on the same held-out set. Its synchronous round is one rollout per worker; its
asynchronous mode needs an explicit ``max_seconds`` (it has no unbounded mode), which is
set far above what any workload here takes, and a run that hits it says so.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable, Sequence

from actors.machines.planner import split_tasks


class NotInstalled(RuntimeError):
    """agentdescent is not importable in this environment."""


#: What a row says when agentdescent is absent.
NOT_INSTALLED = "agentdescent not installed (pip install agentdescent)"
#: An asynchronous run stops here at the latest (agentdescent has no unbounded mode).
MAX_SECONDS = 300.0


def _lib():
    try:
        import agentdescent
    except ImportError as exc:
        raise NotInstalled(NOT_INSTALLED) from exc
    return agentdescent


def available() -> bool:
    try:
        _lib()
    except NotInstalled:
        return False
    return True


def version() -> str:
    try:
        from importlib.metadata import version as v

        return v("agentdescent")
    except Exception:  # not installed, or installed without metadata: say so in the table
        return "unknown"


def tasks_for(tasks: Sequence, held_out_frac: float = 0.4, seed: int = 0) -> list:
    """evobus tasks as agentdescent tasks, ordered so its positional split is ours."""
    ad = _lib()
    train, held = split_tasks([t.id for t in tasks], held_out_frac, seed)
    by_id = {t.id: t for t in tasks}
    return [ad.Task(id=t.id, prompt=t.prompt, meta=dict(t.meta))
            for t in (by_id[i] for i in train + held)]


def _evolve(tasks, reward: Callable, run: Callable, propose: Callable, *,
            asynchronous: bool, n_workers: int, rollouts: int,
            held_out_frac: float = 0.4, strategy=None, target_reward: float | None = None,
            max_seconds: float | None = None):
    """One agentdescent run of (about) ``rollouts`` worker rollouts; the result and its
    wall clock (the whole evolve() call, as for evobus)."""
    ad = _lib()
    kw = dict(n_workers=n_workers, held_out_frac=held_out_frac,
              strategy=strategy if strategy is not None else ad.AppendRules(), seed=0,
              target_reward=target_reward)
    if asynchronous:
        kw.update(asynchronous=True, max_rollouts=rollouts,
                  max_seconds=max_seconds if max_seconds is not None else MAX_SECONDS)
    else:
        # A synchronous round is one rollout per worker, run concurrently.
        kw.update(rounds=max(1, rollouts // n_workers), max_concurrency=n_workers)
        if max_seconds is not None:
            kw.update(max_seconds=max_seconds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its advisory warnings are not the benchmark's
        t = time.perf_counter()
        result = ad.evolve(tasks, reward, run=run, propose=propose, **kw)
        wall = time.perf_counter() - t
    return result, wall


def rollout_rate(tasks, reward, run, propose, *, asynchronous: bool, n_workers: int,
                 rollouts: int) -> float:
    """Worker rollouts per second of one run (``tasks`` from :func:`tasks_for`)."""
    result, wall = _evolve(tasks, reward, run, propose, asynchronous=asynchronous,
                           n_workers=n_workers, rollouts=rollouts)
    if result.error:
        raise RuntimeError(f"agentdescent run failed: {result.error}")
    return result.rollouts / wall


def to_quality(tasks, reward, run, propose, *, asynchronous: bool, n_workers: int,
               strategy, target: float, max_rollouts: int,
               max_seconds: float) -> tuple[bool, float, int, float]:
    """Run until the held-out reward reaches ``target`` (or a budget ends): (reached,
    seconds, worker rollouts, final held-out reward)."""
    result, wall = _evolve(tasks, reward, run, propose, asynchronous=asynchronous,
                           n_workers=n_workers, rollouts=max_rollouts, strategy=strategy,
                           target_reward=target, max_seconds=max_seconds)
    reached = result.final_reward >= target
    return reached, wall, result.rollouts, result.final_reward


def keyed_rules(categories: Sequence[str]):
    return _lib().KeyedRules(categories=list(categories))


def latency_efficiency(tasks, n_workers: int, *, asynchronous: bool, rollouts: int,
                       held_out_frac: float = 0.1) -> float:
    """Workload 3 on agentdescent: each rollout sleeps ``task.meta["sleep"]`` (held-out
    tasks are given 0, so held-out scoring costs no sleep); efficiency is the sleep
    actually performed, divided by the workers, over the wall clock of the whole call
    (its start-up is included: agentdescent keeps no log to time from)."""
    import threading

    lock = threading.Lock()
    slept = [0.0]
    train, held = split_tasks([t.id for t in tasks], held_out_frac, 0)
    held = set(held)
    adt = tasks_for([t for t in tasks], held_out_frac)
    adt = [_lib().Task(id=t.id, prompt=t.prompt,
                       meta={**t.meta, "sleep": 0.0 if t.id in held else t.meta["sleep"]})
           for t in adt]

    def run(rendered, task):
        s = task.meta["sleep"]
        time.sleep(s)
        if s:
            with lock:
                slept[0] += s
        return "ok"

    def solved(task, output):
        return 1.0

    _, wall = _evolve(adt, solved, run, lambda *a: None, asynchronous=asynchronous,
                      n_workers=n_workers, rollouts=rollouts, held_out_frac=held_out_frac)
    return (slept[0] / n_workers) / wall
