"""Throttling, handled instead of failed (docs/budgets.md): retry a call told to
:class:`~actors.errors.RetryLater` with jittered exponential backoff up to a deadline
(tenacity runs the loop), and keep a process under an endpoint's limits with one
:class:`Limiter` per endpoint, shared by every worker thread of the process.
"""

from __future__ import annotations

import collections
import email.utils
import math
import random
import threading
import time
from typing import Any, Callable

import tenacity

from actors.errors import RetryLater, Throttled

__all__ = ["Backoff", "Limiter", "limiter_for", "parse_retry_after"]


class _Jittered(tenacity.wait.wait_base):
    """``initial * 2**n`` (capped at ``maximum``) times a factor in [0.5, 1): workers that
    were throttled together do not come back together. A backend that said when to
    come back (``retry_after`` > 0) is taken at its word: that long, no more, no less."""

    def __init__(self, initial: float, maximum: float, rng: random.Random) -> None:
        self.initial, self.maximum, self.rng = initial, maximum, rng

    def __call__(self, state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        after = getattr(exc, "retry_after", None)
        if after:  # (0, "now", gets the backoff: a retry at once would hammer it)
            return after
        delay = min(self.maximum, self.initial * 2 ** (state.attempt_number - 1))
        return delay * (0.5 + 0.5 * self.rng.random())


class Backoff:
    """Retry a call that raises :class:`RetryLater` (and, up to ``max_retries`` times,
    one that raises an exception of ``transient``), until ``deadline`` seconds have
    passed since the first attempt (or been slept: an injected ``sleep`` that does not
    wait still ends the loop on time). ``call`` returns the value with the attempts made
    and the seconds slept; a call still throttled at the deadline raises
    :class:`Throttled`, the last transient error is raised as it is."""

    def __init__(self, *, initial: float = 1.0, maximum: float = 30.0,
                 deadline: float = 120.0, max_retries: int = 0,
                 transient: tuple[type[BaseException], ...] = (),
                 seed: int | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
        self.initial, self.maximum, self.deadline = initial, maximum, deadline
        self.max_retries, self.transient = max_retries, transient
        self.sleep = sleep
        self.rng = random.Random(seed)
        self.lock = threading.Lock()  # one Random for every thread that shares this

    def call(self, fn: Callable[[], Any], first: BaseException | None = None,
             stats: dict[str, float] | None = None) -> tuple[Any, int, float]:
        """``fn()`` until it succeeds. ``first``: the error of an attempt already made
        (the caller tried once on its fast path); ``stats`` gets ``attempts`` and
        ``slept`` whether the call succeeds or not."""
        slept = [0.0]
        transient_seen = [0]

        def retry(state: tenacity.RetryCallState) -> bool:
            exc = state.outcome.exception()
            if isinstance(exc, RetryLater):
                return True
            if self.transient and isinstance(exc, self.transient):
                transient_seen[0] += 1
                return transient_seen[0] <= self.max_retries
            return False

        def sleep(seconds: float) -> None:
            slept[0] += seconds
            self.sleep(seconds)

        with self.lock:
            rng = random.Random(self.rng.random())
        retrying = tenacity.Retrying(
            retry=retry, wait=_Jittered(self.initial, self.maximum, rng),
            stop=lambda state: (max(state.seconds_since_start or 0.0, slept[0])
                                + state.upcoming_sleep >= self.deadline),
            sleep=sleep, reraise=True)
        attempts = [0]
        pending = [first]

        def attempt() -> Any:
            attempts[0] += 1
            if pending[0] is not None:  # the attempt the caller made: its error, again
                exc, pending[0] = pending[0], None
                raise exc
            return fn()

        try:
            value = retrying(attempt)
        except RetryLater as exc:
            raise Throttled(f"still told to retry later after {attempts[0]} attempt(s) over "
                            f"{slept[0]:.1f} s of waiting (deadline {self.deadline:g} s): "
                            f"{exc}") from exc
        finally:
            if stats is not None:
                stats.update(attempts=attempts[0], slept=slept[0])
        return value, attempts[0], slept[0]


#: After a quiet moment a limiter lets requests through this many times faster than its
#: rate until its window is full again (never more than ``burst`` in a window).
CATCH_UP = 4


class Limiter:
    """At most ``max_concurrent`` requests at once, and ``per_minute`` a minute counted
    the way providers (and bench.endpoint) count it: over a sliding window of about a
    second. At most ``burst = ceil(per_minute / 60)`` requests start in any window of
    ``burst * 60 / per_minute`` seconds (one second, or just over it when the rate is
    not a whole number a second; for a rate under one a second, one request per
    ``60 / per_minute`` seconds). A quiet moment (no thread had a call to make) leaves
    room in the window, which the requests after it take at up to :data:`CATCH_UP`
    times the rate (spaced, not all at once: requests started together reach the
    endpoint in a jittered order). Turns are taken at the moment a request goes, on
    ``time.monotonic()``. ``with limiter:`` waits its turn; :attr:`waited` sums the
    seconds every thread waited."""

    def __init__(self, max_concurrent: int | None = None,
                 per_minute: float | None = None) -> None:
        self.max_concurrent, self.per_minute = max_concurrent, per_minute
        self._slots = threading.BoundedSemaphore(max_concurrent) if max_concurrent else None
        self.burst = max(1, math.ceil(per_minute / 60.0 - 1e-9)) if per_minute else 0
        self.window = self.burst * 60.0 / per_minute if per_minute else 0.0
        self.spacing = 60.0 / per_minute / CATCH_UP if per_minute else 0.0
        self._turns: collections.deque[float] = collections.deque(maxlen=self.burst or 1)
        self._turn = threading.Condition(threading.Lock())
        self._lock = threading.Lock()
        self.waited = 0.0
        self.local = threading.local()

    def _next_turn(self, now: float) -> float:
        turns = self._turns
        if not turns:
            return now
        at = turns[-1] + self.spacing
        if len(turns) == self.burst:   # the window is full: when its oldest turn leaves
            at = max(at, turns[0] + self.window)
        return at

    def __enter__(self) -> "Limiter":
        t0 = time.monotonic()
        if self._slots is not None:
            self._slots.acquire()
        if self.window:
            with self._turn:
                while True:  # woken early or late, the turn is taken at the time it goes
                    now = time.monotonic()
                    at = self._next_turn(now)
                    if at <= now:
                        self._turns.append(now)  # (maxlen: the oldest turn leaves)
                        break
                    self._turn.wait(at - now)
        waited = time.monotonic() - t0
        self.local.waited = waited
        with self._lock:
            self.waited += waited
        return self

    def __exit__(self, *exc) -> None:
        if self._slots is not None:
            self._slots.release()


_LIMITERS: dict[tuple, Limiter] = {}
_LIMITERS_LOCK = threading.Lock()


def limiter_for(endpoint: str, max_concurrent: int | None, per_minute: float | None
                ) -> Limiter | None:
    """The process's limiter for ``endpoint`` with these limits (made at first use; None
    when neither limit is set). Agents of one process that name the same endpoint and
    limits share it, whichever worker thread they run on."""
    if not max_concurrent and not per_minute:
        return None
    key = (endpoint, max_concurrent, per_minute)
    with _LIMITERS_LOCK:
        limiter = _LIMITERS.get(key)
        if limiter is None:
            limiter = _LIMITERS[key] = Limiter(max_concurrent, per_minute)
        return limiter


def parse_retry_after(headers) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds, or an HTTP
    date); None when absent or unreadable."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass  # fall back to Retry-After
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass  # not seconds: an HTTP date
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    # An HTTP date is wall-clock time: only the wall clock can say how far off it is.
    return max(0.0, when.timestamp() - time.time())
