"""A run's rollouts against a model over real HTTP on 127.0.0.1, as a user runs it: an
OpenAIAgent scenario through `evobus run`, the fake chat-completions server of
tests/test_openai_agent.py telling train requests (a train task's solve, a proposal)
from held-out ones (a held-out task's solve) by the text of the task.

DataParallel leases do not chain by default, so a worker makes an unchained rollout
lease's calls up to ``call_concurrency`` at once once they are seen slow and waiting
(actors/workers/core.py ``_at_once``): more proposals (only a rollout lease proposes)
in flight at the server than there are workers, never more requests than the agent's
``max_concurrent``; an endpoint that answers 429 over K requests in flight still sees
the run through, each answered call counted once and the throttling reported; SIGTERM
mid-rollout stops the run with the log closed, and `evobus resume` finishes it; SIGTERM
while the rollouts sleep out a long Retry-After exits once the run has stopped, not
when those calls give up.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("httpx")

from actors.machines.planner import split_tasks  # noqa: E402
from bus.log import read_log  # noqa: E402
from protocol import RunDone, decode  # noqa: E402
from scenarios import router  # noqa: E402
from test_openai_agent import KEY_ENV, FakeServer, agent_scenario, router_model  # noqa: E402

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

#: The router's held-out split under a scenario's defaults (held_out_frac 0.4, seed 0).
_TASKS = router.tasks()
_HELD_OUT = {t.prompt for t in _TASKS
             if t.id in set(split_tasks([t.id for t in _TASKS], 0.4, 0)[1])}


def kind_of(body: dict) -> str:
    """What a request is, by its text: ``proposal`` (the propose template's system
    message; only a rollout lease proposes), ``heldout`` (a held-out task's solve: the
    gates' scoring) or ``train`` (a train task's solve: a rollout, or the Merger's
    screen of a diff on its own evidence task, which the budget counts as scoring)."""
    system, user = body["messages"][0]["content"], body["messages"][1]["content"]
    if "improve the instructions" in system:
        return "proposal"
    return "heldout" if user in _HELD_OUT else "train"


class Model:
    """router_model answering after ``latency`` seconds, counting the requests in flight
    at the server (``now``, ``most``) of all kinds, of the ``rollout`` kinds (train and
    proposal) and of proposals alone, and the ones it answered by kind (``ok``). With
    ``room`` set, a request arriving while ``room`` others are being answered gets a 429
    at once (Retry-After, as providers send it, and retry-after-ms, which the agent
    takes first: 10 ms), counted in ``limited``."""

    def __init__(self, latency: float, room: int | None = None, wanted: int = 1) -> None:
        self.latency, self.room, self.wanted = latency, room, wanted
        self.lock = threading.Lock()
        self.now = {"all": 0, "rollout": 0, "proposal": 0}
        self.most = dict(self.now)
        self.ok = {"train": 0, "proposal": 0, "heldout": 0}
        self.limited = 0
        #: ``wanted`` rollout requests (train solves, proposals) are being answered at once
        self.rollouts_seen = threading.Event()
        self._never = threading.Event()          # never set: the latency itself

    def __call__(self, body: dict):
        kind = kind_of(body)
        groups = {"train": ("all", "rollout"), "proposal": ("all", "rollout", "proposal"),
                  "heldout": ("all",)}[kind]
        with self.lock:
            if self.room is not None and self.now["all"] >= self.room:
                self.limited += 1
                return (429, {"error": {"message": "rate limit reached"}},
                        {"Retry-After": "1", "retry-after-ms": "10"}, 0)
            for g in groups:
                self.now[g] += 1
                self.most[g] = max(self.most[g], self.now[g])
            if self.now["rollout"] >= self.wanted:
                self.rollouts_seen.set()
        try:
            self._never.wait(self.latency)
            answer = router_model(body)
            with self.lock:
                self.ok[kind] += 1
            return answer
        finally:
            with self.lock:
                for g in groups:
                    self.now[g] -= 1


def run_in_process(tmp_path, model: Model, *, rounds: int, workers: int, kwargs: str = "",
                   capsys) -> list[str]:
    """`evobus run` of the router scenario against ``model`` (in this process): its
    output's lines."""
    from actors.cli.main import main

    server = FakeServer(default=model)
    try:
        scenario = agent_scenario(
            tmp_path, server.url, rounds=rounds, kwargs=kwargs,
            tail=f"[workers]\nlocal = {workers}\ncall_concurrency = 8\n")
        code = main(["run", str(scenario), "--log", str(tmp_path / "llm.evolog")])
    finally:
        server.close()
    out = capsys.readouterr().out
    assert code == 0, out
    return out.splitlines()


