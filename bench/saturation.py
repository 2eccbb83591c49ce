"""Where one broker saturates: messages per rollout and per branch, CPU per message of
the broker and of the control machines, and the rate 1,000 and 10,000 workers ask for.

    python -m bench.saturation [--peers 64 256 1024] [--seconds 4] [--quick]
                               [--skip-runs] [--gen-procs 2] [--json FILE]
    python -m bench.saturation --from-json FILE    # part 4 again, nothing measured

Four measurements, then the arithmetic (docs/remote.md, "Where one broker saturates"):

1. **Messages per rollout and per branch**, counted in the logs of real runs: the router
   scenario on two process workers, synchronous and barrier-free (``evobus run``, each
   in its own process), and a parallel group (scenarios/groups.toml). Every record of a
   log went through the broker once, so a log's records are the broker's messages.
2. **Broker CPU per message**: the production broker (bus.zmq_bus.ZmqBus with a
   bus.remote.PeerPort in the worker role, writing a message log) in a process of its
   own, its "scheduler" a pykka ControlActor (the production shell: ``tell``, the
   actor's thread, ``send`` through the broker's intake) around an echo machine that
   answers every ``LeaseDone`` with a ``Lease``. N DEALER peers in other processes
   register a worker name each and keep one ``LeaseDone`` in flight each (closed loop),
   frames encoded with protocol.Codec at the sizes the logs show. CPU is read from
   ``/proc/self/task/TID/schedstat`` (the broker thread; the actor thread) and
   ``getrusage`` (the whole broker process: with it ZeroMQ's I/O thread, where CURVE's
   encryption runs) over a timed window, never wall-clock; per message = CPU /
   messages the broker delivered in the window (both directions count).
3. **Control machines' CPU per message**: the pure Scheduler and Collector fed messages
   directly (``time.thread_time`` around ``admit`` + ``handle``), at 1,000 and 10,000
   workers; the Collector's run also counts its messages per branch at that scale
   (guided lease sizes).
4. **Saturation**: required messages/s = workers / call seconds x messages per rollout
   (or branch; a remote branch crosses the broker twice each way, through the relay),
   plus heartbeats (a call longer than the interval), against the CPU per message of
   the broker thread and of each machine's thread (handle + shell), which share one
   interpreter lock.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import multiprocessing
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from actors.machines.collector import Collector
from actors.machines.scheduler import Scheduler
from actors.runtime.pools import WORKER_ROLE
from actors.runtime.shell import ControlActor
from bench.common import Row, table
from bus.frames import NOBLOCK, envelope
from bus.log import FORMAT_VERSION, LogHeader, LogWriter, iter_log
from bus.remote import PeerPort
from bus.security import create_keys, load_client_keys, load_server_keys, secure_client
from bus.zmq_bus import ZmqBus
from protocol import (Branch, BranchDone, Codec, Commit, Diff, EvalRequest, GroupResult,
                      GroupStart, Hello, Lease, LeaseBatch, LeaseDone, RolloutResult,
                      RoundClosed, Tick)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULER = "scheduler"


# -- 1. messages per rollout and per branch, from real runs' logs ----------------------------


@dataclass
class Counts:
    """What one log holds: records per (message type, direction), bodies' mean sizes."""

    name: str
    records: int = 0
    rollouts: int = 0  # rollout tasks answered by workers (LeaseDone kind=rollout)
    rollout_leases: int = 0
    branches: int = 0  # items the group ran
    rounds: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    size: dict[str, float] = field(default_factory=dict)
    peer_wire: int = 0  # records that crossed the peer port (to or from a worker process)
    forwarded: int = 0  # rollout answers the Scheduler passed on to the Merger (proposals)
    commits_to_workers: int = 0
    heldout: int = 0  # tasks of an EvalRequest (the held-out split)
    workers: list[str] = field(default_factory=list)  # worker names that answered

    def per(self, unit: int) -> float:
        return self.records / unit if unit else float("nan")


def _kind(msg) -> str:
    name = type(msg).__name__
    kind = getattr(msg, "kind", None)
    return f"{name}:{kind}" if name in ("Lease", "LeaseDone") else name


