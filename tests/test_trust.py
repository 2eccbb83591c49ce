"""A peer can only say what its role allows (issue 16): identities stamped on frames and
in the log, a worker's role at the port, answers only from a lease's holder, lease ids a
peer cannot guess, undelivered messages logged.

Loopback only, real sockets; every wait is bounded and waits on an event or a count.
"""

from __future__ import annotations

import glob
import time
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bus_conformance import Inbox

from actors.machines.ids import tagged
from actors.machines.registry import Registry
from actors.machines.scheduler import Scheduler
from actors.replay.engine import _Replay
from actors.runtime.pools import WORKER_ROLE
from actors.runtime.shell import ControlActor
from bus.frames import envelope
from bus.log import (FORMAT_VERSION, UNDELIVERED, LogHeader, LogWriter, Record, read_log)
from bus.remote import PeerPort, RemoteEndpoint
from bus.security import create_keys, load_client_keys, load_server_keys, secure_client
from bus.zmq_bus import ZmqBus
from protocol import (Commit, Heartbeat, Hello, Join, Lease, LeaseBatch, LeaseDone, Message,
                      Ref, RolloutResult, Shutdown, Spec, Start, Stop, Tick, encode)

ROOT = Path(__file__).resolve().parent
WAIT_S = 10.0


def wait_for(predicate, what: str, timeout: float = WAIT_S):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _writer(path: Path) -> LogWriter:
    return LogWriter(path, LogHeader(format_version=FORMAT_VERSION, run_id="t"), fsync="never")


