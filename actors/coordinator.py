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
import functools
import hashlib
import importlib
import importlib.util
import inspect
import logging
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any, Iterable

import msgspec

from actors import refs as refs_mod
from actors.addresses import DRIVER, SCHEDULER
from actors.errors import ConfigError
from protocol import CodeRef, Hello, Join, Message, Refused, Spec, Stop, Task, Tick

log = logging.getLogger(__name__)

Out = tuple[str, Message]

#: The actor that hands out the spec and checks hellos.
REGISTRY = "registry"
#: Names a worker may always resolve without --allow (evobus's own artifact strategies).
BUILTIN_ALLOW = ("actors.artifacts",)
#: Process workers get this long to leave after the run's Stop before being terminated.
PROCESS_STOP_DEADLINE_S = 5.0

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# -- naming code as data ------------------------------------------------------------------


def _closure(what: str, obj: Any, kind: str) -> ConfigError:
    return ConfigError(
        f"{what}={obj!r} is {kind}: workers in other processes can only run code named by "
        f"import path. Define it at module level in an importable module (not the script "
        f"you run) and pass that, or name it as data: "
        f"refs={{'{what}': Ref('package.module:attr', kwargs={{...}})}} in Python "
        f"(from actors.refs import Ref), {what} = \"package.module:attr\" in a scenario")


