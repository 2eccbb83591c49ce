"""evolve(): the Python API. Check the arguments, build the topology, drive it to RunDone.

See docs/concepts.md and docs/async.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import time
import uuid
import warnings
from functools import partial
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import msgspec

from actors.addresses import MERGER, PLANNER, SCHEDULER, worker_name
from actors.artifacts import AppendRules, declared_keys, normaliser, round_tasks
from actors.version import PACKAGE_VERSION
from actors.errors import BackendFailing, ConfigError
from actors.machines.gatesize import gate_size
from actors.machines.merger import CONFLICTS, STALENESS, Merger
from actors.policies.parallelism import (async_pacing, default_parallel, uses_branches,
                                         uses_chain)
from actors.policies.pipeline import PipelineParallel
from actors.machines.planner import Planner, split_tasks
from actors.machines.scheduler import Scheduler
from actors.usage import reports_usage
from actors.workers.core import MAX_CALL_CONCURRENCY, SOLVED, WorkerCore
from actors.workers.scope import AskedRun, BudgetAsks, RunScope
from protocol import (Halted, Hello, Progress, Refused, RoundRecord, RunDone, Start, Task,
                      Tick, Unhalt)
from actors.runtime.clock import Ticker
from actors.runtime.runtime import Runtime, make_log_directory
from actors.runtime.grouping import task_groups
from bus.log import LogCorrupt, read_header
from actors.runtime import pools as coordinator
from actors.tracking import as_tracking

log = logging.getLogger(__name__)


@dataclass
class EvolveResult:
    """What :func:`evolve` returns."""

    rendered: str
    state: dict[str, str]
    version: int
    final_reward: float
    initial_reward: float
    stop_reason: str
    history: list[RoundRecord]
    rollouts: int
    calls: int
    error: str | None = None
    log_path: str | None = None
    elapsed: float = 0.0
    bus: dict[str, int] = field(default_factory=dict)
    #: Runtime counters that are not per-proposal decisions: reverified, stall_refreshes,
    #: starved_seconds (worker-seconds held back by backpressure), held_back,
    #: refreshes, cancelled_leases, max_eta_kept, scoring_calls (backend calls spent
    #: scoring candidates on the held-out split: not in ``calls``).
    stats: dict[str, float] = field(default_factory=dict)
    #: Token usage of the agent, when it keeps one (``agent.usage.as_dict()``, e.g.
    #: actors.openai_agent.OpenAIAgent); None otherwise.
    usage: dict[str, int] | None = None
    #: Every call of the run against its budgets (docs/budgets.md): ``calls``,
    #: ``tokens`` and ``cost``, each by kind (rollout, proposal, scoring) with its
    #: ``total``, ``limit`` and ``over``; ``attempts`` and ``throttled_seconds`` (HTTP
    #: attempts and seconds waited, as reported), ``spent`` (the first budget found
    #: spent), ``in_flight_when_spent`` (calls reserved then), ``refused_leases``.
    #: ``calls`` above counts train calls only (rollout + proposal).
    budget: dict[str, Any] = field(default_factory=dict)
    _outcomes: dict[str, int] = field(default_factory=dict, repr=False)

    def outcomes(self) -> dict[str, int]:
        """Decision -> count: committed, below-threshold, conflict, duplicate, unchanged,
        section-violation, rollout-error, ..."""
        return dict(self._outcomes)


def _validate(tasks, reward, agent, run, propose, n_workers, rounds, held_out_frac,
              max_concurrency) -> list[Task]:
    tasks = list(tasks)
    for t in tasks:
        if not isinstance(t, Task):
            raise ConfigError(f"tasks must be protocol Task objects (Task(id, prompt, meta)); "
                              f"got {type(t).__name__}: build them with actors.Task(id=..., prompt=...)")
    if len(tasks) < 4:
        raise ConfigError(f"evolve() needs at least 4 tasks (some train, some held out); got "
                          f"{len(tasks)}: add tasks")
    seen: set[str] = set()
    dupes = sorted({t.id for t in tasks if t.id in seen or seen.add(t.id)})
    if dupes:
        raise ConfigError(f"duplicate task ids {dupes[:5]}: every Task.id must be unique")
    if not isinstance(n_workers, int) or n_workers < 1:
        raise ConfigError(f"n_workers must be an integer >= 1, got {n_workers!r}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"rounds must be an integer >= 1, got {rounds!r}")
    if not 0.0 < held_out_frac < 1.0:
        raise ConfigError(f"held_out_frac must be in (0, 1), got {held_out_frac!r}")
    if max_concurrency is not None and (not isinstance(max_concurrency, int) or max_concurrency < 1):
        raise ConfigError(f"max_concurrency must be an integer >= 1, got {max_concurrency!r}")
    if not callable(reward):
        raise ConfigError("reward must be a callable reward(task, output) -> float in [0, 1]")
    if agent is None and (run is None or propose is None):
        raise ConfigError("evolve() needs either agent= (an object with solve(rendered, task) "
                          "and propose(rendered, task, output, reward)) or both run= and "
                          "propose=")
    if agent is not None and (run is not None or propose is not None):
        raise ConfigError("pass either agent= or run=/propose=, not both")
    if agent is not None and not (callable(getattr(agent, "solve", None))
                                  and callable(getattr(agent, "propose", None))):
        raise ConfigError(f"agent {type(agent).__name__} needs methods solve(rendered, task) "
                          "and propose(rendered, task, output, reward)")
    return tasks


def prepare_parallel(parallel, strategy, task_ids: list[str], n_workers: int):
    """Check the parallelism/artifact pairing before the first rollout; returns the
    strategy to plan with and the key -> section map the Merger enforces (or None)."""
    if parallel is None:   # the strategy's round if it asks for one (round_tasks)
        return default_parallel(n_workers, strategy), None
    if isinstance(parallel, PipelineParallel):
        raise ConfigError(parallel.refusal_message())
    if not callable(getattr(parallel, "plan", None)):
        raise ConfigError(f"parallel={parallel!r} has no plan(n_workers, round_index, keys) "
                          "method: pass DataParallel(), TensorParallel(...), "
                          "ClusterParallel(...) or an object implementing plan()")
    with_keys = getattr(parallel, "with_keys", None)
    if with_keys is not None:
        # with_keys keeps keys given to the constructor, checking them against the
        # artifact's declared space; otherwise it takes that space.
        parallel = with_keys(declared_keys(strategy), normaliser(strategy))
        parallel.validate(task_ids, n_workers=n_workers)
        return parallel, dict(parallel.section_map())
    return parallel, None


#: ``hold`` is on by default below this many workers (rounds of fewer than 16 rollouts,
#: the default round): measured on the noisy domains, docs/performance.md (eighth pass).
HOLD_BELOW_WORKERS = 4


def evolve(tasks: Sequence[Task], reward: Callable[[Task, str], float], *, agent=None,
           run: Callable | None = None, propose: Callable | None = None, strategy=None,
           parallel=None, task_sampler=None, rounds: int | None = None, n_workers: int = 4,
           max_concurrency: int | None = None, held_out_frac: float = 0.4, seed: int = 0,
           log: str | None = None, max_rollouts: int | None = None,
           max_seconds: float | None = None, max_calls: int | None = None,
           max_tokens: int | None = None, max_cost: float | None = None,
           prices: dict[str, Any] | None = None, target_reward: float | None = None, patience: int | None = None,
           initial_state: dict[str, str] | None = None, solved_threshold: float = SOLVED,
           asynchronous: bool = False, async_ratio: int | None = None,
           staleness: str | None = None, stall_merges: int | None = None,
           lease_size: int | None = None,
           bus: str = "zmq", on_progress: Callable[[RoundRecord], None] | None = None,
           log_meta: dict[str, Any] | None = None, log_fsync: str | None = None,
           log_overwrite: bool = False, resume_from: Any = None, workers: Any = None, refs: dict[str, Any] | None = None,
           insecure: bool = False, tracking: Any = None, screen: bool = True,
           attribute: bool = True, retire: bool = True,
           recheck: bool = False, sequential: bool = True,
           conflicts: str = "first", chain: bool | None = None,
           deterministic: bool = False, noise_z: float = 0.0,
           gate_tasks: int | None = None,
           branches: bool | None = None, hold: bool | None = None,
           rescore: int = 3, level: bool = False, vouch: int = 2,
           cross: bool = True, call_concurrency: int = 8) -> EvolveResult:
    """Evolve an artifact: workers roll it out on ``tasks`` and propose edits, the merger
    folds them in behind a held-out gate. See docs/concepts.md and docs/async.md.

    ``log_fsync``: the log's fsync policy ("always", "batched", "never"; default
    $EVOBUS_LOG_FSYNC, else "batched"). A ``log`` path that exists is refused unless
    ``log_overwrite=True`` (a log is never overwritten by accident). ``resume_from``: an
    :class:`actors.replay.resume.ResumePoint` (use :func:`actors.replay.resume.resume`): the control
    actors start from the state its log rebuilds, and no ``Start`` is sent.

    ``tracking``: an MLflow tracking URI or an :class:`actors.tracking.MlflowTracking`
    (the ``tracking`` extra): parameters, per-round metrics and every committed version.
    ``screen``, ``attribute``, ``retire`` (default on; a log header without them
    replays with them off): the Merger's acceptance rules for noisy models and wrong
    proposals (docs/concepts.md): screen each diff on its evidence task and
    conflicting variants on a held-out minibatch, find and drop the diffs behind a
    fused candidate's regressions, and remove accepted keys that block edits; ``recheck``: score a close call twice, the head too, for noisy models;
    ``sequential``: score a gate's candidate on a held-out minibatch first and stop
    there when it is behind the head task for task; ``conflicts``: "first" (the
    default: of the diffs that write one key differently, the first proposer's goes on
    to the fused candidate unscored, so a merge pays one held-out gate) or "score"
    (each scored on the held-out split, the best kept; a log header without
    ``conflicts`` replays so). ``chain``: a worker applies each proposal of a lease to its
    own copy and rolls the lease's next tasks out on the edited state, proposing on top,
    so one candidate can hold several edits that need each other (docs/concepts.md,
    actors/workers/chain.py); off, every proposal of a lease is made on the head, and a
    lease's calls are independent: made up to ``call_concurrency`` at once when slow.
    By default on for a strategy of one declared key (a single slot) and for leases of
    alike tasks (TensorParallel, ClusterParallel, a ``plan()`` of your own), off for
    DataParallel's mixed shards (actors/policies/parallelism.py ``uses_chain``).
    ``branches`` (with ``conflicts="first"`` and ``chain``; by default on for a strategy
    of one declared key, a single slot, where every diff conflicts): a
    chained lease whose edits lost a conflict is carried on as its plan unit's branch
    (the unit's next lease rolls out on it and chains on top), and of conflicting
    chains the one with the best train evidence is gated (of more than four, the four
    best duel on a few held-out tasks first); a strategy that declares its round
    (``round_tasks``) is gated once per that many rollouts, the merges between carrying
    every chain on (actors/machines/branches.py, docs/concepts.md). ``deterministic=True`` declares that the model gives the same output
    for the same rendered artifact and task: a (state, task) score is then asked for
    once and reused (actors/machines/reuse.py, docs/concepts.md). ``noise_z``: the noise
    test (0: off): a candidate must beat the head by that many standard errors, the
    reward noise measured from repeated rollouts of the same (state, task).
    ``gate_tasks``: how many held-out tasks a gate scores (a fixed sample of the split);
    by default sized to ``max_calls`` (a tenth of it, at least 48: a small budget makes
    more decisions on fewer tasks each; actors/machines/gatesize.py), the whole split
    without a call budget or from ten times the split's size on.
    ``hold`` (synchronous runs and asynchronous waves): a merge left with fewer than two
    diffs after the screen pays no held-out gate, its diffs join the next merge's (one
    merge at most; not the last merge of an asynchronous run; off for a strategy of one
    declared key, whose diffs all conflict). By default on with fewer than
    :data:`HOLD_BELOW_WORKERS` workers, whose rounds are small (a lone diff is most
    merges, and a gate for it is dear), off from there on (a round of 16 rollouts leaves
    a held diff's round-mates proposing it again on the old head); docs/performance.md.
    ``rescore`` (default 3): a head that commits nothing for two merges in a row, on a
    model seen to be noisy, is scored afresh on the held-out split, until its score is the mean of this
    many samples (1: never; docs/concepts.md). ``level`` (default off): a gate candidate
    level with the head on the held-out split (behind by one task at most) has each of
    its diffs judged on the train tasks seen failing at the head, the head scored there
    afresh; those that pass go in (docs/concepts.md). ``vouch`` (default 2; 0: off): a gate
    candidate level with the head on the held-out split (behind by one task at most) is
    committed when each of its diffs passed the screen on at least this many distinct
    train tasks, and a retirement level there goes through when each key's removal alone
    repaired that many stuck train tasks (docs/concepts.md). ``cross`` (default on): before
    the held-out gate, a fused candidate of several diffs is scored on their evidence
    tasks (and a few of the committed diffs'); a diff that breaks another's evidence
    there is left out (``harmful``; actors/machines/interference.py, docs/concepts.md).
    ``call_concurrency`` (default 8): how many of a lease's independent calls (an eval
    lease's held-out scoring, an unchained rollout lease's rollouts, each with its
    proposal) a worker makes at once when they are slow and waiting (2 ms or more, under
    a quarter of it on a core: a model behind a network, not a local evaluator); fast
    calls, and a chained lease's, run one by one (1: always one by one).
    A limit of the endpoint's own (``OpenAIAgent``'s ``max_concurrent``) still holds.

    ``parallel`` (default ``DataParallel(per_worker=4)`` with up to 4 workers, a round
    of 16 tasks shared by more, chosen by the benchmarks in docs/parallelism.md, or the
    strategy's ``round_tasks`` over the workers when it declares one: 64 for
    ``SingleSlot``, 16 per worker with 4 workers; ``DataParallel()`` rolls out each
    worker's whole shard a round). ``rounds`` (default 15) counts synchronous rounds; in asynchronous mode it has no
    meaning (a warning says so if it is passed) and the run stops on a budget:
    ``max_rollouts``, ``max_calls``, ``max_tokens``, ``max_cost``, ``max_seconds``,
    ``target_reward`` or ``patience``. ``max_calls`` counts every call to run/propose
    (rollouts, proposals, held-out scoring); ``max_tokens`` and ``max_cost`` count what
    the calls report (``prices``: model -> (input, output) per 1M tokens), see
    docs/budgets.md. ``async_ratio`` (default 3), ``staleness`` (default "guarded") and ``stall_merges``
    (default 3) shape asynchronous mode only (docs/async.md); passed to a synchronous
    run, a warning names them. Asynchronous waves are paced by merges, and with
    ``async_ratio`` omitted workers roll out on the head (a lag budget of 0).
    """
    modes = _check_modes(asynchronous, rounds, async_ratio, staleness, stall_merges,
                         (max_rollouts, max_calls, max_seconds, target_reward, patience,
                          max_tokens, max_cost))
    if hold is None:
        hold = isinstance(n_workers, int) and n_workers < HOLD_BELOW_WORKERS
    modes = dataclasses.replace(modes, gate=_gate(screen, attribute, retire, recheck,
                                                      sequential, conflicts, noise_z,
                                                      hold))
    if deterministic:   # recorded only when declared: older headers replay without it
        modes.gate["reuse"] = True
    if isinstance(rescore, bool) or not isinstance(rescore, int) or rescore < 1:
        raise ConfigError(f"evolve(rescore={rescore!r}): give the most held-out samples a "
                          "head's score is the mean of, an integer >= 1 (1: off), e.g. 3")
    if rescore > 1:   # recorded only when on: older headers replay without it
        modes.gate["rescore"] = rescore
    if level:   # recorded only when on: older headers replay without it
        modes.gate["level"] = True
    if isinstance(vouch, bool) or not isinstance(vouch, int) or vouch < 0:
        raise ConfigError(f"evolve(vouch={vouch!r}): give the distinct train tasks a diff "
                          "must have passed the screen on, an integer >= 0 (0: off), e.g. 2")
    if vouch:   # recorded only when on: older headers replay without it
        modes.gate["vouch"] = vouch
    if cross:   # recorded only when on: older headers replay without it
        modes.gate["cross"] = True
    if modes.gate["sequential"] and retire:   # likewise: a retirement's confirmation
        modes.gate["sequential_retire"] = True
    _check_numbers(solved_threshold, lease_size)
    if isinstance(call_concurrency, bool) or not isinstance(call_concurrency, int) \
            or not 1 <= call_concurrency <= MAX_CALL_CONCURRENCY:
        raise ConfigError(f"evolve(call_concurrency={call_concurrency!r}): give how many "
                          "of a lease's independent calls (held-out scoring, an unchained "
                          "lease's rollouts) a worker makes at once when calls are slow, "
                          f"an integer from 1 (one at a time) to {MAX_CALL_CONCURRENCY}, "
                          "e.g. 8")
    tasks = _validate(tasks, reward, agent, run, propose, n_workers, modes.rounds,
                      held_out_frac, max_concurrency)
    n_heldout = len(split_tasks([t.id for t in tasks], held_out_frac, seed)[1])
    prices = _check_budgets(max_calls, max_tokens, max_cost, prices, agent, run, propose,
                            n_heldout)
    modes.gate["gate_tasks"] = _gate_tasks(gate_tasks, n_heldout, max_calls)
    _warn_if_inside_a_loop("evolve", "evolve_async")
    # The default is the scenario files' default (protocol.scenario.Scenario.strategy).
    strategy = strategy if strategy is not None else AppendRules()
    task_ids = [t.id for t in tasks]
    plan_with, sections = prepare_parallel(parallel, strategy, task_ids, n_workers)
    chain = uses_chain(chain, strategy, plan_with)
    if uses_branches(branches, strategy, chain=chain, conflicts=conflicts):
        modes.gate["branches"] = True   # recorded only when on: older headers replay without
        if round_tasks(strategy) is not None:   # one gate per the strategy's round (at
            # most the train split: a round of fewer tasks than that is gated every time)
            modes.gate["gate_rollouts"] = min(round_tasks(strategy), len(tasks) - n_heldout)
    if modes.gate["hold"] and len(declared_keys(strategy) or "several") == 1:
        # One key: every two diffs conflict, so a held diff never shares a gate.
        modes = dataclasses.replace(modes, gate={**modes.gate, "hold": False})
    if asynchronous:   # waves paced by merges, rebasing (actors/machines/staleness.py)
        paced = async_pacing(n_workers, modes.async_ratio, lag=async_ratio)
        modes = dataclasses.replace(modes, gate={**modes.gate, **paced["merger"]},
                                    planner=paced["planner"], scheduler=paced["scheduler"])
    if agent is not None:
        run, propose = agent.solve, agent.propose
    state0 = dict(initial_state) if initial_state is not None else strategy.initial()
    run_id = uuid.uuid4().hex[:12]
    # Workers in other processes (``workers``: a protocol.scenario.Workers; ``refs``: how
    # to name the code for them). Closures are refused here, before any rollout.
    remote = coordinator.plan(workers, n_workers, bus=bus, tasks=tasks, reward=reward,
                              run=run, propose=propose, agent=agent, strategy=strategy,
                              initial_state=state0, solved=solved_threshold,
                              package_version=PACKAGE_VERSION, refs=refs, insecure=insecure,
                              run_id=run_id)
    if remote is not None and (max_calls, max_tokens, max_cost) != (None, None, None):
        # Their groups' branch starts ask the Scheduler's budget first (workers.scope).
        remote.spec = msgspec.structs.replace(remote.spec, ask_budget=True)
    if remote is not None:
        remote.spec = msgspec.structs.replace(remote.spec, call_concurrency=call_concurrency)
    meta = _log_meta(seed, run_id, log_meta, plan_with, task_sampler, modes, remote,
                     strategy)
    groups = task_groups(tasks, plan_with)   # how report/inspect group failing tasks
    if groups is not None:
        meta.setdefault("task_groups", groups.to_json())
    start = Start(run_id=run_id, seed=seed, task_ids=task_ids, n_workers=n_workers,
                  rounds=modes.rounds, held_out_frac=held_out_frac,
                  max_concurrency=max_concurrency or n_workers, initial_state=state0,
                  max_rollouts=max_rollouts, max_calls=max_calls, max_seconds=max_seconds,
                  target_reward=target_reward, patience=patience, sections=sections,
                  asynchronous=asynchronous, async_ratio=modes.async_ratio,
                  staleness=modes.staleness, lease_size=lease_size, max_tokens=max_tokens,
                  max_cost=max_cost, prices=prices, chain=bool(chain),
                  lease_key=secrets.token_hex(16))  # ids a peer cannot guess (machines/ids.py)
    tracker = _start_tracker(tracking, locals(), plan_with, strategy, state0, run_id)
    if log is not None:   # `log="runs/x.evolog"` works in a fresh directory, as the CLI does
        make_log_directory(log, "evolve(log=)")
    # A resumed run's clock starts at the time its old logs cover (time budgets).
    t0 = time.monotonic() - (resume_from.elapsed if resume_from is not None else 0.0)
    topology = _Topology(tasks=tasks, reward=reward, run=run, propose=propose,
                         strategy=strategy, solved=solved_threshold, state0=state0,
                         n_workers=n_workers, remote=remote, modes=modes,
                         call_concurrency=call_concurrency,
                         run_id=str(meta["run_id"]))
    # A run refused for its configuration leaves no log (docs/replay.md): a new run's, or
    # the segment a resume began; never a segment of the chain it resumes.
    refused_log = (log, topology.run_id) if not _in_chain(log, resume_from) else None
    try:
        ran = _run(topology, start, plan_with, task_sampler, resume_from, t0,
                   runtime=dict(bus=bus, log_path=log, log_meta=meta, fsync=log_fsync,
                                log_overwrite=log_overwrite),
                   drive=dict(max_seconds=max_seconds, on_progress=on_progress,
                              on_round=_on_round(tracker, agent)),
                   watch=_tee(getattr(on_progress, "watch", None),
                              tracker.watch if tracker is not None else None))
    except ConfigError:   # (workers that never came, say): nothing ran
        _drop_refused_log(refused_log)
        raise
    if isinstance(ran.done, Halted):
        raise BackendFailing(ran.done.error, log)
    if ran.done.fatal:
        raise ConfigError(_fatal(ran.done, log, refused_log))
    result = _result(ran, strategy, log, t0, agent)
    if tracker is not None:
        tracker.end(result, usage=result.usage)
    return result


def _fatal(done: RunDone, log: str | None, refused_log) -> str:
    """A caller's mistake a call found (a reward out of range): before any round closed
    the run was refused, and leaves no log; later, the log keeps what it did."""
    if not done.history and _drop_refused_log(refused_log):
        return done.fatal
    if log is None:
        return done.fatal
    n = len(done.history)
    return (f"{done.fatal} (the log {log} keeps the {n} round{'s' if n != 1 else ''} run "
            "before it, for `evobus inspect`; run again with another log path or with "
            "--overwrite, log_overwrite=True)")


def _in_chain(log: str | None, resume_from) -> bool:
    """Whether ``log`` is a segment of the chain ``resume_from`` resumes (its new log is
    not, unless named so on purpose with log_overwrite)."""
    if resume_from is None or log is None or not os.path.exists(log):
        return False
    return any(os.path.samefile(log, p) for p in resume_from.paths)


def _drop_refused_log(refused_log: tuple[str | None, str] | None) -> bool:
    """Remove the log ``(path, run id)`` of a new run refused for its configuration:
    nothing in it is worth reading or resuming, and the corrected run may take the same
    path. Only this run's own log goes: its header must name this run."""
    path, run_id = refused_log or (None, "")
    if path is None:
        return False
    try:
        if read_header(path).run_id != run_id:
            return False
        os.remove(path)
    except (OSError, LogCorrupt):  # never written (refused before), or unreadable: kept
        return False
    return True


@dataclass(frozen=True)
class _Topology:
    """What the workers of a run are made of."""

    tasks: list[Task]
    reward: Callable
    run: Callable
    propose: Callable
    strategy: Any
    solved: float
    state0: dict[str, str]
    n_workers: int
    remote: Any
    modes: "_Modes"
    call_concurrency: int
    #: The run's id as its log says (a resumed run keeps its chain's): group ids derive
    #: from it, so a resumed run's groups find the branches they had finished.
    run_id: str


@dataclass
class _Ran:
    """What a run leaves once its topology has closed."""

    done: Any
    elapsed_by_round: dict[int, float]
    bus_stats: dict[str, int] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    given_up: int = 0
    budget: Any = None


def _run(top: _Topology, start: Start, plan_with, task_sampler, resume_from, t0: float, *,
         runtime: dict[str, Any], drive: dict[str, Any], watch) -> _Ran:
    """Build the topology (bus, control machines, workers), start it (or resume it) and
    drive it to its end; everything it started is closed when this returns."""
    remote = top.remote
    # A resumed run's log numbers its messages on from the old log's last one.
    first_seq = resume_from.last_seq + 1 if resume_from is not None else 1
    with Runtime(**runtime, peers=remote.ports if remote else (), first_seq=first_seq,
                 watch=watch) as rt:
        _spawn_machines(rt, plan_with, task_sampler, start, top.modes, remote)
        if resume_from is not None:
            # Before any message flows: replay the old log into the machines (no sending),
            # then, in place of Start and before any worker can say Hello, re-send what
            # the crashed run never delivered, in its order (begin).
            resume_from.prepare(rt, rt.machines)
            resume_from.begin()
        _spawn_workers(rt, top, start, resume_from)
        if remote:  # the registry, process workers, and a deadline for everyone
            remote.start(rt, t0)
        if resume_from is None:
            rt.send(PLANNER, start)
        if resume_from is not None and rt.machines[PLANNER].halted:
            rt.send(PLANNER, Unhalt())  # the backend is back (we hope): plan again
        done, elapsed_by_round = _drive(rt, t0, drive["max_seconds"], start.asynchronous,
                                        remote, drive["on_progress"], drive["on_round"])
        if isinstance(done, Halted):  # leaving the with-block closes the actors and the log
            return _Ran(done, elapsed_by_round)
        rt.await_workers()   # their Stops delivered, so the log ends with nothing undelivered
        bus_stats, stats = _counters(rt, done, remote)
        scheduler = rt.machines[SCHEDULER]
        return _Ran(done, elapsed_by_round, bus_stats, stats, scheduler.given_up,
                    scheduler.ledger.summary())


def _spawn_workers(rt: Runtime, top: _Topology, start: Start, resume_from) -> None:
    by_id = {t.id: t for t in top.tasks}
    # Groups started inside run/propose run on this runtime, in this log, within
    # the run's budgets; a resumed run's groups find what they had finished (workers.scope).
    finished = resume_from.group_results() if resume_from is not None else None
    budgeted = (start.max_calls, start.max_tokens, start.max_cost) != (None, None, None)
    run_scope = RunScope(rt, top.run_id, None, finished)
    for i in range(top.remote.local if top.remote else top.n_workers):
        name = worker_name(i)
        scope = run_scope if not budgeted else AskedRun(   # each asks the run's ledger
            top.run_id, BudgetAsks(name, partial(rt.bus.send, name, SCHEDULER)), rt, finished)
        rt.spawn_worker(WorkerCore(name, by_id, top.reward, top.run, top.propose,
                                   top.strategy, solved=top.solved,
                                   initial_state=top.state0, scope=scope,
                                   call_concurrency=top.call_concurrency))


def _on_round(tracker, agent) -> Callable | None:
    if tracker is None:
        return None
    return lambda p, budget=None: tracker.on_round(p.record, rollouts=p.rollouts,
                                                   calls=p.calls, usage=_usage_of(agent),
                                                   budget=budget)


def _result(ran: _Ran, strategy, log, t0: float, agent) -> "EvolveResult":
    done = ran.done
    history = [_with_elapsed(r, ran.elapsed_by_round.get(r.round, r.elapsed))
               for r in done.history]
    outcomes = {**done.outcomes,
                **({"infrastructure-failure": ran.given_up} if ran.given_up else {})}
    return EvolveResult(rendered=strategy.render(done.state), state=dict(done.state),
                        version=done.version, final_reward=done.final_reward,
                        initial_reward=done.initial_reward, stop_reason=done.stop_reason,
                        history=history, rollouts=done.rollouts, calls=done.calls,
                        error=done.error, log_path=log, elapsed=time.monotonic() - t0,
                        bus=ran.bus_stats, stats=ran.stats, usage=_usage_of(agent),
                        budget=ran.budget, _outcomes=outcomes)


@dataclass(frozen=True)
class _Modes:
    """The round settings once defaults are applied: ``rounds`` counts synchronous
    rounds; the other three shape asynchronous mode only."""

    rounds: int
    async_ratio: int
    staleness: str
    stall_merges: int
    #: The Merger's acceptance rules switched on (``{"screen": True, ...}``).
    gate: dict[str, bool] = field(default_factory=dict)
    #: The Planner's arguments beyond the strategy (async pacing: ``{"waves": 2}``),
    #: and the Scheduler's beyond the Start's (``{"lag": 0}``).
    planner: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)


