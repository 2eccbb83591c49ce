"""Workers in other processes : process and remote workers, liveness and
re-dispatch, CURVE keys, the broker's peer policy, code named as data.

Loopback only. Every wait has a deadline; a test waits on log growth (files a gated
rollout writes, the coordinator's progress lines), never on a sleep.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors import ConfigError, KeyedRules, evolve
from actors.machines.registry import Registry
from actors.workers.code import build_spec
from actors.workers.code import code_ref
from actors.runtime.launch import run_scenario
from actors.workers.remote import resolve_spec
from actors.machines.scheduler import Scheduler
from bus.remote import PeerPort, RemoteEndpoint
from bus.security import create_keys, load_client_keys, load_server_keys
from bus.zmq_bus import ZmqBus
from protocol import (Barrier, Ref, Heartbeat, Hello, Join, Lease, LeaseBatch, LeaseDone,
                      Refused, RolloutResult, Settled, Spec, Tick)
from protocol.scenario import Workers, parse_scenario
from scenarios import router

ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT, DEADLINE = 0.2, 1.0


# -- helpers --------------------------------------------------------------------------------


def free_port() -> int:
    """A free port below the ephemeral range, so no outgoing connection (a worker
    retrying to connect, say) is handed the same number before the coordinator binds."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: try another
                continue
            return port
    raise AssertionError("no free port found in 20000-32000")


