"""The coordinator's side of workers in other processes: process workers (spawned,
never forked) and remote workers (``evobus worker --connect``).

- :func:`code_ref` names a callable (or an agent or strategy object) as data: import
  path plus JSON arguments. Closures, lambdas, bound methods, partials and objects
  defined in ``__main__`` are refused *before the first rollout*, with the fix.
- :func:`build_spec` makes the run's :class:`~protocol.Spec`: references, tasks (inline
  as data, or by reference), the first state, environment variable *names* (never their
  values), and a fingerprint of the source of every module named.
- :class:`Registry` (a pure state machine, actor ``registry``) answers a worker's
  ``Join`` with the spec, checks its ``Hello`` (same code, same package version) and
  forwards it to the Scheduler and the driver.
- :class:`RemoteWorkers` is what :func:`actors.evolve` asks: the peer ports to bind,
  the Scheduler's liveness settings, starting process workers, waiting for everyone
  with a deadline, and Ticks for the Scheduler's clock.

See docs/remote.md.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any


from actors.addresses import SCHEDULER, REGISTRY
from actors.errors import ConfigError, RunFailed
from protocol import (CallsAsk, Heartbeat, Hello, Join, LeaseDone, Message, Refused, Spec, Stop,
                      Task, Tick)
from actors.workers.code import BUILTIN_ALLOW, build_spec, module_of, spec_refs
from actors.machines.registry import Registry
from actors.runtime.clock import Ticker
from actors.addresses import SCHEDULER as _S
from bus.remote import PeerPort, bind_refusal
from bus.security import load_server_keys
from actors.workers.remote import EXIT_STOPPED, process_main


log = logging.getLogger(__name__)


#: A worker's role on the wire: what a peer (a remote or process worker) may send, and
#: to whom. Answers, heartbeats and budget asks (for a group's branches) to the Scheduler (which checks that the sender holds
#: what it answers), its join, hello and refusal to the registry (which checks its code
#: before the Scheduler hears of it). Never Shutdown, Tick, Stop, a Hello straight to
#: the Scheduler, or another actor's messages (docs/remote.md, the threat model).
WORKER_ROLE = {_S: (LeaseDone, Heartbeat, CallsAsk), REGISTRY: (Join, Hello, Refused)}


#: Process workers get this long to leave after the run's Stop before being terminated.
PROCESS_STOP_DEADLINE_S = 5.0
#: A process worker that dies is started again, under a new name, at most this many
#: times per worker the run asked for (docs/remote.md); past it, once none is left
#: alive, the run stops with an error and its log can be resumed.
PROCESS_RESPAWNS = 2


class ProcessPool:
    """Process workers: started with multiprocessing's 'spawn' context (never fork: a
    forked copy would inherit the coordinator's threads and sockets), supervised and
    always reaped: Stop first, then terminate, then kill. One that dies is replaced by
    :meth:`respawn_dead` (``proc-I`` comes back as ``proc-I-r1``, ``proc-I-r2``, ...: the
    port gives a dead connection's name to no one else) up to ``respawns`` times in all."""

    def __init__(self, n: int, address: str, *, allow: list[str],
                 broker_timeout: float, respawns: int | None = None,
                 main=process_main) -> None:
        self.n = n
        #: What each process runs (actors.groups.served.process_main serves groups too).
        self.main = main
        self.address = address
        self.allow = allow
        self.broker_timeout = broker_timeout
        self.procs: list = []
        self.respawns = n * PROCESS_RESPAWNS if respawns is None else respawns
        self.respawned = 0
        self.stopped = False  # a worker left on the run's Stop: the run is ending
        self.deaths: list[tuple[str, int]] = []  # (worker name, exit code), in order
        self._live: dict[str, Any] = {}          # worker name -> its current process

    def names(self) -> list[str]:
        return [f"proc-{i}" for i in range(self.n)]

    def start(self) -> None:
        for name in self.names():
            self._spawn(name)

    def _spawn(self, name: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=self.main, name=f"evobus-{name}", daemon=True,
                           kwargs=dict(address=self.address, worker_id=name,
                                       allow=self.allow, broker_timeout=self.broker_timeout))
        proc.start()
        self.procs.append(proc)
        self._live[name] = proc

    def respawn_dead(self) -> list[str]:
        """Replace each worker whose process exited, while respawns are left; returns
        the names started."""
        started = []
        for name, proc in list(self._live.items()):
            if proc.exitcode is None:
                continue
            del self._live[name]
            if proc.exitcode == EXIT_STOPPED:
                self.stopped = True  # it left when told to (the run's Stop): not a death
                continue
            self.deaths.append((name, proc.exitcode))
            if self.respawned >= self.respawns:
                continue
            self.respawned += 1
            base, _, _ = name.partition("-r")
            again = f"{base}-r{self.respawned}"
            log.warning("process worker %s exited with code %s; starting %s in its place "
                        "(respawn %d of %d)", name, proc.exitcode, again, self.respawned,
                        self.respawns)
            self._spawn(again)
            started.append(again)
        return started

    def dead_names(self) -> list[str]:
        """The workers whose current process exited (before respawn_dead replaces them)."""
        return [name for name, p in self._live.items() if p.exitcode is not None]

    def live_names(self) -> list[str]:
        """The workers whose process has not exited."""
        return [name for name, p in self._live.items() if p.exitcode is None]

    def alive(self) -> int:
        return sum(1 for p in self._live.values() if p.exitcode is None)

    def exited(self) -> dict[str, int]:
        return {p.name: p.exitcode for p in self.procs if p.exitcode is not None}

    def close(self, deadline: float = PROCESS_STOP_DEADLINE_S) -> None:
        end = time.monotonic() + deadline
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                log.warning("process worker %s did not leave after the run; terminating it",
                            p.name)
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for p in self.procs:
            if p.exitcode is not None:
                p.close()


@dataclasses.dataclass
class RemoteWorkers:
    """Workers in other processes for one run (see :func:`plan`)."""

    local: int
    processes: int
    remote: int
    spec: Spec
    ports: list
    heartbeat: float
    deadline: float
    max_tries: int
    wait_seconds: float
    bind: str | None
    keys: str | None
    allow: list[str]
    pool: ProcessPool | None = None
    tmpdir: str | None = None
    joined: dict[str, Hello] = dataclasses.field(default_factory=dict)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    _ticker: Ticker | None = None
    _alone_since: float | None = None  # since when no worker is registered (monotonic)
    _wait_end: float | None = None   # while waiting for workers: when the wait ends

    @property
    def expected(self) -> int:
        return self.processes + self.remote

    def scheduler_kwargs(self) -> dict[str, Any]:
        return {"deadline": self.deadline, "max_tries": self.max_tries}

    @property
    def tick_period(self) -> float:
        return max(0.02, min(self.heartbeat, self.deadline / 4))

    def tick(self, rt, now: float) -> None:
        """Time for the Scheduler's liveness checks, as a message."""
        if self._ticker is None:
            self._ticker = Ticker(self.tick_period)
        if self._ticker.due(now):
            rt.send(SCHEDULER, Tick(elapsed=now))

    def supervise(self, rt) -> None:
        """Between the driver's messages: replace process workers that died; stop the
        run (RunFailed) once none is left alive, no respawn remains and no other worker
        could take the work, or once no worker at all has been registered for
        ``wait_seconds`` while work waits, rather than wait for one forever."""
        self._unattended(rt, time.monotonic())
        if self.pool is None:
            return
        self.pool.respawn_dead()
        if self.pool.alive() or self.pool.stopped or self.local or self.remote:
            return
        deaths = ", ".join(f"{name} (exit {code})" for name, code in self.pool.deaths)
        where = f"; resume it with `evobus resume {rt.log_path}`" if rt.log_path else ""
        raise RunFailed(
            f"every process worker died and the {self.pool.respawns} respawn(s) allowed "
            f"(PROCESS_RESPAWNS = {PROCESS_RESPAWNS} per worker) are spent: {deaths}. The "
            f"run stopped instead of waiting for a worker; fix what kills them (see their "
            f"stderr above){where}")

    def _unattended(self, rt, now: float) -> None:
        """Work waits and the Scheduler has no worker (every one presumed lost): allowed
        for ``wait_seconds`` (a worker reconnecting, a respawn joining), then RunFailed.
        The Scheduler's tables are read between messages, as the progress display does."""
        scheduler = rt.machines[SCHEDULER]
        if scheduler.workers or scheduler.shut or not scheduler.leases:
            self._alone_since = None
            return
        if self._alone_since is None:
            self._alone_since = now
            return
        if now - self._alone_since <= self.wait_seconds:
            return
        where = (f"; once workers can connect, resume it with `evobus resume {rt.log_path}`"
                 if rt.log_path else "")
        lost = ", ".join(sorted(scheduler.lost)) or "none"
        raise RunFailed(
            f"no worker has been registered for {now - self._alone_since:.1f} s "
            f"(wait_seconds = {self.wait_seconds:g}) while {len(scheduler.leases)} lease(s) "
            f"wait; workers presumed lost: {lost}. The run stopped instead of waiting "
            f"forever{where}")

    def start(self, rt, t0: float) -> None:
        """Start the registry and the process workers; wait for every expected worker."""
        rt.spawn(REGISTRY, Registry(self.spec))
        rt.own(lambda: self.close(rt))
        if self.processes:
            address = self.ports[-1].addresses[0]
            self.pool = ProcessPool(self.processes, address, allow=self.allow,
                                    broker_timeout=max(5.0, 5 * self.heartbeat))
            self.pool.start()
        self.wait(rt, t0)

    def wait(self, rt, t0: float) -> None:
        begun = time.monotonic()
        end = begun + self.wait_seconds
        self._wait_end = end
        if self.remote:   # said as the wait begins, not only once it ran out
            log.warning(waiting_text(self.wait_seconds, self.remote, self.bind,
                                     self.connect_command()))
        while len(self.joined) < self.expected:
            now = time.monotonic()
            if now >= end:
                raise ConfigError(self.missing_message())
            if self.pool is not None and self.pool.exited():
                raise ConfigError(self.missing_message())
            self.tick(rt, now - t0)
            delivery = rt.next_delivery(timeout=min(self.tick_period, max(0.0, end - now)))
            if delivery is not None:
                self.note(delivery.msg)
        if self.remote:
            log.info(all_in_text(self.expected, time.monotonic() - begun, "run"))
        self._wait_end = None

    def note(self, msg: Message) -> None:
        """A Hello or Refused the registry copied to the driver. A worker new to the
        run is said (one line: who, from where, how many of how many) when remote workers
        were waited for: during the wait and after it (a late joiner)."""
        match msg:
            case Hello(worker=worker):
                new = worker not in self.joined
                self.joined[worker] = msg
                self.refused.pop(worker, None)
                if new and self.remote:
                    log.info(self._joined_text(msg))
            case Refused(worker=worker, reason=reason):
                self.refused[worker] = reason
                log.warning("worker %s refused: %s", worker, reason)

    def _joined_text(self, hello: Hello) -> str:
        left = None if self._wait_end is None else self._wait_end - time.monotonic()
        return joined_text(hello, origin_of(self.ports, hello.worker), len(self.joined),
                           self.expected, left)

    def connect_command(self) -> str:
        """The `evobus worker` command a remote worker of this run is started with."""
        cmd = f"evobus worker --connect {self.ports[0].addresses[0]}"
        modules = sorted({module_of(r) for _, r in spec_refs(self.spec)} - set(BUILTIN_ALLOW))
        cmd += "".join(f" --allow {m}" for m in modules)
        if self.keys:
            cmd += (f" --key {os.path.join(self.keys, 'NAME.key_secret')}"
                    f" --server-key {os.path.join(self.keys, 'server.key')}")
        return cmd

    def missing_message(self) -> str:
        have = len(self.joined)
        parts = [f"expected {self.expected} worker(s) in other processes within "
                 f"{self.wait_seconds:g} s (wait_seconds), {have} registered"
                 + (f" ({', '.join(sorted(self.joined))})" if self.joined else "")]
        if self.remote:
            remote_have = sum(1 for w in self.joined if not w.startswith("proc-"))
            parts.append(f"remote: {remote_have} of {self.remote} at {self.bind}; start each "
                         f"missing one with `{self.connect_command()}`")
        if self.pool is not None:
            proc_have = sum(1 for w in self.joined if w.startswith("proc-"))
            dead = self.pool.exited()
            parts.append(f"processes: {proc_have} of {self.processes}"
                         + (f"; exited: {dead} (see their stderr above)" if dead else ""))
        for worker, reason in sorted(self.refused.items()):
            parts.append(f"worker {worker} refused: {reason}")
        return "; ".join(parts)

    def close(self, rt=None) -> None:
        if rt is not None:
            # The Scheduler's Shutdown already said Stop; workers it presumed lost (or
            # that joined late) hear it here too, so process workers leave by themselves.
            for worker in sorted(self.joined):
                rt.send(worker, Stop(reason="run finished"))
        if self.pool is not None:
            self.pool.close()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def counters(self, scheduler) -> dict[str, int]:
        return {"redispatched": scheduler.redispatched, "lost_workers": scheduler.lost_workers,
                "given_up": scheduler.given_up, "workers_joined": len(self.joined),
                "respawned": self.pool.respawned if self.pool is not None else 0,
                "workers_refused": len(self.refused)}


def waiting_text(wait_seconds: float, remote: int, bind: str | None, command: str) -> str:
    """The line a wait for remote workers begins with (a run's, a group's): how long,
    for how many, where, and the command that starts each."""
    return (f"waiting up to {wait_seconds:g} s (wait_seconds) for {remote} remote "
            f"worker(s) at {bind}; start each with `{command}`")


def origin_of(ports, worker: str) -> str:
    """Where ``worker`` connected from, as the port that holds it knows (PeerPort.origin;
    "" when unknown)."""
    return next((o for o in (port.origin(worker) for port in ports) if o is not None), "")


def joined_text(hello: Hello, origin: str, joined: int, expected: int,
                left: float | None) -> str:
    """The line a wait for workers says as one joins: who (and its slots), from where
    when known (PeerPort.origin), how many of how many are in now, and how long the
    wait has left for the rest; ``left`` None: the wait is over (a late joiner)."""
    slots = f", {hello.slots} slots" if hello.slots > 1 else ""
    who = f"worker {hello.worker} joined" + (f" from {origin}" if origin else "")
    if left is None:
        return f"{who} after the start{slots} ({joined} have joined in all)"
    more = expected - joined
    rest = f"; waiting for {more} more (up to {max(0.0, left):.0f} s)" if more > 0 else ""
    return f"{who} ({joined} of {expected}{slots}){rest}"


def all_in_text(expected: int, waited: float, what: str) -> str:
    """The line a wait for workers ends with once every expected one is in."""
    return f"all {expected} worker(s) joined after {waited:.1f} s; the {what} starts"


def workers_problems(workers, *, insecure: bool = False) -> list[tuple[str, str]]:
    """(scenario key, message) for each refusal a ``workers`` section earns before
    anything starts (`plan` raises the first; `evobus validate` reports them all).
    Nothing to say when every worker is a thread of this process."""
    if workers is None or (not workers.processes and not workers.remote):
        return []
    out = []
    heartbeat = getattr(workers, "heartbeat", 1.0)
    deadline = getattr(workers, "deadline", 5.0)
    if deadline <= heartbeat:
        out.append(("$.workers.deadline",
                    f"workers.deadline ({deadline:g} s) must exceed workers.heartbeat "
                    f"({heartbeat:g} s), or every worker looks dead; use deadline >= "
                    f"{3 * heartbeat:g}"))
    if workers.remote and not workers.bind:
        out.append(("$.workers.bind",
                    f"workers.remote = {workers.remote} needs an address to wait at: set "
                    "bind = \"tcp://HOST:PORT\" (loopback unless keys are configured)"))
    keys_dir = getattr(workers, "keys", None)
    if workers.remote and keys_dir:
        try:
            load_server_keys(keys_dir)
        except ValueError as exc:
            out.append(("$.workers.keys", f"workers: {exc}"))
    if workers.remote and workers.bind:
        refusal = bind_refusal(workers.bind, keys=bool(keys_dir),
                               insecure=insecure or getattr(workers, "insecure", False))
        if refusal is not None:
            out.append(("$.workers.bind", f"workers: {refusal}"))
    return out


def plan(workers, n_workers: int, *, bus: str, tasks: list[Task], reward, run, propose,
         agent, strategy, initial_state: dict[str, str], solved: float, package_version: str,
         refs: dict[str, Any] | None = None, insecure: bool = False,
         run_id: str = "") -> RemoteWorkers | None:
    """Check a ``workers`` section (protocol.scenario.Workers) against ``n_workers`` and,
    when some workers live in other processes, name the run's code as data (refusing
    closures: this runs before the first rollout) and prepare the peer ports.
    None: every worker is a thread of this process."""
    if workers is not None:
        total = workers.local + workers.processes + workers.remote
        if total != n_workers:
            raise ConfigError(f"n_workers={n_workers} but workers declares {workers.local} "
                              f"local + {workers.processes} processes + {workers.remote} "
                              f"remote = {total}: set n_workers={total} (the plan has one "
                              "logical worker per worker)")
    if workers is None or (not workers.processes and not workers.remote):
        unused = [name for name, value in (("refs", refs), ("insecure", insecure)) if value]
        if unused:
            warnings.warn(f"{' and '.join(unused)} only concern workers in other processes "
                          "(workers=Workers(processes=..., remote=...)); every worker of this "
                          "run is a thread here, so "
                          f"{'it is' if len(unused) == 1 else 'they are'} ignored",
                          RuntimeWarning, stacklevel=3)
        return None
    if bus != "zmq":
        raise ConfigError(f"bus={bus!r} cannot reach workers in other processes; use bus='zmq'")
    problems = workers_problems(workers, insecure=insecure)
    if problems:
        raise ConfigError(problems[0][1])
    heartbeat = getattr(workers, "heartbeat", 1.0)
    deadline = getattr(workers, "deadline", 5.0)
    spec = build_spec(tasks=tasks, reward=reward, run=run, propose=propose, agent=agent,
                      strategy=strategy, initial_state=initial_state, solved=solved,
                      heartbeat=heartbeat, package_version=package_version, refs=refs,
                      env=getattr(workers, "env", ()), run_id=run_id)

    keys_dir = getattr(workers, "keys", None)
    insecure = insecure or getattr(workers, "insecure", False)
    ports = []
    if workers.remote:
        try:
            server_keys = load_server_keys(keys_dir) if keys_dir else None
            ports.append(PeerPort([workers.bind], keys=server_keys, insecure=insecure,
                                  allowed=WORKER_ROLE, label="remote"))
        except ValueError as exc:
            raise ConfigError(f"workers: {exc}") from None
    tmpdir = None
    if workers.processes:
        if sys.platform == "win32":
            addr = "tcp://127.0.0.1:*"
        else:
            tmpdir = tempfile.mkdtemp(prefix="evobus-")
            addr = f"ipc://{tmpdir}/workers.sock"
        ports.append(PeerPort([addr], allowed=WORKER_ROLE, label="process"))
    modules = sorted({module_of(r) for _, r in spec_refs(spec)})
    return RemoteWorkers(local=workers.local, processes=workers.processes,
                         remote=workers.remote, spec=spec, ports=ports, heartbeat=heartbeat,
                         deadline=deadline, max_tries=getattr(workers, "max_tries", 3),
                         wait_seconds=workers.wait_seconds, bind=workers.bind, keys=keys_dir,
                         allow=sorted(set(modules) | set(workers.allow)), tmpdir=tmpdir)