def _check_modes(asynchronous: bool, rounds, async_ratio, staleness, stall_merges,
                 stops: tuple) -> _Modes:
    """Apply the defaults; warn by name about what the mode ignores, refuse what is
    invalid. ``stops``: the stop conditions, one of which async mode needs."""
    async_only = {"async_ratio": async_ratio, "staleness": staleness,
                  "stall_merges": stall_merges}
    if not asynchronous:
        given = [name for name, value in async_only.items() if value is not None]
        if given:
            one = len(given) == 1
            warnings.warn(f"evolve(asynchronous=False): {', '.join(given)} only shape"
                          f"{'s' if one else ''} asynchronous mode and "
                          f"{'is' if one else 'are'} ignored in synchronous "
                          "rounds; pass asynchronous=True to use "
                          f"{'it' if one else 'them'}", RuntimeWarning, stacklevel=3)
    modes = _Modes(rounds=15 if rounds is None else rounds,
                   async_ratio=3 if async_ratio is None else async_ratio,
                   staleness="guarded" if staleness is None else staleness,
                   stall_merges=3 if stall_merges is None else stall_merges)
    if not asynchronous:
        return modes
    if rounds is not None:
        warnings.warn("evolve(asynchronous=True): rounds has no meaning without rounds "
                      "and is ignored; stop with max_rollouts, max_calls, max_seconds, "
                      "target_reward or patience", RuntimeWarning, stacklevel=3)
    if all(b is None for b in stops):
        raise ConfigError("evolve(asynchronous=True) needs a stop condition: pass "
                          "max_rollouts, max_calls, max_tokens, max_cost, max_seconds, "
                          "target_reward or patience (there is no default time limit)")
    if not isinstance(modes.async_ratio, int) or modes.async_ratio < 1:
        raise ConfigError(f"async_ratio must be an integer >= 1, got {modes.async_ratio!r}")
    if modes.staleness not in STALENESS:
        raise ConfigError(f"staleness={modes.staleness!r}: choose one of "
                          f"{', '.join(STALENESS)}")
    merges = modes.stall_merges
    if isinstance(merges, bool) or not isinstance(merges, int) or merges < 1:
        raise ConfigError(f"stall_merges must be an integer >= 1, got {merges!r}")
    return modes