class Raw:
    """A raw DEALER on the broker's tcp socket: a peer that writes whatever it likes."""

    def __init__(self, address: str, identity: bytes = b"mallory-sock", keys=None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        if keys is not None:  # an authorised CURVE key: authenticated, still only a worker
            secure_client(self.sock, keys)
        self.sock.connect(address)

    def register(self, name: bytes, token: bytes | None = None) -> list[bytes]:
        """The broker's answer to registering ``name`` ([a, name, token] or [e, name,
        why]), past any delivery that was on its way to this peer first."""
        self.sock.send_multipart([b"A", name] + ([token] if token else []))
        for _ in range(100):
            assert self.sock.poll(int(WAIT_S * 1000)), "no answer to a registration"
            frames = self.sock.recv_multipart()
            if frames[0] in (b"a", b"e") and frames[1] == name:
                return frames
        raise AssertionError(f"no answer to registering {name!r} among 100 frames")

    def send(self, sender: str, receiver: str, msg) -> None:
        self.sock.send(envelope(sender.encode(), receiver.encode(), encode(msg)))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.destroy(0)


# -- 1. identities on frames and in the log ------------------------------------------------


def test_a_peers_frames_carry_its_identity_in_the_delivery_and_the_log(tmp_path):
    port = PeerPort(["tcp://127.0.0.1:0"], receivers=["scheduler"])
    writer = _writer(tmp_path / "run.evolog")
    bus = ZmqBus(writer, peers=(port,))
    inbox = Inbox()
    bus.attach("scheduler", inbox)
    raw = Raw(port.addresses[0], b"rw-peer-1")
    try:
        assert raw.register(b"w")[:2] == [b"a", b"w"]
        raw.send("w", "scheduler", Heartbeat(worker="w"))
        bus.send("driver", "scheduler", Tick(elapsed=1.0))
        got = inbox.wait(2)
        by_type = {type(d.msg): d for d in got}
        assert by_type[Heartbeat].peer == "remote:rw-peer-1"
        assert by_type[Tick].peer == ""
    finally:
        raw.close()
        bus.close()
    records = read_log(tmp_path / "run.evolog").records
    assert {r.sender: r.peer for r in records} == {"w": "remote:rw-peer-1", "driver": ""}


def test_with_curve_a_peer_is_stamped_with_its_public_key(tmp_path):
    create_keys(tmp_path / "keys", ["alice"])
    port = PeerPort(["tcp://127.0.0.1:0"], keys=load_server_keys(tmp_path / "keys"),
                    receivers=["scheduler"])
    bus = ZmqBus(peers=(port,))
    inbox = Inbox()
    bus.attach("scheduler", inbox)
    keys = load_client_keys(tmp_path / "keys" / "alice.key_secret",
                            tmp_path / "keys" / "server.key")
    ep = RemoteEndpoint(port.addresses[0], keys=keys)
    try:
        ep.attach("w", Inbox())
        ep.send("w", "scheduler", Heartbeat(worker="w"))
        (d,) = inbox.wait(1)
        assert d.peer.startswith("remote:rw-") and d.peer.endswith(f" key={keys.public.decode()}")
        # Where it connects from, as a wait for workers says it: the address, the key's name.
        assert port.origin("w") == "127.0.0.1 with key alice"
        assert port.origin("someone-else") is None
    finally:
        ep.close()
        bus.close()


@pytest.mark.parametrize("insecure,where", [(False, "this machine"), (True, "127.0.0.1")])
def test_a_port_says_where_a_peer_connects_from_as_far_as_it_knows(insecure, where):
    """Without keys a loopback port knows only that a peer is on this machine (it reads
    bytes alone); one that may hear other machines (--insecure) reads the address."""
    port = PeerPort(["tcp://127.0.0.1:0"], insecure=insecure, receivers=["scheduler"])
    bus = ZmqBus(peers=(port,))
    inbox = Inbox()
    bus.attach("scheduler", inbox)
    ep = RemoteEndpoint(port.addresses[0])
    try:
        ep.attach("w", Inbox())
        ep.send("w", "scheduler", Heartbeat(worker="w"))
        inbox.wait(1)
        assert (port.origin("w"), port.origin("v")) == (where, None)
    finally:
        ep.close()
        bus.close()


def test_a_record_without_peer_or_status_is_written_as_the_old_five_element_array(tmp_path):
    path = tmp_path / "run.evolog"
    with _writer(path) as w:
        w.append(1, 0.5, "a", "b", b"x")
        w.append(2, 0.5, "a", "b", b"x", peer="remote:rw-1")
        w.append(3, 0.5, "a", "b", b"x", status=UNDELIVERED)
    data = path.read_bytes()
    old = msgspec.msgpack.encode([1, 0.5, "a", "b", b"x"])
    assert old in data  # byte for byte what the code before peer/status wrote
    assert read_log(path).records == [Record(1, 0.5, "a", "b", b"x"),
                                      Record(2, 0.5, "a", "b", b"x", "remote:rw-1"),
                                      Record(3, 0.5, "a", "b", b"x", "", UNDELIVERED)]


def test_recorded_logs_read_with_no_peer_and_every_message_delivered():
    logs = sorted(glob.glob(str(ROOT / "logs" / "*.evolog")))
    assert len(logs) >= 5
    for path in logs:
        records = read_log(path).records
        assert records and all(r.peer == "" and r.status == 0 for r in records), path


# -- 2. a worker's role: at the port, and at the Scheduler -------------------------------------


class Coordinator:
    """A broker with a worker port (the role of pools.WORKER_ROLE), a real Scheduler and
    registry in shells, and inboxes standing in for the planner, merger and driver."""

    def __init__(self, log_path: Path, keys=None) -> None:
        self.port = PeerPort(["tcp://127.0.0.1:0"], allowed=WORKER_ROLE, keys=keys)
        self.bus = ZmqBus(_writer(log_path), peers=(self.port,))
        self.scheduler = Scheduler(2)
        self.crashes: list = []
        self.refs = [ControlActor.spawn(self.bus, "scheduler", self.scheduler,
                                        lambda n, e: self.crashes.append(e)),
                     ControlActor.spawn(self.bus, "registry",
                                        Registry(Spec(reward=Ref(ref="m:r"),
                                                      strategy=Ref(ref="m:s"))),
                                        lambda n, e: self.crashes.append(e))]
        self.planner, self.merger, self.driver = Inbox(), Inbox(), Inbox()
        for name, box in (("planner", self.planner), ("merger", self.merger),
                          ("driver", self.driver)):
            self.bus.attach(name, box)

    @property
    def address(self) -> str:
        return self.port.addresses[0]

    def close(self) -> None:
        for ref in self.refs:
            ref.stop()
        self.bus.close()
        assert not self.crashes


class Worker:
    """An honest worker: joins through the registry, answers the leases it is given."""

    def __init__(self, address: str, name: str, keys=None) -> None:
        self.name = name
        self.inbox = Inbox()
        self.ep = RemoteEndpoint(address, keys=keys)
        self.ep.attach(name, self.inbox)
        self.ep.send(name, "registry", Hello(worker=name, slots=1, heartbeat=0.5))

    def leases(self) -> list[Lease]:
        return [d.msg for d in self.inbox.items if isinstance(d.msg, Lease)]

    def answer(self, lease: Lease, score: float) -> None:
        self.ep.send(self.name, "scheduler", LeaseDone(
            lease_id=lease.lease_id, worker=self.name, round=lease.round, unit=lease.unit,
            results=[RolloutResult(task_id=t, score=score, calls=1) for t in lease.task_ids]))


def _done(lease_id: str, worker: str, score: float = 1.0) -> LeaseDone:
    return LeaseDone(lease_id=lease_id, worker=worker, round=0,
                     results=[RolloutResult(task_id="t0", score=score, calls=1)])


def _curve(tmp_path: Path, curve: bool):
    """(server keys, honest worker's keys, the intruder's keys): with CURVE the intruder
    holds an authorised key of its own."""
    if not curve:
        return None, None, None
    create_keys(tmp_path / "keys", ["honest", "mallory"])
    client = [load_client_keys(tmp_path / "keys" / f"{n}.key_secret",
                               tmp_path / "keys" / "server.key") for n in ("honest", "mallory")]
    return load_server_keys(tmp_path / "keys"), *client


@pytest.mark.parametrize("curve", [False, True], ids=["loopback", "curve"])
def test_forged_answers_and_control_messages_from_a_peer_never_reach_a_control_machine(
        tmp_path, curve):
    server, honest_keys, mallory_keys = _curve(tmp_path, curve)
    c = Coordinator(tmp_path / "run.evolog", keys=server)
    honest = Worker(c.address, "w0", keys=honest_keys)
    raw = Raw(c.address, keys=mallory_keys)
    mallory = "remote:mallory-sock" + (f" key={mallory_keys.public.decode()}" if curve else "")
    try:
        wait_for(lambda: "w0" in c.scheduler.workers, "the honest worker's hello")
        c.bus.send("planner", "scheduler", LeaseBatch(round=0, leases=[
            Lease(lease_id="r0.u0", round=0, task_ids=["t0"]),
            Lease(lease_id="r0.u1", round=0, unit=1, task_ids=["t1"])]))
        (lease,) = wait_for(honest.leases, "the first lease at the honest worker")
        assert lease.lease_id == "r0.u0"  # one slot: r0.u1 waits, never dispatched
        assert raw.register(b"mallory")[:2] == [b"a", b"mallory"]
        # Refused at the port (a worker's role): never delivered, never logged.
        port_refused = [
            ("mallory", "scheduler", Shutdown(reason="bye")),
            ("mallory", "scheduler", Tick(elapsed=1e9)),
            ("mallory", "scheduler", Hello(worker="mallory", slots=8)),  # skips the registry
            ("mallory", "w0", Stop(reason="go away")),                    # another actor's
            ("mallory", "planner", Start(run_id="x", seed=0, task_ids=[], n_workers=1,
                                         rounds=1, held_out_frac=0.0, max_concurrency=1)),
            ("mallory", "scheduler", _done("r0.u0", "w0")),             # as another worker
            ("w0", "scheduler", _done("r0.u0", "w0")),                  # as a name not its own
        ]
        for sender, receiver, msg in port_refused:
            raw.send(sender, receiver, msg)
        wait_for(lambda: c.bus.stats.rejected_frames == len(port_refused), "port refusals")
        # Delivered and logged, refused by the Scheduler's admit: not the holder.
        raw.send("mallory", "scheduler", _done("r0.u0", "mallory"))  # held by w0
        raw.send("mallory", "scheduler", _done("r0.u1", "mallory"))  # never dispatched
        wait_for(lambda: c.bus.stats.refused == 2, "the Scheduler's refusals")
        assert "r0.u0" in c.scheduler.leases and "r0.u1" in c.scheduler.leases
        assert c.planner.items == [] and c.merger.items == []
        assert c.scheduler.workers.keys() == {"w0"} and not c.scheduler.shut
        honest.answer(lease, 0.25)
        second = wait_for(lambda: honest.leases()[1:], "the second lease at the honest worker")
        honest.answer(second[0], 0.5)
        wait_for(lambda: c.planner.items, "the round settled")
        assert [s.scores for s in c.planner.items[0].msg.settled] == [[("t0", 0.25)],
                                                                      [("t1", 0.5)]]
        by_peer = c.bus.stats.rejections.by_peer()
        assert by_peer == {mallory: len(port_refused)}
        assert c.bus.stats.refusals.by_peer() == {mallory: 2}
    finally:
        raw.close()
        honest.ep.close()
        c.close()
    # The log holds the two forged answers, stamped; replay refuses them again and the
    # Scheduler sends exactly what it sent in the run.
    records = read_log(tmp_path / "run.evolog").records
    forged = [r for r in records if r.sender == "mallory"]
    assert len(forged) == 2 and {r.peer for r in forged} == {mallory}
    engine = _Replay({"scheduler": Scheduler(2)}, strict=False)
    engine.segment(tmp_path / "run.evolog", records)
    assert engine.divergences == []
    report = engine.tracks["scheduler"].report
    assert report.refused == 2 and report.matched > 0
    from actors.replay.report import ReplayReport

    text = ReplayReport(path=tmp_path, segments=[], records=len(records),
                        actors={"scheduler": report}).format()
    assert "(2 refused)" in text  # what `evobus replay` prints


def test_a_peer_cannot_take_a_registered_workers_name_without_its_token(tmp_path):
    c = Coordinator(tmp_path / "run.evolog")
    honest = Worker(c.address, "w0")
    raw = Raw(c.address)
    try:
        wait_for(lambda: "w0" in c.scheduler.workers, "the honest worker's hello")
        answer = raw.register(b"w0")
        assert answer[0] == b"e" and b"another connection holds" in answer[2]
        assert c.port.routes[b"w0"] != b"mallory-sock"
        # The worker itself, reconnecting on a new socket with its token, moves the name.
        again = Raw(c.address, b"rw-again")
        try:
            assert again.register(b"w0", honest.ep.tokens["w0"])[:2] == [b"a", b"w0"]
            assert c.port.routes[b"w0"] == b"rw-again"
        finally:
            again.close()
    finally:
        raw.close()
        honest.ep.close()
        c.close()


def test_rejections_are_logged_once_per_peer_and_reason_with_a_running_count(caplog):
    port = PeerPort(["tcp://127.0.0.1:0"], allowed=WORKER_ROLE)
    bus = ZmqBus(peers=(port,))
    raw = Raw(port.addresses[0])
    try:
        raw.register(b"mallory")
        with caplog.at_level("WARNING", logger="bus.base"):
            for i in range(250):
                raw.send("mallory", "scheduler", Tick(elapsed=float(i)))
            wait_for(lambda: bus.stats.rejected_frames == 250, "250 refusals")
        lines = [r.getMessage() for r in caplog.records if "mallory" in r.getMessage()]
        assert len(lines) == 3  # at 1, 10 and 100
        assert "(100 so far from this peer for this reason" in lines[-1]
    finally:
        raw.close()
        bus.close()


# -- 3. lease ids a peer cannot guess ------------------------------------------------------------


def test_lease_ids_are_keyed_by_the_runs_secret_and_readable_without_one():
    assert tagged("", "r0.u1") == "r0.u1"  # logs recorded before keys replay unchanged
    keyed = tagged("k" * 32, "r0.u1")
    assert keyed.startswith("r0.u1.") and len(keyed) == len("r0.u1.") + 16
    assert tagged("k" * 32, "r0.u1") == keyed != tagged("j" * 32, "r0.u1")


# -- the forged and replayed LeaseDone, end to end: `evobus run` with `evobus worker`s ------------


@pytest.fixture
def topology(tmp_path):
    from test_remote import Topology

    made = []

    def make(*args, **kwargs):
        made.append(Topology(tmp_path, *args, **kwargs))
        return made[-1]

    yield make
    for t in made:
        t.close()


@pytest.fixture(scope="module")
def reference_state():
    from test_remote import on_threads, scenario_text

    return on_threads(scenario_text("local = 2"))


def _forgeries() -> list[tuple[str, str, object]]:
    """What a hostile peer registered as ``mallory`` tries: answers for guessed lease and
    eval ids (the readable scheme), control messages, a hello that skips the registry."""
    guessed = [LeaseDone(lease_id=i, worker="mallory", round=0,
                         results=[RolloutResult(task_id="billing-0", score=1.0, calls=1)])
               for i in ("r0.u0", "r0.u1", "r1.u0", "e1.0", "e1.1", "e2.0")]
    control = [Shutdown(reason="bye"), Tick(elapsed=1e9), Hello(worker="mallory", slots=4),
               Join(worker="w0"), Heartbeat(worker="w1")]
    return ([("mallory", "scheduler", m) for m in guessed]
            + [("mallory", "scheduler", m) for m in control]
            + [("mallory", "registry", Hello(worker="mallory", fingerprint="guess"))])


def test_forged_and_replayed_lease_dones_from_a_raw_dealer_change_neither_the_run_nor_its_replay(
        topology, reference_state):
    from actors.cli.main import main

    t = topology(2, gate=True)
    t.first_started()  # a worker is mid-lease: the run is under way
    raw = Raw(t.addr)
    try:
        assert raw.register(b"mallory")[:2] == [b"a", b"mallory"]
        for sender, receiver, msg in _forgeries():
            raw.send(sender, receiver, msg)
        # Frames captured from an earlier run's log, sent again as they were recorded
        # (as their worker's name, which this peer does not hold) and as its own.
        captured = [r for r in read_log(ROOT / "logs" / "redispatched_lease.evolog").records
                    if r.receiver == "scheduler" and r.sender.startswith("proc-")]
        for rec in captured:
            raw.sock.send(envelope(rec.sender.encode(), b"scheduler", rec.body))
            raw.sock.send(envelope(b"mallory", b"scheduler", rec.body))
        assert raw.register(b"w0")[0] == b"e"  # a live worker's name: not without its token
    finally:
        raw.close()
    t.release()
    out = t.result()
    assert out["state"] == reference_state
    assert out["error"] is None and out["bus"]["redispatched"] == 0
    assert out["bus"]["rejected_frames"] + out["bus"]["refused"] >= len(captured) * 2 + 12
    assert main(["replay", str(t.log)]) == 0


# -- a fuzz of well-formed messages of every type from a peer, during a run ------------------------

_ANY = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=2), max_leaves=3)


