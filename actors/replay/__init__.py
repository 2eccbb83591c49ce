"""A run's message log as oracle and as save point: engine (rebuild control machines
from a log chain), verify (replay and report the first divergence), report (what a
replay found), resume (rebuild and go on)."""
