"""Throttling, handled instead of failed (docs/budgets.md): retry a call told to
:class:`~actors.errors.RetryLater` with jittered exponential backoff up to a deadline
(tenacity runs the loop), and keep a process under an endpoint's limits with one
:class:`Limiter` per endpoint, shared by every worker thread of the process.
"""

from __future__ import annotations

import email.utils
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


class Limiter:
    """At most ``max_concurrent`` requests at once and ``per_minute`` a minute, spaced
    evenly: a turn nobody took can be taken late, but only the one just missed (a burst
    of two at most, so an endpoint that counts over a sliding second sees the same rate
    in every second, plus one). ``with limiter:`` waits its turn; :attr:`waited` sums
    the seconds every thread waited."""

    def __init__(self, max_concurrent: int | None = None,
                 per_minute: float | None = None) -> None:
        self.max_concurrent, self.per_minute = max_concurrent, per_minute
        self._slots = threading.BoundedSemaphore(max_concurrent) if max_concurrent else None
        self._interval = 60.0 / per_minute if per_minute else 0.0
        self._next = 0.0
        self._lock = threading.Lock()
        self.waited = 0.0
        self.local = threading.local()

    def __enter__(self) -> "Limiter":
        t0 = time.monotonic()
        if self._slots is not None:
            self._slots.acquire()
        if self._interval:
            with self._lock:
                now = time.monotonic()
                turn = max(now - self._interval, self._next)
                self._next = turn + self._interval
            if turn > now:
                time.sleep(turn - now)
            # (turn < now: the missed turn, taken at once)
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