def wait_for(predicate, timeout: float, what: str):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Lines:
    """A subprocess stream read on a thread, so a test can wait for a line."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait(self, pattern: str, timeout: float) -> str:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if rx.search(line):
                        return line
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} within {timeout} s; "
                                         f"got:\n{''.join(self.lines[-30:])}")
                self._cond.wait(left)

    def text(self) -> str:
        self._thread.join(5)
        return "".join(self.lines)


def env_with(**extra) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


SCENARIO = """
name = "router-remote"
rounds = {rounds}
seed = 0
[domain]
tasks = "tests.remote_domain:tasks"
reward = "tests.remote_domain:reward"
run = "tests.remote_domain:run"
propose = "tests.remote_domain:propose"
[strategy]
kind = "KeyedRules"
categories = ["billing", "shipping", "technical", "account"]
[workers]
{workers}
"""
#: Liveness settings: they concern workers in other processes only (a scenario whose
#: workers are all local is warned about them).
ELSEWHERE = "heartbeat = {hb}\ndeadline = {deadline}\nwait_seconds = 30\n"


def scenario_text(workers: str, rounds: int = 4) -> str:
    text = SCENARIO.format(rounds=rounds, workers=workers)
    if "processes" in workers or "remote" in workers:
        text += ELSEWHERE.format(hb=HEARTBEAT, deadline=DEADLINE)
    return text


def on_threads(text: str) -> dict[str, str]:
    """The reference: the same scenario with every worker a thread of this process."""
    sc = parse_scenario(text)
    w = sc.workers
    threads = msgspec.structs.replace(w, local=w.local + w.processes + w.remote,
                                      processes=0, remote=0, bind=None, keys=None)
    return run_scenario(msgspec.structs.replace(sc, workers=threads)).state


class Topology:
    """`evobus run` plus `evobus worker` processes, all reaped at the end."""

    def __init__(self, tmp_path: Path, n_workers: int, *, keys: Path | None = None,
                 gate: bool = False) -> None:
        self.port = free_port()
        self.addr = f"tcp://127.0.0.1:{self.port}"
        workers = f'local = 0\nremote = {n_workers}\nbind = "{self.addr}"'
        if keys is not None:
            workers += f'\nkeys = "{keys}"'
        self.log = tmp_path / "remote.evolog"
        self.text = f'log = "{self.log}"\n' + scenario_text(workers)
        self.path = tmp_path / "remote.toml"
        self.path.write_text(self.text)
        self.gate = tmp_path / "gate"
        self.gate.mkdir()
        self.env = env_with(**({"EVOBUS_TEST_GATE": self.gate} if gate else {}))
        self.tmp = tmp_path
        self.procs: list[subprocess.Popen] = []
        self.keys = keys
        self.workers = [self._worker(i) for i in range(n_workers)]
        self.coordinator = self._spawn([sys.executable, "-m", "actors.cli", "run",
                                        str(self.path), "--json"])
        self.out = Lines(self.coordinator.stdout)
        self.err = Lines(self.coordinator.stderr)

    def _spawn(self, argv: list[str], log_name: str | None = None) -> subprocess.Popen:
        if log_name is None:  # the coordinator: read live (Lines)
            out = err = subprocess.PIPE
        else:  # a worker: to a file, read when something goes wrong
            out = err = open(self.tmp / log_name, "w")
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=out, stderr=err,
                                text=True)
        if log_name is not None:
            out.close()
        self.procs.append(proc)
        return proc

    def diagnose(self) -> str:
        """What the coordinator and the workers said (for failure messages)."""
        parts = [f"coordinator rc={self.coordinator.poll()}:\n{''.join(self.err.lines[-20:])}"]
        for path in sorted(self.tmp.glob("worker-*.log")):
            parts.append(f"{path.name}:\n{path.read_text()[-1500:]}")
        return "\n".join(parts)

    def _worker(self, i: int) -> subprocess.Popen:
        argv = [sys.executable, "-m", "actors.cli", "worker", "--connect", self.addr,
                "--id", f"w{i}", "--allow", "tests.remote_domain", "--allow", "scenarios",
                "--give-up", "30"]
        if self.keys is not None:
            argv += ["--key", str(self.keys / "client.key_secret"),
                     "--server-key", str(self.keys / "server.key")]
        return self._spawn(argv, f"worker-{i}.log")

    def first_started(self) -> int:
        """The pid of the first worker whose first rollout is waiting at the gate."""
        try:
            found = wait_for(lambda: sorted(self.gate.glob("started-*"),
                                            key=os.path.getmtime), 30,
                             "a worker to start its first rollout")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnose()}") from None
        return int(found[0].name.split("-", 1)[1])

    def release(self) -> None:
        (self.gate / "release").write_text("go")

    def result(self, timeout: float = 60) -> dict:
        self.coordinator.wait(timeout)
        text = self.out.text()
        assert self.coordinator.returncode == 0, self.diagnose()
        return msgspec.json.decode(text.strip().splitlines()[-1])

    def close(self) -> None:
        (self.gate / "release").touch()
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:  # already gone
                    pass
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture
def topology(tmp_path):
    made: list[Topology] = []

    def make(*args, **kwargs) -> Topology:
        made.append(Topology(tmp_path, *args, **kwargs))
        return made[-1]

    yield make
    for t in made:
        t.close()


@pytest.fixture(scope="module")
def reference_state():
    return on_threads(scenario_text("local = 2"))


# -- end to end: evobus worker processes -------------------------------------------------------


def test_two_worker_processes_complete_a_scenario_with_curve_keys(topology, tmp_path,
                                                                   reference_state):
    keys = tmp_path / "keys"
    from actors.cli.main import main

    assert main(["keys", str(keys)]) == 0
    t = topology(2, keys=keys)
    out = t.result()
    assert out["state"] == reference_state
    assert out["bus"]["workers_joined"] == 2 and out["bus"]["redispatched"] == 0
    for w in t.workers:  # each took the run's Stop and left on its own
        assert w.wait(15) == 0


def test_kill_9_of_a_worker_mid_lease_still_completes_with_the_same_artifact(topology,
                                                                             reference_state):
    t = topology(2, gate=True)
    victim = t.first_started()
    os.kill(victim, signal.SIGKILL)
    t.release()
    out = t.result()
    assert out["state"] == reference_state
    assert out["bus"]["redispatched"] >= 1
    assert out["bus"]["lost_workers"] == 1
    assert out["error"] is None
    # Time and heartbeats reached the Scheduler as messages: its log replays exactly.
    from actors.cli.main import main

    assert main(["replay", str(t.log)]) == 0


def test_a_worker_stopped_past_its_deadline_is_redispatched_and_its_late_answer_dropped(
        topology, reference_state):
    t = topology(2, gate=True)
    victim = t.first_started()
    os.kill(victim, signal.SIGSTOP)
    t.release()
    # Round 0 can only close once the stopped worker's lease (its first: a share of the
    # baseline evaluation) was presumed lost, re-dispatched and answered by the other.
    t.err.wait(r"presumed lost", 30)
    t.err.wait(r"round 0 ", 30)
    os.kill(victim, signal.SIGCONT)
    t.err.wait(r"is back after being presumed lost", 30)
    out = t.result()
    assert out["bus"]["redispatched"] >= 1
    assert out["bus"]["duplicates_dropped"] >= 1  # the late answer, counted
    assert out["state"] == reference_state


def test_a_worker_that_is_not_there_is_named_with_the_command_that_starts_it(tmp_path):
    port = free_port()
    text = scenario_text(f'local = 0\nremote = 1\nbind = "tcp://127.0.0.1:{port}"')
    text = text.replace("wait_seconds = 30", "wait_seconds = 0.5")
    log = tmp_path / "refused.evolog"
    with pytest.raises(ConfigError) as info:
        run_scenario(parse_scenario(text), log=str(log))
    assert not log.exists()   # refused for its configuration: no log left behind
    message = str(info.value)
    assert "expected 1 worker(s)" in message and "0 registered" in message
    assert f"evobus worker --connect tcp://127.0.0.1:{port}" in message
    assert "--allow tests" in message or "--allow tests.remote_domain" in message


# -- process workers: spawned, never forked ------------------------------------------------------


def test_process_workers_give_the_same_result_as_threads(reference_state):
    text = scenario_text("local = 0\nprocesses = 2")
    result = run_scenario(parse_scenario(text))
    assert result.state == reference_state
    assert result.bus["workers_joined"] == 2


def test_a_rollout_longer_than_the_deadline_is_not_mistaken_for_death(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("EVOBUS_TEST_GATE", str(gate))
    text = scenario_text("local = 0\nprocesses = 1", rounds=1)
    releaser = threading.Thread(target=lambda: (
        wait_for(lambda: list(gate.glob("started-*")), 30, "the first rollout"),
        # Held at the gate for 2.5 deadlines while its I/O thread keeps heartbeating.
        threading.Event().wait(2.5 * DEADLINE), (gate / "release").touch()), daemon=True)
    releaser.start()
    result = run_scenario(parse_scenario(text))
    releaser.join(5)
    assert result.bus["lost_workers"] == 0 and result.bus["redispatched"] == 0


def test_a_closure_with_process_workers_is_refused_before_any_rollout():
    calls = []
    workers = Workers(local=0, processes=2)
    with pytest.raises(ConfigError, match=r"lambda.*package\.module:attr") as info:
        evolve(router.tasks(), router.reward, run=lambda r, t: calls.append(t) or "x",
               propose=router.propose, strategy=KeyedRules(router.CATEGORIES), n_workers=2,
               workers=workers)
    assert "Ref(" in str(info.value)

    def local_run(rendered, task):
        calls.append(task)
        return "x"

    with pytest.raises(ConfigError, match="closure"):
        evolve(router.tasks(), router.reward, run=local_run, propose=router.propose,
               strategy=KeyedRules(router.CATEGORIES), n_workers=2, workers=workers)
    assert calls == []


def test_named_functions_agents_and_strategies_become_references():
    assert code_ref(router.run, "run") == Ref(ref="scenarios.router:run", call=False)
    assert code_ref(router.RouterAgent(), "agent") == Ref(ref="scenarios.router:RouterAgent",
                                                              call=True)
    ref = code_ref(KeyedRules(["a", "b"]), "strategy")
    assert ref.ref == "actors.artifacts:KeyedRules" and ref.kwargs["categories"] == ["a", "b"]
    assert code_ref(Ref(ref="m:f", kwargs={"x": 1}), "run") == Ref(ref="m:f",
                                                                       kwargs={"x": 1})
    with pytest.raises(ConfigError, match="bound method"):
        code_ref(router.RouterAgent().solve, "run")


def test_n_workers_must_match_the_workers_section():
    with pytest.raises(ConfigError, match="set n_workers=3"):
        evolve(router.tasks(), router.reward, run=router.run, propose=router.propose,
               n_workers=4, workers=Workers(local=1, processes=2))


# -- the spec: allowlist before import, secrets by name -----------------------------------------


def _spec(**over) -> Spec:
    spec = build_spec(tasks=router.tasks(), reward=router.reward, run=router.run,
                      propose=router.propose, agent=None, strategy=KeyedRules(router.CATEGORIES),
                      initial_state={}, solved=0.999, heartbeat=0.2, package_version="x")
    return msgspec.structs.replace(spec, **over)


def test_the_allowlist_is_checked_before_anything_is_imported():
    spec = _spec(run=Ref(ref="evobus_never_imported_module:run"))
    with pytest.raises(ConfigError, match="not in this worker's allowlist"):
        resolve_spec(spec, ["scenarios"])
    assert "evobus_never_imported_module" not in sys.modules
    with pytest.raises(ConfigError, match="not in this worker's allowlist"):
        resolve_spec(_spec(), [])  # scenarios.router is not allowed either
    resolved = resolve_spec(_spec(), ["scenarios"])
    assert set(resolved.tasks) == {t.id for t in router.tasks()}


def test_a_spec_names_environment_variables_never_their_values(monkeypatch):
    monkeypatch.setenv("EVOBUS_TEST_API_KEY", "sk-not-a-real-secret-123")
    spec = build_spec(tasks=router.tasks(), reward=router.reward, run=router.run,
                      propose=router.propose, agent=None, strategy=KeyedRules(router.CATEGORIES),
                      initial_state={}, solved=0.999, heartbeat=0.2, package_version="x",
                      env=["EVOBUS_TEST_API_KEY"])
    assert spec.env == ["EVOBUS_TEST_API_KEY"]
    assert b"sk-not-a-real-secret-123" not in msgspec.msgpack.encode(spec)
    with pytest.raises(ConfigError, match=r"value of \$EVOBUS_TEST_API_KEY"):
        build_spec(tasks=router.tasks(), reward=router.reward, run=router.run,
                   propose=router.propose, agent=None, initial_state={}, solved=0.999,
                   strategy=KeyedRules(["sk-not-a-real-secret-123"]), heartbeat=0.2,
                   package_version="x", env=["EVOBUS_TEST_API_KEY"])
    monkeypatch.delenv("EVOBUS_TEST_API_KEY")
    with pytest.raises(ConfigError, match="EVOBUS_TEST_API_KEY.*not set on this worker"):
        resolve_spec(spec, ["scenarios"])


def test_the_registry_answers_a_join_and_refuses_different_code():
    spec = _spec()
    reg = Registry(spec)
    assert reg.handle(Join(worker="w")) == [("w", spec)]
    ok = Hello(worker="w", fingerprint=spec.fingerprint, package_version="x", heartbeat=0.2)
    assert reg.handle(ok) == [("scheduler", ok), ("driver", ok)]
    bad = Hello(worker="v", fingerprint="0000", package_version="x", heartbeat=0.2)
    out = reg.handle(bad)
    assert [r for r, _ in out] == ["v", "driver"]
    assert isinstance(out[0][1], Refused) and "different code" in out[0][1].reason


# -- the scheduler's liveness, driven by messages -------------------------------------------------


def _lease(lease_id: str, unit: int = 0) -> Lease:
    return Lease(lease_id=lease_id, round=0, unit=unit, task_ids=[f"t{unit}"])


def _done(lease_id: str, worker: str, unit: int = 0) -> LeaseDone:
    return LeaseDone(lease_id=lease_id, worker=worker, round=0, unit=unit,
                     results=[RolloutResult(task_id=f"t{unit}", score=1.0, calls=1)])


def _sched(**kw) -> Scheduler:
    s = Scheduler(2, deadline=1.0, **kw)
    s.handle(Hello(worker="a", heartbeat=0.2))
    s.handle(Hello(worker="b", heartbeat=0.2))
    return s


def test_a_silent_worker_is_presumed_lost_and_its_lease_redispatched_under_the_same_id():
    s = _sched()
    out = s.handle(LeaseBatch(round=0, leases=[_lease("r0.u0", 0), _lease("r0.u1", 1)]))
    assert sorted((w, m.lease_id) for w, m in out) == [("a", "r0.u0"), ("b", "r0.u1")]
    s.handle(Tick(elapsed=0.5))
    s.handle(Heartbeat(worker="b"))
    assert s.handle(Tick(elapsed=1.0)) == [] and s.lost_workers == 0  # at the deadline
    # a: 1.2 s silent, presumed lost; b (heard at 0.5) is busy, so the lease waits ...
    assert s.handle(Tick(elapsed=1.2)) == []
    assert s.lost_workers == 1 and "a" in s.lost and s.redispatched == 1
    out = s.handle(_done("r0.u1", "b", 1))
    # ... and goes to b under the same id as soon as b is free
    assert [(w, m.lease_id) for w, m in out if isinstance(m, Lease)] == [("b", "r0.u0")]
    out = s.handle(_done("r0.u0", "b", 0))
    assert ("merger", Barrier(round=0)) in out
    assert s.handle(_done("r0.u0", "a", 0)) == []  # the late answer
    assert s.duplicates_dropped == 1


def test_a_worker_presumed_lost_is_taken_back_when_it_heartbeats_again():
    s = _sched()
    s.handle(LeaseBatch(round=0, leases=[_lease("r0.u0", 0)]))
    s.handle(Heartbeat(worker="b"))
    s.handle(Tick(elapsed=1.5))
    s.handle(Heartbeat(worker="b"))
    assert "a" in s.lost
    s.handle(Heartbeat(worker="a"))
    assert "a" in s.workers and "a" not in s.lost


def test_a_late_answer_from_a_worker_presumed_lost_takes_it_back_like_a_heartbeat():
    # A remote worker heartbeats only when it has sent nothing else for its interval, so
    # the late answer may be the first word from it after a stop (SIGCONT).
    s = _sched()
    s.handle(LeaseBatch(round=0, leases=[_lease("r0.u0", 0)]))
    s.handle(Tick(elapsed=0.8))
    s.handle(Heartbeat(worker="b"))
    out = s.handle(Tick(elapsed=1.5))  # a: silent past the deadline, presumed lost
    assert "a" in s.lost and [(w, m.lease_id) for w, m in out] == [("b", "r0.u0")]
    s.handle(_done("r0.u0", "b", 0))
    s.handle(_done("r0.u0", "a", 0))  # the late answer: dropped and counted ...
    assert s.duplicates_dropped == 1 and "a" in s.workers and "a" not in s.lost  # ... back
    s.handle(Tick(elapsed=2.0))
    s.handle(_done("r0.u0", "a", 0))  # a live worker's late answer: a sign of life too
    s.handle(Tick(elapsed=2.9))
    assert "a" in s.workers and "a" not in s.lost  # 0.9 s since its last answer


def test_a_lease_whose_workers_keep_dying_is_given_up_as_an_infrastructure_failure():
    s = Scheduler(1, deadline=1.0, max_tries=2)
    s.handle(Hello(worker="a", heartbeat=0.2))
    s.handle(LeaseBatch(round=0, leases=[_lease("r0.u0")]))
    s.handle(Tick(elapsed=1.5))  # a lost: first try
    assert s.redispatched == 1
    assert [m.lease_id for _, m in s.handle(Hello(worker="b", heartbeat=0.2))
            if isinstance(m, Lease)] == ["r0.u0"]
    out = s.handle(Tick(elapsed=3.0))  # b lost too: second try, the bound
    settled = [m for _, m in out if isinstance(m, Settled)]
    assert s.given_up == 1 and len(settled) == 1
    assert "infrastructure failure" in settled[0].errors[0]
    assert ("merger", Barrier(round=0)) in out  # the round can still close


def test_a_reconnecting_worker_gets_back_the_leases_it_no_longer_holds():
    s = Scheduler(2, deadline=5.0)
    s.handle(Hello(worker="a", slots=2, heartbeat=0.2))
    s.handle(LeaseBatch(round=0, leases=[_lease("r0.u0", 0), _lease("r0.u1", 0)]))
    out = s.handle(Hello(worker="a", slots=2, heartbeat=0.2, leases=["r0.u0"]))
    assert [(w, m.lease_id) for w, m in out if isinstance(m, Lease)] == [("a", "r0.u1")]
    assert s.redispatched == 1 and s.lost_workers == 0


def test_thread_workers_are_never_presumed_lost():
    s = Scheduler(1, deadline=1.0)
    s.handle(Hello(worker="worker-0"))
    s.handle(LeaseBatch(round=0, leases=[_lease("r0.u0")]))
    assert s.handle(Tick(elapsed=100.0)) == [] and s.lost_workers == 0



def test_a_worker_leaving_mid_eval_lease_starts_none_of_the_calls_its_pool_had_queued():
    """An eval lease's slow calls run two at once on the slot's pool; the worker leaves
    (Stop, a lost broker) while two are in flight and seven wait in the pool's queue.
    Those seven never start: left queued, they ran after the worker left (the process
    waits for its pool's queue at exit), calls no one counts."""
    import queue

    from actors.artifacts import SingleSlot
    from actors.workers import remote
    from actors.workers.core import SLOW_CALL_S
    from protocol import Spec, Task

    started: list[str] = []
    lock = threading.Lock()
    in_flight = threading.Barrier(3, timeout=10)   # the two pooled calls and this test
    release = threading.Event()

    def run(rendered: str, task: Task) -> str:
        with lock:
            started.append(task.id)
            n = len(started)
        if n == 1:
            time.sleep(SLOW_CALL_S * 5)   # the call's own latency: the rest fan out
        elif n <= 3:
            in_flight.wait()
            assert release.wait(10), "the test never released the calls in flight"
        return task.prompt

    class Endpoint:   # what the slot answers through
        def __init__(self) -> None:
            self.sent: queue.SimpleQueue = queue.SimpleQueue()

        def send(self, sender, receiver, msg) -> None:
            self.sent.put(msg)

    tasks = [Task(f"t{i}", str(i)) for i in range(10)]
    w = remote.RemoteWorker("tcp://127.0.0.1:1", worker_id="r0", slots=1)
    w.ep = Endpoint()
    w.resolved = remote.Resolved(tasks={t.id: t for t in tasks}, reward=lambda t, o: 1.0,
                                 run=run, propose=None, strategy=SingleSlot(),
                                 fingerprint="")
    w.spec = Spec(run_id="x", call_concurrency=2)
    w._start_threads()
    try:
        w._to_slot(Lease(lease_id="e1.0", round=-1, kind="eval",
                         task_ids=[t.id for t in tasks], state={"value": "x"}))
        in_flight.wait()          # t0 done on the slot thread, t1 and t2 in flight
        w._leave()
    finally:
        release.set()
        w._drain_slots()
    assert sorted(started) == ["t0", "t1", "t2"]
    assert not any(t.is_alive() for t in w.threads)
    done = w.ep.sent.get(timeout=10)   # the calls it made are answered
    assert isinstance(done, LeaseDone) and [r.task_id for r in done.results] == [
        "t0", "t1", "t2"]


# -- the broker's peer port: keys, policy, fuzz, reconnect ------------------------------------------


class Inbox:
    def __init__(self) -> None:
        self.items = []
        self.event = threading.Event()

    def __call__(self, delivery) -> None:
        self.items.append(delivery)
        self.event.set()


def test_a_peer_with_a_wrong_key_is_refused_and_one_with_a_good_key_is_served(tmp_path):
    keys = tmp_path / "keys"
    create_keys(keys, ["good"])
    create_keys(tmp_path / "rogue", ["bad"])  # a valid pair the broker never authorised
    port = PeerPort(["tcp://127.0.0.1:0"], keys=load_server_keys(keys),
                    receivers=["scheduler"])
    bus = ZmqBus(peers=(port,))
    inbox = Inbox()
    bus.attach("scheduler", inbox)
    good = RemoteEndpoint(port.addresses[0], keys=load_client_keys(keys / "good.key_secret",
                                                                   keys / "server.key"))
    bad = RemoteEndpoint(port.addresses[0], keys=load_client_keys(
        tmp_path / "rogue" / "bad.key_secret", keys / "server.key"))
    try:
        good.attach("w-good", Inbox())
        good.send("w-good", "scheduler", Heartbeat(worker="w-good"))
        assert inbox.event.wait(5) and inbox.items[0].sender == "w-good"
        with pytest.raises(TimeoutError, match="refused this worker's key"):
            bad.attach("w-bad", Inbox(), timeout=2.0)
        bad.send("w-bad", "scheduler", Heartbeat(worker="w-bad"))
        assert b"w-bad" not in port.routes
        assert [d.sender for d in inbox.items] == ["w-good"]
    finally:
        good.close()
        bad.close()
        bus.close()


def test_binding_beyond_loopback_without_keys_needs_the_insecure_flag(tmp_path):
    with pytest.raises(ValueError, match="--insecure"):
        PeerPort(["tcp://0.0.0.0:0"])
    PeerPort(["tcp://0.0.0.0:0"], insecure=True)  # allowed, and says so by name
    text = scenario_text('local = 0\nremote = 1\nbind = "tcp://0.0.0.0:5999"')
    path = tmp_path / "open.toml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "actors.cli", "run", str(path)], cwd=ROOT,
                          env=env_with(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--insecure" in proc.stderr


FRAME = st.binary(max_size=64)
# Every envelope a peer can send except a registration (A), which would make it a peer.
ENVELOPE = st.one_of(
    st.lists(FRAME, min_size=0, max_size=6).filter(lambda fs: not fs or fs[0] != b"A"),
    st.tuples(st.just(b"M"), FRAME, FRAME, FRAME).map(list),
    st.tuples(st.just(b"M"), st.just(b"scheduler"), st.just(b"scheduler"), FRAME).map(list),
    st.just([b"P"]), st.tuples(st.just(b"D"), FRAME).map(list))


def test_a_fuzz_of_random_frames_leaves_the_broker_serving_and_counts_them():
    port = PeerPort(["tcp://127.0.0.1:0"], receivers=["scheduler"])
    bus = ZmqBus(peers=(port,))
    inbox = Inbox()
    bus.attach("scheduler", inbox)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(port.addresses[0])
    sent = [0]

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(ENVELOPE, min_size=1, max_size=8))
    def fuzz(envelopes):
        before = bus.stats.rejected_frames
        for frames in envelopes:
            raw.send_multipart(frames if frames else [b""])
        sent[0] += len(envelopes)
        # The broker reads one connection in order: once it has counted them all, a
        # check that it still answers is meaningful.
        wait_for(lambda: bus.stats.rejected_frames - before == len(envelopes), 5,
                 f"{len(envelopes)} rejections")

    try:
        fuzz()
        assert bus.stats.rejected_frames == sent[0]
        assert inbox.items == [] and port.routes == {}
        ok = RemoteEndpoint(port.addresses[0])  # still serving
        try:
            ok.attach("w-ok", Inbox())
            ok.send("w-ok", "scheduler", Heartbeat(worker="w-ok"))
            assert inbox.event.wait(5)
        finally:
            ok.close()
        # A registered peer's undecodable body is refused too.
        raw.send_multipart([b"A", b"w-raw"])
        assert raw.poll(5000) and raw.recv_multipart()[:2] == [b"a", b"w-raw"]
        before = bus.stats.rejected_frames
        raw.send_multipart([b"M", b"w-raw", b"scheduler", b"\xc1not msgpack"])
        wait_for(lambda: bus.stats.rejected_frames == before + 1, 5, "the bad body counted")
    finally:
        raw.close(0)
        ctx.destroy(0)
        bus.close()


def test_a_peer_may_not_take_a_coordinator_name_or_write_to_other_actors():
    port = PeerPort(["tcp://127.0.0.1:0"], receivers=["scheduler"])
    bus = ZmqBus(peers=(port,))
    planner = Inbox()
    bus.attach("planner", planner)
    ep = RemoteEndpoint(port.addresses[0])
    try:
        with pytest.raises(ConnectionRefusedError, match="name of a coordinator actor"):
            ep.attach("planner", Inbox(), timeout=5.0)  # refused at once, saying why
        ep.attach("w", Inbox())
        before = bus.stats.rejected_frames
        ep.send("w", "planner", Heartbeat(worker="w"))
        wait_for(lambda: bus.stats.rejected_frames > before, 5, "the refusal counted")
        assert planner.items == []
    finally:
        ep.close()
        bus.close()


def test_a_worker_reconnects_after_the_broker_restarts_and_registers_again():
    port_no = free_port()
    addr = f"tcp://127.0.0.1:{port_no}"
    reconnected = threading.Event()
    ep = RemoteEndpoint(addr, ping_interval=0.1, broker_timeout=0.5, backoff=0.05,
                        on_reconnect=reconnected.set)
    first = ZmqBus(peers=(PeerPort([addr], receivers=["scheduler"]),))
    try:
        ep.attach("w", Inbox())
        first.close()  # the coordinator goes away ...
        second = ZmqBus(peers=(PeerPort([addr], receivers=["scheduler"]),))  # ... comes back
        try:
            inbox = Inbox()
            second.attach("scheduler", inbox)
            assert reconnected.wait(10), "no reconnect within 10 s"
            ep.send("w", "scheduler", Heartbeat(worker="w"))
            assert inbox.event.wait(5)  # registered again: the new broker routes it
            assert ep.reconnects >= 1
        finally:
            second.close()
    finally:
        ep.close()


def test_a_quiet_line_is_pinged_after_a_third_of_the_broker_timeout_not_every_interval():
    addr = f"tcp://127.0.0.1:{free_port()}"
    bus = ZmqBus(peers=(PeerPort([addr], receivers=["scheduler"]),))
    # ping_interval alone would ping every 0.05 s; a third of broker_timeout is 0.5 s.
    ep = RemoteEndpoint(addr, ping_interval=0.05, broker_timeout=1.5)
    try:
        assert ep.ping_quiet == 0.5
        ep.attach("w", Inbox())
        attached = time.monotonic()   # the ack was the last frame heard
        wait_for(lambda: ep.pings >= 1, 10, "a ping on a quiet line")
        first_gap = ep.last_ping - attached
        assert first_gap >= 0.45, f"pinged {first_gap:.2f} s after the last frame"
        wait_for(lambda: ep.pings >= 2, 10, "a second ping")   # the first was answered
        assert ep.reconnects == 0
    finally:
        ep.close()
        bus.close()


# -- docs/remote.md ----------------------------------------------------------------------------


def test_the_python_example_of_the_remote_page_runs(tmp_path):
    text = (ROOT / "docs" / "remote.md").read_text()
    examples = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert examples, "docs/remote.md has no python example"
    for i, code in enumerate(examples):
        script = tmp_path / f"example_{i}.py"
        script.write_text(code)
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env_with(),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] == "2"  # both process workers joined