def _strategy(tp):
    """Well-formed values of a message field's type (every message type, nested structs)."""
    if tp is Any:
        return _ANY
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp)
        return st.builds(tp, **{f.name: _strategy(hints[f.name])
                                for f in msgspec.structs.fields(tp)})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([_strategy(a) for a in args])
    if origin is list:
        return st.lists(_strategy(args[0]), max_size=2)
    if origin is dict:
        return st.dictionaries(_strategy(args[0]), _strategy(args[1]), max_size=2)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_strategy(args[0]), max_size=2).map(tuple)
        return st.tuples(*[_strategy(a) for a in args])
    simple = {type(None): st.none(), str: st.text(max_size=8), int: st.integers(-3, 10**6),
              float: st.floats(allow_nan=False, width=32), bool: st.booleans(),
              bytes: st.binary(max_size=8),
              dict: st.dictionaries(st.text(max_size=3), st.integers(-3, 10**6), max_size=2)}
    return simple[tp]


def _as_mallory(msg):
    """Half the messages speak for the peer itself (past the port's worker= check, so
    the Scheduler and the registry see them); the rest keep their random worker."""
    if "worker" in msgspec.structs.asdict(msg):
        return msgspec.structs.replace(msg, worker="mallory")
    return msg


MESSAGES = st.one_of([_strategy(t) for t in typing.get_args(Message)])
FORGERY = st.tuples(st.sampled_from(["mallory", "mallory", "w0", "scheduler"]),
                    st.sampled_from(["scheduler", "registry", "planner", "merger", "driver",
                                     "w0", "w1"]),
                    st.one_of(MESSAGES, MESSAGES.map(_as_mallory)))


