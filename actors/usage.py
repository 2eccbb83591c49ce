"""How a call reports what it used, for the token and cost budgets (docs/budgets.md).

The worker keeps a meter for the calls it makes to run or propose (an agent's
``solve``/``propose``) and takes what each call put in it; code running inside that
call, on its thread or in a coroutine awaited by it, reports with :func:`report`. What
was reported travels in the rollout's result (``protocol.Usage``, one per model and
phase) to the Scheduler, which counts it against ``max_tokens`` and ``max_cost``. :class:`actors.openai_agent.OpenAIAgent`
reports every request; an agent of your own calls :func:`report` once per model call
and declares ``reports_usage = True`` (a token or cost budget refuses an agent that
does not).

A thread the call starts itself has no meter (the meter is per thread; a coroutine
the call awaits runs on the call's thread and reports to it): report from the call's
own thread. The branches of a parallel group the call starts report into the call's
meter (the group takes it with :func:`current`, its worker threads :func:`swap` it in
while they run its branches), so a group's model calls count with the call's.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from protocol import Usage

__all__ = ["bind", "current", "metered", "report", "reports_usage", "swap", "take"]

#: The meter of the call running on this thread (``meter``: model -> sums), if any.
_LOCAL = threading.local()
#: A meter can be shared by the threads running a group's branches.
_ADD = threading.Lock()


def report(*, model: str = "", input_tokens: int = 0, output_tokens: int = 0,
           cost: float | None = None, attempts: int = 0, throttled: float = 0.0,
           calls: int = 0) -> None:
    """Add one model call's usage to the call being metered (outside one: nothing).

    ``cost``: what the call cost in your currency, if the agent prices it itself (else the
    run's ``prices`` price ``model``); ``attempts``: HTTP attempts it took (retries
    included); ``throttled``: seconds it waited on a 429/503 or a rate limiter."""
    meter = getattr(_LOCAL, "meter", None)
    if meter is None:
        return
    with _ADD:
        entry = meter.setdefault(model, [0, 0, None, 0, 0.0, 0])
        entry[0] += int(input_tokens)
        entry[1] += int(output_tokens)
        if cost is not None:
            entry[2] = (entry[2] or 0.0) + float(cost)
        entry[3] += int(attempts)
        entry[4] += float(throttled)
        entry[5] += int(calls)


def bind(meter: dict[str, list] | None) -> None:
    """Make ``meter`` the one :func:`report` adds to on this thread (a worker binds its
    own for each lease, takes what each call reported with :func:`take`, and unbinds it,
    ``None``, when the lease ends)."""
    _LOCAL.meter = meter


def current() -> dict[str, list] | None:
    """The meter bound on this thread (None outside a metered call)."""
    return getattr(_LOCAL, "meter", None)


def swap(meter: dict[str, list] | None) -> dict[str, list] | None:
    """Bind ``meter`` on this thread for a while; returns the one to bind back after."""
    outer = getattr(_LOCAL, "meter", None)
    _LOCAL.meter = meter
    return outer


def take(meter: dict[str, list], phase: str) -> tuple[Usage, ...]:
    """What was reported into ``meter`` since the last take, as ``Usage`` of ``phase``
    (one per model); empties it."""
    if not meter:
        return ()
    with _ADD:
        out = tuple(Usage(phase=phase, model=model, input_tokens=e[0], output_tokens=e[1],
                          cost=e[2], attempts=e[3], throttled=round(e[4], 6), calls=e[5])
                    for model, e in meter.items())
        meter.clear()
    return out


def metered(phase: str, fn: Callable[..., Any], *args: Any
            ) -> tuple[Any, tuple[Usage, ...], BaseException | None]:
    """Call ``fn(*args)`` with a fresh meter: (its value or None, what it reported, the
    exception it raised or None). The exception is returned, not raised, so that what a
    failed call reported is kept too."""
    outer = getattr(_LOCAL, "meter", None)
    meter: dict[str, list] = {}
    bind(meter)
    try:
        value, error = fn(*args), None
    except Exception as exc:  # returned to the caller, which decides what it means
        value, error = None, exc
    finally:
        _LOCAL.meter = outer
    return value, take(meter, phase), error


def reports_usage(*things: Any) -> bool:
    """Whether any of ``things`` (an agent, a run or propose function, a bound method's
    object) declares ``reports_usage = True``."""
    for thing in things:
        for candidate in (thing, getattr(thing, "__self__", None)):
            if candidate is not None and getattr(candidate, "reports_usage", False) is True:
                return True
    return False
