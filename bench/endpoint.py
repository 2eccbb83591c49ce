"""A simulated model endpoint: an OpenAI-compatible chat-completions server on 127.0.0.1,
for the fault tests and the benchmarks (real sockets, real HTTP; never product code).

    with SimulatedEndpoint(rps=20, latency=0.05, sigma=0.5, seed=1) as ep:
        agent = OpenAIAgent(model="sim", base_url=ep.url, api_key_env="")
        ...
    ep.counts  # what the server received and how it answered

What it does to each ``POST /v1/chat/completions``, in this order:

- ``rps``: at most this many requests are accepted in any sliding second; the others get
  ``429`` with ``Retry-After`` (whole seconds, rounded up, as HTTP says) and
  ``retry-after-ms`` (what OpenAI's servers also send);
- ``throttle``: this fraction of the accepted requests still gets a ``429`` (with
  ``Retry-After: 0``): a provider that pushes back for its own reasons;
- ``errors``: this fraction gets a ``503`` (``Retry-After: 0``) or a ``500``, half each;
- ``stalls``: this fraction waits ``stall_seconds`` before answering (the client's
  timeout should fire first);
- every other request waits a lognormal latency (median ``latency`` seconds, shape
  ``sigma``) and answers ``reply(body)`` with token usage: prompt tokens are the words of
  the messages, completion tokens the words of the reply.

Draws come from one ``random.Random(seed)`` in arrival order. ``counts`` holds
``requests``, ``ok``, ``rate_limited`` (over ``rps``), ``throttled``, ``errors``,
``stalls``, ``prompt_tokens`` and ``completion_tokens`` (of the answers sent),
``max_call_tokens`` (the most one answer used), and ``peak_concurrent``
(requests being handled at once); ``ok_times`` holds the clock (``time.monotonic()``)
of each 200 sent, ``limited_times`` of each request refused over ``rps``. ``stop()`` ends any stall at once.
"""

from __future__ import annotations

import collections
import importlib
import json
import math
import os
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

#: How the default model answers: the last user message, reversed word by word for a
#: solve, a one-line rule naming the task for a propose (its prompt asks for an edit).
def default_reply(body: dict[str, Any]) -> str:
    messages = body.get("messages") or [{}]
    user = str(messages[-1].get("content", ""))
    if "Propose one edit" in user:
        task = next((line[6:] for line in user.splitlines() if line.startswith("Task: ")), "")
        return f"When asked {task.strip()!r}, answer carefully."
    return " ".join(reversed(user.split()))


class SimulatedEndpoint:
    def __init__(self, *, rps: float | None = None, latency: float = 0.0, sigma: float = 0.0,
                 throttle: float = 0.0, errors: float = 0.0, stalls: float = 0.0,
                 stall_seconds: float = 30.0, seed: int = 0,
                 reply: Callable[[dict[str, Any]], str] | str = default_reply,
                 model: str = "sim") -> None:
        for name, value in (("throttle", throttle), ("errors", errors), ("stalls", stalls)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"SimulatedEndpoint({name}={value!r}): a fraction in [0, 1]")
        self.rps, self.latency, self.sigma = rps, latency, sigma
        self.throttle, self.errors, self.stalls = throttle, errors, stalls
        if isinstance(reply, str):  # "module:function" (an endpoint in its own process)
            module, _, name = reply.partition(":")
            reply = getattr(importlib.import_module(module), name)
        self.stall_seconds, self.seed, self.reply, self.model = stall_seconds, seed, reply, model
        self.counts: dict[str, int] = collections.Counter()
        self.ok_times: list[float] = []   # time.monotonic() of each 200 sent
        self.limited_times: list[float] = []  # time.monotonic() of each 429 over ``rps``
        self._rng = random.Random(seed)
        self._accepted: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._active = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, port: int = 0) -> "SimulatedEndpoint":
        """Listen on 127.0.0.1:``port`` (0: a free port)."""
        self._stopping.clear()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._httpd.daemon_threads = True
        self._httpd.request_queue_size = 128
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,),
                                        name="simulated-endpoint", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._httpd = None

    def __enter__(self) -> "SimulatedEndpoint":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    # -- one request ----------------------------------------------------------------------

    def decide(self) -> tuple[str, float]:
        """What to do with a request arriving now: ``(what, value)`` where ``what`` is
        ``rate_limited`` (value: seconds until a slot frees), ``throttled``, ``error503``,
        ``error500``, ``stall`` or ``ok`` (value: the latency)."""
        with self._lock:
            self.counts["requests"] += 1
            now = time.monotonic()
            if self.rps is not None:
                window = self._accepted
                while window and now - window[0] >= 1.0:
                    window.popleft()
                if len(window) >= self.rps:
                    self.counts["rate_limited"] += 1
                    self.limited_times.append(now)
                    return "rate_limited", window[0] + 1.0 - now
                window.append(now)
            draw = self._rng.random()
            for what, share in (("throttled", self.throttle), ("error", self.errors),
                                ("stall", self.stalls)):
                if draw < share:
                    if what == "error":
                        what = "error503" if self._rng.random() < 0.5 else "error500"
                    self.counts["errors" if what.startswith("error") else
                                "throttled" if what == "throttled" else "stalls"] += 1
                    return what, self.stall_seconds
                draw -= share
            latency = (self._rng.lognormvariate(math.log(self.latency), self.sigma)
                       if self.latency > 0 else 0.0)
            return "ok", latency

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        text = self.reply(body)
        prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
        completion = len(text.split())
        with self._lock:
            self.counts["ok"] += 1
            self.counts["prompt_tokens"] += prompt
            self.counts["completion_tokens"] += completion
            self.counts["max_call_tokens"] = max(self.counts["max_call_tokens"],
                                                 prompt + completion)
            self.ok_times.append(time.monotonic())
        return {"id": f"sim-{self.counts['ok']}", "object": "chat.completion",
                "model": body.get("model", self.model),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}

    def _enter(self) -> None:
        with self._lock:
            self._active += 1
            self.counts["peak_concurrent"] = max(self.counts["peak_concurrent"], self._active)

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1


