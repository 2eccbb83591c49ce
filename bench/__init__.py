"""Benchmarks (never timed tests). ``python -m bench`` runs them all."""