@pytest.mark.parametrize("limit", [None, 3])
def test_a_runs_rollouts_go_several_at_once_per_worker_within_max_concurrent(
        tmp_path, monkeypatch, capsys, limit):
    """Two workers (one lease at a time each), 20 ms calls: more proposals are in flight
    at the server at once than there are workers (only a rollout lease proposes, so the
    workers' rollout leases went several calls at once, not only the held-out scoring);
    with the agent's ``max_concurrent = 3``, never more than 3 requests of any kind at
    once."""
    monkeypatch.setenv(KEY_ENV, "sk-test-123")
    model = Model(latency=0.020)
    run_in_process(tmp_path, model, rounds=2, workers=2, capsys=capsys,
                   kwargs="" if limit is None else f"max_concurrent = {limit}")
    assert model.ok["train"] > 0 and model.ok["proposal"] > 0, model.ok
    if limit is None:
        assert model.most["proposal"] > 2 and model.most["rollout"] > 2, model.most
    else:
        assert model.most["all"] <= limit, model.most


def test_an_endpoint_refusing_over_k_in_flight_sees_the_run_through_each_call_once(
        tmp_path, monkeypatch, capsys):
    """Two workers of up to 8 calls at once against an endpoint that answers 429 to a
    request arriving while 3 are being answered: the run finishes (exit 0), its budget
    line counts exactly the requests the server answered (each call once, its retries
    not again: the proposals one for one, the solves as rollouts and scoring), and the
    throttling shows: the HTTP attempts are every request the server received, the
    retries its 429s, some seconds throttled."""
    monkeypatch.setenv(KEY_ENV, "sk-test-123")
    model = Model(latency=0.010, room=3)
    lines = run_in_process(tmp_path, model, rounds=2, workers=2, capsys=capsys)
    assert model.limited > 0, "no 429 sent: the test throttled nothing"
    assert model.most["all"] <= 3
    text = "\n".join(lines)
    calls = next((x for x in lines if x.startswith("budget: calls ")), None)
    assert calls is not None, text
    m = re.match(r"budget: calls ([\d,]+) \(rollout ([\d,]+), proposal ([\d,]+), "
                 r"scoring ([\d,]+)\)", calls)
    assert m, calls
    total, rollout, proposal, scoring = (int(g.replace(",", "")) for g in m.groups())
    ok = model.ok
    assert total == sum(ok.values()), (calls, ok)
    assert proposal == ok["proposal"], (calls, ok)
    assert rollout + scoring == ok["train"] + ok["heldout"], (calls, ok)
    assert rollout <= ok["train"] and scoring >= ok["heldout"], (calls, ok)
    rounds = [int(x) for x in re.findall(r"  (\d+) rollouts ", text)]
    assert len(rounds) == 2 and sum(rounds) == rollout, text
    requests = sum(ok.values()) + model.limited
    throttled = next((x for x in lines if "HTTP attempts" in x), None)
    assert throttled is not None, text
    m = re.search(r"([\d,]+) HTTP attempts, ([\d.]+) s throttled \(summed over calls\)",
                  throttled)
    assert m and int(m.group(1).replace(",", "")) == requests, (throttled, requests)
    assert float(m.group(2)) > 0, throttled
    tokens = next(x for x in lines if x.startswith("tokens: "))
    assert f"requests {total:,}, retries {model.limited:,}, failures 0" in tokens, tokens
    outcomes = next(x for x in lines if x.startswith("outcomes: "))
    assert "rollout-error" not in outcomes, outcomes


def _on_disk(log: Path) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # closed properly: no torn tail
        return [decode(r.body) for r in read_log(log).records]


def _env() -> dict[str, str]:
    env = dict(os.environ, **{KEY_ENV: "sk-test-123"})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    return env