def _check_numbers(solved_threshold, lease_size) -> None:
    if isinstance(solved_threshold, bool) or not isinstance(solved_threshold, (int, float)) \
            or not 0.0 < solved_threshold <= 1.0:
        raise ConfigError(f"solved_threshold must be in (0, 1] (a rollout scoring at least "
                          f"this asks for no proposal; rewards are in [0, 1]), got "
                          f"{solved_threshold!r}")
    if lease_size is not None and (not isinstance(lease_size, int) or lease_size < 1):
        raise ConfigError(f"lease_size must be an integer >= 1 (tasks per lease), got "
                          f"{lease_size!r}; None sends each worker's share as one lease")


def usage_refusal(name: str, value: Any, who: str) -> str:
    """Why a token or cost budget is refused for code that reports no usage (run's
    refusal and validate's, word for word)."""
    return (f"{name}={value!r} but {who} does not report token usage (no reports_usage = "
            "True): the budget could not be enforced. Report each model call with "
            "actors.usage.report(...) and set reports_usage = True (OpenAIAgent does), or "
            f"drop {name}")


def _check_budgets(max_calls, max_tokens, max_cost, prices, agent, run, propose,
                   n_heldout: int) -> dict[str, tuple[float, float]]:
    """Refuse budgets that cannot mean what they say; return the prices, checked."""
    for name, value, kind in (("max_tokens", max_tokens, int), ("max_cost", max_cost, float)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, kind))
                                  or value <= 0):
            raise ConfigError(f"{name} must be a positive number, got {value!r}")
    if max_calls is not None and max_calls <= n_heldout:
        raise ConfigError(f"max_calls={max_calls} cannot pay for the run: scoring version 0 "
                          f"on the {n_heldout} held-out task(s) takes {n_heldout} calls "
                          "before the first rollout; raise max_calls well above "
                          f"{n_heldout} (every merge scores on the held-out tasks again)")
    for name, value in (("max_tokens", max_tokens), ("max_cost", max_cost)):
        if value is not None and not reports_usage(agent, run, propose):
            who = type(agent).__name__ if agent is not None else "run/propose"
            raise ConfigError(usage_refusal(name, value, who))
    checked: dict[str, tuple[float, float]] = {}
    for model, price in (prices or {}).items():
        if not (isinstance(price, (list, tuple)) and len(price) == 2 and all(
                isinstance(p, (int, float)) and not isinstance(p, bool) and p >= 0
                for p in price)):
            raise ConfigError(f"prices[{model!r}] = {price!r}: give (input, output), the "
                              "price of 1M input tokens and of 1M output tokens, e.g. "
                              f"{{{model!r}: (0.15, 0.60)}}")
        checked[str(model)] = (float(price[0]), float(price[1]))
    return checked


