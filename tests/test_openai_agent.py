"""The OpenAI-compatible agent against a fake chat-completions server on 127.0.0.1.

The server is http.server in a thread, scripted per test: each request takes the next
scripted reply (status, body, headers, delay); requests are recorded. Retries sleep
through an injected function, so no test waits out a real backoff.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("httpx")

from actors.errors import ConfigError  # noqa: E402
from actors.openai_agent import LLMError, OpenAIAgent  # noqa: E402
from protocol import Task  # noqa: E402

pytestmark = pytest.mark.timeout(60)

KEY_ENV = "EVOBUS_TEST_LLM_KEY"


def completion(text: str, prompt_tokens: int = 10, completion_tokens: int = 3) -> dict:
    return {"id": "x", "object": "chat.completion", "model": "fake",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


class FakeServer:
    """Scripted replies; when the script runs out, ``default(request_json)`` answers."""

    def __init__(self, default=None) -> None:
        self.script: list[tuple[int, dict | str, dict, float]] = []
        self.requests: list[dict] = []
        self.default = default or (lambda body: (200, completion("ok"), {}, 0.0))
        self.release = threading.Event()  # ends any delayed reply at teardown
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real endpoints do

            def setup(self):
                super().setup()
                # Headers and body go out in two writes: without this, Nagle's algorithm
                # and delayed ACKs add 40 ms to every keep-alive request.
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                with server.lock:
                    server.requests.append({"path": self.path, "json": body,
                                            "headers": dict(self.headers)})
                    step = server.script.pop(0) if server.script else None
                status, payload, headers, delay = step or server.default(body)
                if delay:
                    server.release.wait(delay)
                data = payload if isinstance(payload, str) else json.dumps(payload)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data.encode())))
                    self.end_headers()
                    self.wfile.write(data.encode())
                except (BrokenPipeError, ConnectionResetError):  # the client timed out
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                                       name="fake-llm", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test-123")
    return "sk-test-123"


def make_agent(server, sleeps=None, **kw):
    kw.setdefault("api_key_env", KEY_ENV)
    kw.setdefault("backoff", 0.5)
    return OpenAIAgent(model="fake-model", base_url=server.url,
                       sleep=(sleeps.append if sleeps is not None else (lambda s: None)), **kw)


TASK = Task(id="t1", prompt="Where is my parcel?", meta={})


def test_solve_sends_the_artifact_as_system_and_the_task_as_user(server, key):
    server.script.append((200, completion("shipping", 12, 1), {}, 0))
    agent = make_agent(server)
    assert agent.solve("# Rules\nroute parcels to shipping", TASK) == "shipping"
    req = server.requests[0]
    assert req["path"] == "/v1/chat/completions"
    assert req["headers"]["Authorization"] == f"Bearer {key}"
    assert req["json"]["model"] == "fake-model" and req["json"]["temperature"] == 0.0
    assert req["json"]["messages"] == [
        {"role": "system", "content": "# Rules\nroute parcels to shipping"},
        {"role": "user", "content": "Where is my parcel?"}]


def test_token_usage_accumulates_across_requests(server, key):
    server.script += [(200, completion("a", 10, 2), {}, 0), (200, completion("b", 7, 5), {}, 0)]
    agent = make_agent(server)
    agent.solve("x", TASK)
    agent.solve("x", TASK)
    assert agent.usage.as_dict() == {"prompt_tokens": 17, "completion_tokens": 7,
                                     "total_tokens": 24, "requests": 2, "retries": 0,
                                     "failures": 0, "throttled_seconds": 0.0}


def test_a_429_is_retried_honouring_retry_after(server, key):
    server.script += [(429, {"error": {"message": "slow down"}}, {"Retry-After": "2"}, 0),
                      (200, completion("fine"), {}, 0)]
    sleeps: list[float] = []
    agent = make_agent(server, sleeps, backoff=0.1)
    assert agent.solve("x", TASK) == "fine"
    assert len(server.requests) == 2
    assert sleeps == [2.0]  # Retry-After wins over the (smaller) backoff
    assert agent.usage.retries == 1


def test_5xx_are_retried_with_growing_backoff(server, key):
    server.script += [(500, "boom", {}, 0), (503, "busy", {}, 0), (502, "gateway", {}, 0),
                      (200, completion("done"), {}, 0)]
    sleeps: list[float] = []
    agent = make_agent(server, sleeps, backoff=0.5, max_backoff=30, seed=7)
    assert agent.solve("x", TASK) == "done"
    assert len(server.requests) == 4
    assert len(sleeps) == 3
    # Each delay lies in [base * 2**attempt / 2, base * 2**attempt] (jitter), so they grow.
    for attempt, delay in enumerate(sleeps):
        assert 0.25 * 2 ** attempt <= delay <= 0.5 * 2 ** attempt, sleeps


def test_retries_give_up_with_the_last_error(server, key):
    server.default = lambda body: (500, {"error": "down for maintenance"}, {}, 0)
    sleeps: list[float] = []
    agent = make_agent(server, sleeps, max_retries=2, backoff=10, max_backoff=12)
    with pytest.raises(LLMError, match=r"gave up after 3 attempt\(s\).*500.*maintenance"):
        agent.solve("x", TASK)
    assert len(server.requests) == 3
    assert all(d <= 12 for d in sleeps)  # max_backoff caps every delay
    assert agent.usage.failures == 1


def test_a_timeout_is_retried_then_reported(server, key):
    server.default = lambda body: (200, completion("late"), {}, 5.0)
    agent = make_agent(server, max_retries=1, timeout=0.2)
    with pytest.raises(LLMError, match=r"gave up after 2 attempt\(s\): no answer within 0.2 s"):
        agent.solve("x", TASK)
    assert len(server.requests) == 2


def test_a_timeout_then_an_answer_succeeds(server, key):
    server.script.append((200, completion("late"), {}, 5.0))
    agent = make_agent(server, max_retries=2, timeout=0.2)
    assert agent.solve("x", TASK) == "ok"
    assert agent.usage.retries == 1


@pytest.mark.parametrize("status,hint", [(400, "refused"), (401, KEY_ENV), (404, "base_url")])
def test_other_4xx_fail_at_once_naming_status_and_fix(server, key, status, hint):
    server.script.append((status, {"error": {"message": "nope"}}, {}, 0))
    agent = make_agent(server)
    with pytest.raises(LLMError) as info:
        agent.solve("x", TASK)
    assert len(server.requests) == 1
    text = str(info.value)
    assert f"answered {status}" in text and "nope" in text and hint in text
    assert key not in text


def test_an_endpoint_that_refuses_connections_fails_at_once(key):
    agent = OpenAIAgent(model="m", base_url="http://127.0.0.1:9/v1", api_key_env=KEY_ENV,
                        max_retries=1, sleep=lambda s: None, connect_timeout=1)
    with pytest.raises(LLMError, match="cannot reach http://127.0.0.1:9/v1"):
        agent.solve("x", TASK)


def test_a_reply_that_is_not_a_completion_is_an_error(server, key):
    server.script.append((200, {"unexpected": True}, {}, 0))
    with pytest.raises(LLMError, match="not with a chat completion"):
        make_agent(server).solve("x", TASK)


def test_propose_fills_the_template_and_none_means_no_edit(server, key):
    server.script += [(200, completion("billing: refund, invoice"), {}, 0),
                      (200, completion("NONE"), {}, 0)]
    agent = make_agent(server, edit_format='Write it as "category: keywords".')
    assert agent.propose("# Rules", TASK, "unknown", 0.0) == "billing: refund, invoice"
    user = server.requests[0]["json"]["messages"][1]["content"]
    assert "# Rules" in user and "Where is my parcel?" in user and "unknown" in user
    assert "scored 0.00" in user and '"category: keywords"' in user
    assert agent.propose("# Rules", TASK, "unknown", 0.0) is None


def test_a_missing_key_variable_is_a_config_error_naming_it(monkeypatch, server):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"environment variable {KEY_ENV} is not set"):
        make_agent(server)


def test_an_endpoint_without_a_key_sends_no_authorization(server):
    agent = make_agent(server, api_key_env="")
    agent.solve("x", TASK)
    assert "Authorization" not in server.requests[0]["headers"]


def test_the_key_itself_is_refused_and_never_shown(server, key):
    with pytest.raises(ConfigError, match="never put the key"):
        OpenAIAgent(model="m", base_url=server.url, api_key="sk-secret")
    assert key not in repr(make_agent(server))


def test_a_bad_template_placeholder_is_a_config_error(server, key):
    with pytest.raises(ConfigError, match="solve_user has a bad placeholder"):
        make_agent(server, solve_user="{question}")


# -- end to end: a scenario file drives the agent through evobus run --------------------


def router_model(body: dict):
    """A fake model that knows the router domain: it routes by the keyword lists in the
    system message, and proposes the failed message's keyword for its category."""
    from scenarios import router

    system, user = body["messages"][0]["content"], body["messages"][1]["content"]
    if "improve the instructions" in system:
        prompt = re.search(r"^Task: (.*)$", user, re.MULTILINE).group(1)
        artifact = user.split("---\n")[1]
        kw = next(k for ks in router.KEYWORDS.values() for k in ks if k in prompt)
        category = next(c for c, ks in router.KEYWORDS.items() if kw in ks)
        task = Task(id="x", prompt=prompt, meta={"category": category, "keyword": kw})
        text = router.propose(artifact, task, "", 0.0)
    else:
        text = router.run(system, Task(id="x", prompt=user, meta={}))
    return 200, completion(text, prompt_tokens=len(system) // 4 + 5, completion_tokens=2), {}, 0


def agent_scenario(tmp_path, url: str, *, rounds: int, kwargs: str = "", tail: str = ""):
    """A router scenario whose agent is OpenAIAgent against ``url``, written to tmp_path."""
    scenario = tmp_path / "llm.toml"
    scenario.write_text(f'''name = "router-llm"
rounds = {rounds}
[domain]
tasks = "scenarios.router:tasks"
reward = "scenarios.router:reward"
[domain.agent]
ref = "actors.openai_agent:OpenAIAgent"
[domain.agent.kwargs]
base_url = "{url}"
model = "fake-router"
api_key_env = "{KEY_ENV}"
{kwargs}
[strategy]
kind = "KeyedRules"
categories = ["billing", "shipping", "technical", "account"]
{tail}''')
    return scenario


def test_a_scenario_runs_the_agent_against_the_endpoint(tmp_path, key, capsys):
    from actors.cli.main import main

    server = FakeServer(default=router_model)
    try:
        scenario = agent_scenario(tmp_path, server.url, rounds=15,
                                  kwargs='edit_format = "Write it as category: keywords."',
                                  tail="[budgets]\ntarget_reward = 1.0\n")
        assert main(["run", str(scenario), "--log", str(tmp_path / "llm.evolog")]) == 0
    finally:
        server.close()
    out = capsys.readouterr().out
    assert "held-out reward 0.000 -> 1.000" in out, out
    assert len(server.requests) > 100
    assert all(r["json"]["model"] == "fake-router" for r in server.requests)
    assert all(r["headers"]["Authorization"] == f"Bearer {key}" for r in server.requests)


@pytest.mark.slow   # ~6 s under load: a whole run over HTTP
def test_a_baseline_with_some_failed_calls_says_so_in_the_summary(tmp_path, key, capsys):
    """Two of the baseline's held-out calls get a 400 (the first two requests of the run:
    the baseline is scored before any round plans): they score 0 and the summary says
    how many failed and the first error, over real HTTP on 127.0.0.1."""
    from actors.cli.main import main

    server = FakeServer(default=router_model)
    server.script += [(400, {"error": {"message": "bad request, on purpose"}}, {}, 0)] * 2
    try:
        scenario = agent_scenario(tmp_path, server.url, rounds=1)
        assert main(["run", str(scenario), "--log", str(tmp_path / "llm.evolog")]) == 0
    finally:
        server.close()
    out = capsys.readouterr().out
    line = next((x for x in out.splitlines() if x.startswith("baseline: ")), None)
    assert line is not None, out
    assert re.match(r"baseline: 2 of \d+ held-out call\(s\) failed and scored 0", line), line
    assert "first error: " in line and "400" in line, line


@pytest.mark.slow   # ~6 s under load: a whole run over HTTP
def test_json_and_inspect_summary_carry_the_baselines_failed_calls(tmp_path, key, capsys):
    """The same partly failed baseline (two 400s over real HTTP on 127.0.0.1): `evobus
    run --json` says how many of its held-out calls failed and the first error, and
    `evobus inspect --summary` (text and --json) reads the same figures from the log."""
    from actors.cli.main import main

    server = FakeServer(default=router_model)
    server.script += [(400, {"error": {"message": "bad request, on purpose"}}, {}, 0)] * 2
    log = tmp_path / "llm.evolog"
    try:
        scenario = agent_scenario(tmp_path, server.url, rounds=1)
        assert main(["run", str(scenario), "--log", str(log), "--json", "--quiet"]) == 0
    finally:
        server.close()
    summary = json.loads(capsys.readouterr().out)
    baseline = summary["baseline"]
    assert baseline["failed"] == 2 and baseline["calls"] >= 2, baseline
    assert "400" in baseline["first_error"] and "on purpose" in baseline["first_error"]
    assert main(["inspect", str(log), "--summary", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["baseline"] == baseline
    assert main(["inspect", str(log), "--summary"]) == 0
    text = capsys.readouterr().out
    assert (f"baseline: 2 of {baseline['calls']} held-out call(s) failed and scored 0, so "
            f"the starting reward is partly unscored; first error: "
            f"{baseline['first_error']}") in text.splitlines(), text


def _in_flight_model(latency_s: float):
    """router_model answering after ``latency_s`` (a model's latency), counting the
    requests in flight at the server (now, most)."""
    lock, counts, pause = threading.Lock(), {"now": 0, "most": 0}, threading.Event()

    def model(body: dict):
        with lock:
            counts["now"] += 1
            counts["most"] = max(counts["most"], counts["now"])
        try:
            pause.wait(latency_s)   # never set: the latency itself
            return router_model(body)
        finally:
            with lock:
                counts["now"] -= 1

    return model, counts


@pytest.mark.parametrize("limit", [None, 2])
def test_a_gate_scored_over_http_fans_out_within_the_agents_max_concurrent(tmp_path, key,
                                                                          capsys, limit):
    """Two workers, calls of 10 ms over real HTTP: the held-out scoring has more than two
    requests in flight at the server (call_concurrency), and never more than the agent's
    ``max_concurrent`` when it has one."""
    from actors.cli.main import main

    model, counts = _in_flight_model(0.010)
    server = FakeServer(default=model)
    try:
        scenario = agent_scenario(
            tmp_path, server.url, rounds=1,
            kwargs="" if limit is None else f"max_concurrent = {limit}",
            tail="[workers]\nlocal = 2\ncall_concurrency = 8\n")
        assert main(["run", str(scenario), "--log", str(tmp_path / "llm.evolog"),
                     "--quiet"]) == 0
    finally:
        server.close()
    capsys.readouterr()
    if limit is None:
        assert counts["most"] > 2
    else:
        assert counts["most"] <= limit
