"""Quality per model call on the noisy domains (bench/noisy_domains.py): evobus,
agentdescent and GEPA, each given the same tasks, the same train/held-out split, the
same noisy model and the same noisy proposer, through ONE counting wrapper.

The wrapper (:class:`Calls`) counts every ``run`` and ``propose`` call, whoever makes
it and whatever it is for (a train rollout, held-out scoring, a minibatch screen).
At the budget it stops answering: from then on ``run`` returns an answer that scores
0 and ``propose`` proposes nothing, at no cost, so whatever a library does after the
budget cannot improve its artifact; each library is also given its own budget knob
(evobus ``max_calls``, agentdescent ``max_calls``, GEPA ``max_metric_calls``) so that
it stops soon after. Quality is the returned artifact's test accuracy with the
noise-free model, on test items no library sees, as a fraction of the best reachable.

    python -m bench.curves [--quick] [--domains router,settings,instruction]
        [--budgets 500,1500,5000,15000] [--seeds 3] [--systems "evobus;agentdescent;gepa"]
        [--png docs/learning_curves.png] [--json out.json] [--matrix] [--goal 0.95]
        [--latency-ms 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import random
import statistics
import threading
import time
import warnings

from actors import ClusterParallel, DataParallel, TensorParallel, evolve
from actors.policies import parallelism
from actors.policies.parallelism import cluster_round, default_parallel
from actors.machines.planner import split_tasks
from bench import agentdescent_side as ad
from bench import gepa_side
from bench.common import table
from bench.noisy_domains import DOMAINS, Domain

HELD_OUT = 0.4
N_WORKERS = 4
BUDGETS = (500, 1_500, 5_000, 15_000)
#: A run that takes longer than this is stopped by its library's own clock.
MAX_SECONDS = 300.0
SPENT = "(budget spent)"
#: ``evobus[gate=full]``: more held-out tasks than any split has (the whole split).
WHOLE_SPLIT = 10**9


class Calls:
    """The one counting wrapper: every call of every library goes through it."""

    def __init__(self, domain: Domain, budget: int, seed: int, latency_ms: float = 0.0,
                 repeatable: bool = False) -> None:
        self.domain = domain
        self.budget = budget
        self.seed = seed
        self.rng = random.Random(seed)
        #: With ``repeatable`` each call's noise is drawn from (seed, kind, task, prompt,
        #: the k-th such call) instead of one stream shared by the library's threads, whose
        #: order follows thread timing: the same statistics, but one seed is one run, so
        #: two rules can be compared seed for seed.
        self.repeatable = repeatable
        self._seen: dict[tuple, int] = {}
        self.n = 0
        self.refused = 0
        self.lock = threading.Lock()
        #: Each answered call sleeps a lognormal time of this median (0: none): the
        #: latency-bound runs, where wall clock follows the calls a library makes at once.
        self.latency_ms = latency_ms
        self._wait = random.Random(seed + 7919)

    def _latency(self) -> None:
        if self.latency_ms > 0:
            with self.lock:
                seconds = self.latency_ms / 1000 * self._wait.lognormvariate(0.0, 0.5)
            time.sleep(seconds)

    def _noise(self, kind: str, rendered, task) -> random.Random:
        """The stream a call draws its noise from (called under the lock)."""
        if not self.repeatable:
            return self.rng
        key = (kind, task.id, rendered)
        k = self._seen[key] = self._seen.get(key, -1) + 1
        digest = hashlib.blake2b(f"{self.seed}|{kind}|{task.id}|{k}|{rendered}".encode(),
                                 digest_size=8).digest()
        return random.Random(int.from_bytes(digest, "big"))

    def reward(self, task, output) -> float:
        return self.domain.reward(task, output)

    def run(self, rendered, task):
        with self.lock:
            if self.n >= self.budget:
                self.refused += 1
                return SPENT
            self.n += 1
            answer = self.domain.run(rendered, task, self._noise("run", rendered, task))
        self._latency()
        return answer

    def propose(self, rendered, task, output, reward):
        with self.lock:
            if self.n >= self.budget:
                self.refused += 1
                return None
            self.n += 1
            proposal = self.domain.propose(rendered, task, self._noise("propose", rendered, task))
        self._latency()
        return proposal


def split(domain: Domain, seed: int):
    train, held = split_tasks([t.id for t in domain.tasks], HELD_OUT, seed)
    by_id = {t.id: t for t in domain.tasks}
    return [by_id[i] for i in train], [by_id[i] for i in held]


def run_evobus(domain: Domain, calls: Calls, seed: int, n_workers: int = N_WORKERS,
               **kw) -> str:
    rounds = {} if kw.get("asynchronous") else {"rounds": 100_000}
    strategy = kw.pop("strategy", None) or domain.strategy()
    result = evolve(domain.tasks, calls.reward, run=calls.run, propose=calls.propose,
                    strategy=strategy, n_workers=n_workers, held_out_frac=HELD_OUT,
                    seed=seed, max_calls=calls.budget, max_seconds=MAX_SECONDS,
                    **rounds, **kw)
    return result.rendered


def run_evobus_pw1(domain: Domain, calls: Calls, seed: int) -> str:
    return run_evobus(domain, calls, seed, parallel=DataParallel(per_worker=1))


def run_agentdescent(domain: Domain, calls: Calls, seed: int, n_workers: int = N_WORKERS,
                     asynchronous: bool = False) -> str:
    lib = ad._lib()
    tasks = ad.tasks_for(domain.tasks, HELD_OUT, seed)
    rounds = {} if asynchronous else {"rounds": 100_000}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = lib.evolve(tasks, calls.reward, run=calls.run, propose=calls.propose,
                            strategy=domain.ad_strategy(lib), n_workers=n_workers,
                            max_concurrency=n_workers, held_out_frac=HELD_OUT, seed=seed,
                            max_calls=calls.budget, max_seconds=MAX_SECONDS,
                            asynchronous=asynchronous, **rounds)
    return result.rendered


def agentdescent_variant(spec: str):
    """``agentdescent[w=16,async]``: agentdescent with 16 workers, asynchronous."""
    kw: dict = {}
    for part in filter(None, spec[len("agentdescent["):-1].split(",")):
        name, _, value = part.partition("=")
        if name == "w":
            kw["n_workers"] = int(value)
        elif name == "async":
            kw["asynchronous"] = True
        else:
            raise ValueError(f"{spec}: unknown option {part!r} (w=N, async)")
    return lambda domain, calls, seed: run_agentdescent(domain, calls, seed, **kw)


class NotApplicable(Exception):
    """A configuration that does not apply to a domain (TensorParallel needs a key
    space): the point is left out and the table says "n/a"."""


def run_gepa(domain: Domain, calls: Calls, seed: int) -> str:
    train, held = split(domain, seed)
    return gepa_side.optimize(calls, domain.strategy(), train, held, budget=calls.budget,
                              seed=seed)


def evobus_variant(spec: str):
    """``evobus[pw=4,screen,attribute,retire]``: evobus with DataParallel(per_worker=4)
    (``pw=shard``: DataParallel(), the whole shard a round; ``busy=4`` after it: on
    four workers only, the others sharing the gates)
    and the Merger's optional rules switched on (docs/concepts.md); ``w=16``: 16
    workers; ``async``: asynchronous, ``lease=4`` tasks per lease; ``first``:
    ``conflicts="first"`` (``scored``: ``conflicts="score"``); ``gate=48``: a gate scores
    48 held-out tasks (``gate=full``: the whole split; by default sized to the budget,
    actors/machines/gatesize.py); ``chain=off``: every
    proposal made on the head (``evolve(chain=False)``); ``cp``:
    ClusterParallel over the domain's task types (:func:`cluster_of`), ``cp=k`` with
    ``per_worker=k``; ``tp``: TensorParallel routed over a keyed domain's settings
    (:func:`tensor_parallel`), ``tp=k`` with ``per_worker=k``."""
    inside = spec[len("evobus["):-1]
    kw: dict = {}
    clustered: dict | None = None
    for part in filter(None, inside.split(",")):
        name, _, value = part.partition("=")
        if name == "cp":
            clustered = {"per_worker": -1 if value == "auto" else int(value)} if value else {}
        elif name == "tp":
            kw["_tp"] = -1 if value == "auto" else int(value) if value else 0
        elif name == "pw":
            kw["parallel"] = DataParallel(per_worker=None if value == "shard" else int(value))
        elif name == "busy":
            kw["parallel"] = DataParallel(per_worker=getattr(kw.get("parallel"), "per_worker",
                                                             4), busy=int(value))
        elif name == "w":
            kw["n_workers"] = int(value)
        elif name == "lease":
            kw["lease_size"] = int(value)
        elif name == "async":
            kw["asynchronous"] = True
        elif name == "aw":
            kw["_waves"] = int(value)
        elif name == "first":
            kw["conflicts"] = "first"
        elif name == "scored":
            kw["conflicts"] = "score"
        elif name == "chain":
            kw["chain"] = value != "off"
        elif name == "gate":   # held-out tasks a gate scores (full: the whole split)
            kw["gate_tasks"] = WHOLE_SPLIT if value == "full" else int(value)
        elif value.lower() in ("off", "false", "on", "true"):   # a rule switched off or on
            kw[name] = value.lower() in ("on", "true")
        else:   # a rule switched on, or given a number (noise_z=1)
            kw[name] = (int(value) if value.isdigit() else float(value)) if value else True

    def run(domain, calls, seed):
        if "_waves" in kw:   # async waves ahead of the last merge (0: unpaced)
            saved = parallelism.ASYNC_WAVES
            parallelism.ASYNC_WAVES = kw["_waves"] or None
            try:
                return run_one(domain, calls, seed, {k: v for k, v in kw.items()
                                                     if k != "_waves"})
            finally:
                parallelism.ASYNC_WAVES = saved
        return run_one(domain, calls, seed, kw)

    def run_one(domain, calls, seed, kw):
        if "_tp" in kw:
            n_workers = kw.get("n_workers", N_WORKERS)
            per_worker, busy = kw["_tp"] or None, None   # tp=k: k; tp: whole units
            if kw["_tp"] == -1:   # tp=auto: the default round, as default_parallel plans it
                default = default_parallel(n_workers)
                per_worker, busy = default.per_worker, default.busy
            parallel, strategy = tensor_parallel(domain, n_workers, per_worker, busy=busy)
            return run_evobus(domain, calls, seed, parallel=parallel, strategy=strategy,
                              **{k: v for k, v in kw.items() if k != "_tp"})
        if clustered is not None:
            per_worker = clustered.get("per_worker")
            size = {"per_worker": per_worker}
            if per_worker == -1:   # cp=auto: parallelism.cluster_round
                n = len(set(map(cluster_of(domain), (t.id for t in domain.tasks))))
                size = cluster_round(kw.get("n_workers", N_WORKERS), n, domain.strategy())
            return run_evobus(domain, calls, seed, parallel=ClusterParallel(
                cluster_of(domain), **size), **kw)
        return run_evobus(domain, calls, seed, **kw)
    return run


def tensor_parallel(domain: Domain, n_workers: int, per_worker: int | None = None,
                    busy: int | None = None):
    """``(TensorParallel, artifact strategy)`` for a domain, one section per worker (per
    busy worker with ``busy``; at most one per declared key or section):

    - a keyed domain (``extra["keys"]``, the settings): routed over its settings, a task
      going to the first setting it needs (its proposals edit its first unmet one, often
      that one); the domain's own strategy;
    - a rule list with sections (``extra["sections"]``, the router's categories): the
      domain's ``AppendRules`` with those sections declared (a rule is filed under the
      category its text routes to), a task routed to the category it wants, the section
      its right rule lands in. The tasks, the model and the proposer are the domain's."""
    keys, sections = domain.extra.get("keys"), domain.extra.get("sections")
    owners = min(n_workers, busy or n_workers)
    if keys:
        first = {t.id: min(t.meta["need"]) for t in domain.tasks}
        return (TensorParallel(min(owners, len(keys)), route=first.__getitem__,
                               per_worker=per_worker, busy=busy), None)
    if sections:
        want = {t.id: t.meta["want"] for t in domain.tasks}
        return (TensorParallel(min(owners, len(sections)), route=want.__getitem__,
                               per_worker=per_worker, busy=busy),
                dataclasses.replace(domain.strategy(), sections=tuple(sections)))
    raise NotApplicable(f"{domain.name}: TensorParallel needs a key space "
                        f"({domain.shape} declares none)")