def _gate(screen: bool, attribute: bool, retire: bool, recheck: bool,
          sequential: bool = False, conflicts: str = "score",
          noise_z: float = 0.0, hold: bool = False) -> dict[str, Any]:
    """The Merger's optional acceptance rules (docs/concepts.md), each on or off: the
    log header records them all, and a header that lacks one was written before it
    existed (replay takes it as off)."""
    if conflicts not in CONFLICTS:
        raise ConfigError(f"evolve(conflicts={conflicts!r}): choose one of "
                          f"{', '.join(map(repr, CONFLICTS))}")
    if isinstance(noise_z, bool) or not isinstance(noise_z, (int, float)) or noise_z < 0:
        raise ConfigError(f"evolve(noise_z={noise_z!r}): the noise test takes a number of "
                          "standard errors >= 0 (0 turns it off), e.g. noise_z=1.0")
    return {"screen": bool(screen), "attribute": bool(attribute), "retire": bool(retire),
            "recheck": bool(recheck), "sequential": bool(sequential),
            "conflicts": conflicts, "noise_z": float(noise_z), "hold": bool(hold)}


def _gate_tasks(gate_tasks: int | None, n_heldout: int, max_calls: int | None) -> int | None:
    """The held-out tasks a gate scores, as the Merger takes it (None: the whole split)."""
    if gate_tasks is None:
        return gate_size(n_heldout, max_calls)
    if isinstance(gate_tasks, bool) or not isinstance(gate_tasks, int) or gate_tasks < 1:
        raise ConfigError(f"evolve(gate_tasks={gate_tasks!r}): give a number of held-out "
                          "tasks >= 1 for each gate to score, or leave it out (sized to "
                          "max_calls)")
    return None if gate_tasks >= n_heldout else gate_tasks