@pytest.mark.slow
@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(st.lists(FORGERY, min_size=30, max_size=80))
def test_random_well_formed_messages_from_a_peer_leave_the_runs_outcome_unchanged(
        tmp_path_factory, reference_state, forgeries):
    from test_remote import Topology

    t = Topology(tmp_path_factory.mktemp("fuzz"), 2, gate=True)
    try:
        t.first_started()
        raw = Raw(t.addr)
        try:
            raw.register(b"mallory")
            for sender, receiver, msg in forgeries:
                raw.send(sender, receiver, msg)
        finally:
            raw.close()
        t.release()
        out = t.result()
        assert out["state"] == reference_state, forgeries
        assert out["error"] is None
    finally:
        t.close()


# -- 4. what the broker could not deliver is in the log ------------------------------------------


def test_a_message_to_a_peer_that_left_is_logged_as_undelivered_and_counted(tmp_path):
    port = PeerPort(["tcp://127.0.0.1:0"], receivers=["scheduler"])
    bus = ZmqBus(_writer(tmp_path / "run.evolog"), peers=(port,))
    raw = Raw(port.addresses[0], b"rw-gone")
    try:
        raw.register(b"w")
        raw.close()  # gone without a word: its route stays until it registers again
        wait_for(lambda: bus.broker._routes is not None, "the broker")
        deadline = time.monotonic() + WAIT_S
        while bus.stats.undelivered == 0 and time.monotonic() < deadline:
            bus.send("scheduler", "w", Stop(reason="run finished"))
            wait_for(lambda: bus.stats.undelivered + bus.stats.delivered > 0, "a hand-over")
    finally:
        bus.close()
    records = read_log(tmp_path / "run.evolog").records
    assert records and records[-1].status == UNDELIVERED and records[-1].receiver == "w"
    assert bus.stats.undelivered == sum(r.status == UNDELIVERED for r in records)


def test_a_run_whose_worker_lost_messages_while_gone_replays_without_diverging(tmp_path):
    """A worker's connection drops (a stop past its deadline, a network cut) and it comes
    back on a new socket: what the Scheduler sent it meanwhile could not be delivered.
    Those messages are in the log as undelivered, so replay matches every output, also
    the ones the worker got after it came back."""
    c = Coordinator(tmp_path / "run.evolog")
    first = Raw(c.address, b"rw-first")
    try:
        token = first.register(b"w0")[2]
        first.send("w0", "registry", Hello(worker="w0", slots=1, heartbeat=0.5))
        wait_for(lambda: "w0" in c.scheduler.workers and c.driver.items, "the worker's hello")
        first.close()  # gone; its route stays until it registers again
        stats = c.bus.stats
        base = stats.delivered + stats.undelivered
        version = 0
        deadline = time.monotonic() + WAIT_S
        while stats.undelivered == 0 and time.monotonic() < deadline:
            version += 1
            c.bus.send("merger", "scheduler", Commit(version=version, state={"k": "v"}))
            wait_for(lambda: stats.delivered + stats.undelivered >= base + 2 * version,
                     "the commit and its copy to the worker")
        assert c.bus.stats.undelivered == 1
        back = Raw(c.address, b"rw-back")
        try:
            assert back.register(b"w0", token)[:2] == [b"a", b"w0"]
            c.bus.send("merger", "scheduler", Commit(version=version + 1, state={"k": "w"}))
            assert back.sock.poll(int(WAIT_S * 1000)), "the worker back gets the next commit"
        finally:
            back.close()
    finally:
        c.close()
    records = read_log(tmp_path / "run.evolog").records
    assert [r.status for r in records if r.receiver == "w0"][-2:] == [UNDELIVERED, 0]
    engine = _Replay({"scheduler": Scheduler(2)}, strict=True)
    engine.segment(tmp_path / "run.evolog", records)
    assert engine.divergences == [] and engine.unrecorded == []


# -- 5. a pool of process workers that loses every worker ---------------------------------------


@pytest.mark.slow
def test_every_process_worker_killed_mid_lease_is_respawned_and_the_run_completes(
        tmp_path, monkeypatch, reference_state):
    import os
    import signal
    import threading

    from actors.runtime.launch import run_scenario
    from protocol.scenario import parse_scenario
    from test_remote import scenario_text

    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("EVOBUS_TEST_GATE", str(gate))
    killed: list[int] = []

    def kill_both() -> None:
        started = wait_for(lambda: sorted(gate.glob("started-*"))[1:] and
                           sorted(gate.glob("started-*")), "both workers mid-lease", 60)
        for path in started:
            pid = int(path.name.split("-", 1)[1])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        (gate / "release").touch()

    killer = threading.Thread(target=kill_both, daemon=True)
    killer.start()
    result = run_scenario(parse_scenario(scenario_text("local = 0\nprocesses = 2")))
    killer.join(5)
    assert len(killed) == 2
    assert result.state == reference_state and result.error is None
    assert result.bus["respawned"] == 2 and result.bus["lost_workers"] == 2


@pytest.mark.slow
def test_process_workers_that_always_die_stop_the_run_with_a_resumable_log(
        tmp_path, monkeypatch, capsys):
    from actors.cli.main import main
    from actors.replay.resume import ResumePoint, resume_scenario_log
    from test_remote import on_threads, scenario_text

    # The default round is a task per worker: the reference has this run's one worker.
    reference_state = on_threads(scenario_text("local = 0\nprocesses = 1"))

    log = tmp_path / "dying.evolog"
    path = tmp_path / "dying.toml"  # `evobus run FILE` records the scenario: resumable
    path.write_text(f'log = "{log}"\n' + scenario_text("local = 0\nprocesses = 1"))
    monkeypatch.setenv("EVOBUS_TEST_DIE", "1")
    assert main(["run", str(path)]) != 0
    message = capsys.readouterr().err
    assert "every process worker died" in message and "2 respawn(s)" in message
    assert "proc-0 (exit 3), proc-0-r1 (exit 3), proc-0-r2 (exit 3)" in message
    assert f"evobus resume {log}" in message
    monkeypatch.delenv("EVOBUS_TEST_DIE")
    result = resume_scenario_log(ResumePoint(log))
    assert result.state == reference_state