def cluster_of(domain: Domain):
    """A task's cluster for ClusterParallel: its settings type, its instruction topic,
    or its router category."""
    by_id = {t.id: t.meta.get("type", t.meta.get("topic", t.meta["want"]))
             for t in domain.tasks}
    return by_id.__getitem__


SYSTEMS = {"evobus": run_evobus, "evobus pw1": run_evobus_pw1,
           "agentdescent": run_agentdescent, "gepa": run_gepa}


def system(name: str):
    if name.startswith("evobus[") and name.endswith("]"):
        return evobus_variant(name)
    if name.startswith("agentdescent[") and name.endswith("]"):
        return agentdescent_variant(name)
    return SYSTEMS[name]


def available(system: str) -> str | None:
    """None when the system can run here, else why not."""
    if system.startswith("agentdescent") and not ad.available():
        return ad.NOT_INSTALLED
    if system == "gepa" and not gepa_side.available():
        return gepa_side.NOT_INSTALLED
    return None


def one(name: str, domain_name: str, budget: int, seed: int, latency_ms: float = 0.0,
        repeatable: bool = False) -> dict:
    domain = DOMAINS[domain_name]()
    calls = Calls(domain, budget, seed, latency_ms, repeatable)
    t = time.perf_counter()
    rendered = system(name)(domain, calls, seed)
    return {"system": name, "domain": domain_name, "budget": budget, "seed": seed,
            "calls": calls.n, "quality": domain.quality(rendered),
            "seconds": time.perf_counter() - t}


