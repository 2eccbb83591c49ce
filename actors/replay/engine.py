"""Replay: the message log as the test oracle (DESIGN sections 3 and 5).

Each control actor (Planner, Scheduler, Merger, and the Collector of each parallel
group) is a pure state machine, so feeding a fresh one every message the log recorded
it *receiving*, in sequence order, must make it send, message for message, what the
log recorded it *sending*. :func:`replay_log` does that for every control actor of a
log in one pass and reports the first divergence: the sequence number, the actor, the
expected and the actual message and a field-level difference (``lease_id: 'r1.u0' !=
'r1.u1'``).

How outputs are matched (one actor at a time; the actors are independent here, each
is fed the recorded inputs, never another machine's outputs):

- An actor sends from one thread through one socket, so the messages the log
  recorded from it are in the order it produced them. Each produced message is
  compared with the next recorded one: same receiver and same bytes (the same
  message decoded, when the bytes differ).
- A message recorded at seq ``t`` was produced by an input with a smaller seq, so
  when the replay reaches an input past ``t`` and has not produced it, that is a
  divergence at ``t`` (the log holds a message the machine no longer sends).
- A produced message with no recorded counterpart *and no later recorded message from
  the same actor to the same receiver* is "unrecorded": the receiver had left (a
  worker stopped at shutdown) or the log ended (a crash). It is listed in the report,
  never silently dropped, and ``strict=True`` turns it into a divergence.

A log written by ``evobus resume`` names the log it continues (``resumed_from`` in
its header meta); replaying it replays the whole chain, applying at each junction what
resume did (:mod:`actors.replay.resume`): the rebuilt actors first send the messages the
crashed run had produced but never delivered (so those must head their outputs in the
next log), and the Scheduler re-issues the leases that were in flight
(:func:`actors.replay.engine.reopen`).

Building the machines: from the scenario text the header carries (``evobus run``
records it), or from the arguments (``planner=``, ``parallel=``, ...) for a log of
:func:`actors.evolve` called from Python. The Planner, Scheduler and Merger need
nothing else: every other parameter is in the log's ``Start`` message.

Collectors (:mod:`actors.machines.collector`) are found by what they receive: a name that is
sent a ``GroupStart`` is a Collector, rebuilt as ``Collector(name)`` from that message
alone (bounds, workers, lease policy, seconds left and, for a resumed group, the
checkpoint's results, journals, pending interactions and used ids all travel in it).
Each ``GroupStart`` to a name whose Collector already started begins a new group
there (a group resumed from its checkpoint keeps its id, so its Collector its name):
a fresh Collector takes over, as :func:`actors.groups.run_group` builds one per call.
A log with no ``Start`` (a group run on its own) replays its Collectors only.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import logging
from pathlib import Path
from typing import Any, Callable

import msgspec

from actors.addresses import DRIVER, MERGER, PLANNER, SCHEDULER
from actors.artifacts import KeyedRules
from actors.errors import ConfigError, RunFailed
from actors.machines.collector import Collector
from actors.machines.merger import Merger
from actors.machines.planner import Planner
from actors.machines.scheduler import Scheduler
from actors.policies.parallelism import DataParallel, data_parallel_from_repr
from actors.replay.report import (
    ActorReport,
    Divergence,
    ReplayReport,
    Unrecorded,
    _cap,
    field_diff,
)
from actors.runtime.evolve import prepare_parallel
from actors.runtime.specs import build_parallel, build_strategy, strategy_from_meta
from bus.log import LogContents, Record
from protocol import GroupStart, Message, Start, decode, encode
from protocol.scenario import ScenarioError, parse_scenario

log = logging.getLogger(__name__)


#: The control actors of a run, in the order reports list them. Collectors have one
#: name per group (``collector.<group id>``) and are found in the log (module docstring).
CONTROL_ACTORS = (PLANNER, SCHEDULER, MERGER)


#: Header meta keys written by evolve()/resume and read here.
META_SCENARIO_TOML = "scenario_toml"


META_RESUMED_AFTER = "resumed_after_seq"


META_PARALLEL = "parallel"


META_SAMPLER = "task_sampler"


META_MACHINE_ARGS = "machine_args"


MachineSpec = Any  # an instance with handle(), a class, or a callable (Start) -> machine


def build_machines(header_meta: dict[str, str], start: Start, *, planner: MachineSpec = None,
                   scheduler: MachineSpec = None, merger: MachineSpec = None,
                   parallel: Any = None, strategy: Any = None,
                   task_sampler: Any = None) -> dict[str, Any]:
    """Fresh Planner, Scheduler and Merger for a log whose first message is ``start``.

    Each of ``planner``/``scheduler``/``merger`` may be a ready machine (anything with
    ``handle``), a class (built with the arguments the runtime would use), or a
    callable taking the ``Start`` message. The Planner's parallelism strategy comes
    from ``parallel``/``strategy`` when given, else from the scenario text in the
    header, else (a Python run that used the default) ``DataParallel``.
    """

    extra = _machine_args(header_meta)

    def make(name: str, spec: MachineSpec, default_cls: type, args: Callable[[], tuple],
             kwargs: dict[str, Any]):
        if spec is not None and hasattr(spec, "handle") and not isinstance(spec, type):
            return spec
        if spec is not None and not isinstance(spec, type):
            return spec(start)
        cls = spec or default_cls
        return cls(*args(), **_accepted(cls, {**kwargs, **extra.get(name, {})}))

    def planner_args() -> tuple:
        return _planner_strategy(header_meta, start, parallel, strategy, task_sampler)

    # The same arguments evolve() passes, from the Start message (a parameter a class
    # does not take is left out, so older and newer machines both build).
    return {
        PLANNER: make(PLANNER, planner, Planner, planner_args, {}),
        SCHEDULER: make(SCHEDULER, scheduler, Scheduler, lambda: (start.max_concurrency,),
                        dict(asynchronous=start.asynchronous, async_ratio=start.async_ratio,
                             n_workers=start.n_workers)),
        MERGER: make(MERGER, merger, Merger, lambda: (),
                     dict(asynchronous=start.asynchronous, alpha=start.async_ratio,
                          staleness=start.staleness)),
    }


def _machine_args(meta: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Constructor arguments a run's control actors took that its ``Start`` does not
    carry, recorded by evolve() as JSON in the header meta ``machine_args``
    (``{"scheduler": {"deadline": 5.0}, ...}``)."""
    text = meta.get(META_MACHINE_ARGS)
    if not text:
        return {}
    try:
        value = msgspec.json.decode(text, type=dict[str, dict[str, Any]])
    except msgspec.DecodeError as exc:
        raise ConfigError(f"the log header's {META_MACHINE_ARGS} is not a JSON object of "
                          f"objects ({exc})") from None
    return value


