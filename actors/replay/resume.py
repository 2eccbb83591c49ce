"""Resume a run whose coordinator died (``kill -9``) from its message log.

Resuming is replay without sending (DESIGN section 3): every control actor is rebuilt
by feeding it the inputs the log recorded (and checking it reproduces the log's
outputs; a log that does not replay is refused), then a new topology starts whose
Planner, Scheduler and Merger *are* those rebuilt machines. At the junction:

- messages the old run's control actors had produced but the log never recorded
  (lost with the process: a ``Settled``, an ``EvalRequest``, a ``RoundClosed``...), and
  those it holds as UNDELIVERED because their receiver had stopped, are sent again, as
  their senders, all at once and in the old run's order, before any worker joins and
  before anything the rebuilt actors send: each actor's messages keep their order, and
  so does every receiver's (a Merger's ``Commit`` still reaches the Scheduler before the
  ``LeaseBatch`` the Planner planned on the ``RoundClosed`` that followed it); a
  ``Start`` the log holds as UNDELIVERED (the Planner stopped before the run's first
  message reached it) is one of them, sent as the driver: the run begins from the
  start, in the same chain, with the same run id and seed;
- leases the Scheduler had handed to a worker with no ``LeaseDone`` in the log (rollout
  and eval leases alike) go back to the front of its queue and are dispatched again,
  under their original ids, to the new workers (:func:`reopen`, which asks the
  Scheduler: ``Scheduler.reopen``); every rollout whose result is in the log has been
  fed to the machines and is never run again;
- counters (rollouts, calls, rounds without commit, the time spent) live in the
  rebuilt Planner, so budgets consumed before the crash stay consumed; the driver's
  clock starts at the time the old logs cover.

The resumed run writes a **new log** (``run.evolog`` -> ``run.r1.evolog``, then
``run.r2.evolog``) whose header names the log it continues (``resumed_from``, relative
to its directory, and ``resumed_after_seq``); its sequence numbers go on after the old
log's last one (evolve() starts the bus at ``first_seq = last_seq + 1``). The old log is left as it was, except that a torn tail (what a crash
leaves) is cut back to its last good record on disk first. ``evobus replay`` of the
new log replays the whole chain, whose segments must all carry the run's id. Every
record reaches the OS within a second of its delivery, so a ``kill -9`` under the
default ``batched`` policy loses at most the last half second of records, and the work
they recorded is done again (never lost, never counted twice); with
``EVOBUS_LOG_FSYNC=always`` nothing the log acknowledged is redone (docs/replay.md).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from actors.addresses import DRIVER, PLANNER
from actors.errors import ConfigError, RunFailed
from actors.replay.chain import META_RESUMED_FROM, log_chain
from actors.replay.engine import META_RESUMED_AFTER, META_SCENARIO_TOML, rebuild, reopen
from actors.replay.report import ReplayReport
from bus.log import read_log
from protocol import BranchDone, BranchFailed, Interaction, Message, RunDone, Start, decode
from actors.runtime.evolve import evolve
from actors.runtime.launch import evolve_kwargs
from protocol.scenario import parse_scenario
from bus.log import read_header
from actors.artifacts import AppendRules
from actors.runtime.evolve import EvolveResult

logger = logging.getLogger(__name__)

__all__ = ["ResumePoint", "next_log_path", "resume", "resume_scenario_log"]

def next_log_path(path: str | Path) -> Path:
    """``run.evolog`` -> ``run.r1.evolog``; ``run.r1.evolog`` -> ``run.r2.evolog``."""
    path = Path(path)
    stem, suffix = path.stem, path.suffix or ".evolog"
    m = re.fullmatch(r"(.*)\.r(\d+)", stem)
    base, n = (m.group(1), int(m.group(2)) + 1) if m else (stem, 1)
    candidate = path.with_name(f"{base}.r{n}{suffix}")
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{base}.r{n}{suffix}")
    return candidate


class ResumePoint:
    """A crashed run's logs, read and ready to be rebuilt into fresh machines.

    Passed to :func:`actors.evolve` as ``resume_from``: evolve() builds its machines as
    usual, spawns them, and calls :meth:`prepare` (replay into them, no sending) and
    :meth:`begin` (re-send what was lost) before spawning the workers, instead of
    sending ``Start``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.paths = log_chain(self.path)
        # Only the newest log can have a torn tail (older ones were repaired when they
        # were resumed); cut it on disk so the chain reads clean from now on.
        self.contents = [read_log(p, repair=(p == self.paths[-1])) for p in self.paths]
        self.dropped_tail = self.contents[-1].dropped_tail
        self.dropped_records = self.contents[-1].dropped_records
        self.last_seq = max((c.records[-1].seq for c in self.contents if c.records),
                            default=0)
        # Time the old logs cover (each log's clock starts at its own run's start).
        self.elapsed = sum(c.records[-1].t for c in self.contents if c.records)
        self.meta = dict(self.contents[0].header.meta)
        for c in self.contents[1:]:
            self.meta.update({k: v for k, v in c.header.meta.items()
                              if k not in (META_RESUMED_FROM, META_RESUMED_AFTER)})
        self.start = _first(self.contents, Start, DRIVER, "planner")
        self.finished: RunDone | None = _first(self.contents, RunDone, None, DRIVER)
        self.report: ReplayReport | None = None
        self.pending: list[tuple[str, str, Message]] = []
        self.reissued: list[str] = []
        self._rt = None

    def group_results(self) -> dict[str, dict[int, Any]]:
        """What each parallel group in the old logs had finished, by group id: a rollout
        run again on resume starts its groups under the same ids (actors.workers.scope),
        and they never run these branches again."""
        out: dict[str, dict[int, Any]] = {}
        for content in self.contents:
            for rec in content.records:
                if not rec.receiver.startswith("collector."):
                    continue
                msg = decode(rec.body)
                if isinstance(msg, (BranchDone, BranchFailed, Interaction)) and msg.indices:
                    out.setdefault(msg.group_id, {}).update(zip(msg.indices, msg.values))
        return out

    # -- the evolve() hook ------------------------------------------------------------

    def prepare(self, rt, machines: dict[str, Any]) -> None:
        """Replay the logs into ``machines`` (nothing is sent) and reopen them for new
        workers. The runtime's bus must have been built with ``first_seq = last_seq +
        1`` (evolve() does it) so the new log's numbers follow the old ones."""
        report, engine = rebuild(self.paths, self.contents, strict=False, machines=machines,
                              specs={})
        self.report = report
        if not report.ok:
            raise RunFailed(f"cannot resume {self.path}: the control actors do not "
                            f"reproduce the log, so their state cannot be rebuilt from it "
                            f"(was it written by another version of the code?)\n"
                            f"{report.format()}")
        if engine is None:
            raise RunFailed(f"cannot resume {self.path}: it holds no Start message")
        if getattr(machines.get(PLANNER), "start", True) is None \
                and not any(isinstance(m, Start) for _, _, m in engine.pending):
            # Nothing would ever set the run going: refused, not a resume that waits.
            raise RunFailed(f"cannot resume {self.path}: the run's Start never reached "
                            "the Planner and is not the last message it was sent, so "
                            "nothing can begin it: the run never started; run it again "
                            "(`evobus run SCENARIO --overwrite`, or with another log path)")
        self._rt = rt
        self.pending = list(engine.pending)
        self.reissued = reopen(machines)
        logger.info("resuming %s after seq %d: %d message(s) to re-send, %d lease(s) to "
                    "re-issue %s", self.path, self.last_seq, len(self.pending),
                    len(self.reissued), self.reissued[:8])

    def begin(self) -> None:
        """Called by evolve() in place of sending ``Start`` (the log's Start was
        replayed, or is pending itself when the log holds it undelivered), before any
        worker joins: sends again what the crashed run produced and never delivered
        (``pending``), each message as its sender, in one lot in the old run's order,
        ahead of anything the rebuilt actors send next. (Sent by each
        actor on its own thread they raced: a Planner's ``LeaseBatch`` could reach the
        Scheduler before the Merger's ``Commit`` that preceded the ``RoundClosed`` it was
        planned on, and the round went out on the version before.)"""
        if self.pending:
            self._rt.bus.send_in_order(self.pending)

    # -- the new log --------------------------------------------------------------------

    def log_meta(self, new_log: str | Path) -> dict[str, str]:
        """Header meta of the log the resumed run writes."""
        new_dir = Path(new_log).resolve().parent
        meta = dict(self.meta)
        meta[META_RESUMED_FROM] = os.path.relpath(self.path.resolve(), new_dir)
        meta[META_RESUMED_AFTER] = str(self.last_seq)
        meta["run_id"] = self.start.run_id if self.start else meta.get("run_id", "")
        meta["seed"] = str(self.start.seed if self.start else 0)
        meta.setdefault("scenario", self.contents[0].header.scenario)
        return meta