def _handler(ep: SimulatedEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real endpoints do

        def setup(self) -> None:
            super().setup()
            # Headers and body go out in two writes: without TCP_NODELAY, Nagle's
            # algorithm and delayed ACKs add 40 ms to every keep-alive request.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, *args) -> None:  # a benchmark's output stays readable
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return self._send(400, {"error": {"message": "the body is not JSON"}})
            if not self.path.endswith("/chat/completions"):
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            ep._enter()
            try:
                self._serve(body)
            finally:
                ep._leave()

        def _serve(self, body: dict[str, Any]) -> None:
            what, value = ep.decide()
            if what == "rate_limited":
                return self._send(429, {"error": {"message": "rate limit reached"}},
                                  {"Retry-After": str(max(1, math.ceil(value))),
                                   "retry-after-ms": str(max(1, round(value * 1000)))})
            if what == "throttled":
                return self._send(429, {"error": {"message": "busy, retry"}},
                                  {"Retry-After": "0"})
            if what == "error503":
                return self._send(503, {"error": {"message": "overloaded"}},
                                  {"Retry-After": "0"})
            if what == "error500":
                return self._send(500, {"error": {"message": "internal error"}})
            if ep._stopping.wait(value if what == "stall" else value or 0):
                return None  # stopping: drop the request (the client sees a closed socket)
            return self._send(200, ep.answer(body))

        def _send(self, status: int, payload: dict, headers: dict | None = None) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                pass

    return Handler


# -- in a process of its own (the benchmark: no GIL shared with the client) -------------


class EndpointProcess:
    """:class:`SimulatedEndpoint` in a child process (``python -m bench.endpoint``), as a
    real provider would be: its threads share no interpreter lock with the client under
    test. ``counts`` and ``ok_times`` are read back when it stops (times are seconds
    since the child started serving)."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.counts: dict[str, int] = {}
        self.ok_times: list[float] = []
        self.limited_times: list[float] = []
        self.url = ""
        self._proc = None

    def __enter__(self) -> "EndpointProcess":
        import subprocess
        import sys

        # The checkout's root on the child's path, whatever the caller's directory (a
        # reply named "module:function" still imports from the caller's directory too).
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.endpoint", json.dumps(self.options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.url = self._proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            self._proc.kill()
            raise RuntimeError(f"bench.endpoint did not start: {self.url!r}")
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self._proc.communicate(input="", timeout=30)  # EOF on stdin: stop
        report = json.loads(out.strip().splitlines()[-1])
        self.counts, self.ok_times = report["counts"], report["ok_times"]
        self.limited_times = report["limited_times"]
        self.t0 = report["t0"]  # the child's time.monotonic() the times count from


def _serve(options: str) -> None:
    """``python -m bench.endpoint '{"rps": 40, ...}'``: print the URL, serve until stdin
    closes, then print what was received as one JSON line."""
    import sys

    try:
        given = json.loads(options)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"bench.endpoint: the options must be one JSON object, e.g. "
                         f"'{{\"latency\": 0.05, \"rps\": 40}}' ({exc})") from None
    if not isinstance(given, dict):
        raise SystemExit("bench.endpoint: the options must be one JSON object, e.g. "
                         "'{\"latency\": 0.05, \"rps\": 40}'")
    ep = SimulatedEndpoint(**given).start()
    t0 = time.monotonic()
    print(ep.url, flush=True)
    sys.stdin.read()
    ep.stop()
    print(json.dumps({"counts": dict(ep.counts), "t0": t0,
                      "ok_times": [t - t0 for t in ep.ok_times],
                      "limited_times": [t - t0 for t in ep.limited_times]}), flush=True)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] in (["-h"], ["--help"]):
        print("usage: python -m bench.endpoint ['{\"latency\": 0.05, \"rps\": 40, ...}']\n"
              "Serves a simulated chat-completions endpoint on 127.0.0.1: prints its URL,\n"
              "serves until stdin closes, then prints what it received as one JSON line.\n"
              "The options are SimulatedEndpoint's (see this module's docstring).")
        raise SystemExit(0)
    _serve(sys.argv[1] if len(sys.argv) > 1 else "{}")
