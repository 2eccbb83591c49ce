"""Every message that crosses the bus, as frozen tagged msgspec Structs in one union.

Schema evolution (docs/concepts.md): a new field gets a default, a field never
changes type, a tag is never reused or renamed. tests/logs/ holds yesterday's bytes.
"""

from __future__ import annotations

import msgspec

from protocol.domain import Diff, RolloutResult


class Msg(msgspec.Struct, frozen=True, kw_only=True, tag=True, omit_defaults=True):
    """Base of every message.

    - ``frozen``: messages are shared between threads and recorded; nobody mutates one.
    - ``tag=True``: the class name is the wire tag, so one typed decoder reads the union.
    - ``kw_only``: fields are added with defaults over time; keyword construction keeps
      call sites readable and order-independent.
    - unknown fields are *allowed* (msgspec's default) so an older reader skips fields a
      newer writer added.
    - ``omit_defaults``: smaller frames and logs; defaults are part of the schema.
    """


# -- run control ---------------------------------------------------------------------


class Start(Msg, frozen=True):
    """Driver -> Planner: the run's first message; carries everything a replay needs."""

    run_id: str
    seed: int
    task_ids: list[str]
    n_workers: int
    rounds: int
    held_out_frac: float
    max_concurrency: int
    initial_state: dict[str, str] = {}
    max_rollouts: int | None = None
    max_calls: int | None = None
    max_seconds: float | None = None
    target_reward: float | None = None
    patience: int | None = None
    asynchronous: bool = False
    async_ratio: int = 3
    staleness: str = "guarded"
    sections: dict[str, int] | None = None


class Open(Msg, frozen=True):
    """Planner -> Merger: the held-out split and the artifact's version 0."""

    heldout_ids: list[str]
    initial_state: dict[str, str] = {}
    sections: dict[str, int] | None = None


class Baseline(Msg, frozen=True):
    """Merger -> Planner: version 0 has been scored on the held-out tasks."""

    version: int
    heldout_reward: float


class Tick(Msg, frozen=True):
    """Shell -> Planner/Scheduler: time passing, as data (seconds since the run began)."""

    elapsed: float


class Finish(Msg, frozen=True):
    """Planner -> Merger: stop; answer the driver with the result."""

    stop_reason: str
    error: str | None = None
    fatal: str | None = None
    rollouts: int = 0
    calls: int = 0
    backend_errors: int = 0
    history: list["RoundRecord"] = []


class Shutdown(Msg, frozen=True):
    """Planner -> Scheduler (-> workers): the run is over; stop taking work."""

    reason: str = ""


# -- work ----------------------------------------------------------------------------


class Lease(Msg, frozen=True):
    """Work for one worker: roll out (``kind='rollout'``) or score (``kind='eval'``).

    A lease keeps its id when it is re-dispatched. ``unit`` is the logical worker of the
    plan (``WorkUnit.worker``); ``section`` the artifact section it may edit (TP).
    ``state`` is set on eval leases: the candidate artifact to score."""

    lease_id: str
    round: int
    kind: str = "rollout"
    unit: int = 0
    task_ids: list[str] = []
    section: int | None = None
    stage: int = 0
    version: int = 0
    state: dict[str, str] | None = None


class LeaseBatch(Msg, frozen=True):
    """Planner -> Scheduler: every lease of one round (or wave)."""

    round: int
    leases: list[Lease]


class LeaseDone(Msg, frozen=True):
    """Worker -> Scheduler (-> Merger): the results of one lease, in task order."""

    lease_id: str
    worker: str
    round: int
    kind: str = "rollout"
    unit: int = 0
    section: int | None = None
    version: int = 0
    results: list[RolloutResult] = []
    fatal: str | None = None


class Settled(Msg, frozen=True):
    """Scheduler -> Planner: a rollout lease is settled (for ``observe`` and budgets)."""

    lease_id: str
    round: int
    unit: int
    scores: list[tuple[str, float | None]] = []
    calls: int = 0
    errors: list[str] = []
    fatal: str | None = None
    section: int | None = None
    stage: int = 0


class Barrier(Msg, frozen=True):
    """Scheduler -> Merger: every lease of this round is settled."""

    round: int


