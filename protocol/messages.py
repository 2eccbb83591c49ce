"""Every message that crosses the bus, as frozen tagged msgspec Structs in one union.

Schema evolution (docs/concepts.md): a new field gets a default, a field never
changes type, a tag is never reused or renamed. tests/logs/ holds yesterday's bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.domain import Diff, Ref, RolloutResult, Task, Usage


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
    lease_size: int | None = None
    max_tokens: int | None = None
    max_cost: float | None = None
    #: model -> (price of 1M input tokens, price of 1M output tokens), for ``max_cost``.
    prices: dict[str, tuple[float, float]] = {}
    #: Calls one rollout task may make (run, then propose): what a lease reserves.
    calls_per_task: int = 2
    #: Rollout leases chain their proposals (``Lease.chain``); False (every log recorded
    #: before it existed): each proposal is made on the head.
    chain: bool = False

    #: The run's secret for lease and eval ids (actors/machines/ids.py); "" (every log
    #: recorded before it existed): readable ids such as ``r0.u1``.
    lease_key: str = ""


class Budget(Msg, frozen=True):
    """Planner -> Scheduler, before anything is dispatched, only when a budget on calls,
    tokens or cost is set: the Scheduler reserves calls before it dispatches a lease and
    starts nothing once a budget is spent (docs/budgets.md)."""

    max_calls: int | None = None
    max_tokens: int | None = None
    max_cost: float | None = None
    prices: dict[str, tuple[float, float]] = {}
    calls_per_task: int = 2


class Open(Msg, frozen=True):
    """Planner -> Merger: the held-out split and the artifact's version 0."""

    heldout_ids: list[str]
    initial_state: dict[str, str] = {}
    sections: dict[str, int] | None = None
    lease_key: str = ""  # Start.lease_key: the Merger's eval ids are keyed by it too


class Baseline(Msg, frozen=True):
    """Merger -> Planner: version 0 has been scored on the held-out tasks."""

    version: int
    heldout_reward: float
    #: Every held-out call of the baseline failed (``errors`` of them): the first error.
    #: Nothing was scored, ``heldout_reward`` means nothing, and the Planner halts.
    failed: str | None = None
    errors: int = 0


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


class Halted(Msg, frozen=True):
    """Planner -> Driver: the backend fails every rollout (``reason``
    ``backend_failing``): the run halts without finishing, so its log stays resumable;
    ``evobus resume`` sends ``Unhalt`` and it goes on."""

    reason: str
    error: str = ""


class Unhalt(Msg, frozen=True):
    """Driver -> Planner, first thing on resuming a halted run: plan again."""


class Shutdown(Msg, frozen=True):
    """Planner -> Scheduler (-> workers): the run is over; stop taking work."""

    reason: str = ""


# -- work ----------------------------------------------------------------------------


class Lease(Msg, frozen=True):
    """Work for one worker: roll out (``kind='rollout'``) or score (``kind='eval'``).

    A lease keeps its id when it is re-dispatched. ``unit`` is the logical worker of the
    plan (``WorkUnit.worker``); ``section`` the artifact section it may edit (TP).
    ``state`` is set on eval leases: the candidate artifact to score; on a rollout lease,
    the state to roll out on instead of the head (a branch, RoundClosed.bases). ``chain``: the
    worker applies each proposal to its own copy and rolls the lease's next tasks out
    on the edited state (actors/workers/chain.py)."""

    lease_id: str
    round: int
    kind: str = "rollout"
    unit: int = 0
    task_ids: list[str] = []
    section: int | None = None
    stage: int = 0
    version: int = 0
    state: dict[str, str] | None = None
    chain: bool = False


class LeaseBatch(Msg, frozen=True):
    """Planner -> Scheduler: every lease of one round (or wave).

    ``report_each``: the Planner wants a ``Settled`` per lease as it settles (a budget it
    must check per lease, such as ``max_calls`` in async mode) instead of the default
    ``SettledBatch`` when it next has to act."""

    round: int
    leases: list[Lease]
    report_each: bool = False


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
    #: The budget (``max_calls``, ``max_tokens``, ``max_cost``) that kept some of this
    #: lease's tasks (``skipped``) from starting.
    exhausted: str | None = None
    skipped: int = 0


