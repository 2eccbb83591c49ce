"""The registry, a pure state machine (actor ``registry``): answers a worker's ``Join``
with the spec, checks its ``Hello`` (same code, same package version) and forwards it
to the Scheduler and the driver.
"""

from __future__ import annotations

import logging

from protocol import Hello, Join, Message, Refused, Spec
from actors.addresses import DRIVER, REGISTRY, SCHEDULER, Out

log = logging.getLogger(__name__)


class Registry:
    """Hands the spec to joining workers and admits those that run the same code."""

    name = REGISTRY

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.joined: dict[str, Hello] = {}
        self.refused: dict[str, str] = {}

    def handle(self, msg: Message) -> list[Out]:
        match msg:
            case Join(worker=worker):
                return [(worker, self.spec)]
            case Hello():
                problem = self._check(msg)
                if problem is not None:
                    self.refused[msg.worker] = problem
                    refusal = Refused(worker=msg.worker, reason=problem)
                    return [(msg.worker, refusal), (DRIVER, refusal)]
                self.joined[msg.worker] = msg
                return [(SCHEDULER, msg), (DRIVER, msg)]
            case Refused(worker=worker, reason=reason):
                self.refused[worker] = reason
                return [(DRIVER, msg)]
            case _:
                log.warning("registry: unexpected %s", type(msg).__name__)
                return []

    def _check(self, hello: Hello) -> str | None:
        s = self.spec
        if s.package_version and hello.package_version != s.package_version:
            return (f"worker {hello.worker} runs evobus {hello.package_version or '?'}, the "
                    f"coordinator {s.package_version}: install the same version on both")
        if hello.fingerprint != s.fingerprint:
            return (f"worker {hello.worker} runs different code (fingerprint "
                    f"{hello.fingerprint or '-'}, expected {s.fingerprint}): install the same "
                    f"version of {sorted(s.fingerprints)} on it")
        return None
