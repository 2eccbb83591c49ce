"""Parallel groups on workers in other processes: `evobus worker --connect` processes with
CURVE keys, process workers, a worker killed mid-group, a question answered by
`evobus resume` with the worker reconnected, and the refusals made before the first call.

Loopback only. Every wait has a deadline; a test waits on files the target writes or on
a process's output, never on a sleep.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from actors import Budgets, ConfigError, run_group
from actors.groups import load_checkpoint, resume_group
from actors.groups.fleet import NESTED_PER_SLOT, Fleet
from actors.cli.main import main
from protocol import HostCall
from protocol.scenario import Workers
from tests import group_remote_domain as domain
from tests.test_remote import ROOT, env_with, free_port, wait_for

HEARTBEAT, DEADLINE = 0.2, 1.0
#: How long a group waits for its `evobus worker --connect` processes to register (and a
#: worker for the coordinator): a bound on that event, wide enough for a Python start on
#: a loaded 2-core machine, and with the waits after it still inside pytest-timeout.
REGISTER_S = 45


class Workers_:
    """`evobus worker --connect` processes, reaped at the end."""

    def __init__(self, tmp: Path, keys: Path | None, **env) -> None:
        self.tmp = tmp
        self.keys = keys
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.env = env_with(**env)
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *extra: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "actors.cli", "worker", "--connect", self.addr,
                "--id", name, "--allow", "tests.group_remote_domain", "--give-up", str(REGISTER_S),
                "--broker-timeout", "2", *extra]
        if self.keys is not None:
            argv += ["--key", str(self.keys / f"{name}.key_secret"),
                     "--server-key", str(self.keys / "server.key")]
        out = open(self.tmp / f"{name}.log", "w")
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=out, stderr=out, text=True)
        out.close()
        self.procs.append(proc)
        return proc

    def section(self, n: int, **kw) -> Workers:
        return Workers(local=0, remote=n, bind=self.addr,
                       keys=str(self.keys) if self.keys else None, heartbeat=HEARTBEAT,
                       deadline=DEADLINE, wait_seconds=REGISTER_S, **kw)

    def said(self) -> str:
        return "\n".join(f"{p.name}:\n{p.read_text()[-1500:]}"
                         for p in sorted(self.tmp.glob("w*.log")))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture
def fleet(tmp_path):
    made: list[Workers_] = []

    def make(keys: Path | None = None, **env) -> Workers_:
        made.append(Workers_(tmp_path, keys, **env))
        return made[-1]

    yield make
    for w in made:
        w.close()


@pytest.fixture
def keys(tmp_path) -> Path:
    root = tmp_path / "keys"
    assert main(["keys", str(root), "--client", "w0", "--client", "w1"]) == 0
    return root


def start_group(box: dict, *args, **kw) -> threading.Thread:
    """`run_group(*args, **kw)` on a thread: its outcome in ``box["out"]``, or what it
    raised in ``box["error"]`` (a group whose workers never registered, say)."""
    def run() -> None:
        try:
            box["out"] = run_group(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - the test's thread reports it
            box["error"] = exc

    group = threading.Thread(target=run, daemon=True)
    group.start()
    return group


def wait_for_hang(box: dict, marker: Path, w: Workers_, what: str) -> int:
    """The pid of the worker whose branch wrote ``marker`` and hangs. The bound covers
    the workers' registration (REGISTER_S) and the branches before it; a group that
    raised (no workers registered) fails at once with its error."""
    try:
        pid = wait_for(lambda: "error" in box or (marker.exists()
                                                  and marker.read_text().strip()),
                       REGISTER_S + 25, f"{what} to hang")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{w.said()}") from None
    assert "error" not in box, f"{box['error']!r}\n{w.said()}"
    return int(pid)


def test_a_group_of_200_items_over_two_curve_workers_returns_results_in_input_order(
        fleet, keys, caplog):
    w = fleet(keys)
    w.start("w0")
    w.start("w1")
    with caplog.at_level(logging.INFO, logger="actors.groups.fleet"):
        out = run_group("tests.group_remote_domain:square", list(range(200)),
                        max_concurrency=8, max_items=200, workers=w.section(2))
    # The wait said who joined, from which address with which key, and when all were in.
    said = [r.getMessage() for r in caplog.records if r.name == "actors.groups.fleet"]
    joins = sorted(line.split(" (")[0] for line in said if " joined from " in line)
    assert joins == [f"worker {n} joined from 127.0.0.1 with key {n}" for n in ("w0", "w1")]
    assert [line.split(" (")[1][:6] for line in said if " joined from " in line] == [
        "1 of 2", "2 of 2"], said
    assert said[-1].startswith("all 2 worker(s) joined after ") and said[-1].endswith(
        "; the group starts"), said
    assert out.status == "completed", (out.error, w.said())
    assert out.results == [i * i for i in range(200)]
    assert out.consumed.calls == 200   # counted by the relay from the answers
    remote = out.stats["remote"]
    assert remote["workers_joined"] == 2 and remote["late"] == 0
    assert set(remote["served"]) == {"w0", "w1"} and sum(remote["served"].values()) == 200


def test_a_worker_killed_mid_group_has_its_branches_finish_elsewhere_each_effect_once(
        fleet, tmp_path):
    w = fleet(EVOBUS_TEST_HANG=1)
    w.start("w0")
    w.start("w1")
    count, marker = tmp_path / "effects.txt", tmp_path / "hanging"
    items = [{"i": i, "log": str(count), "hang_at": 25, "marker": str(marker)}
             for i in range(60)]
    box: dict = {}
    group = start_group(box, "tests.group_remote_domain:counted", items, max_concurrency=4,
                        max_items=60, workers=w.section(2))
    # Branch 25 ran its effect (journaled with the coordinator) and hangs on one worker.
    os.kill(wait_for_hang(box, marker, w, "branch 25"), signal.SIGKILL)
    group.join(30)
    assert not group.is_alive(), w.said()
    out = box["out"]
    assert out.status == "completed", (out.error, w.said())
    assert out.results == [i * 10 for i in range(60)]
    lines = count.read_text().split()
    assert sorted(map(int, lines)) == list(range(60)), "an effect ran twice or never"
    # A branch of the killed worker's lease that had ended there ran again elsewhere,
    # its effect replayed from the journal and its store write answered from the first.
    assert out.store["done"] == 60
    # Every branch answered once (the killed worker never answered branch 25).
    assert sum(out.stats["remote"]["served"].values()) == 60


def test_a_question_on_a_remote_worker_is_answered_by_evobus_resume_after_it_reconnects(
        fleet, tmp_path):
    w = fleet()
    proc = w.start("w0")
    ckpt = tmp_path / "ask.ckpt"
    out = run_group("tests.group_remote_domain:asking", [0, 1, 2, 3], max_concurrency=2,
                    max_items=4, checkpoint=ckpt, workers=w.section(1))
    assert out.status == "user_input_pending", (out.error, w.said())
    assert out.finished == [0, 2, 3]
    (pending,) = out.pending_interactions
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({pending.id: "yes"}))
    resumed = subprocess.run(
        [sys.executable, "-m", "actors.cli", "resume", str(ckpt), "--answers", str(answers),
         "--json"], cwd=ROOT, env=w.env, capture_output=True, text=True, timeout=60)
    assert resumed.returncode == 0, (resumed.stderr, w.said())
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["results"] == ["0:auto", "1:yes", "2:auto", "3:auto"]
    assert proc.poll() is None, "the same worker process served both coordinators"
    assert "joining again" in (tmp_path / "w0.log").read_text()


def test_process_workers_run_a_group_with_the_store_and_effects(tmp_path):
    count = tmp_path / "effects.txt"
    items = [{"i": i, "log": str(count)} for i in range(20)]
    out = run_group("tests.group_remote_domain:counted", items, max_concurrency=4,
                    max_items=20, store={"done": 0},
                    workers=Workers(local=0, processes=2, heartbeat=HEARTBEAT,
                                    deadline=DEADLINE))
    assert out.status == "completed", out.error
    assert out.results == [i * 10 for i in range(20)]
    assert out.store == {"done": 20}
    assert sorted(map(int, count.read_text().split())) == list(range(20))


def test_a_callable_that_cannot_be_named_is_refused_for_process_workers_before_any_call():
    calls = []

    def local(x) -> int:
        calls.append(x)
        return x

    with pytest.raises(ConfigError, match="closure"):
        run_group(local, [1, 2], max_concurrency=1, max_items=2,
                  workers=Workers(local=0, processes=1))
    assert calls == []


def test_a_target_outside_the_workers_allowlist_is_refused_by_the_worker(fleet):
    w = fleet()
    w.start("w0")   # --allow tests.group_remote_domain only
    with pytest.raises(ConfigError, match=r"w0 refused the group's target.*allowlist"):
        run_group("tests.remote_domain:reward", [1], max_concurrency=1, max_items=1,
                  workers=w.section(1))


def test_workers_with_only_local_threads_run_the_group_here():
    out = run_group(domain.square, [1, 2, 3], max_concurrency=2, max_items=3,
                    workers=Workers(local=2))
    assert out.results == [1, 4, 9] and "remote" not in out.stats


def test_a_scenarios_groups_run_on_the_process_workers_of_its_workers_section(
        tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the group's log goes under runs/ here
    scenario = tmp_path / "fan.toml"
    scenario.write_text(
        'name = "fan"\n\n[[groups]]\nname = "squares"\n'
        'target = "tests.group_remote_domain:square"\nitems = [1, 2, 3, 4, 5]\n'
        'max_concurrency = 2\nmax_items = 5\n'
        f'checkpoint = "{tmp_path / "fan.ckpt"}"\n\n'
        f'[workers]\nlocal = 0\nprocesses = 2\nheartbeat = {HEARTBEAT}\ndeadline = {DEADLINE}\n')
    assert main(["run", str(scenario), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["results"] == [1, 4, 9, 16, 25]


def _starts_in_order(starts: list[int], bound: int) -> list[tuple[int, list[int]]]:
    """Each start that came before a branch ``bound`` or more below it had started."""
    seen: set[int] = set()
    ahead = []
    for j in starts:
        behind = [i for i in range(j - bound + 1) if i not in seen]
        if behind:
            ahead.append((j, behind))
        seen.add(j)
    return ahead


@pytest.mark.slow
def test_a_group_on_thread_and_process_workers_starts_its_branches_in_input_order(tmp_path):
    """Thread workers here and a process worker share one start order (kept here): a
    branch on either starts only once every branch ``bound`` or more below it has, on
    either. The start of a branch elsewhere counts once the worker says it began."""
    n, bound = 40, 3
    starts = tmp_path / "starts.txt"
    items = [{"i": i, "log": str(starts), "ms": 20} for i in range(n)]
    out = run_group("tests.group_remote_domain:stamped", items, max_concurrency=bound,
                    max_items=n, trace=True,
                    workers=Workers(local=2, processes=1, heartbeat=HEARTBEAT,
                                    deadline=DEADLINE))
    assert out.status == "completed", out.error
    assert out.results == list(range(n))
    assert out.stats["remote"]["served"].get("proc-0", 0) > 0, out.stats["remote"]
    first = list(dict.fromkeys(i for kind, i in out.trace if kind == "start"))
    assert sorted(first) == list(range(n))
    assert _starts_in_order(first, bound) == [], first
    assert sorted(map(int, starts.read_text().split())) == list(range(n))


PROCS = dict(local=0, processes=2, heartbeat=HEARTBEAT, deadline=DEADLINE)


def test_a_branch_error_on_a_process_worker_fails_the_group_and_cancels_the_rest():
    out = run_group("tests.group_remote_domain:fails_first", list(range(8)),
                    max_concurrency=4, max_items=8, workers=Workers(**PROCS))
    assert out.status == "failed" and out.error_branch == 0
    assert "item 0 is bad" in str(out.error)
    # The others were cancelled or never started (which, depends on how far the workers
    # had got when branch 0 raised); none ran out its 60 s.
    assert not out.finished and out.stats["elapsed"] < 30.0
    assert sorted(out.cancelled + out.never_started + out.abandoned) == list(range(1, 8))


def test_a_calls_budget_is_charged_on_the_coordinator_for_branches_on_process_workers():
    out = run_group("tests.group_remote_domain:spends", list(range(10)),
                    max_concurrency=2, max_items=10, budgets=Budgets(calls=4),
                    workers=Workers(**PROCS))
    assert out.status == "failed" and type(out.error).__name__ == "BudgetExhausted"
    assert out.consumed.calls == 4


def test_a_cost_budget_is_charged_on_the_coordinator_by_ctx_spend_on_process_workers():
    out = run_group("tests.group_remote_domain:spends", list(range(10)),
                    max_concurrency=2, max_items=10, budgets=Budgets(cost=5.0),
                    workers=Workers(**PROCS))
    assert out.status == "failed" and type(out.error).__name__ == "BudgetExhausted"
    assert out.consumed.cost == 5.0


def test_a_process_worker_that_dies_mid_group_is_reported_lost_and_its_respawn_takes_over(
        tmp_path):
    items = [{"i": i, "die_at": 5, "marker": str(tmp_path / "died")} for i in range(20)]
    out = run_group("tests.group_remote_domain:dies_once", items, max_concurrency=2,
                    max_items=20, workers=Workers(**PROCS))
    assert out.status == "completed", out.error
    assert out.results == list(range(20))
    remote = out.stats["remote"]
    assert remote["lost_workers"] >= 1 and sum(remote["served"].values()) == 20


def test_a_group_on_process_workers_replays_from_its_log(tmp_path):
    log = tmp_path / "group.evolog"
    out = run_group("tests.group_remote_domain:square", list(range(30)), max_concurrency=4,
                    max_items=30, log=str(log), workers=Workers(**PROCS))
    assert out.status == "completed" and out.results == [i * i for i in range(30)]
    assert main(["replay", str(log)]) == 0   # the Collector's outputs, message for message


def _tally_items(n: int, marker: Path, **extra) -> list[dict]:
    return [{"i": i, "hang_at": n // 2, "marker": str(marker), **extra} for i in range(n)]


def _assert_written_once(out, n: int) -> None:
    assert out.status == "completed", out.error
    assert out.results == list(range(n))
    store = out.store
    assert (store["before"], store["seen"], store["after"]) == (n, n, 2 * n), store
    # Each branch's set got the value its own first incr of "seen" answered: all differ.
    assert sorted(store[f"b{i}"] for i in range(n)) == list(range(1, n + 1))


def test_store_writes_count_once_when_a_remote_worker_is_killed_mid_group(fleet, tmp_path):
    w = fleet()
    w.start("w0")
    w.start("w1")
    marker = tmp_path / "hanging"
    box: dict = {}
    group = start_group(box, "tests.group_remote_domain:tallied", _tally_items(40, marker),
                        max_concurrency=4, max_items=40, chunk=4, workers=w.section(2))
    # Branch 20 wrote the store (with the coordinator) and hangs on one worker, its
    # lease's earlier branches done there but not answered: all of them run again.
    os.kill(wait_for_hang(box, marker, w, "branch 20"), signal.SIGKILL)
    group.join(30)
    assert not group.is_alive(), w.said()
    out = box["out"]
    _assert_written_once(out, 40)
    assert out.stats["remote"]["store_repeated"] >= 3, out.stats["remote"]


def test_store_writes_count_once_when_a_process_worker_dies_mid_group(tmp_path):
    out = run_group("tests.group_remote_domain:tallied",
                    _tally_items(30, tmp_path / "died", exit=True), max_concurrency=2,
                    max_items=30, chunk=3, workers=Workers(**PROCS))
    _assert_written_once(out, 30)
    assert out.stats["remote"]["lost_workers"] >= 1
    assert out.stats["remote"]["store_repeated"] >= 3, out.stats["remote"]


_COORDINATOR = """
import sys
from actors import run_group
from protocol.scenario import Workers
items = [{"i": i, "dir": sys.argv[2]} for i in range(6)]
run_group("tests.group_remote_domain:gated", items, max_concurrency=2, max_items=6,
          chunk=1, checkpoint=sys.argv[1],
          workers=Workers(local=0, processes=2, heartbeat=0.2, deadline=1.0))
