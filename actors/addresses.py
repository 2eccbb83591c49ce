"""Actor names on the bus, and the shape of what a control machine sends.

Routing knows where an actor lives; actors know only names.
"""

from protocol import Message

PLANNER = "planner"
SCHEDULER = "scheduler"
MERGER = "merger"
DRIVER = "driver"
#: The actor that hands out the spec and checks hellos.
REGISTRY = "registry"

#: What ``handle`` returns, one per message to send: (receiver, message).
Out = tuple[str, Message]


def worker_name(i: int) -> str:
    return f"worker-{i}"