def _start_tracker(tracking, params: dict[str, Any], plan_with, strategy,
                   state0: dict[str, str], run_id: str):
    """The MLflow tracker, started before any rollout (a missing extra is a ConfigError
    now, not after the run), or None."""
    tracker = as_tracking(tracking)
    if tracker is not None:
        tracker.start(_tracked_params(params, plan_with, strategy), render=strategy.render,
                      initial_state=state0, tags={"evobus.run_id": run_id,
                                                  "evobus.version": PACKAGE_VERSION})
    return tracker


def _log_meta(seed: int, run_id: str, log_meta, plan_with, task_sampler, modes: _Modes,
              remote, strategy) -> dict[str, Any]:
    """The log header's meta: what replay needs to rebuild the machines of a run
    started from Python (its planner's strategy and the constructor arguments that
    Start does not carry)."""
    meta = {"seed": seed, "run_id": run_id, **(log_meta or {})}
    meta.setdefault("parallel", repr(plan_with))
    meta.setdefault("machine_args", msgspec.json.encode(
        {"merger": {"stall_merges": modes.stall_merges, **modes.gate},
         **({"planner": modes.planner} if modes.planner else {}),
         **({"scheduler": {**modes.scheduler, **(remote.scheduler_kwargs() if remote
                                                 else {})}}
            if remote or modes.scheduler else {})}).decode())
    if task_sampler is not None:
        meta.setdefault("task_sampler", repr(task_sampler))
    # How `evobus inspect --version` and the report render the artifact (built-ins only).
    spec = strategy_spec(strategy)
    if spec is not None:
        meta.setdefault("strategy", json.dumps(spec))
    return meta