def _first(contents, kind: type, sender: str | None, receiver: str):
    for c in contents:
        for rec in c.records:
            if rec.receiver == receiver and (sender is None or rec.sender == sender):
                msg = decode(rec.body)
                if isinstance(msg, kind):
                    return msg
    return None


def resume(path: str | Path | ResumePoint, *, log: str | Path | None = None,
           **evolve_kwargs: Any):
    """Resume the run whose (newest) log is ``path``; returns an ``EvolveResult``.

    Pass the same :func:`actors.evolve` arguments the run was started with (tasks,
    reward, agent or run/propose, strategy, parallel, n_workers, ...). ``log`` is the
    new log (default: :func:`next_log_path`). A run whose log already holds its result
    is not run again: that result is returned. ``path`` may be a :class:`ResumePoint`
    already read (its ``report``, ``pending`` and ``reissued`` then tell what resume
    did)."""

    point = path if isinstance(path, ResumePoint) else ResumePoint(path)
    strategy = evolve_kwargs.get("strategy")
    if point.finished is not None:
        return _result_of(point, point.finished, strategy)
    new_log = Path(log) if log is not None else next_log_path(point.path)
    kwargs = dict(evolve_kwargs)
    kwargs["log"] = str(new_log)
    user_meta = dict(kwargs.pop("log_meta", None) or {})
    if point.start is None:
        # Killed before the run began: there is no state to rebuild, start it again.
        logger.warning("%s holds no Start message: starting the run again from scratch",
                    point.path)
        meta = {**user_meta, "restarted_from": os.path.relpath(
            point.path.resolve(), new_log.resolve().parent)}
        if META_SCENARIO_TOML in point.meta:
            meta[META_SCENARIO_TOML] = point.meta[META_SCENARIO_TOML]
        return evolve(**kwargs, log_meta=meta)
    kwargs["seed"] = point.start.seed
    meta = {**point.log_meta(new_log), **user_meta}
    return evolve(**kwargs, log_meta=meta, resume_from=point)


