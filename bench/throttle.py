"""Workload (9): a rate-limited model endpoint. ``python -m bench.throttle``

bench.endpoint.SimulatedEndpoint (in a process of its own, as a provider is) accepts
``R`` requests in any sliding second (the rest
get 429 + Retry-After) and answers after a lognormal latency; 16 workers run an async
evolve() through actors.openai_agent.OpenAIAgent with the process-wide limiter set just
under R (``requests_per_minute = 0.99 * 60 * R``, ``max_concurrent = 16``). Figures:
successful calls per second sustained (the middle 80% of the run, from the endpoint's
own clock of the answers it sent) as a fraction of R, and 429s as a share of every
attempt the endpoint received. Targets (issue 15): >= 0.95 R, <= 2% 429s.

Beside it, agentdescent's own evolve() with the same agent (the same limiter) against
a fresh endpoint with the same limit; and, as a baseline, the same evobus run with no
limiter (the agent only backs off on 429s).
"""

from __future__ import annotations

import argparse
import logging
import warnings

from actors import AppendRules, Task, evolve
from actors.openai_agent import OpenAIAgent
from bench import agentdescent_side as ad
from bench.common import Row, figure, median, table
from bench.endpoint import EndpointProcess

N_WORKERS = 16
RPS = 40
LATENCY, SIGMA = 0.2, 0.5


def tasks() -> list[Task]:
    return [Task(f"t{i}", f"question number {i} about the parcel") for i in range(40)]


def reply(body: dict) -> str:
    """The model: the solve answer carries the artifact's length, so the reward grows
    with the rules the run adds and a merge usually commits (one scoring request a
    merge, as in a run that learns); a propose answer is one new rule."""
    messages = body["messages"]
    user = messages[-1]["content"]
    if "Propose one edit" in user:
        return f"Rule {len(user) % 997}: check the parcel number first."
    return f"{len(messages[0]['content'])} {user}"


def reward(task: Task, output: str) -> float:
    size = int(output.split(" ", 1)[0]) if output[:1].isdigit() else 0
    return min(0.9, 0.05 + size / 4000)   # < solved: every rollout proposes


def agent(url: str, limited: bool) -> OpenAIAgent:
    limits = dict(requests_per_minute=0.99 * 60 * RPS, max_concurrent=N_WORKERS) \
        if limited else {}
    return OpenAIAgent(model="sim", base_url=url, api_key_env="", backoff=0.05,
                       max_backoff=1.0, retry_deadline=60.0, timeout=10.0, **limits)


def sustained(ep) -> tuple[float, float]:
    """(successful calls/s over the middle 80% of the run, 429s / attempts)."""
    times = sorted(ep.ok_times)
    if len(times) < 10:
        return 0.0, 1.0
    span = times[-1] - times[0]
    lo, hi = times[0] + 0.1 * span, times[-1] - 0.1 * span
    ok = sum(1 for t in times if lo <= t <= hi)
    c = ep.counts
    limited = c.get("rate_limited", 0) + c.get("throttled", 0)
    return ok / (hi - lo), limited / max(1, c.get("requests", 0))


def one(seconds: float, *, lib: str = "evobus", limited: bool = True,
        seed: int = 0) -> tuple[float, float]:
    with EndpointProcess(rps=RPS, latency=LATENCY, sigma=SIGMA, seed=seed,
                         reply="bench.throttle:reply") as ep:
        a = agent(ep.url, limited)
        if lib == "evobus":
            evolve(tasks(), reward, agent=a, strategy=AppendRules(), n_workers=N_WORKERS,
                   asynchronous=True, lease_size=1, max_seconds=seconds, seed=seed)
        else:
            lib_ = ad._lib()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lib_.evolve(ad.tasks_for(tasks()), reward, run=a.solve, propose=a.propose,
                            strategy=lib_.AppendRules(), n_workers=N_WORKERS,
                            asynchronous=True, max_seconds=seconds, seed=seed)
        a.close()
    return sustained(ep)


def suite(quick: bool = False) -> list[Row]:
    seconds, repeats = (6.0, 1) if quick else (20.0, 3)
    ours = [one(seconds, seed=i) for i in range(repeats)]
    bare = [one(seconds, limited=False, seed=i) for i in range(repeats)]
    theirs, note = None, f"R = {RPS}/s, lognormal latency median {LATENCY} s sigma {SIGMA}, " \
                         f"{seconds:g} s runs"
    if ad.available():
        theirs = [one(seconds, lib="agentdescent", seed=i) for i in range(repeats)]
    else:
        note += "; " + ad.NOT_INSTALLED
    frac = [r / RPS for r, _ in ours]
    share = [s * 100 for _, s in ours]
    return [
        Row(f"(9) rate-limited endpoint, {N_WORKERS} workers: calls/s sustained / R",
            "fraction of R", frac, "no limiter (backoff on 429 only)",
            [r / RPS for r, _ in bare],
            [r / RPS for r, _ in theirs] if theirs else None,
            target=">= 0.95", met=median(frac) >= 0.95, note=note),
        Row(f"(9) rate-limited endpoint, {N_WORKERS} workers: 429s / attempts", "%", share,
            "no limiter (backoff on 429 only)", [s * 100 for _, s in bare],
            [s * 100 for _, s in theirs] if theirs else None, higher_is_better=False,
            target="<= 2%", met=median(share) <= 2.0, note=note),
    ]


def main(argv=None) -> list[Row]:
    p = argparse.ArgumentParser(description="a rate-limited model endpoint")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows = suite(args.quick)
    print(table([(r.workload, figure(r.evobus), r.baseline, figure(r.base),
                  figure(r.agentdescent), r.target, r.met) for r in rows],
                ("workload", "evobus", "baseline", "base", "agentdescent", "target", "met")))
    return rows


if __name__ == "__main__":
    main()
