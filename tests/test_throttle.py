"""The process-wide limiter (actors.throttle.Limiter): at most ``burst`` requests in any
window the way providers count a per-minute limit, a quiet moment made up for at up to
CATCH_UP times the rate, spaced; and against bench.endpoint.SimulatedEndpoint (real
HTTP on 127.0.0.1) a process's threads stay under the endpoint's own sliding-second
limit without a 429. The window arithmetic is driven with given times (no clock); the
HTTP test waits on threads with a bound.
"""

from __future__ import annotations

import bisect
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from actors.throttle import CATCH_UP, Limiter

pytest.importorskip("httpx")

from actors.openai_agent import OpenAIAgent  # noqa: E402
from bench.endpoint import EndpointProcess  # noqa: E402
from protocol import Task  # noqa: E402


def granted(limiter: Limiter, arrivals: list[float]) -> list[float]:
    """When each request arriving at ``arrivals`` (in order, one thread after the other)
    would go: the limiter's own turn rule, fed times instead of a clock."""
    out = []
    for now in arrivals:
        now = max(now, out[-1] if out else now)
        at = limiter._next_turn(now)
        go = max(now, at)
        limiter._turns.append(go)
        out.append(go)
    return out


def most_in_a_window(times: list[float], window: float) -> int:
    return max(bisect.bisect_left(times, t + window - 1e-9) - i for i, t in enumerate(times))


@pytest.mark.parametrize("per_minute", [30, 90, 1140, 2376])
def test_a_per_minute_limit_is_counted_over_about_a_second(per_minute):
    limiter = Limiter(per_minute=per_minute)
    assert limiter.burst == max(1, -(-per_minute // 60))
    assert 1.0 <= limiter.window < 1.0 + 60 / per_minute + 1e-9 or per_minute < 60
    assert abs(limiter.burst / limiter.window - per_minute / 60) < 1e-9   # the rate given


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=30, max_value=3000),
       st.lists(st.floats(min_value=0.0, max_value=0.2), min_size=1, max_size=300))
def test_no_window_ever_holds_more_than_the_burst_and_turns_are_spaced(per_minute, gaps):
    limiter = Limiter(per_minute=per_minute)
    arrivals = [sum(gaps[:i + 1]) for i in range(len(gaps))]
    times = granted(limiter, arrivals)
    assert most_in_a_window(times, limiter.window) <= limiter.burst, (per_minute, gaps)
    assert all(b - a >= limiter.spacing - 1e-9 for a, b in zip(times, times[1:]))


def test_a_quiet_moment_is_made_up_for_at_catch_up_times_the_rate():
    limiter = Limiter(per_minute=2400)               # 40 a second
    rate = 1 / 40
    steady = granted(limiter, [i * rate for i in range(80)])   # 2 s asked at the rate
    # Nothing asked for 0.25 s, then 40 requests at once: the window holds 30 turns
    # where it could hold 40, and the 10 missing go first, spaced at CATCH_UP x the rate.
    end = steady[-1] + 0.25
    later = granted(limiter, [end] * 40)
    assert later[0] == pytest.approx(end)
    quick = [b - a for a, b in zip(later, later[1:]) if b - a < rate - 1e-9]
    assert len(quick) >= 9 and all(q == pytest.approx(rate / CATCH_UP) for q in quick)
    everything = steady + later
    assert most_in_a_window(everything, limiter.window) <= 40
    # Over the second after the quiet moment, as many went as the window allowed.
    assert sum(1 for t in later if t < end + 1.0) >= 39


def _ask(url: str, n: int, threads: int, **limits) -> float:
    """``n`` solves from ``threads`` threads through agents of one process; seconds."""
    agents = [OpenAIAgent(model="sim", base_url=url, api_key_env="", backoff=0.05,
                          **limits) for _ in range(2)]
    if limits:
        assert agents[0].limiter is agents[1].limiter              # one per endpoint
    task = Task(id="t", prompt="hello there")
    left = list(range(n))
    lock = threading.Lock()

    def work(agent):
        while True:
            with lock:
                if not left:
                    return
                left.pop()
            agent.solve("sys", task)

    t0 = time.monotonic()
    pool = [threading.Thread(target=work, args=(agents[i % 2],)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in pool)
    for a in agents:
        a.close()
    return time.monotonic() - t0


def test_threads_of_one_process_stay_under_the_endpoints_sliding_second():
    # 18 a second against an endpoint (in a process of its own, as a provider is) that
    # takes 20 in any sliding second: 45 requests from 6 threads need three windows.
    with EndpointProcess(rps=20, latency=0.01, seed=3) as ep:
        elapsed = _ask(ep.url, 45, 6, max_concurrent=4, requests_per_minute=1080)
    with EndpointProcess(rps=20, latency=0.01, seed=3) as bare:
        _ask(bare.url, 45, 6)                                      # the same, no limiter
    assert ep.counts["ok"] == 45 and ep.counts["peak_concurrent"] <= 4
    assert elapsed >= 2.0                       # the 37th and later waited for the window
    # The endpoint sees when a request arrives, the limiter when it leaves: on a loaded
    # machine (a new connection's setup, scheduling) a request can arrive late enough
    # to share the endpoint's second with the next window's first; never more than a
    # couple, where without the limiter most attempts bounce.
    assert ep.counts.get("rate_limited", 0) <= 2, (ep.counts, ep.limited_times)
    assert bare.counts["ok"] == 45 and bare.counts["rate_limited"] >= 10, bare.counts