def _accepted(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = _keywords(cls)
    if params is None:
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


@functools.lru_cache(maxsize=64)
def _keywords(cls: type) -> frozenset[str] | None:
    """The parameter names ``cls`` takes (None: any, it has ``**kwargs``); looked up
    once per class, not once per replay."""

    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


def _planner_strategy(meta: dict[str, str], start: Start, parallel, strategy, task_sampler):

    sampler = task_sampler
    if parallel is None and strategy is None and META_SCENARIO_TOML in meta:

        try:
            scenario = parse_scenario(meta[META_SCENARIO_TOML], "the log's scenario")
        except ScenarioError as exc:
            raise ConfigError(f"cannot rebuild the planner from the scenario in the log "
                              f"header: {exc}") from None
        parallel = _recorded_round(meta, build_parallel(scenario.parallel))
        strategy = build_strategy(scenario.strategy)
    elif parallel is None:
        recorded = meta.get(META_PARALLEL, "")
        # A log without the key predates it, when the default was the whole shard.
        parallel = data_parallel_from_repr(recorded or "DataParallel()")
        if parallel is None:
            raise ConfigError(
                f"the log was written by evolve() with parallel={recorded} and carries no "
                "scenario text, so replay cannot rebuild its planner: pass the same "
                "strategy (replay(path, parallel=..., strategy=...)) or a planner=")
    if sampler is None and meta.get(META_SAMPLER):
        raise ConfigError(
            f"the log was written with task_sampler={meta[META_SAMPLER]}: pass the same "
            "sampler (replay(path, task_sampler=...)) so the planner orders tasks as it did")
    if strategy is None:

        # What evolve() recorded; a log older than that was written with its default
        # of the time, KeyedRules(categories=[]) (now AppendRules(), recorded).
        strategy = strategy_from_meta(meta) or KeyedRules(categories=[])
    plan_with, sections = prepare_parallel(parallel, strategy, list(start.task_ids),
                                           start.n_workers)
    if sections != start.sections:
        raise ConfigError(
            f"the rebuilt parallelism strategy ({plan_with!r}) maps artifact keys to "
            f"sections as {sections}, but the run used {start.sections}: pass the "
            "strategy and artifact strategy the run used")
    return plan_with, sampler


def _recorded_round(meta: dict[str, str], built):
    """The scenario's DataParallel as the run planned with it: its round size as the
    header recorded it: a scenario that omits ``per_worker`` took the default of the
    day it ran (the whole shard before the default became a minibatch), and a header
    without the key predates ``per_worker`` itself."""
    if not isinstance(built, DataParallel):
        return built
    recorded = data_parallel_from_repr(meta.get(META_PARALLEL) or "DataParallel()")
    return recorded if recorded is not None else built


class _Track:
    """One control actor under replay."""

    __slots__ = ("name", "machine", "handle", "admit", "recorded", "produced", "report",
                 "divergence", "inputs", "matched")

    def __init__(self, name: str, machine: Any) -> None:
        self.name = name
        self.machine = machine
        self.handle = machine.handle  # bound again each segment (a caller may rewrap it)
        # Who may send what (Scheduler.admit): a message the run's shell refused is
        # refused here too, so it never reaches handle in replay either.
        self.admit = getattr(machine, "admit", None)
        self.recorded: collections.deque[Record] = collections.deque()
        # (input seq, receiver, message, its bytes as produced, the message again when it
        # is the very input being handled (forwarded as received), else None)
        self.produced: collections.deque[tuple[int, str, Message, bytes, Message | None]] = \
            collections.deque()
        self.report = ActorReport()
        self.divergence: Divergence | None = None
        self.inputs = 0  # counted here on the hot path, copied into report at the end
        self.matched = 0


class _Lives:
    """The Collector at one bus name, across the groups that use the name: each
    ``GroupStart`` after the first begins a new group there (a group resumed from its
    checkpoint keeps its id), and a fresh machine takes it, as groups.py builds one per
    run_group/resume_group call."""

    def __init__(self, name: str, make: Callable[[str], Any]) -> None:
        self.name = name
        self.make = make
        self.machine = make(name)
        self.started = False

    def handle(self, msg: Message) -> list[tuple[str, Message]]:
        if type(msg) is GroupStart:
            if self.started:
                self.machine = self.make(self.name)
            self.started = True
        return self.machine.handle(msg)

    def admit(self, sender: str, msg: Message) -> str | None:
        admit = getattr(self.machine, "admit", None)
        return None if admit is None else admit(sender, msg)


class _Replay:
    def __init__(self, machines: dict[str, Any], strict: bool,
                 collector: Callable[[str], Any] | None = None) -> None:
        self.tracks = {name: _Track(name, m) for name, m in machines.items()}
        self.collector = collector
        self.strict = strict
        self.unrecorded: list[Unrecorded] = []
        self.divergences: list[Divergence] = []
        self.path = Path()
        self._records: list[Record] = []
        # (sender, receiver) -> seq of the segment's last message between them; built on
        # first need (a produced message the log may not hold), not for every replay.
        self._last_sent: dict[tuple[str, str], int] | None = None
        # Messages produced but never delivered, to control actors or the driver, as
        # (sender, receiver, message): what a resume re-sends.
        self.pending: list[tuple[str, str, Message]] = []

    def machines(self) -> dict[str, Any]:
        return {name: t.machine for name, t in self.tracks.items()}

    def resend(self, lost: list[Unrecorded]) -> None:
        """At a resume junction: each actor's undelivered messages are produced again,
        first, so the next log's first messages from that actor must be these."""
        for u in lost:
            t = self.tracks.get(u.actor)
            # The driver is not replayed (its undelivered Start is an input of the next
            # segment, where the log records it delivered).
            if t is not None and t.divergence is None:
                t.produced.append((u.input_seq, u.receiver, u.msg, encode(u.msg), None))

    # -- one segment (one log file) ---------------------------------------------------

    def segment(self, path: Path, records: list[Record]) -> None:
        self.path = path
        self._records, self._last_sent = records, None
        tracks = self.tracks
        for t in tracks.values():
            t.recorded.clear()
        # Names never seen before: a Collector's first input is its GroupStart (it sends
        # nothing before), so one decode per new receiver name finds the Collectors.
        looked: set[str] | None = set(tracks) if self.collector is not None else None
        settle = self._settle
        # This replay's own codec (the module's functions add a call per message).
        dec = msgspec.msgpack.Decoder(Message).decode
        enc = msgspec.msgpack.Encoder().encode
        for t in tracks.values():
            t.handle = t.machine.handle
            t.admit = getattr(t.machine, "admit", None)
        for rec in records:
            feed = None
            t = tracks.get(rec.sender)
            if t is not None and t.divergence is None:
                produced = t.produced
                if produced and not t.recorded:
                    # The common case, inline: the next message this actor produced.
                    first = produced[0]
                    if first[1] == rec.receiver and first[3] == rec.body:
                        produced.popleft()
                        t.matched += 1
                        # A message forwarded as received (the Scheduler's LeaseDone to
                        # the Merger) was decoded from these very bytes: its receiver is
                        # fed that message instead of decoding them again. Control
                        # actors never modify a message (they are immutable values).
                        feed = first[4]
                    else:
                        t.recorded.append(rec)
                        settle(t, None)
                else:
                    t.recorded.append(rec)
                    if produced:
                        settle(t, None)
            if rec.status:  # undelivered: its sender sent it, its receiver never had it
                continue
            t = tracks.get(rec.receiver)
            if t is None:
                if looked is None or rec.receiver in looked:
                    continue
                looked.add(rec.receiver)
                feed = dec(rec.body)
                if type(feed) is not GroupStart:
                    continue
                t = tracks[rec.receiver] = _Track(rec.receiver,
                                                  _Lives(rec.receiver, self.collector))
            elif t.divergence is not None:
                continue
            if t.recorded:
                settle(t, rec.seq)
                if t.divergence is not None:
                    continue
            t.inputs += 1
            seq = rec.seq
            append = t.produced.append
            body = rec.body
            msg = dec(body) if feed is None else feed
            if t.admit is not None and t.admit(rec.sender, msg) is not None:
                t.report.refused += 1
                continue
            for receiver, out in t.handle(msg):
                if out is msg:
                    # Forwarded as received: compared by the bytes it came in (a match
                    # means the same bytes, so the same message once decoded, which is
                    # what a re-encoding that differed would be compared by anyway).
                    append((seq, receiver, out, body, out))
                else:
                    append((seq, receiver, out, enc(out), None))
        for t in tracks.values():
            if t.divergence is None:
                self._settle(t, None, final=True)
            t.report.inputs, t.report.matched = t.inputs, t.matched

    def _settle(self, t: _Track, next_input: int | None, final: bool = False) -> None:
        recorded, produced = t.recorded, t.produced
        while recorded and produced:
            rec = recorded[0]
            input_seq, receiver, msg, body, _ = produced[0]
            if receiver == rec.receiver and (body == rec.body or decode(rec.body) == msg):
                recorded.popleft()
                produced.popleft()
                t.matched += 1
                continue
            if self._last(t.name, receiver) < rec.seq and not self.strict:
                produced.popleft()
                self._unrecorded(t, input_seq, receiver, msg)
                continue
            expected = decode(rec.body)
            diff = field_diff(expected, msg)
            if receiver != rec.receiver:
                diff.insert(0, f"receiver: {rec.receiver!r} != {receiver!r}")
            self._diverge(t, Divergence(
                log=self.path, seq=rec.seq, actor=t.name, expected=(rec.receiver, expected),
                actual=(receiver, msg), input_seq=input_seq, diff=tuple(_cap(diff)),
                reason="sent a different message than the log records"))
            return
        if recorded and (final or next_input is not None):
            rec = recorded[0]
            where = "by the end of the log" if final else f"before its input at seq {next_input}"
            self._diverge(t, Divergence(
                log=self.path, seq=rec.seq, actor=t.name,
                expected=(rec.receiver, decode(rec.body)), actual=None,
                input_seq=next_input, diff=(),
                reason=f"did not produce a message the log records ({where})"))
            return
        if final:
            while produced:
                input_seq, receiver, msg, _, _ = produced.popleft()
                if self.strict:
                    self._diverge(t, Divergence(
                        log=self.path, seq=input_seq, actor=t.name, expected=None,
                        actual=(receiver, msg), input_seq=input_seq, diff=(),
                        reason="produced a message the log does not hold (strict)"))
                    return
                self._unrecorded(t, input_seq, receiver, msg)

    def _last(self, sender: str, receiver: str) -> int:
        """The seq of this segment's last message from ``sender`` to ``receiver`` (-1:
        none): a produced message with no counterpart and nothing later on that stream
        went to a receiver that had left, or the log ended."""
        if self._last_sent is None:
            self._last_sent = {(r.sender, r.receiver): r.seq for r in self._records}
        return self._last_sent.get((sender, receiver), -1)

    def _unrecorded(self, t: _Track, input_seq: int, receiver: str, msg: Message) -> None:
        t.report.unrecorded += 1
        self.unrecorded.append(Unrecorded(self.path, t.name, input_seq, receiver, msg))

    def _diverge(self, t: _Track, d: Divergence) -> None:
        t.divergence = d
        t.recorded.clear()
        t.produced.clear()
        self.divergences.append(d)


def _find_start(contents: list[LogContents]) -> tuple[int, Start] | None:
    for i, c in enumerate(contents):
        for rec in c.records:
            if rec.receiver == PLANNER and rec.sender == DRIVER:
                msg = decode(rec.body)
                if isinstance(msg, Start):
                    return i, msg
    return None


def reopen(machines: dict[str, Any]) -> list[str]:
    """Turn rebuilt machines into ones a *new* set of workers can join: the Scheduler's
    ``reopen()`` forgets the old workers and re-queues, under their original ids, the
    leases that were with a worker and never answered (see ``Scheduler.reopen``).
    Returns those lease ids."""
    scheduler = machines.get("scheduler")
    if scheduler is None:
        return []
    own = getattr(scheduler, "reopen", None)
    if not callable(own):
        raise RunFailed(f"cannot reopen {type(scheduler).__name__} for resume: give it a "
                        "reopen() method that forgets the workers and re-queues "
                        "the leases they held (actors.machines.scheduler.Scheduler.reopen does)")
    return list(own())


def rebuild(paths: list[Path], contents: list[LogContents], *, strict: bool,
         machines: dict[str, Any] | None, specs: dict[str, Any]
         ) -> tuple[ReplayReport, _Replay | None]:
    """Replay a log chain into machines: the engine behind replay and resume; returns the report and the replay (whose
    machines hold the rebuilt state), or None when the chain holds no ``Start``."""

    path = paths[-1]
    report = ReplayReport(path=path, segments=list(paths),
                          records=sum(len(c.records) for c in contents), actors={})
    for c in contents:
        if c.dropped_tail:
            report.notes.append(f"{c.path}: a torn tail of {c.dropped_tail} bytes "
                                f"(about {c.dropped_records} records) was cut off")
    specs = dict(specs)
    collector_spec = specs.pop("collector", None)
    found = _find_start(contents)
    if found is None:
        if not _has_groups(contents):
            report.notes.append("the log holds no Start message: the run never began, "
                                "nothing to replay")
            return report, None
        # Parallel groups run on their own: their Collectors are the control actors.
        first, meta = 0, dict(contents[0].header.meta)
        machines = dict(machines or {})
    else:
        first, start = found
        if first > 0:
            report.notes.append(f"{paths[first]}: the chain's earlier logs hold no Start "
                                "and were not replayed (the run was restarted, not resumed)")
        meta = dict(contents[first].header.meta)
        if machines is None:
            machines = build_machines(meta, start, **specs)
    engine = _Replay(machines, strict, collector=_collector_factory(meta, collector_spec))
    with _recorded_past_is_quiet():
        pending, resent = _feed(engine, paths, contents, first)
    report.actors = {name: t.report for name, t in engine.tracks.items()}
    was_resent = {id(u) for u in resent}
    report.unrecorded = [u for u in engine.unrecorded if id(u) not in was_resent]
    report.resent = resent
    if engine.divergences:
        ordered = sorted(engine.divergences, key=lambda d: (str(d.log) != str(paths[first]),
                                                             d.seq))
        report.divergence = ordered[0]
        report.other_divergences = ordered[1:]
    engine.pending = [(u.actor, u.receiver, u.msg) for u in pending]
    return report, engine


def _feed(engine: "_Replay", paths: list[Path], contents: list[LogContents],
          first: int) -> tuple[list[Unrecorded], list[Unrecorded]]:
    """Feed every segment of the chain from ``first`` on; returns the messages the last
    segment left undelivered and those re-sent at the junctions."""
    pending: list[Unrecorded] = []
    resent: list[Unrecorded] = []
    for i in range(first, len(contents)):
        c = contents[i]
        if i > first:
            # What resume did here: the rebuilt actors first send what the crash left
            # undelivered (so it heads their outputs in the new log), and the Scheduler
            # re-issues the leases that were in flight.
            engine.resend(pending)
            resent += pending
            reopen(engine.machines())
        before = len(engine.unrecorded)
        engine.segment(c.path, c.records)
        # Undelivered, in the order they were produced (by input seq; stable per actor):
        # first those the log holds as UNDELIVERED (they came before, on each sender's
        # stream), then those it never recorded.
        lost = sorted(engine.unrecorded[before:], key=lambda u: u.input_seq)
        pending = _undelivered_at_close(engine, c) \
            + [u for u in lost if _resend_to(u.receiver)]
        if engine.divergences:
            break
    return pending, resent


@contextlib.contextmanager
def _recorded_past_is_quiet():
    """While a log is fed to the machines, their warnings ("worker presumed lost")
    describe the recorded run, not anything happening now: they are held back (the
    replay report says what matters), except under debug logging (``evobus -v``)."""
    machines_log = logging.getLogger("actors.machines")
    before = machines_log.level
    if machines_log.getEffectiveLevel() > logging.DEBUG:
        machines_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        machines_log.setLevel(before)


def _has_groups(contents: list[LogContents]) -> bool:
    """Whether some name in the logs is sent a ``GroupStart`` (one decode per name)."""
    looked: set[str] = set()
    for c in contents:
        for rec in c.records:
            if rec.receiver not in looked:
                looked.add(rec.receiver)
                if type(decode(rec.body)) is GroupStart:
                    return True
    return False


def _collector_factory(meta: dict[str, str], spec: MachineSpec) -> Callable[[str], Any]:
    """How a Collector is built for its name: ``spec`` (a class or a callable taking the
    name), else :class:`~actors.machines.collector.Collector` with the header's ``machine_args``
    for ``"collector"`` (none today: a Collector takes everything from its GroupStart)."""
    if spec is not None:
        return spec

    extra = _accepted(Collector, _machine_args(meta).get("collector", {}))
    return lambda name: Collector(name, **extra)


def _undelivered_at_close(engine: "_Replay", c: LogContents) -> list[Unrecorded]:
    """Messages between control actors (or to the driver) that the log holds as
    UNDELIVERED because their receiver had already stopped: a run stopped by a signal
    closes its actors one by one while messages still fly (a Scheduler's EvalDone to a
    Merger that has stopped). The replay never feeds them to their receiver, and they
    are not unrecorded either, so a resume must send them again or the receiver waits
    for them forever. Only those after which their receiver got nothing more: one it
    missed while it was still running is part of the run as recorded.

    The driver's ``Start`` too, when the Planner stopped before it arrived (a SIGTERM in
    the run's first moments): the run never began, and the Planner, rebuilt with
    nothing, would wait for it forever. Re-sent, it begins the run as it would have,
    under the same run id and seed (the driver's other messages, ``Tick``s, are sent
    anew by the resumed driver)."""
    last_in: dict[str, int] = {}
    for rec in c.records:
        if not rec.status:
            last_in[rec.receiver] = rec.seq
    out: list[Unrecorded] = []
    for rec in c.records:
        if not rec.status or not _resend_to(rec.receiver) \
                or rec.seq <= last_in.get(rec.receiver, -1):
            continue
        by_driver = rec.sender == DRIVER and rec.receiver == PLANNER
        if rec.sender not in engine.tracks and not by_driver:
            continue
        msg = decode(rec.body)
        if not by_driver or type(msg) is Start:
            out.append(Unrecorded(c.path, rec.sender, rec.seq, rec.receiver, msg))
    return out


def _resend_to(receiver: str) -> bool:
    """Undelivered messages resume re-sends: to control actors and the driver (workers
    are new after a resume; what they need comes from the Scheduler again)."""
    return receiver in CONTROL_ACTORS or receiver == DRIVER
