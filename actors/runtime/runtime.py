"""Wiring: build a topology (bus, control actors, workers), run it, tear it down.

:class:`Runtime` owns everything it starts and closes all of it (a supervisor never
exits leaving orphans). :func:`evolve` is the Python API on top.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from typing import Any, Callable, Sequence

import pykka

from actors.addresses import DRIVER
from actors.version import PACKAGE_VERSION
from actors.errors import ConfigError, RunFailed
from actors.runtime.shell import ControlActor
from actors.workers.local import Worker
from actors.workers.core import WorkerCore
from bus.base import Delivery
from bus.memory import InMemoryBus
from bus.zmq_bus import ZmqBus
from bus.log import FORMAT_VERSION, FSYNC_POLICIES, LogExists, LogHeader, LogWriter
from protocol import (Commit, GroupResult, GroupSuspended, Merged, RoundClosed, RunDone,
                      Start)


log = logging.getLogger(__name__)


#: How long close() waits for actors to stop before leaving a stuck one behind.
STOP_DEADLINE_S = 10.0


#: Messages whose log record is fsynced as soon as the broker has delivered them (with
#: the records before them): the run's start, every commit of the artifact, the end of
#: each round, the run's and a group's result. docs/replay.md says what this guarantees.
SYNC_ON = (Start, Commit, RoundClosed, Merged, RunDone, GroupResult, GroupSuspended)

#: The environment variable that chooses the log's fsync policy when no argument does.
FSYNC_ENV = "EVOBUS_LOG_FSYNC"


def fsync_policy(fsync: str | None = None) -> str:
    """The log's fsync policy: the argument, else $EVOBUS_LOG_FSYNC, else "batched"
    ("always" makes a kill -9 lose no record: docs/replay.md)."""
    if fsync is not None:
        if fsync not in FSYNC_POLICIES:
            raise ConfigError(f"log_fsync={fsync!r}: expected one of "
                              f"{', '.join(FSYNC_POLICIES)} (bus/log.py says what each keeps)")
        return fsync
    policy = os.environ.get(FSYNC_ENV) or "batched"
    if policy not in FSYNC_POLICIES:
        raise ConfigError(f"${FSYNC_ENV}={policy!r}: expected one of "
                          f"{', '.join(FSYNC_POLICIES)}; fix: export {FSYNC_ENV}=batched "
                          f"(or unset it)")
    return policy


def open_log(log_path: str, log_meta: dict[str, Any] | None, fsync: str | None, *,
             overwrite: bool = False) -> LogWriter:
    """A new log at ``log_path`` with the run's header; refused (ConfigError naming the
    fix) when a log is already there, unless ``overwrite``."""
    meta = dict(log_meta or {})
    scenario_file = str(meta.get("scenario", ""))
    if "scenario_toml" not in meta and scenario_file.endswith(".toml") \
            and os.path.isfile(scenario_file):
        # The scenario's text makes `evobus replay/resume LOG` work standalone.
        with open(scenario_file, encoding="utf-8") as f:
            meta["scenario_toml"] = f.read()
    header = LogHeader(format_version=FORMAT_VERSION, package_version=PACKAGE_VERSION,
                       scenario=str(meta.pop("scenario", "")),
                       seed=int(meta.pop("seed", 0)), run_id=str(meta.pop("run_id", "")),
                       started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       meta={k: str(v) for k, v in meta.items()})
    try:
        return LogWriter(log_path, header, fsync=fsync_policy(fsync), overwrite=overwrite)
    except LogExists:
        raise ConfigError(f"log {log_path}: a log is already there, and a log is never "
                          "overwritten (it may be the base of a resume chain); fix: write "
                          "this run's log to a new path, or pass log_overwrite=True to "
                          "replace it (`evobus run --overwrite`)") from None
    except OSError as exc:
        raise ConfigError(f"log {log_path}: cannot create the log file "
                          f"({exc.strerror or exc}); fix: choose a log path in a directory "
                          "you can write") from None


def make_log_directory(path: str, where: str) -> None:
    """Create the directory of the log at ``path``, or refuse naming ``where`` (the key
    or flag that set it)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"at `{where}`: cannot create the directory of the log {path!r} "
                          f"({exc.strerror or exc}); fix: choose a log path in a directory "
                          "you can write") from None


class _Watched:
    """The log writer as the bus sees it, also handing each delivered message to
    ``watch(sender, receiver, body)`` on the bus's thread (which must stay cheap: live
    progress only queues it). ``inner`` is the real writer, or None without a log."""

    def __init__(self, inner: LogWriter | None, watch: Callable[[str, str, bytes], None]):
        self.inner = inner
        self.watch = watch

    def append(self, seq: int, t: float, sender: str, receiver: str, body: bytes,
               *more: Any, **named: Any) -> None:
        if self.inner is not None:
            self.inner.append(seq, t, sender, receiver, body, *more, **named)
        if not named.get("status"):   # an undelivered message was never delivered
            self.watch(sender, receiver, body)

    def flush_if_due(self) -> None:
        if self.inner is not None:
            self.inner.flush_if_due()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def __getattr__(self, name: str) -> Any:   # anything else the bus asks of its writer
        return getattr(self.inner, name)