def count_log(path: str, name: str, workers_prefix: tuple[str, ...] = ("proc-",)) -> Counts:
    codec = Codec()
    c = Counts(name)
    by, size = collections.Counter(), collections.Counter()
    for rec in iter_log(path):
        msg = codec.decode(rec.body)
        k = _kind(msg)
        by[k] += 1
        size[k] += len(rec.body)
        c.records += 1
        if rec.sender.startswith(workers_prefix) or rec.receiver.startswith(workers_prefix):
            c.peer_wire += 1
        if k == "LeaseDone:rollout" and rec.sender.startswith(workers_prefix):
            c.rollouts += len(msg.results)
            c.rollout_leases += 1
            if rec.sender not in c.workers:
                c.workers.append(rec.sender)
        elif isinstance(msg, GroupStart):
            c.branches += len(msg.items)
        elif isinstance(msg, RoundClosed):
            c.rounds += 1
        elif isinstance(msg, EvalRequest):
            c.heldout = max(c.heldout, len(msg.task_ids))
        if k == "LeaseDone:rollout" and rec.receiver == "merger":
            c.forwarded += 1
        elif k == "Commit" and rec.receiver.startswith(workers_prefix):
            c.commits_to_workers += 1
    c.by_type = dict(by.most_common())
    c.size = {k: size[k] / by[k] for k in by}
    return c


_ASYNC_WORKERS = "[workers]\nlocal = 0\nprocesses = 2\n\n"


def record_runs(tmp: str) -> dict[str, str]:
    """Run the three scenarios with ``evobus run`` (one process each) and return their
    logs. The async scenario is scenarios/router_async.toml on two process workers."""
    with open(os.path.join(ROOT, "scenarios", "router_async.toml")) as f:
        text = f.read()
    async_toml = os.path.join(tmp, "router_async_processes.toml")
    with open(async_toml, "w") as f:
        f.write(text.replace("[budgets]", _ASYNC_WORKERS + "[budgets]", 1))
    with open(os.path.join(ROOT, "scenarios", "groups.toml")) as f:
        groups = f.read().replace("runs/groups", os.path.join(tmp, "groups"))
    groups_toml = os.path.join(tmp, "groups.toml")
    with open(groups_toml, "w") as f:
        f.write(groups)
    runs = {"sync, 2 process workers": (os.path.join(ROOT, "scenarios",
                                                      "router_processes.toml"), "sync"),
            "async, 2 process workers": (async_toml, "async"),
            "parallel group (groups.toml)": (groups_toml, "groups")}
    logs = {}
    for label, (scenario, stem) in runs.items():
        log = os.path.join(tmp, f"{stem}.evolog")
        proc = subprocess.run([sys.executable, "-m", "actors.cli", "run", scenario, "--log",
                               log, "--quiet"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        if stem == "groups":  # a group writes its own log beside its checkpoint
            log = os.path.join(tmp, "groups.triage.evolog")
        # groups.toml pauses for a human by design (exit 3): its log is complete.
        if proc.returncode not in (0, 3) or not os.path.exists(log):
            raise RuntimeError(f"evobus run {scenario} exited {proc.returncode}: "
                               f"{proc.stderr.strip()[-800:]}")
        logs[label] = log
    return logs


# -- 2. broker CPU per message -----------------------------------------------------------------


def _schedstat_ns(native_id: int) -> int:
    """CPU nanoseconds this process's thread ``native_id`` has run (Linux schedstat)."""
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0])


def _tid(name: str) -> int:
    for t in threading.enumerate():
        if t.name == name and t.native_id is not None:
            return t.native_id
    raise RuntimeError(f"no thread named {name!r} in the broker process")


def sample_frames() -> tuple[bytes, bytes]:
    """A rollout lease and its answer as the logs show them (one task, a tagged id, the
    answer carrying a proposal): (Lease body, LeaseDone body)."""
    codec = Codec()
    lease = Lease(lease_id="r12.u345.8dfe78255292a5d6", round=12, unit=345,
                  task_ids=["billing-refund-3"], version=7)
    done = LeaseDone(lease_id=lease.lease_id, worker="w00345", round=12, unit=345, version=7,
                     results=[RolloutResult(task_id="billing-refund-3", score=0.0, calls=2,
                                            diff=Diff(diff_id="w00345:billing:7:rb51118f587",
                                                      author="w00345", base_version=7,
                                                      ops={"billing": "refund"}))])
    return codec.encode(lease), codec.encode(done)