def test_a_worker_that_joins_before_the_registry_listens_joins_again():
    from actors.workers.remote import RemoteWorker
    from protocol import Stop

    port = PeerPort(["tcp://127.0.0.1:0"], receivers=["scheduler", "registry"])
    bus = ZmqBus(peers=(port,))
    worker = RemoteWorker(port.addresses[0], worker_id="w-early", allow=["scenarios"],
                          give_up=20)
    codes = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    try:
        # Its first Join finds no registry: dropped and counted ...
        wait_for(lambda: bus.stats.unroutable >= 1, 10, "the first Join to be dropped")
        hellos = Inbox()
        spec = _spec(package_version=__import__("actors.version").version.PACKAGE_VERSION)

        def registry(delivery) -> None:
            if isinstance(delivery.msg, Join):
                bus.send("registry", delivery.msg.worker, spec)
            elif isinstance(delivery.msg, Hello):
                hellos(delivery)

        bus.attach("registry", registry)
        bus.attach("scheduler", Inbox())
        # ... and the worker joins again until the spec comes, then says hello once.
        assert hellos.event.wait(10)
        hello = hellos.items[0].msg
        assert hello.worker == "w-early" and hello.fingerprint == spec.fingerprint
        assert hello.heartbeat == spec.heartbeat
        bus.send("scheduler", "w-early", Stop(reason="test over"))
        thread.join(10)
        assert codes == [0] and len(hellos.items) == 1
    finally:
        worker.done.set()
        thread.join(5)
        bus.close()