class Runtime:
    """One topology's bus and actors. Use as a context manager. ``watch``: told of
    every delivered message (sender, receiver, encoded body), with or without a log."""

    def __init__(self, *, bus: str = "zmq", log_path: str | None = None,
                 log_meta: dict[str, Any] | None = None, binds: Sequence[str] = (),
                 fsync: str | None = None, peers: Sequence = (), first_seq: int = 1,
                 log_overwrite: bool = False,
                 watch: Callable[[str, str, bytes], None] | None = None) -> None:
        if bus not in ("zmq", "memory"):
            raise ConfigError(f"bus={bus!r}: choose 'zmq' (default) or 'memory'")
        writer = None
        if log_path is not None:
            writer = open_log(log_path, log_meta, fsync, overwrite=log_overwrite)
        if watch is not None:   # live progress: told of every message the log records
            writer = _Watched(writer, watch)
        try:
            if bus == "zmq":
                # ``peers``: bus.remote.PeerPort objects for workers in other processes
                self.bus = ZmqBus(writer, binds=binds, peers=tuple(peers),
                                  first_seq=first_seq, sync_on=SYNC_ON)
            else:
                self.bus = InMemoryBus(writer, first_seq=first_seq, sync_on=SYNC_ON)
        except BaseException:  # no bus to close the log: close it here, re-raise
            if writer is not None:
                writer.close()
            raise
        self.log_path = log_path
        self.refs: list[pykka.ActorRef] = []
        self.workers: list[pykka.ActorRef] = []   # the rollout workers spawn_worker started
        self.crashes: "queue.Queue[tuple[str, BaseException]]" = queue.Queue()
        self.inbox: "queue.Queue[Delivery]" = queue.Queue()
        self.bus.attach(DRIVER, self.inbox.put)
        self.machines: dict[str, Any] = {}
        self._closed = False
        self._owned: list[Callable[[], None]] = []  # closed after actors, before the bus

    def own(self, closer: Callable[[], None]) -> None:
        """Close something this runtime started (process workers) after the actors stop
        and before the bus closes."""
        self._owned.append(closer)

    def _on_crash(self, name: str, exc: BaseException) -> None:
        self.crashes.put((name, exc))
        self.inbox.put(None)  # wake the driver

    def spawn(self, name: str, machine) -> None:
        self.machines[name] = machine
        self.refs.append(ControlActor.spawn(self.bus, name, machine, self._on_crash))

    def spawn_worker(self, core: WorkerCore) -> None:
        ref = Worker.spawn(self.bus, core, self._on_crash)
        self.refs.append(ref)
        self.workers.append(ref)

    def await_workers(self, timeout: float = STOP_DEADLINE_S) -> bool:
        """Wait until every rollout worker has stopped on its own (the Scheduler's Stop at
        Shutdown). A run that ended normally waits here before close(): a worker stopped
        by close() while the Scheduler's Stop to it is still in flight leaves that Stop
        undelivered in the log. False if one is still running at the deadline (close()
        then stops it)."""
        deadline = time.monotonic() + timeout
        for ref in self.workers:
            if not ref.actor_stopped.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def start_actor(self, actor_class, *args, **kwargs) -> pykka.ActorRef:
        """Start any other actor on this runtime's bus; the runtime owns it (close stops it).
        Used by parallel groups (actors.groups) for their Collector and branch workers."""
        ref = actor_class.start(*args, **kwargs)
        self.refs.append(ref)
        return ref

    def stop_actors(self, refs: Sequence[pykka.ActorRef], timeout: float) -> list[pykka.ActorRef]:
        """Stop these actors (not the whole runtime) within ``timeout`` seconds; returns
        those still running at the deadline. Every one is released by the runtime: a
        stuck one is left behind (logged by the caller), never waited on again at close."""
        futures = []
        for ref in refs:
            try:
                futures.append((ref, ref.stop(block=False)))
            except pykka.ActorDeadError:  # already stopped: nothing to do
                pass
        deadline = time.monotonic() + timeout
        stuck = []
        for ref, fut in futures:
            try:
                fut.get(timeout=max(0.0, deadline - time.monotonic()))
            except pykka.Timeout:  # reported to the caller, which decides what to say
                stuck.append(ref)
            except pykka.ActorDeadError:  # stopped meanwhile
                pass
        gone = {id(r) for r in refs}
        self.refs = [r for r in self.refs if id(r) not in gone]
        return stuck

    def send(self, receiver: str, msg) -> None:
        self.bus.send(DRIVER, receiver, msg)

    def next_delivery(self, timeout: float) -> Delivery | None:
        """The next message for the driver, or None on timeout; raises if an actor died."""
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            item = None
        if not self.crashes.empty():
            name, exc = self.crashes.get()
            if isinstance(exc, (ConfigError, ValueError, TypeError)):
                raise exc
            raise RunFailed(f"actor {name!r} crashed: {type(exc).__name__}: {exc}") from exc
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.bus.closing()
        futures = []
        for ref in self.refs:
            try:
                futures.append(ref.stop(block=False))
            except pykka.ActorDeadError:  # already stopped: nothing to do
                pass
        deadline = time.monotonic() + STOP_DEADLINE_S
        for fut in futures:
            try:
                fut.get(timeout=max(0.0, deadline - time.monotonic()))
            except pykka.Timeout:
                # A worker stuck in a user's rollout: its thread is a daemon and the bus
                # closes under it; say so rather than hang.
                log.warning("an actor did not stop within %s s; leaving it behind", STOP_DEADLINE_S)
            except pykka.ActorDeadError:  # stopped meanwhile
                pass
        for closer in reversed(self._owned):  # e.g. reap process workers
            try:
                closer()
            except Exception:  # logged; the bus must still close
                log.exception("closing %r failed", closer)
        self.bus.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
