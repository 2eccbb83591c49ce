"""Running a topology: runtime (Runtime: the bus, the actors, teardown), shell (pykka
shells around the pure machines), evolve (the Python API), pools (process and remote
workers), launch (a scenario -> evolve's arguments), checks (static scenario checks),
grouping (which group each task is in, recorded in the log header)."""