def measure(systems, domains, budgets, seeds, latency_ms: float = 0.0,
            repeatable: bool = False, first_seed: int = 0) -> list[dict]:
    out = []
    for domain in domains:
        for budget in budgets:
            for system in systems:
                if available(system):
                    continue
                for seed in range(first_seed, first_seed + seeds):
                    try:
                        out.append(one(system, domain, budget, seed, latency_ms, repeatable))
                    except NotApplicable:
                        break
                    logging.getLogger("bench.curves").info("%s", out[-1])
    return out


def summary(points: list[dict], systems, seconds: bool = False) -> list[tuple]:
    """One row per (domain, budget): each system's mean quality [min-max] @ mean calls
    (and ``in`` mean wall-clock seconds, with ``seconds``)."""
    rows = []
    keys = sorted({(p["domain"], p["budget"]) for p in points},
                  key=lambda k: (list(DOMAINS).index(k[0]), k[1]))
    for domain, budget in keys:
        row = [f"{domain} ({DOMAINS[domain]().shape})", f"{budget:,}"]
        for system in systems:
            mine = [p for p in points if (p["domain"], p["budget"], p["system"])
                    == (domain, budget, system)]
            if not mine:
                row.append(available(system) or "n/a")
                continue
            q = [p["quality"] for p in mine]
            c = statistics.mean(p["calls"] for p in mine)
            cell = f"{statistics.mean(q):.2f} [{min(q):.2f}-{max(q):.2f}] @ {c:,.0f}"
            if seconds:
                cell += f" in {statistics.mean(p['seconds'] for p in mine):.1f} s"
            row.append(cell)
        rows.append(tuple(row))
    return rows


