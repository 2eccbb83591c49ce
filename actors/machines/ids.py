"""Lease and eval ids a peer cannot guess: the readable id plus a tag keyed by the
run's secret (``Start.lease_key``), so only the worker a lease went to learns its id.

A run without a key (every log recorded before keys existed) keeps today's ids, so
those logs replay unchanged.
"""

from __future__ import annotations

import hashlib
import hmac

#: Hex digits of the tag: 64 bits, far beyond what a peer could try within a run.
TAG_HEX = 16


def tagged(key: str, base: str) -> str:
    """``base`` itself without a key, else ``base.<tag>`` (HMAC-SHA256 of ``base``)."""
    if not key:
        return base
    tag = hmac.new(key.encode(), base.encode(), hashlib.sha256).hexdigest()[:TAG_HEX]
    return f"{base}.{tag}"