def resume_scenario_log(path: str | Path | ResumePoint, *, log: str | Path | None = None,
                        on_progress=None, log_fsync: str | None = None):
    """`evobus resume`: the run's scenario comes from the log header."""

    where = path.path if isinstance(path, ResumePoint) else Path(path)
    chain = path.paths if isinstance(path, ResumePoint) else log_chain(path)
    meta: dict[str, str] = {}
    for p in chain:
        meta.update(read_log_header_meta(p))
    text = meta.get(META_SCENARIO_TOML)
    if not text:
        raise ConfigError(
            f"{where}: the log carries no scenario (the run was started from Python, not "
            "with `evobus run`): resume it from Python with actors.replay.resume.resume(path, "
            "**the evolve() arguments of the run)")
    source = meta.get("scenario", "") or "the log's scenario"
    scenario = parse_scenario(text, source)
    kwargs = evolve_kwargs(scenario, source)
    kwargs.pop("log", None)
    kwargs.pop("log_meta", None)
    if log_fsync is not None:
        kwargs["log_fsync"] = log_fsync
    return resume(path, log=log, on_progress=on_progress, **kwargs)


def read_log_header_meta(path: str | Path) -> dict[str, str]:

    return dict(read_header(path).meta)


def _result_of(point: ResumePoint, done: RunDone, strategy):

    strategy = strategy if strategy is not None else AppendRules()   # evolve()'s default
    return EvolveResult(rendered=strategy.render(done.state), state=dict(done.state),
                        version=done.version, final_reward=done.final_reward,
                        initial_reward=done.initial_reward, stop_reason=done.stop_reason,
                        history=list(done.history), rollouts=done.rollouts,
                        calls=done.calls, error=done.error, log_path=str(point.path),
                        elapsed=point.elapsed, _outcomes=dict(done.outcomes))
