"""Actor names on the bus. Routing knows where an actor lives; actors know only names."""

PLANNER = "planner"
SCHEDULER = "scheduler"
MERGER = "merger"
DRIVER = "driver"
COLLECTOR = "collector"


def worker_name(i: int) -> str:
    return f"worker-{i}"