# -- 6. one loopback rule for every transport; damaged files named ---------------------------------


@pytest.mark.parametrize("addr,local", [
    ("inproc://x", True), ("ipc:///tmp/x.sock", True), ("tcp://127.0.0.1:5555", True),
    ("tcp://127.3.4.5:1", True), ("tcp://localhost:1", True), ("tcp://[::1]:1", True),
    ("tcp://0.0.0.0:1", False), ("tcp://*:1", False), ("tcp://192.168.1.2:1", False),
    ("tcp://127.0.0.1.example.com:1", False), ("tcp://eth0:1", False),
    ("tipc://{5560,0,0}", False), ("udp://127.0.0.1:5555", False),
    ("pgm://eth0;239.192.1.1:5555", False), ("epgm://eth0;239.192.1.1:5555", False),
    ("ws://127.0.0.1:1", False), ("vmci://1:1", False)])
def test_one_loopback_rule_serves_every_transport_and_both_doors(addr, local):
    from bus.security import loopback_only

    assert loopback_only(addr) is local
    if local or addr.startswith("tcp://"):
        return
    # Neither the broker's own binds nor a worker port passes a non-loopback transport.
    with pytest.raises(ValueError, match="without CURVE keys"):
        ZmqBus(binds=[addr])
    with pytest.raises(ValueError, match="without CURVE keys"):
        PeerPort([addr])


def test_a_flipped_header_length_byte_names_the_intact_records_behind_it(tmp_path):
    from bus.log import LogCorrupt

    path = tmp_path / "run.evolog"
    with _writer(path) as w:
        for i in range(150):
            w.append(i + 1, 0.0, "a", "b", b"body")
    data = bytearray(path.read_bytes())
    data[7] ^= 0x01  # the header frame's length, low byte
    path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match=r"about 150 intact record\(s\) follow: the header "
                                         r"is damaged, not torn"):
        read_log(path)


def _paused_checkpoint(tmp_path: Path) -> Path:
    from actors.groups import run_group
    from trust_groups import ask_odd

    path = tmp_path / "g.ckpt"
    outcome = run_group(ask_odd, list(range(4)), max_concurrency=2, max_items=4,
                        checkpoint=path)
    assert outcome.status == "user_input_pending"
    return path


@pytest.mark.parametrize("where,says", [
    (0, "starts with b'DVOGRP' instead of b'EVOGRP', though its content checks out"),
    (3, "instead of b'EVOGRP', though its content checks out"),
    (-5, "its checksum does not match")])
def test_a_damaged_group_checkpoint_is_called_damaged_by_load_and_by_the_cli(
        tmp_path, capsys, where, says):
    from actors.cli.main import main
    from actors.errors import ResumeRefused
    from actors.groups import load_checkpoint

    path = _paused_checkpoint(tmp_path)
    data = bytearray(path.read_bytes())
    data[where] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ResumeRefused, match="the checkpoint is damaged") as err:
        load_checkpoint(path)
    assert says in str(err.value) and "restore the file from a copy" in str(err.value)
    assert main(["resume", str(path), "--show"]) != 0
    assert "the checkpoint is damaged" in capsys.readouterr().err


def test_a_file_that_is_no_checkpoint_is_not_called_damaged(tmp_path):
    from actors.errors import ResumeRefused
    from actors.groups import load_checkpoint

    path = tmp_path / "notes.txt"
    path.write_text("just some notes, long enough to fill a frame header")
    with pytest.raises(ResumeRefused, match="not a parallel-group checkpoint"):
        load_checkpoint(path)


# -- 7. groups: a result over the frame limit, code fingerprints, write-ahead effects -----------


def _fifty_megabytes(i) -> object:
    return b"x" * (50 * 1024 * 1024) if i == 1 else i


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_a_50_mb_result_fails_its_own_branch_by_name_on_either_bus(bus):
    from actors.errors import ResultTooLarge
    from actors.groups import run_group

    outcome = run_group(_fifty_megabytes, [0, 1, 2], max_concurrency=1, max_items=3, bus=bus)
    assert outcome.status == "failed" and outcome.error_branch == 1
    assert isinstance(outcome.error, ResultTooLarge)
    assert "the result of branch 1 takes 52428805 bytes" in str(outcome.error)
    # The report agrees with itself: the big one failed, it is not also finished.
    assert outcome.failed == [1] and 1 not in outcome.finished and outcome.finished == [0]
    assert outcome.partial == {0: 0}


def _answers(outcome, value="yes"):
    return {p.id: value for p in outcome.pending_interactions}


def _resume_to_the_end(path, outcome, value="yes", **options):
    """Resume, answering every question with ``value``, until the group ends (bounded:
    each resume answers at least one branch)."""
    from actors.groups import resume_group

    for _ in range(8):
        outcome = resume_group(path, user_inputs=_answers(outcome, value), **options)
        if outcome.status not in ("user_input_pending", "approval_pending"):
            return outcome
    raise AssertionError(f"{path}: still paused after 8 resumes")


def test_a_checkpoint_resumed_with_other_code_is_refused_by_name_and_kept(tmp_path):
    from actors.errors import ResumeRefused
    from actors.groups import resume_group, run_group
    from trust_groups import ask_odd, ask_odd_reordered

    path = tmp_path / "g.ckpt"
    paused = run_group(ask_odd, list(range(4)), max_concurrency=1, max_items=4,
                       checkpoint=path)
    before = path.read_bytes()
    with pytest.raises(ResumeRefused) as err:
        resume_group(path, target=ask_odd_reordered, user_inputs=_answers(paused))
    message = str(err.value)
    assert "the target trust_groups:ask_odd_reordered is not the code that paused" in message
    assert "(trust_groups:ask_odd, fingerprint" in message and "checkpoint is kept" in message
    assert path.read_bytes() == before  # not spent: the right code still resumes it
    done = _resume_to_the_end(path, paused)
    assert done.results == ["0: even", "1: yes", "2: even", "3: yes"]


