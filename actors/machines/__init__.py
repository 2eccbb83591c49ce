"""The pure control machines: ``handle(message) -> [(receiver, message), ...]``.

planner (rounds, waves, budgets, the stop decision), scheduler (leases to workers,
liveness, barriers), merger (versions, the held-out gate), collector (one parallel
group), registry (admits workers in other processes). Nothing here imports pykka, zmq,
threads or a clock (DESIGN section 3; an import-linter contract checks it).
"""