class SettledBatch(Msg, frozen=True):
    """Scheduler -> Planner: the leases settled since the last report, in settling order.

    One message instead of one per lease: sync mode sends it just before a round's
    ``Barrier``; async mode just before ``NeedWork``, when nothing is left running, and
    before draining ends. A fatal settlement is never held back (it goes alone, as a
    ``Settled``, after the batch held so far)."""

    settled: list[Settled]


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
    #: A budget was spent before this scoring could start: ``score`` means nothing and
    #: the candidate is not committed (counted as ``unscored-at-budget``).
    unscored: str | None = None
    #: Every call of this scoring failed (``errors`` of them): the first error, in task
    #: order. Unset when any call succeeded, so a partly failed scoring reads as before.
    failed: str | None = None
    #: Some calls failed (``errors`` of them, scored 0): the first error, in task order,
    #: as ``"task_id: error"``; unset when none did. Set with ``failed`` too.
    first_error: str | None = None


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
    #: Plan unit -> the state its next rollout lease rolls out on, when not the head
    #: (its branch: the Merger's ``branches``, actors/machines/branches.py).
    bases: dict[int, dict[str, str]] = {}
    #: Decisions this merge made about diffs an earlier round proposed and held for it
    #: (the Merger's ``hold``; that round counted them as ``held`` in its outcomes).
    carried: dict[str, int] = {}


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
    #: Workers registered and not presumed lost when the round closed (filled in by
    #: the driver from the Scheduler; None when unknown, e.g. in a replayed log).
    workers_alive: int | None = None


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
    # Seconds between this worker's heartbeats (0: an in-process worker, never
    # presumed lost), and the leases it still holds when it registers again.
    heartbeat: float = 0.0
    leases: list[str] = []
    # Leases this worker can hold queued behind the ``slots`` it runs (it starts them in
    # arrival order); the Scheduler uses them in async mode only.
    prefetch: int = 0


class Heartbeat(Msg, frozen=True):
    """Worker -> Scheduler: still alive (sent by the worker's I/O thread, never one
    running a rollout, when it has sent the Scheduler nothing else for its interval)."""

    worker: str


class Lost(Msg, frozen=True):
    """A shell -> the Scheduler or a Collector: this worker is gone (its process exited,
    its connection closed for good), without waiting for its heartbeat deadline. Its
    leases are re-dispatched under their ids, as for a worker silent past the deadline."""

    worker: str
    reason: str = ""


class CallsAsk(Msg, frozen=True):
    """Worker -> Scheduler: may the call running under ``lease_id`` start ``calls`` more
    calls (branches of a parallel group it started)? Only from a worker in another
    process, for a lease it holds; they are reserved against the run's budgets as the
    lease's own calls are, and answered with ``CallsGranted``."""

    worker: str
    lease_id: str
    ask: int
    calls: int = 1


class CallsGranted(Msg, frozen=True):
    """Scheduler -> Worker: the answer to ``CallsAsk`` ``ask``: reserved (``refused``
    empty), or not, with why (the budget spent, or the lease no longer open)."""

    lease_id: str
    ask: int
    refused: str = ""


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


class WaveSettled(Msg, frozen=True):
    """Planner -> Merger (async, waves paced by merges): every rollout of ``wave`` has
    settled, so merge what it proposed now (a merge of nothing closes at once)."""

    wave: int


class Branched(Msg, frozen=True):
    """Planner -> Merger: the rollout leases of ``round`` roll out on the bases that
    ``RoundClosed(round=merge).bases`` gave (their units' branches,
    actors/machines/branches.py). Sent only when some lease carries one."""

    round: int
    merge: int


class Merged(Msg, frozen=True):
    """Merger -> Scheduler (async): ``consumed`` proposals left the unmerged backlog."""

    consumed: int
    version: int = 0


class Refresh(Msg, frozen=True):
    """Merger -> Scheduler (async stall guard): send every worker the head now."""

    reason: str = ""


class Drain(Msg, frozen=True):
    """Planner -> Scheduler (async stop): start nothing new, let running leases settle,
    then ask the Merger to merge what it holds (or, ``merge=False``, only count it)."""

    reason: str = ""
    merge: bool = True


class Flush(Msg, frozen=True):
    """Scheduler -> Merger (async stop): every lease is settled; merge all you hold and
    answer with a final ``RoundClosed``. ``merge=False`` (a time budget ran out): count
    what it holds as ``unmerged-at-stop`` instead of spending more time merging."""

    cancelled: int = 0
    merge: bool = True


# -- parallel groups (docs/groups.md) -------------------------------------------------
#
# Items, results, answers and effect values are JSON-like data (None, bool, int, float,
# str, bytes, lists, dicts): they cross the bus as msgpack, never as pickled objects.


class JournalEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One step of a branch's continuation, replayed when the branch runs again.

    ``kind`` is ``"ask"`` (``value``: the answer), ``"approve"`` (``value``: the decision,
    a bool) or ``"effect"`` (``value``: what the effect returned; it never runs again).
    ``key`` is the question, the action, or the effect's name; ``id`` the interaction id."""

    kind: str
    key: Any = None
    value: Any = None
    id: str = ""


class PendingInteraction(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A question (``kind="ask"``) or an action to approve (``kind="approve"``) that a
    suspended branch waits on; answered by ``id``, exactly once."""

    id: str
    branch: int
    kind: str
    prompt: Any = None
    item: Any = None


class Suspension(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A branch that reached an unanswered ask or approve (coordinated suspension): the
    interaction it waits on and its ``journal`` (answers and effects so far)."""

    index: int
    pending: PendingInteraction
    journal: list[JournalEntry] = []


class GroupStart(Msg, frozen=True):
    """Driver -> Collector: a group's first message; holds everything a replay needs.

    On resume (``resume=True``) it carries the checkpoint: ``finished`` results (never
    re-dispatched), the ``journals`` of suspended branches, the ``pending`` interactions
    and the interaction ids already ``used``; the Collector then waits for ``UserInputs``."""

    group_id: str
    items: list[Any]
    workers: list[str]
    max_concurrency: int
    max_items: int
    driver: str = "driver"
    chunk: int = 0
    chunk_factor: int = 2
    max_chunk: int = 4096
    prefetch: int = 1
    min_lease_seconds: float = 0.0
    announce: bool = False
    max_seconds: float | None = None
    cancel_deadline: float = 5.0
    max_result_bytes: int = 0
    resume: bool = False
    finished: dict[int, Any] = {}
    journals: dict[int, list[JournalEntry]] = {}
    pending: list[PendingInteraction] = []
    used_ids: list[str] = []
    approvers: list[str] | None = None
    effects: list[tuple[int, str]] = []
    #: Starts follow input order: one branch per lease (``Branch.in_order``) until
    #: ``concurrency`` branches are measured cheaper than ``batch_below`` seconds each.
    #: False (older logs): guided leases from the first.
    ordered: bool = False
    batch_below: float = 0.0
    #: With ``ordered``, once branches are measured no cheaper than ``batch_below``: the
    #: next leases are cut in waves, one per worker with room at once (once every worker
    #: has room, or one is idle), the ``p``-th of ``W`` holding the ``p``-th, ``p + W``-th,
    #: ... queued branches (starts still in input order); a branch that comes back below
    #: one dealt goes out again at once, alone. False (older logs): one branch per lease
    #: until they are measured cheap.
    waves: bool = False
    #: Liveness: a worker whose Hello declares a heartbeat is presumed lost after
    #: ``deadline`` seconds of silence (None: never), or on ``Lost``; its branch leases are
    #: re-dispatched under their ids, and a lease whose workers were lost ``max_tries``
    #: times fails the group.
    deadline: float | None = None
    max_tries: int = 3
    #: ``"all"``: an interaction blocks its own branch only; the group suspends once every
    #: branch has ended or waits. ``"first"`` (older logs): the first interaction stops
    #: new starts (``Hold``).
    suspend: str = "first"
    #: Even shares (> 0; 0: guided leases): leases are cut in rounds of one per worker,
    #: every lease of a round the same size; the first round gives each worker this
    #: fraction of its fair share (queued / workers), every later one half of what is
    #: queued over the workers, at least ``min_lease_seconds`` long by measure.
    shares: float = 0.0


class Branch(Msg, frozen=True):
    """Collector -> worker: a lease of one or more branches, run one after the other.

    A worker runs one branch at a time (leases queued behind it wait), and a group uses
    at most ``max_concurrency`` workers: running branches never exceed the bound."""

    group_id: str
    lease_id: str
    indices: list[int]
    items: list[Any]
    journals: dict[int, list[JournalEntry]] = {}
    #: Cut while starts follow input order (``GroupStart.ordered``, branches not yet
    #: measured cheap): the worker starts it only in its turn.
    in_order: bool = False


class BranchAnswer(Msg, frozen=True):
    """Worker -> Collector: how a lease of branches ended; the fields the three answers
    share (never sent itself: not in the union). ``values[k]`` is the result of
    ``indices[k]``; ``cancelled`` ended on a cancel request; ``unstarted`` were never
    started (the group was stopping or pausing); ``effects`` are (branch, name) of the
    effects performed; ``nbytes`` is the encoded size of ``values``."""

    group_id: str
    lease_id: str
    worker: str = ""
    indices: list[int] = []
    values: list[Any] = []
    cancelled: list[int] = []
    unstarted: list[int] = []
    effects: list[tuple[int, str]] = []
    nbytes: int = 0
    #: This answer reports only the branches listed: other threads of the same process
    #: ran (or will run) the lease's others, and answer them under the same lease id (a
    #: worker waiting for its turn took the lowest branches left of a running lease). The
    #: lease is settled once every branch of it is reported.
    part: bool = False


class BranchDone(BranchAnswer, frozen=True):
    """Worker -> Collector: a lease ended, every branch of it with a value (or
    cancelled, or unstarted)."""

    elapsed: float = 0.0
    #: Branches of the lease that wait on an interaction (``GroupStart.suspend="all"``):
    #: the lease went on past them.
    suspended: list[Suspension] = []


class BranchFailed(BranchAnswer, frozen=True, kw_only=True):
    """Worker -> Collector: branch ``index`` raised; the lease stopped there.

    ``after_stop``: the group was already stopping when it raised (a secondary error,
    never the group's first). The other fields report the rest of the lease."""

    index: int
    error: str
    error_type: str = ""
    after_stop: bool = False
    suspended: list[Suspension] = []


class Interaction(BranchAnswer, frozen=True, kw_only=True):
    """Worker -> Collector: branch ``index`` needs an answer or an approval and stopped
    there; ``journal`` is its continuation (answers and effects so far)."""

    index: int
    pending: PendingInteraction
    journal: list[JournalEntry] = []


class Hold(Msg, frozen=True):
    """Collector -> worker: the group is pausing; start nothing more from this lease
    (what runs finishes or reaches its own suspension)."""

    lease_id: str


class Revoke(Msg, frozen=True):
    """Collector -> worker: give this lease back if it has not started (another worker is
    idle and the lease waits behind a long branch); answered by a ``BranchDone`` with
    every branch ``unstarted``, or not at all if it had started."""

    lease_id: str


class UserInputs(Msg, frozen=True):
    """Driver -> Collector, on resume: answers (``answers``) and decisions (``approvals``)
    by interaction id, from ``principal``."""

    group_id: str
    answers: dict[str, Any] = {}
    approvals: dict[str, bool] = {}
    principal: str | None = None


class GroupCancel(Msg, frozen=True):
    """Driver -> Collector: stop the group (its parent branch was cancelled, the caller
    gave up). Handled like a first error."""

    group_id: str
    reason: str = "cancelled"


class GroupResult(Msg, frozen=True):
    """Collector -> Driver: the group ended. ``status``: ``completed`` (``results`` in
    input order), ``failed`` (the first error and where every branch stands) or
    ``refused`` (resume inputs that do not fit the checkpoint; nothing ran)."""

    group_id: str
    status: str
    results: list[Any] = []
    error: str | None = None
    error_type: str = ""
    error_branch: int | None = None
    finished: dict[int, Any] = {}
    failed: list[int] = []
    cancelled: list[int] = []
    never_started: list[int] = []
    abandoned: list[int] = []
    errors: dict[int, str] = {}
    effects: list[tuple[int, str]] = []
    leases: int = 0
    peak_leases: int = 0
    late: int = 0


class GroupSuspended(Msg, frozen=True):
    """Collector -> Driver: the group paused in a coordinated way (no branch runs); the
    content of its checkpoint. ``status``: ``user_input_pending`` or ``approval_pending``."""

    group_id: str
    status: str
    pending: list[PendingInteraction]
    finished: dict[int, Any] = {}
    journals: dict[int, list[JournalEntry]] = {}
    not_started: list[int] = []
    used_ids: list[str] = []
    effects: list[tuple[int, str]] = []
    leases: int = 0
    peak_leases: int = 0


# -- workers in other processes (docs/remote.md) -------------------------------
#
# Work crosses a process only as data: code is named by import path plus JSON arguments
# and resolved on the worker against its allowlist; secrets travel as the *names* of
# environment variables, never as values.


class Join(Msg, frozen=True):
    """Worker (another process) -> Registry: I am here; what does this run execute?"""

    worker: str
    slots: int = 1
    package_version: str = ""


class Spec(Msg, frozen=True):
    """Registry -> Worker: the run's code as references, the tasks (by reference, or
    inline as data), the artifact's first state, and what the coordinator expects:
    the per-module source ``fingerprints``, the package version and the heartbeat."""

    reward: Ref | None = None     # None: a session of parallel groups only (no rollouts)
    strategy: Ref | None = None
    run_id: str = ""
    tasks: Ref | None = None
    inline_tasks: list[Task] = []
    task_digest: str = ""
    agent: Ref | None = None
    run: Ref | None = None
    propose: Ref | None = None
    initial_state: dict[str, str] = {}
    solved: float = 0.999
    env: list[str] = []
    fingerprints: dict[str, str] = {}
    fingerprint: str = ""
    package_version: str = ""
    heartbeat: float = 1.0
    #: Where the worker's heartbeats go ("": the Scheduler; a group session: its relay).
    heartbeat_to: str = ""
    #: The run has a calls, tokens or cost budget: a group started inside a call asks
    #: the Scheduler (``CallsAsk``) before each branch starts.
    ask_budget: bool = False
    #: How many of a lease's slow independent calls (held-out scoring, an unchained
    #: lease's rollouts) a worker slot makes at once (``evolve(call_concurrency=)``).
    call_concurrency: int = 1


class Refused(Msg, frozen=True):
    """Worker -> Registry -> Driver: this worker will not run the spec (why, and the fix)."""

    worker: str
    reason: str


# -- parallel groups on workers in other processes (docs/remote.md) -------------------


class GroupOpen(Msg, frozen=True):
    """Coordinator -> a worker in another process: the branches of this group call
    ``target`` (checked against the worker's allowlist before anything is imported, and
    against the coordinator's source ``fingerprint``); answers go to ``relay``."""

    group_id: str
    target: Ref
    fingerprint: str = ""
    wants_ctx: bool = False
    suspend_all: bool = True
    #: The budget ledger limits starts (each start asks the coordinator first).
    limited: bool = False
    #: The output type R by name ("int", "pkg.mod:Type"; "": any value).
    returns: str = ""
    relay: str = "groups"


class GroupOpened(Msg, frozen=True):
    """Worker -> relay: ready for this group's branches, or why not (``error``)."""

    group_id: str
    worker: str
    error: str = ""


class HostCall(Msg, frozen=True):
    """Worker -> relay: what must stay in one place for a group (the store and its lock,
    the budget ledger, the effect journal), asked for by a branch on another process.
    ``op`` names the operation; ``call_id`` "" is a one-way call (no reply)."""

    group_id: str
    worker: str
    op: str
    args: list[Any] = []
    call_id: str = ""


class HostReply(Msg, frozen=True):
    """Relay -> worker: the value of a :class:`HostCall`, or the error it raised."""

    call_id: str
    value: Any = None
    error: str = ""
    error_type: str = ""


Message = (
    Start | Budget | Open | Baseline | Tick | Finish | Halted | Unhalt | Shutdown | Lease | LeaseBatch | LeaseDone
    | Settled | SettledBatch | Barrier | EvalRequest | EvalDone | Commit | RoundClosed
    | Progress | RunDone
    | Hello | Heartbeat | Lost | CallsAsk | CallsGranted | Cancel | Stop | NeedWork | Merged | Refresh | Drain | Flush
    | WaveSettled | Branched
    | GroupStart | Branch | BranchDone | BranchFailed | Interaction | Hold | UserInputs
    | GroupCancel | GroupResult | GroupSuspended | Revoke
    | Join | Spec | Refused  # workers in other processes
    | GroupOpen | GroupOpened | HostCall | HostReply  # groups on workers elsewhere
)

__all__ = [
    "Msg", "Message", "Start", "Budget", "Open", "Baseline", "Tick", "Finish", "Halted", "Unhalt", "Shutdown", "Lease",
    "LeaseBatch", "LeaseDone", "Settled", "SettledBatch", "Barrier", "EvalRequest", "EvalDone", "Commit",
    "RoundClosed", "RoundRecord", "Progress", "RunDone", "Hello", "Heartbeat", "Lost", "CallsAsk", "CallsGranted", "Cancel", "Stop", "NeedWork", "Merged", "Refresh", "Drain", "Flush",
    "WaveSettled", "Branched",
    "Diff", "RolloutResult", "Usage",
    "JournalEntry", "PendingInteraction", "Suspension", "GroupStart", "Branch", "BranchDone",
    "BranchFailed", "Interaction", "Hold", "UserInputs", "GroupCancel", "GroupResult",
    "GroupSuspended", "Revoke",
    "Join", "Spec", "Refused", "GroupOpen", "GroupOpened", "HostCall", "HostReply",
]