def test_a_target_edited_in_place_is_refused_on_resume(tmp_path, monkeypatch):
    import importlib
    import sys

    from actors.errors import ResumeRefused
    from actors.groups import resume_group, run_group

    source = tmp_path / "edited_target.py"
    source.write_text("def target(i, ctx) -> object:\n    return ctx.ask(i) if i else 'zero'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("edited_target")
    try:
        paused = run_group(module.target, [0, 1], max_concurrency=1, max_items=2,
                           checkpoint=tmp_path / "g.ckpt")
        source.write_text("def target(i, ctx) -> object:\n    return ctx.ask(-i) if i else 'zero'\n")
        module = importlib.reload(module)
        with pytest.raises(ResumeRefused, match="edited_target:target is not the code"):
            resume_group(tmp_path / "g.ckpt", target=module.target,
                         user_inputs=_answers(paused))
    finally:
        sys.modules.pop("edited_target", None)


def test_a_failed_resume_does_not_spend_the_checkpoint(tmp_path):
    from actors.groups import load_checkpoint, resume_group, run_group
    from trust_groups import ask_then_check

    path = tmp_path / "g.ckpt"
    paused = run_group(ask_then_check, list(range(4)), max_concurrency=1, max_items=4,
                       checkpoint=path)
    failed = resume_group(path, user_inputs=_answers(paused, "boom"))
    assert failed.status == "failed" and failed.error_branch == 1
    assert load_checkpoint(path).status == "user_input_pending"
    done = _resume_to_the_end(path, paused, "fine")
    assert done.results == ["0: even", "1: fine", "2: even", "3: fine"]


def _python(code: str, env: dict[str, str]):
    import os
    import subprocess
    import sys

    full = {**os.environ, **env,
            "PYTHONPATH": os.pathsep.join([str(ROOT.parent), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", code], env=full, cwd=ROOT.parent)


def _kill_when_held(proc, hold_dir: Path) -> None:
    import os
    import signal

    try:
        wait_for(lambda: (hold_dir / "held").exists() or proc.poll() is not None,
                 "the branch that holds", 60)
        assert proc.poll() is None, f"the process ended first (rc {proc.returncode})"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _counts(path: Path) -> dict[int, int]:
    out: dict[int, int] = {}
    for line in path.read_text().split():
        out[int(line)] = out.get(int(line), 0) + 1
    return out


@pytest.mark.slow
def test_kill_9_during_resume_group_never_runs_a_finished_effect_twice(tmp_path, monkeypatch):
    from actors.groups import resume_group, run_group

    count, ckpt, hold = tmp_path / "count.txt", tmp_path / "g.ckpt", tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv("EVOBUS_TEST_COUNT", str(count))
    # suspend="first": the group pauses at branch 0's question before any effect runs.
    paused = run_group("trust_groups:counted", list(range(8)), max_concurrency=1,
                       max_items=8, chunk=1, checkpoint=ckpt, suspend="first")
    assert paused.status == "user_input_pending" and not count.exists()
    (iid,) = [p.id for p in paused.pending_interactions]
    proc = _python(f"from actors.groups import resume_group\n"
                   f"resume_group({str(ckpt)!r}, user_inputs={{{iid!r}: 'go'}})",
                   {"EVOBUS_TEST_COUNT": str(count), "EVOBUS_TEST_HOLD": f"{hold}:5"})
    _kill_when_held(proc, hold)
    assert _counts(count) == {i: 1 for i in range(6)}  # branch 5 held after its effect
    done = resume_group(ckpt, user_inputs={iid: "go"})
    assert done.status == "completed" and done.results == [i * 10 for i in range(8)]
    assert _counts(count) == {i: 1 for i in range(8)}  # 0-5 came from the effect log
    assert not (tmp_path / "g.ckpt.effects").exists()  # spent with the checkpoint


@pytest.mark.slow
def test_a_first_run_killed_before_any_pause_leaves_a_checkpoint_that_resumes(tmp_path,
                                                                              monkeypatch):
    from actors.groups import load_checkpoint, resume_group

    count, ckpt, hold = tmp_path / "count.txt", tmp_path / "g.ckpt", tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv("EVOBUS_TEST_COUNT", str(count))
    proc = _python(f"from actors.groups import run_group\n"
                   f"run_group('trust_groups:counted_quiet', list(range(6)), "
                   f"max_concurrency=1, max_items=6, chunk=1, checkpoint={str(ckpt)!r})",
                   {"EVOBUS_TEST_HOLD": f"{hold}:3"})
    _kill_when_held(proc, hold)
    assert load_checkpoint(ckpt).status == "running"
    assert _counts(count) == {i: 1 for i in range(4)}
    done = resume_group(ckpt)
    assert done.status == "completed" and done.results == [i * 10 for i in range(6)]
    assert _counts(count) == {i: 1 for i in range(6)}
    assert load_checkpoint(ckpt).status == "completed"
    assert not (tmp_path / "g.ckpt.effects").exists()


@pytest.mark.slow
def test_an_effect_started_and_never_recorded_fails_its_branch_instead_of_running_twice(
        tmp_path, monkeypatch):
    from actors.errors import EffectInDoubt
    from actors.groups import load_checkpoint, resume_group
    from actors.groups.checkpoint import EffectLog

    count, ckpt, hold = tmp_path / "count.txt", tmp_path / "g.ckpt", tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv("EVOBUS_TEST_COUNT", str(count))
    proc = _python(f"from actors.groups import run_group\n"
                   f"run_group('trust_groups:counted_quiet', list(range(6)), "
                   f"max_concurrency=1, max_items=6, chunk=1, checkpoint={str(ckpt)!r})",
                   {"EVOBUS_TEST_HOLD": f"{hold}:3"})
    _kill_when_held(proc, hold)
    # What a kill between an effect's intent and its result leaves: branch 4 at step 0.
    effects = EffectLog(ckpt)
    effects.intent(4, 0, "count")
    effects.close()
    failed = resume_group(ckpt)
    assert failed.status == "failed" and failed.error_branch == 4
    assert isinstance(failed.error, EffectInDoubt) and "'count' (step 0)" in str(failed.error)
    assert _counts(count) == {i: 1 for i in range(4)}  # 4 never ran twice; 5 never started
    assert load_checkpoint(ckpt).status == "running"   # not spent


@pytest.mark.slow
def test_evobus_resume_goes_on_from_a_checkpoint_left_running(tmp_path, monkeypatch, capsys):
    from actors.cli.main import main

    count, ckpt, hold = tmp_path / "count.txt", tmp_path / "g.ckpt", tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv("EVOBUS_TEST_COUNT", str(count))
    proc = _python(f"from actors.groups import run_group\n"
                   f"run_group('trust_groups:counted_quiet', list(range(4)), "
                   f"max_concurrency=1, max_items=4, chunk=1, checkpoint={str(ckpt)!r})",
                   {"EVOBUS_TEST_HOLD": f"{hold}:1"})
    _kill_when_held(proc, hold)
    assert main(["resume", str(ckpt), "--json"]) == 0, capsys.readouterr().err
    out = msgspec.json.decode(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == "completed" and out["results"] == [0, 10, 20, 30]
    assert _counts(count) == {i: 1 for i in range(4)}


def test_a_branch_answer_is_admitted_only_from_the_worker_its_lease_went_to():
    from actors.machines.collector import Collector
    from protocol import Branch, BranchDone, GroupStart

    c = Collector("collector.g")
    out = c.handle(GroupStart(group_id="g", items=[1, 2], workers=["w0", "w1"],
                              max_concurrency=2, max_items=2, chunk=1))
    leases = {m.lease_id: to for to, m in out if isinstance(m, Branch)}
    assert set(leases.values()) == {"w0", "w1"}
    lease_id, holder = next(iter(leases.items()))
    other = "w1" if holder == "w0" else "w0"
    done = BranchDone(group_id="g", lease_id=lease_id, worker=other, indices=[0], values=[1])
    assert "which went to" in c.admit(other, done)
    assert c.admit(holder, msgspec.structs.replace(done, worker=holder)) is None


def test_with_curve_only_the_same_key_moves_a_name_without_its_token(tmp_path):
    server, honest_keys, mallory_keys = _curve(tmp_path, True)
    c = Coordinator(tmp_path / "run.evolog", keys=server)
    first = Raw(c.address, b"rw-first", keys=honest_keys)
    try:
        assert first.register(b"w0")[:2] == [b"a", b"w0"]
        other = Raw(c.address, b"rw-other", keys=mallory_keys)
        same = Raw(c.address, b"rw-same", keys=honest_keys)
        try:
            assert other.register(b"w0")[0] == b"e"    # another authorised key: refused
            assert same.register(b"w0")[:2] == [b"a", b"w0"]  # the same key: moved
            assert c.port.routes[b"w0"] == b"rw-same"
        finally:
            other.close()
            same.close()
    finally:
        first.close()
        c.close()


def _ten_megabytes(i) -> object:
    return b"x" * (10 * 1024 * 1024)


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_results_that_together_pass_the_frame_limit_fail_the_branch_that_tips_them(bus):
    from actors.errors import ResultTooLarge
    from actors.groups import run_group

    outcome = run_group(_ten_megabytes, [0, 1, 2], max_concurrency=1, max_items=3, bus=bus,
                        chunk=1)
    assert outcome.status == "failed" and outcome.error_branch == 1
    assert isinstance(outcome.error, ResultTooLarge)
    assert "with the result of branch 1 the group's results would take" in str(outcome.error)
    assert outcome.finished == [0] and 1 in outcome.failed and 1 not in outcome.finished
    everyone = sorted(outcome.finished + outcome.failed + outcome.never_started
                      + outcome.cancelled)
    assert everyone == [0, 1, 2]  # each branch in exactly one place


def test_evobus_inspect_shows_who_sent_a_frame_and_what_was_never_delivered(tmp_path, capsys):
    from actors.cli.main import main

    path = tmp_path / "run.evolog"
    with _writer(path) as w:
        w.append(1, 0.1, "w0", "scheduler", encode(Heartbeat(worker="w0")),
                 peer="remote:rw-1 key=abc")
        w.append(2, 0.2, "scheduler", "w0", encode(Stop(reason="bye")), status=UNDELIVERED)
        w.append(3, 0.3, "driver", "scheduler", encode(Tick(elapsed=0.3)))
    assert main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("[from remote:rw-1 key=abc]")
    assert lines[2].endswith("(undelivered)")
    assert "[from" not in lines[3] and "undelivered" not in lines[3]


def test_the_scheduler_admits_an_answer_only_from_a_holder_and_only_as_its_lease_was():
    s = Scheduler(2)
    s.handle(Hello(worker="w0"))
    s.handle(Hello(worker="w1"))
    s.handle(LeaseBatch(round=0, leases=[Lease(lease_id="r0.u0", round=0, task_ids=["t0"]),
                                         Lease(lease_id="r0.u1", round=0, unit=1,
                                               task_ids=["t1"])]))
    holder = s.holder["r0.u0"]
    other = "w1" if holder == "w0" else "w0"
    done = LeaseDone(lease_id="r0.u0", worker=holder, round=0,
                     results=[RolloutResult(task_id="t0", score=0.5, calls=1)])
    assert s.admit(holder, done) is None
    assert "it does not hold (held by another worker)" in s.admit(
        other, msgspec.structs.replace(done, worker=other))
    assert "names worker" in s.admit(other, done)                  # as someone else
    assert "gives its round, kind, unit and section as (5," in s.admit(
        holder, msgspec.structs.replace(done, round=5))             # another round
    assert "not a known worker" in s.admit("mallory", msgspec.structs.replace(
        done, lease_id="r9.u9", worker="mallory"))                  # a guessed id
    s.handle(done)
    late = msgspec.structs.replace(done)
    assert s.admit(holder, late) is None  # late or duplicate: handle drops and counts it


@pytest.mark.parametrize("bus", ["zmq", "memory"])
def test_a_pause_whose_journal_would_not_fit_a_message_fails_its_branch(bus, tmp_path):
    from actors.errors import ResultTooLarge
    from actors.groups import run_group
    from trust_groups import big_effect_then_ask

    outcome = run_group(big_effect_then_ask, [0], max_concurrency=1, max_items=1, bus=bus,
                        checkpoint=tmp_path / "g.ckpt")
    assert outcome.status == "failed" and outcome.error_branch == 0
    assert isinstance(outcome.error, ResultTooLarge)
    assert "branch 0 paused with its journal and question taking" in str(outcome.error)


@pytest.mark.slow
def test_a_run_whose_every_remote_worker_is_lost_stops_after_wait_seconds(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import threading

    from actors.errors import RunFailed
    from actors.runtime.launch import run_scenario
    from protocol.scenario import parse_scenario
    from test_remote import env_with, free_port, scenario_text

    addr = f"tcp://127.0.0.1:{free_port()}"
    text = scenario_text(f'local = 0\nremote = 1\nbind = "{addr}"').replace(
        "wait_seconds = 30", "wait_seconds = 2")
    gate = tmp_path / "gate"
    gate.mkdir()
    worker = subprocess.Popen(
        [sys.executable, "-m", "actors.cli", "worker", "--connect", addr, "--id", "w0",
         "--allow", "tests.remote_domain", "--allow", "scenarios", "--give-up", "30"],
        cwd=ROOT.parent, env=env_with(EVOBUS_TEST_GATE=gate), stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)
    # wait_seconds = 2 bounds the first registration too: the run starts only once the
    # worker process has imported and is connecting, else a loaded machine fails it early.
    connecting = threading.Event()

    def drain() -> None:
        for line in worker.stdout:
            if "waiting for the broker at" in line:
                connecting.set()

    threading.Thread(target=drain, daemon=True).start()
    assert connecting.wait(60), "the worker process never said it was waiting for its broker"

    def kill_mid_lease() -> None:
        wait_for(lambda: list(gate.glob("started-*")), "the worker mid-lease", 60)
        os.kill(worker.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_mid_lease, daemon=True)
    killer.start()
    try:
        started = time.monotonic()
        with pytest.raises(RunFailed) as err:
            run_scenario(parse_scenario(text))
        assert time.monotonic() - started < 60
    finally:
        killer.join(5)
        if worker.poll() is None:
            worker.kill()
        worker.wait(10)
    message = str(err.value)
    assert "no worker has been registered for" in message and "(wait_seconds = 2)" in message
    assert "workers presumed lost: w0" in message


# -- nested groups write their effects ahead too ---------------------------------------------


def test_a_nested_groups_effects_are_on_disk_and_not_run_again_on_resume(tmp_path,
                                                                          monkeypatch):
    from actors.groups import run_group
    from actors.groups.checkpoint import EffectLog

    count, ckpt = tmp_path / "count.txt", tmp_path / "g.ckpt"
    monkeypatch.setenv("EVOBUS_TEST_COUNT", str(count))
    paused = run_group("trust_groups:nested_counted_then_ask", [0, 1], max_concurrency=1,
                       max_items=2, checkpoint=ckpt)
    assert paused.status == "user_input_pending"
    keys = [0, 1, 2, 10, 11, 12]
    assert _counts(count) == {k: 1 for k in keys}
    # Each nested branch's intent and result, under the branch that started its group.
    recorded = EffectLog(ckpt).recorded
    assert {(scope, b, kind) for (scope, b, _), (kind, *_) in
            ((k, (r.kind,)) for k, r in recorded.items())} == {
        (f"{i}.1/", j, "result") for i in (0, 1) for j in range(3)}
    done = _resume_to_the_end(ckpt, paused)
    assert done.status == "completed" and done.results == ["3: yes", "33: yes"]
    assert _counts(count) == {k: 1 for k in keys}      # the re-run branches found them
    assert not (tmp_path / "g.ckpt.effects").exists()


#: Where each seeded kill lands: the nested effect (key 10 * branch + j) held after it ran.
NESTED_KILLS = {seed: __import__("random").Random(seed).choice([1, 2, 10, 12, 21, 30, 32])
                for seed in range(5)}


@pytest.mark.slow
@pytest.mark.parametrize("seed", sorted(NESTED_KILLS))
def test_kill_9_inside_a_nested_group_never_runs_a_finished_effect_twice(tmp_path,
                                                                         monkeypatch, seed):
    from actors.groups import load_checkpoint, resume_group

    count, ckpt, hold = tmp_path / "count.txt", tmp_path / "g.ckpt", tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv("EVOBUS_TEST_COUNT", str(count))
    at = NESTED_KILLS[seed]
    proc = _python(f"from actors.groups import run_group\n"
                   f"run_group('trust_groups:nested_counted', list(range(4)), "
                   f"max_concurrency=1, max_items=4, chunk=1, checkpoint={str(ckpt)!r})",
                   {"EVOBUS_TEST_HOLD": f"{hold}:{at}"})
    _kill_when_held(proc, hold)
    before = _counts(count)
    assert set(before.values()) == {1} and at in before, (seed, at, before)
    assert load_checkpoint(ckpt).status == "running"
    done = resume_group(ckpt)
    assert done.status == "completed", (seed, at, done.error)
    assert done.results == [30 * i + 3 for i in range(4)]
    # Every nested effect ran once: those before the kill came from the effect log.
    assert _counts(count) == {10 * i + j: 1 for i in range(4) for j in range(3)}, (seed, at)


# -- budgets spent by a group killed while running -------------------------------------------


@pytest.mark.slow
def test_a_group_killed_while_running_counts_what_it_had_spent_when_resumed(tmp_path,
                                                                             monkeypatch):
    from actors.errors import BudgetExhausted
    from actors.groups import load_checkpoint, resume_group

    count, ckpt, hold = tmp_path / "count.txt", tmp_path / "g.ckpt", tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv("EVOBUS_TEST_COUNT", str(count))
    proc = _python(f"from actors.groups import Budgets, run_group\n"
                   f"run_group('trust_groups:counted_quiet', list(range(6)), "
                   f"max_concurrency=1, max_items=6, chunk=1, checkpoint={str(ckpt)!r}, "
                   f"budgets=Budgets(calls=8))",
                   {"EVOBUS_TEST_HOLD": f"{hold}:3"})
    _kill_when_held(proc, hold)
    assert _counts(count) == {i: 1 for i in range(4)}   # branches 0-3 started: 4 calls
    assert load_checkpoint(ckpt).consumed.calls == 0    # written before the first start
    # The resume runs the group again under its id: 6 more starts where 8 - 4 are left.
    outcome = resume_group(ckpt)
    assert outcome.status == "failed" and isinstance(outcome.error, BudgetExhausted)
    assert "the calls budget (8) is used up: 8 used" in str(outcome.error)
    assert outcome.consumed.calls == 8 and outcome.finished == [0, 1, 2, 3]
    assert _counts(count) == {i: 1 for i in range(4)}   # and no effect ran twice
    assert load_checkpoint(ckpt).consumed.calls == 8    # kept, for the next resume


def test_a_groups_budget_charges_reach_its_effect_log_before_the_branch_runs(tmp_path):
    from actors.groups import Budgets, run_group
    from actors.groups.checkpoint import EffectLog

    seen = []

    def look(i, ctx) -> int:    # what a kill at this moment would leave on disk
        log = EffectLog(tmp_path / "g.ckpt")
        seen.append(log.spent)
        log.close()
        ctx.spend(0.5)
        return i

    outcome = run_group(look, [0, 1, 2], max_concurrency=1, max_items=3,
                        checkpoint=tmp_path / "g.ckpt", budgets=Budgets(calls=5, cost=9.0))
    assert outcome.status == "completed"
    assert [s[:2] for s in seen] == [[1, 0.0], [2, 0.5], [3, 1.0]]