#: The anchors the wall-clock goal is measured against (the faster of the two).
ANCHORS = ("agentdescent", "gepa")


def held_from(points: list[dict], goal: float) -> int | None:
    """The smallest budget from which the mean quality of ``points`` (one system on one
    domain) is at least ``goal`` at that budget and every larger one measured: a mean
    that reaches the goal once and falls below it at a larger budget is the seeds'
    luck, not the time to the goal (None: no such budget)."""
    budgets = sorted({p["budget"] for p in points})
    found = None
    for budget in reversed(budgets):
        if statistics.mean(p["quality"] for p in points if p["budget"] == budget) < goal:
            break
        found = budget
    return found


def to_quality(points: list[dict], systems, goal: float) -> list[tuple]:
    """One row per domain: for each system, the smallest budget from which its mean
    quality holds at ``goal`` (:func:`held_from`), with its mean calls and wall clock
    ("-" when none does); a system that is not an anchor also gets its wall clock as a
    fraction of the faster anchor's (the goal of issue 19: at most 0.5x)."""
    rows = []
    for domain in [d for d in DOMAINS if any(p["domain"] == d for p in points)]:
        row = [f"{domain} ({DOMAINS[domain]().shape})"]
        cells, seconds = [], {}
        for system in systems:
            mine = [p for p in points if p["domain"] == domain and p["system"] == system]
            budget = held_from(mine, goal)
            if budget is None:
                cells.append((system, "-"))
                continue
            at = [p for p in mine if p["budget"] == budget]
            seconds[system] = statistics.mean(p["seconds"] for p in at)
            cells.append((system, f"{statistics.mean(p['quality'] for p in at):.2f} at "
                                  f"{budget:,} ({statistics.mean(p['calls'] for p in at):,.0f}"
                                  f" calls) in {seconds[system]:.1f} s"))
        anchors = [seconds[s] for s in seconds if s.startswith(ANCHORS)]
        for system, cell in cells:
            if anchors and system in seconds and not system.startswith(ANCHORS):
                cell += f" = {seconds[system] / min(anchors):.2f}x the faster anchor"
            row.append(cell)
        rows.append(tuple(row))
    return rows


