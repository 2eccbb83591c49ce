"""Time enters the control machines only as ``Tick`` messages (DESIGN section 3); a
:class:`Ticker` says when the next one is due, for every loop that sends them."""

from __future__ import annotations


class Ticker:
    """Due once per ``period`` seconds of a monotonic clock the caller reads."""

    def __init__(self, period: float, first: float = 0.0) -> None:
        if period <= 0:
            raise ValueError(f"a tick period must be > 0 seconds, got {period!r}")
        self.period = period
        self.next = first

    def due(self, now: float) -> bool:
        """True (once) when ``now`` has reached the next tick; the one after is a period
        from now, so a late loop never sends a burst of ticks to catch up."""
        if now < self.next:
            return False
        self.next = now + self.period
        return True

    def wait(self, now: float) -> float:
        """Seconds until the next tick (0 when it is due)."""
        return max(0.0, self.next - now)