class EvalRequest(Msg, frozen=True):
    """Merger -> Scheduler: score ``state`` on ``task_ids`` (held-out) through workers."""

    eval_id: str
    state: dict[str, str]
    task_ids: list[str]


class EvalDone(Msg, frozen=True):
    """Scheduler -> Merger: the mean score of an ``EvalRequest`` and how it was reached."""

    eval_id: str
    score: float
    scores: dict[str, float] = {}
    errors: int = 0


class Commit(Msg, frozen=True):
    """Merger -> Scheduler -> workers: a new head version of the artifact."""

    version: int
    state: dict[str, str]


class RoundClosed(Msg, frozen=True):
    """Merger -> Planner: round merged; ``outcomes`` counts each decision of the round."""

    round: int
    version: int
    committed: bool
    heldout_reward: float
    proposals: int = 0
    outcomes: dict[str, int] = {}
    final: bool = False


class RoundRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One line of ``history``."""

    round: int
    version: int
    committed: bool
    heldout_reward: float
    rollouts: int = 0
    proposals: int = 0
    reasons: dict[str, int] = {}
    elapsed: float = 0.0


class Progress(Msg, frozen=True):
    """Planner -> Driver: a round ended (live progress for the CLI and the API)."""

    record: RoundRecord
    rollouts: int = 0
    calls: int = 0


class RunDone(Msg, frozen=True):
    """Merger -> Driver: the run's result."""

    stop_reason: str
    version: int
    state: dict[str, str]
    final_reward: float
    initial_reward: float
    history: list[RoundRecord] = []
    outcomes: dict[str, int] = {}
    rollouts: int = 0
    calls: int = 0
    error: str | None = None
    fatal: str | None = None
    stats: dict[str, float] = {}


# -- workers -------------------------------------------------------------------------


class Hello(Msg, frozen=True):
    """Worker -> Scheduler: a worker registers (again, after a reconnect)."""

    worker: str
    slots: int = 1
    package_version: str = ""
    fingerprint: str = ""


class Heartbeat(Msg, frozen=True):
    """Worker -> Scheduler: still alive (sent from a thread of its own)."""

    worker: str


class Cancel(Msg, frozen=True):
    """Anyone -> a worker: stop the lease (cooperatively) if it is still running."""

    lease_id: str


class Stop(Msg, frozen=True):
    """Scheduler -> Worker: leave."""

    reason: str = ""


# -- barrier-free (async) mode ---------------------------------------------------------


class NeedWork(Msg, frozen=True):
    """Scheduler -> Planner (async): the queue ran dry and a worker is free."""

    wave: int = 0


class Merged(Msg, frozen=True):
    """Merger -> Scheduler (async): ``consumed`` proposals left the unmerged backlog."""

    consumed: int
    version: int = 0


class Refresh(Msg, frozen=True):
    """Merger -> Scheduler (async stall guard): send every worker the head now."""

    reason: str = ""


class Drain(Msg, frozen=True):
    """Planner -> Scheduler (async stop): start nothing new, let running leases settle,
    then ask the Merger to merge what it holds."""

    reason: str = ""


class Flush(Msg, frozen=True):
    """Scheduler -> Merger (async stop): every lease is settled; merge all you hold and
    answer with a final ``RoundClosed``."""

    cancelled: int = 0


Message = (
    Start | Open | Baseline | Tick | Finish | Shutdown | Lease | LeaseBatch | LeaseDone
    | Settled | Barrier | EvalRequest | EvalDone | Commit | RoundClosed | Progress | RunDone
    | Hello | Heartbeat | Cancel | Stop | NeedWork | Merged | Refresh | Drain | Flush
)

__all__ = [
    "Msg", "Message", "Start", "Open", "Baseline", "Tick", "Finish", "Shutdown", "Lease",
    "LeaseBatch", "LeaseDone", "Settled", "Barrier", "EvalRequest", "EvalDone", "Commit",
    "RoundClosed", "RoundRecord", "Progress", "RunDone", "Hello", "Heartbeat", "Cancel", "Stop", "NeedWork", "Merged", "Refresh", "Drain", "Flush",
    "Diff", "RolloutResult",
]