"""


def test_a_coordinator_killed_mid_group_leaves_its_workers_and_where_branches_ran_to_resume(
        tmp_path):
    ckpt = tmp_path / "group.ckpt"
    proc = subprocess.Popen([sys.executable, "-c", _COORDINATOR, str(ckpt), str(tmp_path)],
                            cwd=ROOT, env=env_with(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # Branches 0 and 1 run, one on each process worker; then the whole machine dies
        # (the coordinator and its workers, one process group, kill -9).
        wait_for(lambda: len(list(tmp_path.glob("started-*"))) >= 2 or proc.poll() is not None,
                 60, "two branches to start")
        assert proc.poll() is None, proc.stderr.read()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    running = load_checkpoint(ckpt)
    assert running.status == "running"
    assert running.workers is not None and running.workers.processes == 2
    (tmp_path / "go").write_text("")
    out = resume_group(ckpt)
    assert out.status == "completed", out.error
    assert out.results == list(range(6))
    remote = out.stats["remote"]   # the resume ran on process workers again
    assert remote["workers_joined"] == 2
    # Where each branch was when the machine died: 0 and 1 running, one per worker; the
    # lease each worker held queued behind (prefetch) is named too.
    held = remote["held_before"]
    assert {0, 1} <= set(held) <= {0, 1, 2, 3}, held
    assert {held[0], held[1]} == {"proc-0", "proc-1"}, held


def _fan_expected(n: int) -> list[int]:
    return [sum(k * k for k in range(3 * i, 3 * i + 3)) for i in range(n)]


def test_a_branch_on_a_process_worker_runs_a_nested_group_on_the_coordinator(tmp_path):
    effects = tmp_path / "inner.txt"
    items = [{"i": i} for i in range(8)]
    out = run_group("tests.group_remote_domain:fans_out", items, max_concurrency=4,
                    max_items=8, store={"log": str(effects)}, workers=Workers(**PROCS))
    assert out.status == "completed", out.error
    assert out.results == _fan_expected(8)
    assert out.store["inner"] == 24 and out.store["outer"] == 8
    assert out.consumed.calls == 8 + 24   # the nested starts count in the group's budget
    assert len(effects.read_text().split()) == 24


def test_a_nested_group_from_a_process_worker_shares_the_groups_calls_budget():
    items = [{"i": i} for i in range(6)]
    out = run_group("tests.group_remote_domain:fans_out", items, max_concurrency=2,
                    max_items=6, budgets=Budgets(calls=10), workers=Workers(**PROCS))
    # A start hit the budget: an outer one, or a nested one (then its branch failed with
    # the nested group's error), whichever came first.
    assert out.status == "failed" and "the calls budget (10) is used up" in str(out.error)
    assert out.consumed.calls == 10


def test_a_nested_groups_failure_comes_back_to_the_remote_branch_and_bad_options_are_refused():
    out = run_group("tests.group_remote_domain:nested_outcome", ["fails", "refused", "plain"],
                    max_concurrency=2, max_items=3, workers=Workers(**PROCS))
    assert out.status == "completed", out.error
    failed, refused, plain = out.results
    assert "call ctx.parallel()/ctx.run_group() there" in plain["refused"]
    assert failed["status"] == "failed" and failed["error"] == "KeyError"
    assert failed["error_branch"] == 2
    assert "option 'log_overwrite' cannot travel to the coordinator" in refused["refused"]


def test_a_remote_branch_killed_after_its_nested_group_runs_it_again_without_double_writes(
        fleet, tmp_path):
    w = fleet()
    w.start("w0")
    w.start("w1")
    effects, marker = tmp_path / "inner.txt", tmp_path / "hanging"
    items = [{"i": i, "hang_at": 5, "marker": str(marker)} for i in range(12)]
    box: dict = {}
    group = start_group(box, "tests.group_remote_domain:fans_out", items, max_concurrency=4,
                        max_items=12, store={"log": str(effects)}, workers=w.section(2))
    os.kill(wait_for_hang(box, marker, w, "branch 5"), signal.SIGKILL)
    group.join(30)
    assert not group.is_alive(), w.said()
    out = box["out"]
    assert out.status == "completed", (out.error, w.said())
    assert out.results == _fan_expected(12)
    # Branch 5's nested group ran twice (under two group ids); its effects and store
    # writes counted once, found under the branch's scope.
    assert out.store["inner"] == 36 and out.store["outer"] == 12, out.store
    assert len(effects.read_text().split()) == 36


def test_nested_groups_asked_for_past_four_per_remote_slot_are_refused_by_name():
    fleet = Fleet(Workers(**PROCS), gid="g1")
    try:
        got: queue.SimpleQueue = queue.SimpleQueue()
        fleet.bus.attach("w9", lambda d: got.put(d.msg))
        fleet.proxies = ["remote.g1.0"]
        fleet.nesting = NESTED_PER_SLOT
        fleet._on_call(HostCall(group_id="g1", worker="w9", op="group.run", call_id="c1",
                                args=["0.1/", "tests.group_remote_domain:square", [1], 1, 1,
                                      {}, ""]))
        reply = got.get(timeout=10)
        assert reply.call_id == "c1" and reply.error_type == "GroupError"
        assert "4 per remote slot at most" in reply.error and fleet.nesting == NESTED_PER_SLOT
    finally:
        fleet.runtime.close()


def test_a_turn_elsewhere_is_given_when_it_comes_and_not_now_past_the_wait():
    """The coordinator's half of starts in input order for branches elsewhere: a turn
    that has come is given at once (the start is marked only when the worker reports
    it), one that has not is given once the branches before it start here, or answered
    "not now" after ORDER_WAIT_S (the worker sends the rest of its lease back), and a
    branch that is not the group's is refused by name."""
    from actors.groups.fleet import ORDER_WAIT_S
    from actors.groups.host import _StartOrder

    class Host:   # what Fleet._turn reads of a group's host
        cancelled = holding = False
        trace = None
        order = _StartOrder(6, 2)

    fleet = Fleet(Workers(**PROCS), gid="g1")
    try:
        got: queue.SimpleQueue = queue.SimpleQueue()
        fleet.bus.attach("w9", lambda d: got.put(d.msg))
        fleet.proxies, fleet.host = ["remote.g1.0"], Host()
        order = Host.order

        def turn(j, call_id):
            fleet._on_call(HostCall(group_id="g1", worker="w9", op="order.turn",
                                    call_id=call_id, args=[j]))

        turn(1, "c1")
        reply = got.get(timeout=10)
        assert (reply.call_id, reply.value) == ("c1", True) and not order.started[1]
        fleet._on_call(HostCall(group_id="g1", worker="w9", op="order.mark", args=[1]))
        assert order.started[1]
        turn(3, "c2")          # needs 0 and 1 started: 0 starts here, then it is given
        order.mark(0)
        reply = got.get(timeout=10)
        assert (reply.call_id, reply.value) == ("c2", True)
        turn(5, "c3")          # needs 0-3: 2 and 3 never start
        reply = got.get(timeout=10 + ORDER_WAIT_S)
        assert (reply.call_id, reply.value) == ("c3", False) and fleet.turns == 0
        turn(6, "c4")
        reply = got.get(timeout=10)
        assert reply.error_type == "ValueError" and "not one of the group's 6" in reply.error
    finally:
        fleet.runtime.close()


def test_workers_joining_at_once_are_each_said_in_the_order_they_joined(caplog):
    """Both Hellos already queued when the wait looks (the second worker joined while the
    first was being said): each is said, counted 1 of 2 then 2 of 2, before the group
    starts. The join count alone would end the wait with the second one unsaid."""
    from protocol import Hello

    port = free_port()
    fleet = Fleet(Workers(local=0, remote=2, bind=f"tcp://127.0.0.1:{port}",
                          wait_seconds=5), gid="g1")
    try:
        fleet._joined = lambda: 2   # both in, as the registry thread recorded them
        for name in ("w0", "w1"):
            fleet.events.put(Hello(worker=name))
        with caplog.at_level(logging.INFO, logger="actors.groups.fleet"):
            fleet.connect()
    finally:
        fleet.close()
    said = [r.getMessage() for r in caplog.records if " joined" in r.getMessage()]
    assert [line.split(" (")[0] for line in said[:2]] == ["worker w0 joined",
                                                          "worker w1 joined"], said
    assert [line.split(" (")[1][:6] for line in said[:2]] == ["1 of 2", "2 of 2"], said
    assert said[-1].startswith("all 2 worker(s) joined after "), said