def _spawn_machines(rt: Runtime, plan_with, task_sampler, start: Start, modes: _Modes,
                    remote) -> None:
    rt.spawn(PLANNER, Planner(plan_with, task_sampler, **modes.planner))
    rt.spawn(SCHEDULER, Scheduler(start.max_concurrency, asynchronous=start.asynchronous,
                                  async_ratio=modes.async_ratio, n_workers=start.n_workers,
                                  **modes.scheduler,
                                  **(remote.scheduler_kwargs() if remote else {})))
    rt.spawn(MERGER, Merger(asynchronous=start.asynchronous, alpha=modes.async_ratio,
                            staleness=modes.staleness, stall_merges=modes.stall_merges,
                            **modes.gate))


def _drive(rt: Runtime, t0: float, max_seconds, asynchronous: bool, remote,
           on_progress, on_round=None) -> tuple[RunDone, dict[int, float]]:
    """Deliver the driver's messages until ``RunDone``, sending the clock as ``Tick``s
    where something runs on time (a seconds budget, async mode, remote liveness)."""
    elapsed_by_round: dict[int, float] = {}
    ticking = max_seconds is not None or asynchronous or remote is not None
    ticker = Ticker(min(0.1, max_seconds / 10) if max_seconds is not None else 0.1)
    while True:
        now = time.monotonic() - t0
        if ticking and ticker.due(now):
            if max_seconds is not None:
                rt.send(PLANNER, Tick(elapsed=now))
            if asynchronous or remote is not None:  # liveness runs on Ticks
                rt.send(SCHEDULER, Tick(elapsed=now))
            if remote is not None:  # dead process workers replaced, or the run stops
                remote.supervise(rt)
        delivery = rt.next_delivery(timeout=ticker.period if ticking else 0.5)
        if delivery is None:
            continue
        match delivery.msg:
            case Progress(record=record) as progress:
                elapsed_by_round[record.round] = time.monotonic() - t0
                if on_round is not None:   # tracking, between messages (the ledger too)
                    on_round(progress, rt.machines[SCHEDULER].ledger.summary())
                if on_progress is not None:
                    # The Scheduler's registry, read between messages: a count, for
                    # display only (decisions never depend on it).
                    alive = len(rt.machines[SCHEDULER].workers)
                    on_progress(msgspec.structs.replace(
                        record, elapsed=round(elapsed_by_round[record.round], 6),
                        workers_alive=alive))
            case RunDone() | Halted() as done:
                return done, elapsed_by_round
            case Hello() | Refused() if remote:  # late joiners, refusals
                remote.note(delivery.msg)