class _Echo:
    """The stand-in Scheduler (bench only): every LeaseDone gets a Lease back, to the
    worker that sent it. Pure, like the real machine: handle(msg) -> [(to, msg)]."""

    def __init__(self) -> None:
        self._lease = Codec().decode(sample_frames()[0])

    def handle(self, msg) -> list:
        if isinstance(msg, LeaseDone):
            return [(msg.worker, self._lease)]
        return []


def _broker_process(address: str, keys_dir: str | None, log_path: str, conn) -> None:
    logging.basicConfig(level=logging.ERROR)
    keys = load_server_keys(keys_dir) if keys_dir else None
    port = PeerPort([address], keys=keys, allowed=WORKER_ROLE)
    writer = LogWriter(log_path, LogHeader(format_version=FORMAT_VERSION,
                                           scenario="bench.saturation"))
    bus = ZmqBus(log_writer=writer, peers=[port])
    crashes: list = []
    ref = ControlActor.spawn(bus, SCHEDULER, _Echo(), lambda n, e: crashes.append(e))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the actor names its thread in on_start
        if any(t.name == f"evobus-{SCHEDULER}" for t in threading.enumerate()):
            break
        time.sleep(0.01)
    broker, actor = _tid("evobus-broker"), _tid(f"evobus-{SCHEDULER}")
    conn.send(("ready", port.addresses[0]))

    def sample() -> dict:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"broker_ns": _schedstat_ns(broker), "actor_ns": _schedstat_ns(actor),
                "process_s": ru.ru_utime + ru.ru_stime, "delivered": bus.stats.delivered,
                "rejected": bus.stats.rejected_frames,
                "t": time.monotonic()}

    while True:
        cmd = conn.recv()
        if cmd == "sample":
            conn.send(sample())
        else:
            break
    ref.stop()
    bus.close()
    conn.send({"crashes": [repr(e) for e in crashes]})