def _importable(obj: Any, what: str) -> str:
    """``module:qualname`` of a module-level function or class, checked by import."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not module or not qualname:
        raise _closure(what, obj, "not a named function or class")
    if "<lambda>" in qualname:
        raise _closure(what, obj, "a lambda")
    if "<locals>" in qualname:
        raise _closure(what, obj, "a closure (defined inside a function)")
    if module in ("__main__", "__mp_main__"):
        raise _closure(what, obj, "defined in the script being run (__main__)")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        raise _closure(what, obj, f"not importable as {module}:{qualname}") from None
    if found is not obj:
        raise _closure(what, obj, f"not what {module}:{qualname} names (decorated or rebound?)")
    return f"{module}:{qualname}"


def _json_ok(value: Any) -> bool:
    try:
        return msgspec.json.decode(msgspec.json.encode(value)) == value
    except (TypeError, msgspec.EncodeError, msgspec.DecodeError):
        return False


def code_ref(obj: Any, what: str) -> CodeRef:
    """Name ``obj`` as data, or refuse with the fix. Accepts a CodeRef, an actors.refs.Ref,
    a ``"module:attr"`` string, a module-level function or class, or an instance of an
    importable class that is a dataclass (its fields become JSON kwargs) or holds no state."""
    if isinstance(obj, CodeRef):
        return obj
    if isinstance(obj, refs_mod.Ref):
        return CodeRef(ref=obj.ref, args=list(obj.args), kwargs=dict(obj.kwargs), call=obj.call)
    if hasattr(obj, "ref") and hasattr(obj, "kwargs") and isinstance(getattr(obj, "ref"), str):
        # protocol.scenario.RefSpec (a scenario's table form)
        return CodeRef(ref=obj.ref, args=list(obj.args), kwargs=dict(obj.kwargs),
                       call=getattr(obj, "call", None))
    if isinstance(obj, str):
        if ":" not in obj:
            raise ConfigError(f"{what}={obj!r} is not a reference; write 'package.module:attr'")
        return CodeRef(ref=obj)
    if isinstance(obj, functools.partial):
        raise _closure(what, obj, "a functools.partial")
    if inspect.ismethod(obj):
        raise _closure(what, obj, f"a bound method of a {type(obj.__self__).__name__} object")
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return CodeRef(ref=_importable(obj, what), call=False)
    if inspect.isclass(obj):
        return CodeRef(ref=_importable(obj, what), call=False)
    cls = type(obj)
    name = _importable(cls, f"{what} (its class {cls.__name__})")
    if dataclasses.is_dataclass(obj):
        kwargs = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
        kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
        if not _json_ok(kwargs):
            raise ConfigError(f"{what}: the fields of {cls.__name__} are not all JSON values, "
                              f"so it cannot be rebuilt in another process; name it as "
                              f"Ref('{name}', kwargs={{...}}) with JSON arguments")
        return CodeRef(ref=name, kwargs=kwargs, call=True)
    if not getattr(obj, "__dict__", None) and not getattr(cls, "__slots__", None):
        return CodeRef(ref=name, call=True)
    raise ConfigError(f"{what}: a {cls.__name__} object holds state ({sorted(vars(obj))[:5]}) "
                      f"that cannot travel to another process; name how to build it: "
                      f"refs={{'{what}': Ref('{name}', kwargs={{...}})}} (JSON arguments), "
                      f"or {what} = {{ ref = \"{name}\", kwargs = {{...}} }} in a scenario")


def module_of(ref: CodeRef) -> str:
    return ref.ref.partition(":")[0]


def module_fingerprint(module: str) -> str:
    """sha256 (16 hex digits) of a module's source file; "-" when it has none."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None)
    if not origin or not os.path.isfile(origin):
        return "-"
    with open(origin, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def combined_fingerprint(fingerprints: dict[str, str]) -> str:
    text = "\n".join(f"{m}={fp}" for m, fp in sorted(fingerprints.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def task_digest(tasks: Iterable[Task]) -> str:
    data = msgspec.msgpack.encode([(t.id, t.prompt, t.meta) for t in tasks])
    return hashlib.sha256(data).hexdigest()[:16]


def build_spec(*, tasks: list[Task], reward, run, propose, agent, strategy,
               initial_state: dict[str, str], solved: float, heartbeat: float,
               package_version: str, refs: dict[str, Any] | None = None,
               env: Iterable[str] = (), run_id: str = "") -> Spec:
    """The run's code as data, for workers in other processes (refuses closures)."""
    named = dict(refs or {})
    unknown = sorted(set(named) - {"tasks", "reward", "run", "propose", "agent", "strategy"})
    if unknown:
        raise ConfigError(f"refs: unknown keys {unknown}; use tasks, reward, run, propose, "
                          "agent, strategy")

    def ref(key: str, obj: Any) -> CodeRef:
        return code_ref(named.get(key, obj), key)

    fields: dict[str, Any] = {"reward": ref("reward", reward),
                              "strategy": ref("strategy", strategy)}
    if agent is not None or "agent" in named:
        fields["agent"] = ref("agent", agent)
    else:
        fields["run"] = ref("run", run)
        fields["propose"] = ref("propose", propose)
    if "tasks" in named:
        fields["tasks"] = code_ref(named["tasks"], "tasks")
    else:
        fields["inline_tasks"] = list(tasks)
    env = sorted(set(env))
    bad = [e for e in env if not _ENV_NAME.fullmatch(e)]
    if bad:
        raise ConfigError(f"env: {bad} are not environment variable names; list the *names* "
                          "of the variables workers need (their values never travel)")
    modules = sorted({module_of(r) for r in fields.values() if isinstance(r, CodeRef)})
    fingerprints = {m: module_fingerprint(m) for m in modules}
    spec = Spec(**fields, run_id=run_id, task_digest=task_digest(tasks),
                initial_state=dict(initial_state), solved=solved, env=env,
                fingerprints=fingerprints, fingerprint=combined_fingerprint(fingerprints),
                package_version=package_version, heartbeat=heartbeat)
    _no_secret_values(spec)
    return spec


def _no_secret_values(spec: Spec) -> None:
    """Secrets travel as variable names only: refuse a spec that holds a listed value."""
    encoded = msgspec.msgpack.encode(spec)
    for name in spec.env:
        value = os.environ.get(name, "")
        if len(value) >= 8 and value.encode() in encoded:
            raise ConfigError(f"the value of ${name} appears in the code references sent to "
                              f"workers; pass the variable's name instead (env = [\"{name}\"]) "
                              "and read it with os.environ on the worker")


def spec_refs(spec: Spec) -> list[tuple[str, CodeRef]]:
    pairs = [("tasks", spec.tasks), ("reward", spec.reward), ("agent", spec.agent),
             ("run", spec.run), ("propose", spec.propose), ("strategy", spec.strategy)]
    return [(k, r) for k, r in pairs if r is not None]


# -- the registry (a pure state machine) ---------------------------------------------------


class Registry:
    """Hands the spec to joining workers and admits those that run the same code."""

    name = REGISTRY

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.joined: dict[str, Hello] = {}
        self.refused: dict[str, str] = {}

    def handle(self, msg: Message) -> list[Out]:
        match msg:
            case Join(worker=worker):
                return [(worker, self.spec)]
            case Hello():
                problem = self._check(msg)
                if problem is not None:
                    self.refused[msg.worker] = problem
                    refusal = Refused(worker=msg.worker, reason=problem)
                    return [(msg.worker, refusal), (DRIVER, refusal)]
                self.joined[msg.worker] = msg
                return [(SCHEDULER, msg), (DRIVER, msg)]
            case Refused(worker=worker, reason=reason):
                self.refused[worker] = reason
                return [(DRIVER, msg)]
            case _:
                log.warning("registry: unexpected %s", type(msg).__name__)
                return []

    def _check(self, hello: Hello) -> str | None:
        s = self.spec
        if s.package_version and hello.package_version != s.package_version:
            return (f"worker {hello.worker} runs evobus {hello.package_version or '?'}, the "
                    f"coordinator {s.package_version}: install the same version on both")
        if hello.fingerprint != s.fingerprint:
            return (f"worker {hello.worker} runs different code (fingerprint "
                    f"{hello.fingerprint or '-'}, expected {s.fingerprint}): install the same "
                    f"version of {sorted(s.fingerprints)} on it")
        return None


# -- process workers --------------------------------------------------------------------------


class ProcessPool:
    """Process workers: started with multiprocessing's 'spawn' context (never fork: a
    forked copy would inherit the coordinator's threads and sockets), supervised and
    always reaped: Stop first, then terminate, then kill."""

    def __init__(self, n: int, address: str, *, allow: list[str],
                 broker_timeout: float) -> None:
        self.n = n
        self.address = address
        self.allow = allow
        self.broker_timeout = broker_timeout
        self.procs: list = []

    def names(self) -> list[str]:
        return [f"proc-{i}" for i in range(self.n)]

    def start(self) -> None:
        from actors.remote_worker import process_main

        ctx = multiprocessing.get_context("spawn")
        for name in self.names():
            proc = ctx.Process(target=process_main, name=f"evobus-{name}", daemon=True,
                               kwargs=dict(address=self.address, worker_id=name,
                                           allow=self.allow,
                                           broker_timeout=self.broker_timeout))
            proc.start()
            self.procs.append(proc)

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


# -- what evolve() asks ------------------------------------------------------------------------


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
    _next_tick: float = 0.0

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
        if now >= self._next_tick:
            rt.send(SCHEDULER, Tick(elapsed=now))
            self._next_tick = now + self.tick_period

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
        end = time.monotonic() + self.wait_seconds
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

    def note(self, msg: Message) -> None:
        """A Hello or Refused the registry copied to the driver."""
        match msg:
            case Hello(worker=worker):
                self.joined[worker] = msg
                self.refused.pop(worker, None)
            case Refused(worker=worker, reason=reason):
                self.refused[worker] = reason
                log.warning("worker %s refused: %s", worker, reason)

    def missing_message(self) -> str:
        have = len(self.joined)
        parts = [f"expected {self.expected} worker(s) in other processes within "
                 f"{self.wait_seconds:g} s (wait_seconds), {have} registered"
                 + (f" ({', '.join(sorted(self.joined))})" if self.joined else "")]
        if self.remote:
            remote_have = sum(1 for w in self.joined if not w.startswith("proc-"))
            cmd = f"evobus worker --connect {self.ports[0].addresses[0]}"
            modules = sorted({module_of(r) for _, r in spec_refs(self.spec)}
                             - set(BUILTIN_ALLOW))
            cmd += "".join(f" --allow {m}" for m in modules)
            if self.keys:
                cmd += (f" --key {os.path.join(self.keys, 'NAME.key_secret')}"
                        f" --server-key {os.path.join(self.keys, 'server.key')}")
            parts.append(f"remote: {remote_have} of {self.remote} at {self.bind}; start each "
                         f"missing one with `{cmd}`")
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
                "workers_refused": len(self.refused)}


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
    heartbeat = getattr(workers, "heartbeat", 1.0)
    deadline = getattr(workers, "deadline", 5.0)
    if deadline <= heartbeat:
        raise ConfigError(f"workers.deadline ({deadline:g} s) must exceed workers.heartbeat "
                          f"({heartbeat:g} s), or every worker looks dead; use deadline >= "
                          f"{3 * heartbeat:g}")
    if workers.remote and not workers.bind:
        raise ConfigError(f"workers.remote = {workers.remote} needs an address to wait at: "
                          "set bind = \"tcp://HOST:PORT\" (loopback unless keys are configured)")
    spec = build_spec(tasks=tasks, reward=reward, run=run, propose=propose, agent=agent,
                      strategy=strategy, initial_state=initial_state, solved=solved,
                      heartbeat=heartbeat, package_version=package_version, refs=refs,
                      env=getattr(workers, "env", ()), run_id=run_id)
    from actors.addresses import SCHEDULER as _S
    from bus.remote import PeerPort
    from bus.security import load_server_keys

    keys_dir = getattr(workers, "keys", None)
    insecure = insecure or getattr(workers, "insecure", False)
    ports = []
    if workers.remote:
        try:
            server_keys = load_server_keys(keys_dir) if keys_dir else None
            ports.append(PeerPort([workers.bind], keys=server_keys, insecure=insecure,
                                  receivers=[_S, REGISTRY], label="remote"))
        except ValueError as exc:
            raise ConfigError(f"workers: {exc}") from None
    tmpdir = None
    if workers.processes:
        if sys.platform == "win32":
            addr = "tcp://127.0.0.1:*"
        else:
            tmpdir = tempfile.mkdtemp(prefix="evobus-")
            addr = f"ipc://{tmpdir}/workers.sock"
        ports.append(PeerPort([addr], receivers=[_S, REGISTRY], label="process"))
    modules = sorted({module_of(r) for _, r in spec_refs(spec)})
    return RemoteWorkers(local=workers.local, processes=workers.processes,
                         remote=workers.remote, spec=spec, ports=ports, heartbeat=heartbeat,
                         deadline=deadline, max_tries=getattr(workers, "max_tries", 3),
                         wait_seconds=workers.wait_seconds, bind=workers.bind, keys=keys_dir,
                         allow=sorted(set(modules) | set(workers.allow)), tmpdir=tmpdir)