def test_refs_and_insecure_without_workers_in_other_processes_are_warned_about():
    import warnings

    from protocol.scenario import Workers

    kw = dict(tasks=router.tasks(), reward=router.reward, run=router.run,
              propose=router.propose, strategy=KeyedRules(router.CATEGORIES), rounds=1,
              n_workers=2)
    for extra, names in [({}, None),
                         ({"refs": {"tasks": "scenarios.router:tasks"}}, "refs only concern"),
                         ({"insecure": True, "workers": Workers(local=2)},
                          "insecure only concern"),
                         ({"refs": {"tasks": "scenarios.router:tasks"}, "insecure": True},
                          "refs and insecure only concern")]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            evolve(**kw, **extra)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if names is None:
            assert messages == []
        else:
            (message,) = messages
            assert message.startswith(names) and "ignored" in message
            assert caught[0].filename == __file__   # attributed to the caller's line


def test_evobus_keys_keeps_existing_pairs_and_says_so(tmp_path, capsys):
    from actors.cli.main import main

    keys = tmp_path / "keys"
    assert main(["keys", str(keys)]) == 0
    first = capsys.readouterr().out
    assert "(kept)" not in first
    secret = (keys / "server.key_secret").read_bytes()
    assert main(["keys", str(keys), "--client", "alice"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (keys / "server.key_secret").read_bytes() == secret   # never replaced
    kept = {line.split()[0] for line in lines if line.endswith("(kept)")}
    assert kept == {"server.key", "server.key_secret"}
    assert any(line.split()[0] == "alice.key_secret" and "(kept)" not in line
               for line in lines if line.startswith("  "))
    # The worker's command has every flag it needs (without --allow it refuses the run).
    command = next(line for line in lines if line.startswith("each worker: "))
    assert command == (f"each worker: evobus worker --connect tcp://HOST:PORT --allow PKG "
                       f"--key {keys}/NAME.key_secret --server-key {keys}/server.key")
    assert "NAME: alice (copy its NAME.key_secret and server.key there)" in "\n".join(lines)