def _sigterm_when(seen: threading.Event, proc: subprocess.Popen) -> tuple[str, float]:
    """SIGTERM to ``proc`` once ``seen`` is set (bounded): its stderr, and the seconds
    from the signal to its exit."""
    try:
        assert seen.wait(30), "the rollouts never reached the server in 30 s"
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=30)
        return err, time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _run_in_a_subprocess(tmp_path: Path, server, log: Path) -> subprocess.Popen:
    """`evobus run` of the agent scenario against ``server``, two workers, calls at once."""
    scenario = agent_scenario(tmp_path, server.url, rounds=2,
                              tail="[workers]\nlocal = 2\ncall_concurrency = 8\n")
    return subprocess.Popen([sys.executable, "-m", "actors.cli", "run", str(scenario),
                             "--log", str(log), "--quiet"], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow   # ~6 s: a run stopped mid-rollout in a subprocess, then resumed
def test_sigterm_mid_rollout_over_http_exits_143_and_resume_finishes_the_run(tmp_path):
    """`evobus run` in a subprocess against a slow endpoint (200 ms a call) is sent
    SIGTERM while more of its rollouts are at the server than it has workers: it exits
    143 within a few call times (the calls in flight end: a rollout and its proposal),
    the log closed (no torn tail, no RunDone) and naming `evobus resume`; the resume
    against the same endpoint finishes the run (exit 0, not already finished)."""
    model = Model(latency=0.200, wanted=3)   # 2 workers: a worker's calls at once
    server = FakeServer(default=model)
    log = tmp_path / "llm.evolog"
    try:
        proc = _run_in_a_subprocess(tmp_path, server, log)
        err, took = _sigterm_when(model.rollouts_seen, proc)
        assert proc.returncode == 143, err[-2000:]
        assert took < 5, f"{took:.1f} s from SIGTERM to exit with 200 ms calls"
        assert f"evobus resume {log}" in err, err[-2000:]
        messages = _on_disk(log)
        assert messages and not any(isinstance(m, RunDone) for m in messages)
        before = sum(model.ok.values())
        done = subprocess.run([sys.executable, "-m", "actors.cli", "resume", str(log),
                               "--json"], cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=45)
    finally:
        server.close()
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = json.loads(done.stdout.strip().splitlines()[-1])
    assert resumed["resumed"] == str(log) and not resumed["already_finished"], resumed
    assert resumed["error"] is None and resumed["final_reward"] is not None, resumed
    assert sum(model.ok.values()) > before   # the resume made its calls at the endpoint
    assert any(isinstance(m, RunDone) for m in _on_disk(Path(resumed["log"])))


@pytest.mark.slow   # ~12 s: the run's actors are given STOP_DEADLINE_S (10 s) to stop
def test_sigterm_while_rollouts_are_throttled_exits_once_the_run_has_stopped(tmp_path):
    """Rollouts told to come back in 30 s (429, Retry-After: 30) when SIGTERM comes: the
    workers are still in those calls (the agent sleeps out the Retry-After, up to its
    retry_deadline), so the run leaves them behind after its stop deadline, closes the
    log and exits 143 then, not once the calls give up (a worker's thread is a daemon,
    as its call pool's are: it keeps no process alive)."""
    from actors.runtime.runtime import STOP_DEADLINE_S

    seen = threading.Event()

    def model(body: dict):
        if kind_of(body) == "heldout":   # the baseline is scored; rollouts are throttled
            return router_model(body)
        seen.set()
        return (429, {"error": {"message": "slow down"}}, {"Retry-After": "30"}, 0)

    server = FakeServer(default=model)
    log = tmp_path / "llm.evolog"
    try:
        proc = _run_in_a_subprocess(tmp_path, server, log)
        err, took = _sigterm_when(seen, proc)
    finally:
        server.close()
    assert proc.returncode == 143, err[-2000:]
    assert took < STOP_DEADLINE_S + 8, (
        f"{took:.1f} s from SIGTERM to exit: the process waited for the throttled calls")
    assert f"evobus resume {log}" in err, err[-2000:]
    messages = _on_disk(log)
    assert messages and not any(isinstance(m, RunDone) for m in messages)