def _counters(rt: Runtime, done: RunDone, remote) -> tuple[dict[str, int], dict[str, float]]:
    """The bus's and the Scheduler's counters, read once the run is done."""
    bus_stats = rt.bus.stats.as_dict()
    for what, counted in (("frames refused at the bus", rt.bus.stats.rejections),
                          ("messages refused by a control actor", rt.bus.stats.refusals)):
        if counted.counts:  # said once at the end, by peer and reason (docs/remote.md)
            log.warning("%d %s, the most frequent:\n%s", counted.total(), what,
                        counted.summary())
    scheduler = rt.machines[SCHEDULER]
    bus_stats["duplicates_dropped"] = scheduler.duplicates_dropped
    bus_stats["peak_running"] = scheduler.peak_running
    bus_stats["redispatched"] = scheduler.redispatched
    if remote:
        bus_stats.update(remote.counters(scheduler))
    stats = dict(done.stats)
    stats.update(starved_seconds=round(scheduler.starved_seconds, 3),
                 held_back=scheduler.held_back, refreshes=scheduler.refreshes,
                 cancelled_leases=scheduler.cancelled, scoring_calls=scheduler.eval_calls)
    return bus_stats, stats


async def evolve_async(*args: Any, **kwargs: Any) -> EvolveResult:
    """:func:`evolve` for code already inside an event loop: the run goes on in a worker
    thread and the loop stays free (``await evolve_async(tasks, reward, ...)``). Async
    ``run``/``propose``/agent methods work as with evolve(). Cancelling the awaiting
    task does not stop the run: bound it with ``max_seconds`` or another budget."""
    return await asyncio.to_thread(evolve, *args, **kwargs)


