"""The worker side: core (WorkerCore, the Awaiter for async code), local (the thread
worker), remote (the worker process and ``evobus worker``), code (naming callables as
data: the one Ref type, resolving against an allowlist, code fingerprints)."""