#: The matrix of issue 19: parallelism x mode x workers, each with its default round.
MATRIX = ";".join(f"evobus[{p}{m}w={w}]" for p in ("", "tp=auto,", "cp=auto,")
                  for m in ("", "async,") for w in (4, 16))


def plot(points: list[dict], systems, path: str) -> None:
    # matplotlib is an optional extra: imported only when a PNG is asked for.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = [d for d in DOMAINS if any(p["domain"] == d for p in points)]
    fig, axes = plt.subplots(1, len(domains), figsize=(5 * len(domains), 4), squeeze=False)
    for ax, domain in zip(axes[0], domains):
        for system in systems:
            mine = [p for p in points if p["domain"] == domain and p["system"] == system]
            budgets = sorted({p["budget"] for p in mine})
            if not budgets:
                continue
            xs = [statistics.mean(p["calls"] for p in mine if p["budget"] == b)
                  for b in budgets]
            ys = [statistics.mean(p["quality"] for p in mine if p["budget"] == b)
                  for b in budgets]
            ax.plot(xs, ys, marker="o", label=system)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{domain} ({DOMAINS[domain]().shape})")
        ax.set_xlabel("model calls (run + propose, all counted)")
        ax.set_ylabel("test quality (fraction of best)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def show(rows: list[tuple], header: tuple, markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        print(table(rows, header))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description="quality per model call on noisy domains")
    p.add_argument("--quick", action="store_true", help="one seed, budget 500, router")
    p.add_argument("--domains", default=",".join(DOMAINS))
    p.add_argument("--budgets", default=",".join(str(b) for b in BUDGETS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--systems", default="evobus;agentdescent;gepa",
                   help="';'-separated; evobus[pw=4,screen,attribute,retire] for variants")
    p.add_argument("--png", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--from-json", default=None,
                   help="print (and plot) the points a --json run saved, running nothing")
    p.add_argument("--seconds", action="store_true", help="show wall clock in the table")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="every call sleeps a lognormal time of this median (wall clock)")
    p.add_argument("--matrix", action="store_true",
                   help="the systems are DP, TP (routed) and CP, sync and async, 4 and 16 "
                        "workers, each with its default round")
    p.add_argument("--goal", type=float, default=None,
                   help="also print, per domain, the first budget from which the mean "
                        "quality holds at this goal, and the wall clock to it")
    p.add_argument("--repeatable", action="store_true",
                   help="draw each call's noise from (seed, task, prompt, k-th call) so one "
                        "seed is one run whatever the thread timing (same statistics)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds first_seed .. first_seed + seeds - 1 (more seeds for a "
                        "comparison without running the first ones again)")
    p.add_argument("-v", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.v else logging.WARNING)
    systems = (MATRIX if args.matrix else args.systems).split(";")
    unknown = [s for s in systems if s not in SYSTEMS
               and not s.startswith(("evobus[", "agentdescent["))]
    if unknown:
        p.error(f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}")
    if args.quick:
        domains, budgets, seeds = ["router"], [500], 1
    else:
        domains = args.domains.split(",")
        budgets = [int(b) for b in args.budgets.split(",")]
        seeds = args.seeds
    if args.from_json:
        with open(args.from_json) as f:
            points = json.load(f)
        systems = [s for s in systems if any(p["system"] == s for p in points)]
    else:
        points = measure(systems, domains, budgets, seeds, args.latency_ms, args.repeatable,
                         args.first_seed)
    header = ("domain", "budget") + tuple(systems)
    rows = summary(points, systems, seconds=args.latency_ms > 0 or args.seconds)
    show(rows, header, args.markdown)
    if args.goal is not None:
        show(to_quality(points, systems, args.goal), ("domain",) + tuple(systems),
             args.markdown)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(points, f, indent=1)
    if args.png:
        plot(points, systems, args.png)
    return points


if __name__ == "__main__":
    main()