def _warn_if_inside_a_loop(name: str, instead: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:   # no loop in this thread: nothing is blocked
        return
    warnings.warn(f"{name}() was called inside a running event loop and blocks it until "
                  f"the run ends: use `await {instead}(...)` there", RuntimeWarning,
                  stacklevel=3)


def strategy_spec(strategy: Any) -> dict[str, Any] | None:
    """A built-in artifact strategy as its scenario table (``{"kind": "AppendRules",
    "title": ...}``); None for any other strategy."""
    if type(strategy).__name__ not in ("AppendRules", "KeyedRules", "SingleSlot") \
            or not dataclasses.is_dataclass(strategy):
        return None
    fields = {f.name: getattr(strategy, f.name) for f in dataclasses.fields(strategy)
              if f.name in ("title", "categories", "initial_value", "key", "sections")}
    for name in ("categories", "sections"):   # a sectioned AppendRules: its key space
        if name in fields:
            fields[name] = list(fields[name])
    if fields.get("sections") == []:
        del fields["sections"]   # as a header without sections records it
    return {"kind": type(strategy).__name__, **fields}


def _tee(*watchers):
    """One ``Runtime(watch=)`` callback telling every given watcher (None: no watcher)."""
    given = [w for w in watchers if w is not None]
    if len(given) <= 1:
        return given[0] if given else None

    def watch(sender: str, receiver: str, body: bytes) -> None:
        for w in given:
            w(sender, receiver, body)
    return watch


def _tracked_params(args: dict[str, Any], plan_with, strategy) -> dict[str, Any]:
    """The run's parameters as a tracking backend records them."""
    keys = ("n_workers", "max_concurrency", "held_out_frac", "seed", "asynchronous",
            "max_rollouts", "max_calls", "max_seconds", "target_reward", "patience",
            "lease_size", "log", "run_id")
    out = {k: args.get(k) for k in keys}
    modes = args.get("modes")
    if modes is not None:
        out.update(rounds=modes.rounds, async_ratio=modes.async_ratio,
                   staleness=modes.staleness)
    out.update(parallel=repr(plan_with), strategy=repr(strategy),
               tasks=len(args.get("tasks") or []))
    return out


def _usage_of(agent) -> dict[str, int] | None:
    usage = getattr(agent, "usage", None)
    if usage is None:
        return None
    as_dict = getattr(usage, "as_dict", None)
    return dict(as_dict()) if callable(as_dict) else dict(usage)


def _with_elapsed(record: RoundRecord, elapsed: float) -> RoundRecord:
    return msgspec.structs.replace(record, elapsed=round(elapsed, 6))