def _peers_process(address: str, first: int, count: int, keys_dir: str | None,
                   conn) -> None:
    _, done = sample_frames()
    ctx = zmq.Context(io_threads=1)
    client = (load_client_keys(os.path.join(keys_dir, "bench.key_secret"),
                               os.path.join(keys_dir, "server.key")) if keys_dir else None)
    socks, frames = [], {}
    poller = zmq.Poller()
    for i in range(first, first + count):
        name = f"w{i:05d}".encode()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if client is not None:
            secure_client(s, client)
        s.connect(address)
        s.send_multipart([b"A", name])
        socks.append(s)
        # The worker field must name the sender (the port's role check): re-encode.
        codec = Codec()
        msg = codec.decode(done)
        body = codec.encode(msgspec.structs.replace(msg, worker=name.decode()))
        frames[s] = envelope(name, SCHEDULER.encode(), body)
        poller.register(s, zmq.POLLIN)
    acked, deadline = 0, time.monotonic() + 120
    while acked < count and time.monotonic() < deadline:
        for s, _ in poller.poll(200):
            while s.poll(0):
                if s.recv_multipart()[0] == b"a":
                    acked += 1
    conn.send(("registered", acked))
    if conn.recv() != "go":
        return
    sent = received = 0
    for s in socks:
        s.send(frames[s], NOBLOCK)
        sent += 1
    stop = False
    while not stop:
        for s, _ in poller.poll(100):
            for _ in range(64):
                try:
                    s.recv(NOBLOCK)
                except zmq.Again:
                    break
                received += 1
                s.send(frames[s], NOBLOCK)
                sent += 1
        if conn.poll():
            stop = conn.recv() == "stop"
    conn.send({"sent": sent, "received": received})
    ctx.destroy(linger=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broker_cpu(peers: int, curve: bool, seconds: float, gen_procs: int = 2,
               warmup: float = 1.0) -> dict:
    """Drive the broker with ``peers`` DEALER connections for ``seconds`` (after a
    warm-up) and return its CPU per delivered message (microseconds)."""
    tmp = tempfile.mkdtemp(prefix="evobus-saturation-")
    keys_dir = None
    if curve:
        keys_dir = os.path.join(tmp, "keys")
        create_keys(keys_dir, ["bench"])
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    broker = ctx.Process(target=_broker_process, daemon=True,
                         args=(f"tcp://127.0.0.1:{_free_port()}", keys_dir,
                               os.path.join(tmp, "broker.evolog"), there))
    broker.start()
    gens = []
    try:
        if not here.poll(60):
            raise RuntimeError("the broker process did not start within 60 s")
        _, address = here.recv()
        per = [peers // gen_procs + (1 if i < peers % gen_procs else 0)
               for i in range(gen_procs)]
        first = 0
        for n in per:
            a, b = ctx.Pipe()
            p = ctx.Process(target=_peers_process, args=(address, first, n, keys_dir, b),
                            daemon=True)
            p.start()
            gens.append((p, a, n))
            first += n
        for p, a, n in gens:
            if not a.poll(180):
                raise RuntimeError(f"a peer process did not register its {n} peers in 180 s")
            _, acked = a.recv()
            if acked != n:
                raise RuntimeError(f"only {acked} of {n} peers registered")
        for _, a, _ in gens:
            a.send("go")
        time.sleep(warmup)  # the closed loop fills before the window opens
        here.send("sample")
        s0 = here.recv()
        time.sleep(seconds)
        here.send("sample")
        s1 = here.recv()
        for _, a, _ in gens:
            a.send("stop")
        gen_figs = [a.recv() if a.poll(30) else {} for _, a, _ in gens]
        here.send("quit")
        end = here.recv() if here.poll(30) else {}
    finally:
        for p, _, _ in gens:
            p.join(10)
            if p.is_alive():
                p.terminate()
        broker.join(10)
        if broker.is_alive():
            broker.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    msgs = s1["delivered"] - s0["delivered"]
    wall = s1["t"] - s0["t"]
    broker_us = (s1["broker_ns"] - s0["broker_ns"]) / 1e3
    actor_us = (s1["actor_ns"] - s0["actor_ns"]) / 1e3
    process_us = (s1["process_s"] - s0["process_s"]) * 1e6
    if not msgs:
        raise RuntimeError(f"the broker delivered nothing in {wall:.1f} s with {peers} peers")
    if s1["rejected"]:
        raise RuntimeError(f"the broker's port refused {s1['rejected']} frames: the load is "
                           "not what a worker sends")
    return {"peers": peers, "curve": curve, "messages": msgs, "wall": wall,
            "rate": msgs / wall, "broker_us": broker_us / msgs,
            "actor_us": actor_us / msgs, "process_us": process_us / msgs,
            "other_us": (process_us - broker_us - actor_us) / msgs,
            "broker_busy": broker_us / 1e6 / wall, "crashes": end.get("crashes", []),
            "peer_sent": sum(g.get("sent", 0) for g in gen_figs)}


# -- 3. the control machines' CPU per message ----------------------------------------------------


def scheduler_cpu(workers: int, rounds: int, tasks_per_lease: int = 1) -> dict:
    """The pure Scheduler at ``workers`` workers: Hello each, then ``rounds`` synchronous
    rounds of one lease per worker (LeaseBatch, every LeaseDone, a Commit), Ticks among
    them; CPU (thread time) of admit + handle per message handled, and per lease."""
    s = Scheduler(workers, deadline=10.0, n_workers=workers)
    names = [f"w{i:05d}" for i in range(workers)]
    handled = 0
    cpu = 0.0
    t0 = time.thread_time()
    for n in names:
        s.handle(Hello(worker=n, heartbeat=1.0))
    hello_cpu = time.thread_time() - t0
    elapsed = 0.0
    for r in range(rounds):
        leases = [Lease(lease_id=f"r{r}.u{u}", round=r, unit=u,
                        task_ids=[f"t{u}.{k}" for k in range(tasks_per_lease)])
                  for u in range(workers)]
        t0 = time.thread_time()
        out = s.handle(LeaseBatch(round=r, leases=leases))
        cpu += time.thread_time() - t0
        handled += 1
        sent = [(to, m) for to, m in out if isinstance(m, Lease)]
        answers = [LeaseDone(lease_id=m.lease_id, worker=to, round=r, unit=m.unit,
                             results=[RolloutResult(task_id=t, score=0.5, calls=1)
                                      for t in m.task_ids]) for to, m in sent]
        t0 = time.thread_time()
        for i, a in enumerate(answers):
            if s.admit(a.worker, a) is None:
                s.handle(a)
            if i % 1000 == 999:
                elapsed += 0.1
                s.handle(Tick(elapsed=elapsed))
                handled += 1
        s.handle(Commit(version=r + 1, state={"rules": "x" * 200}))
        cpu += time.thread_time() - t0
        handled += len(answers) + 1
    return {"workers": workers, "messages": handled, "us_per_msg": cpu / handled * 1e6,
            "us_per_lease": cpu / (rounds * workers) * 1e6,
            "hello_us": hello_cpu / workers * 1e6}


def collector_cpu(workers: int, items: int, prefetch: int = 1, max_answers: int = 0) -> dict:
    """The pure Collector at ``workers`` workers over ``items`` items (guided lease
    sizes, as GroupStart's defaults give): every Branch answered at once, oldest first;
    CPU (thread time) per message handled, and its messages per branch. With
    ``max_answers``, only that many answers are handled (the CPU figure covers them;
    the messages per item are then not known: None)."""
    names = [f"w{i:05d}" for i in range(workers)]
    start = GroupStart(group_id="g", items=list(range(items)), workers=names,
                       max_concurrency=workers, max_items=items, driver="d",
                       prefetch=prefetch, deadline=10.0)
    c = Collector("c")
    t0 = time.thread_time()
    out = c.handle(start)
    for n in names:
        out += c.handle(Hello(worker=n, heartbeat=1.0))
    handled = 1 + workers
    branches = 0
    result = None
    pending = collections.deque((to, m) for to, m in out if isinstance(m, Branch))
    branches += len(pending)
    answered = 0
    while pending and not (max_answers and answered >= max_answers):
        answered += 1
        to, b = pending.popleft()
        out = c.handle(BranchDone(group_id="g", lease_id=b.lease_id, worker=to,
                                  indices=b.indices, values=list(b.indices)))
        handled += 1
        for dest, m in out:
            if isinstance(m, Branch):
                pending.append((dest, m))
                branches += 1
            elif isinstance(m, GroupResult):
                result = m
    cpu = time.thread_time() - t0
    if max_answers and pending:
        return {"workers": workers, "items": items, "leases": branches, "messages": None,
                "per_item": None, "leases_per_item": None, "answers": answered,
                "us_per_msg": cpu / handled * 1e6, "us_per_item": None}
    if result is None or result.status != "completed":
        raise RuntimeError(f"the collector did not complete: {result}")
    # The group's messages through the broker: GroupStart, Hellos, each Branch and its
    # answer, the result (Stop to the workers at the end not counted: one per worker).
    messages = 1 + workers + 2 * branches + 1
    return {"workers": workers, "items": items, "leases": branches, "answers": answered,
            "messages": messages, "per_item": messages / items,
            "leases_per_item": branches / items, "us_per_msg": cpu / handled * 1e6,
            "us_per_item": cpu / items * 1e6}


# -- 4. the arithmetic -----------------------------------------------------------------------------


#: Broker crossings per Collector message for branches on workers in other processes
#: (actors/groups/fleet.py: the relay and one proxy per slot stand between them).
RELAY_HOPS = 2

_PER_ROUND = ("LeaseBatch", "SettledBatch", "Settled", "Barrier", "RoundClosed", "Progress",
              "NeedWork", "Merged", "Refresh")


@dataclass
class Model:
    """Messages at scale, from one run's log: per rollout lease (what each worker's lease
    costs, wherever it runs) and per round or merge (what the coordinator adds)."""

    tasks_per_lease: float
    per_lease: float  # Lease, LeaseDone, the answer forwarded to the Merger, commits sent
    commits_per_worker_round: float  # sync: a Commit to every worker per committed round
    evals_per_round: float  # EvalRequests per round (sync) or merge (async)
    heldout: int
    fixed_per_round: float  # LeaseBatch, SettledBatch, Barrier, RoundClosed, ...

    def per_round_at(self, workers: int) -> float:
        """Coordinator messages of one round or merge at ``workers`` workers: each eval is
        split into min(held-out, workers) leases, each answered, plus its request and
        result."""
        chunks = min(self.heldout, workers)
        return self.evals_per_round * (2 * chunks + 2) + self.fixed_per_round


def model(c: Counts, workers_in_run: int) -> Model:
    leases = max(1, c.rollout_leases)
    rounds = max(1, c.rounds)
    commits = c.commits_to_workers
    sync_commits = c.by_type.get("Barrier", 0) > 0
    per_lease = 2 + c.forwarded / leases
    if not sync_commits:  # async: a worker is sent the head only when its lag is spent
        per_lease += commits / leases
    return Model(tasks_per_lease=c.rollouts / leases, per_lease=per_lease,
                 commits_per_worker_round=commits / workers_in_run / rounds
                 if sync_commits else 0.0,
                 evals_per_round=c.by_type.get("EvalRequest", 0) / rounds,
                 heldout=c.heldout,
                 fixed_per_round=sum(c.by_type.get(k, 0) for k in _PER_ROUND) / rounds
                 + (c.by_type.get("Commit", 0) - commits) / rounds)


@dataclass
class Load:
    workers: int
    call: float
    unit: str
    calls_per_s: float
    msgs_per_call: float
    heartbeats_per_call: float
    msgs_per_s: float
    broker: float  # share of one core the broker thread needs (> 1: saturated)
    machine: float  # the same for the Scheduler's or Collector's thread
    machine_name: str

    @property
    def gil(self) -> float:
        """The coordinator's Python threads share one interpreter lock: the broker thread
        and the machine's thread together get at most one core."""
        return self.broker + self.machine


def _nearest(by_workers: dict[int, dict], workers: int) -> dict:
    """The machine's figures measured at ``workers``, else at the nearest count measured."""
    return by_workers[min(by_workers, key=lambda w: abs(math.log(w / workers)))]


def loads(sync: Model | None, asyn: Model | None, branch: dict[int, dict],
          broker_us: float, shell_us: float, scheduler: dict[int, dict],
          heartbeat: float = 1.0) -> list[Load]:
    """For 1,000 and 10,000 workers at 1 s and 10 s calls. A worker heartbeats when it
    sent nothing for ``heartbeat`` s, so a call longer than that adds call/heartbeat -
    answers per call. Half of the broker's messages go to the machine (the answers and
    heartbeats in; the leases out are its own): its thread costs handle + shell each."""
    out = []
    for workers in (1_000, 10_000):
        for call in (1.0, 10.0):
            rate = workers / call
            units = []
            scheduler_us = _nearest(scheduler, workers)["us_per_msg"]
            b = _nearest(branch, workers)
            if sync is not None:
                per = (sync.per_lease + sync.commits_per_worker_round
                       + sync.per_round_at(workers) / workers) / sync.tasks_per_lease
                units.append(("rollout, sync", per, 1 / sync.tasks_per_lease, 0.0,
                              scheduler_us, "Scheduler"))
            if asyn is not None:
                # Merges follow one another, each waiting for at least one scoring call.
                per = asyn.per_lease / asyn.tasks_per_lease
                units.append(("rollout, async", per, 1 / asyn.tasks_per_lease,
                              asyn.per_round_at(workers) / call, scheduler_us, "Scheduler"))
            if b["per_item"] is not None:
                units.append(("branch", b["per_item"], b["leases_per_item"], 0.0,
                              b["us_per_msg"], "Collector"))
            for unit, per, answers, extra, machine_us, name in units:
                beats = max(0.0, call / heartbeat - answers)
                # A remote branch crosses the broker twice each way (Collector -> proxy ->
                # worker, worker -> relay -> Collector; a connection's heartbeat becomes
                # one per slot to the Collector): the Collector sees half of those.
                hops = RELAY_HOPS if unit == "branch" else 1
                seen = rate * (per + beats) + extra  # what the machine sends and receives
                msgs = seen * hops
                out.append(Load(workers, call, unit, rate, per * hops, beats * hops, msgs,
                                msgs * broker_us / 1e6,
                                seen / 2 * (machine_us + shell_us) / 1e6, name))
    return out


# -- the command ---------------------------------------------------------------------------------


def _pct(values: list[float]) -> str:
    v = sorted(values)
    mid = v[len(v) // 2]
    return f"{mid:.1f} ({v[0]:.1f}-{v[-1]:.1f})" if len(v) > 1 else f"{mid:.1f}"


def print_loads(figures: dict, sync: Model | None, asyn: Model | None) -> None:
    """Part 4 from the figures of parts 1-3 (also ``--from-json``: the arithmetic again
    on figures measured before)."""
    runs, sched, coll = figures["broker"], figures["scheduler"], figures["collector"]
    branch = {c["workers"]: c for c in coll}
    # The production remote path: CURVE on, the most peers measured.
    prod = [f for figs in runs for f in figs if f["curve"]] or [f for figs in runs for f in figs]
    most = max(f["peers"] for f in prod)
    at = [f for f in prod if f["peers"] == most]
    b_us = sorted(f["broker_us"] for f in at)[len(at) // 2]
    shell_us = 2 * sorted(f["actor_us"] for f in at)[len(at) // 2]
    by_workers = {x["workers"]: x for x in sched}
    figures["inputs"] = {"broker_us": b_us, "shell_us": shell_us, "peers": most}
    rows = [(f"{x.workers:,}", f"{x.call:g} s", x.unit, f"{x.calls_per_s:,.0f}",
             f"{x.msgs_per_call:.2f} + {x.heartbeats_per_call:.2f}", f"{x.msgs_per_s:,.0f}",
             f"{x.broker:.2f}", f"{x.machine_name} {x.machine:.2f}", f"{x.gil:.2f}",
             f"{x.workers / x.gil:,.0f}")
            for x in loads(sync, asyn, branch, b_us, shell_us, by_workers)]
    figures["loads"] = rows
    print(f"4. share of one core asked (> 1.00: saturated); broker thread {b_us:.1f} us/msg "
          f"({most} peers, CURVE {'on' if prod[0]['curve'] else 'off'}), actor shell "
          f"{shell_us:.1f} us per message in, the machines' handle as in part 3 at the "
          "nearest worker count measured; heartbeat 1 s")
    print(table(rows, ("workers", "call", "unit", "calls/s", "msgs per call + heartbeats",
                       "msgs/s", "broker thread", "machine thread",
                       "both (one interpreter lock)", "workers at 1.00 (both)")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.saturation",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--seconds", type=float, default=4.0, help="timed window per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gen-procs", type=int, default=2, help="processes hosting the peers")
    ap.add_argument("--machine-workers", type=int, nargs="+", default=[1_000, 10_000])
    ap.add_argument("--items-per-worker", type=int, default=10,
                    help="the Collector's group: this many items per worker")
    ap.add_argument("--full-group", type=int, default=1_000,
                    help="run whole groups up to this many workers (past it: capped)")
    ap.add_argument("--max-answers", type=int, default=3_000,
                    help="answers handled in a capped Collector run")
    ap.add_argument("--skip-runs", action="store_true", help="no scenario runs (part 1)")
    ap.add_argument("--no-curve", action="store_true", help="CURVE off only")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny smoke run: 8 peers, 0.5 s, 1 repeat, 100 workers")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--from-json", help="measure nothing: part 4 again from a --json file")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            figures = json.load(f)
        models = figures.get("models", {})
        print_loads(figures, Model(**models["sync"]) if "sync" in models else None,
                    Model(**models["async"]) if "async" in models else None)
        return 0
    if args.quick:
        args.peers, args.seconds, args.repeats = [8], 0.5, 1
        args.machine_workers = [100]
    logging.basicConfig(level=logging.WARNING)
    figures: dict = {}

    counts: dict[str, Counts] = {}
    if not args.skip_runs:
        tmp = tempfile.mkdtemp(prefix="evobus-saturation-runs-")
        try:
            logs = record_runs(tmp)
            counts = {label: count_log(path, label) for label, path in logs.items()}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        figures["logs"] = {k: vars(v) for k, v in counts.items()}
        rows = []
        for label, c in counts.items():
            unit = c.rollouts or c.branches
            rows.append((label, c.records, c.rollouts or "-", c.rollout_leases or "-",
                         c.branches or "-", c.rounds or "-", f"{c.per(unit):.2f}",
                         ", ".join(f"{k} {v}" for k, v in list(c.by_type.items())[:8])))
        print("1. messages in real runs' logs (every record crossed the broker once)")
        print(table(rows, ("run", "records", "rollouts", "rollout leases", "branches",
                           "rounds", "records per rollout or branch", "most common")))
        print()

    print("2. broker CPU per delivered message (closed loop, one LeaseDone in flight a peer; "
          f"{args.seconds:g} s windows, {args.repeats} repeat(s))")
    runs = []
    for curve in ((False,) if args.no_curve else (False, True)):
        for n in args.peers:
            figs = [broker_cpu(n, curve, args.seconds, args.gen_procs)
                    for _ in range(args.repeats)]
            runs.append(figs)
            print(f"  peers={n} curve={curve}: " + "; ".join(
                f"{f['rate']:,.0f} msg/s broker {f['broker_us']:.1f} us actor "
                f"{f['actor_us']:.1f} us process {f['process_us']:.1f} us"
                for f in figs), file=sys.stderr, flush=True)
    figures["broker"] = runs
    rows = []
    for figs in runs:
        f0 = figs[0]
        rows.append((f0["peers"], "on" if f0["curve"] else "off",
                     _pct([f["rate"] for f in figs]), _pct([f["broker_us"] for f in figs]),
                     _pct([f["actor_us"] for f in figs]), _pct([f["other_us"] for f in figs]),
                     _pct([f["process_us"] for f in figs]),
                     _pct([f["broker_busy"] for f in figs])))
    print(table(rows, ("peers", "CURVE", "msg/s", "broker thread us/msg",
                       "actor shell us/msg", "zmq I/O + rest us/msg", "process us/msg",
                       "broker thread busy")))
    print()

    print("3. control machines (pure handle, thread CPU); a group of "
          f"{args.items_per_worker} items per worker; above {args.full_group:,} workers the "
          f"Collector's CPU is over its first {args.max_answers:,} answers")
    mrows = []
    sched, coll = [], []
    for w in args.machine_workers:
        s = scheduler_cpu(w, rounds=3)
        cap = 0 if w <= args.full_group else args.max_answers
        c = collector_cpu(w, args.items_per_worker * w, max_answers=cap)
        sched.append(s)
        coll.append(c)
        dash = "-"
        mrows.append((f"{w:,}", f"{s['us_per_msg']:.1f}", f"{s['us_per_lease']:.1f}",
                      f"{c['items']:,}", f"{c['answers']:,}",
                      dash if c["per_item"] is None else f"{c['leases_per_item']:.3f}",
                      dash if c["per_item"] is None else f"{c['per_item']:.3f}",
                      f"{c['us_per_msg']:.1f}"))
    # Guided lease sizes depend on queued / (chunk_factor x workers) only: a capped run
    # takes its messages per item from the largest full run (same items per worker).
    full = [c for c in coll if c["per_item"] is not None]
    for c in coll:
        if c["per_item"] is None and full:
            c["per_item"], c["leases_per_item"] = full[-1]["per_item"], full[-1]["leases_per_item"]
            c["per_item_from"] = full[-1]["workers"]
    figures["scheduler"], figures["collector"] = sched, coll
    print(table(mrows, ("workers", "Scheduler us/msg", "Scheduler us/lease", "group items",
                        "answers handled", "branch leases per item", "messages per item",
                        "Collector us/msg")))
    print()

    sync = asyn = None
    if counts:
        sync = model(counts["sync, 2 process workers"],
                     len(counts["sync, 2 process workers"].workers))
        asyn = model(counts["async, 2 process workers"],
                     len(counts["async, 2 process workers"].workers))
        figures["models"] = {"sync": vars(sync), "async": vars(asyn)}
        print("messages at scale, from the logs: " + "; ".join(
            f"{k}: {m.per_lease:.2f} per lease of {m.tasks_per_lease:.2f} task(s), "
            f"{m.commits_per_worker_round:.2f} commits per worker per round, "
            f"{m.evals_per_round:.2f} evals of {m.heldout} held-out tasks and "
            f"{m.fixed_per_round:.1f} other messages per {'round' if k == 'sync' else 'merge'}"
            for k, m in (("sync", sync), ("async", asyn))))
    print_loads(figures, sync, asyn)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1, default=str)
    return 0


def suite(quick: bool) -> list[Row]:
    """Rows for ``python -m bench``: broker CPU per message, CURVE off and on."""
    rows = []
    # --quick: one row (the suite's smoke run is timed as a whole), CURVE on as remote
    # workers run.
    for curve in ((True,) if quick else (False, True)):
        for n in ((16,) if quick else (64, 1024)):
            try:
                figs = [broker_cpu(n, curve, 0.5 if quick else 4.0,
                                   warmup=0.3 if quick else 1.0)
                        for _ in range(1 if quick else 3)]
                rows.append(Row(f"saturation: broker, {n} peers, CURVE {'on' if curve else 'off'}",
                                "broker us/msg (CPU)", [f["broker_us"] for f in figs],
                                higher_is_better=False,
                                note=f"{figs[0]['rate']:,.0f} msg/s closed loop"))
            except Exception as exc:  # reported in the table, not raised: the suite goes on
                rows.append(Row(f"saturation: broker, {n} peers", "broker us/msg",
                                note=f"failed: {type(exc).__name__}: {exc}"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
