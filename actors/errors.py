"""The handful of exception types evobus raises."""


class EvobusError(Exception):
    """Base of evobus's own errors."""


class ConfigError(EvobusError, ValueError):
    """A caller's mistake found before (or at) the first rollout; the message names the fix."""


class RunFailed(EvobusError):
    """The runtime itself failed (an actor crashed, the bus died); carries the cause."""
