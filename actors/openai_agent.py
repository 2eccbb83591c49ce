"""A real model agent: any OpenAI-compatible chat-completions endpoint (OpenAI, vLLM,
llama.cpp's server, Ollama, LiteLLM, ...), over httpx.

From a scenario (the key itself never appears in a file; ``api_key_env`` names the
environment variable that holds it)::

    [domain]
    agent = {ref = "actors.openai_agent:OpenAIAgent", kwargs = {
        base_url = "http://127.0.0.1:8000/v1", model = "qwen2.5-7b-instruct",
        api_key_env = "MY_LLM_KEY"}}

``solve`` sends the artifact as the system message and the task's prompt as the user
message; ``propose`` shows the model the artifact, the task, the answer and its
reward and asks for one edit (``edit_format`` says what an edit looks like for your
artifact strategy). Requests that fail with 429 or a 5xx status, time out or cannot
connect are retried with exponential backoff (``Retry-After`` is honoured, capped);
other errors (400, 401, 404) fail at once, with the status and the server's words.
A failure that survives its retries is raised, and the worker records it as a failed
rollout (evidence, not a crash). Token usage accumulates in :attr:`OpenAIAgent.usage`.

Needs the ``llm`` extra: ``pip install "evobus[llm]"``.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.errors import ConfigError, EvobusError

__all__ = ["LLMError", "OpenAIAgent", "Usage"]

log = logging.getLogger(__name__)

SOLVE_SYSTEM = "{artifact}"
SOLVE_USER = "{prompt}"
PROPOSE_SYSTEM = ("You improve the instructions an assistant follows. Reply with the edit "
                  "only: no preamble, no explanation.")
PROPOSE_USER = """The assistant's current instructions:
---
{artifact}
---
Task: {prompt}
The assistant answered: {output}
That answer scored {reward:.2f} (1.00 is perfect).

Propose one edit to the instructions that would make the answer score higher.
{edit_format}
If no edit would help, reply with NONE."""
EDIT_FORMAT = "Write one new rule, as a single sentence."


class LLMError(EvobusError):
    """A chat-completions request failed for good (after retries, or at once for a 4xx)."""


@dataclass
class Usage:
    """Tokens and requests so far (thread-safe: every worker thread adds to it)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    requests: int = 0
    retries: int = 0
    failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, usage: dict[str, Any] | None) -> None:
        usage = usage or {}
        with self._lock:
            self.requests += 1
            p = int(usage.get("prompt_tokens") or 0)
            c = int(usage.get("completion_tokens") or 0)
            self.prompt_tokens += p
            self.completion_tokens += c
            self.total_tokens += int(usage.get("total_tokens") or (p + c))

    def count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {"prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens,
                    "total_tokens": self.total_tokens, "requests": self.requests,
                    "retries": self.retries, "failures": self.failures}


_RETRY_STATUS = frozenset({429, 500, 502, 503, 504}) | frozenset(range(505, 600))
_HINTS = {
    401: "the key was refused: check that ${env} holds a valid key for this endpoint",
    403: "the key may not use this model or endpoint: check its permissions",
    404: "check base_url (it usually ends in /v1) and the model name",
}


class OpenAIAgent:
    """An agent (``solve`` + ``propose``) backed by a chat-completions endpoint.

    Every argument is JSON-friendly, so a scenario can pass them as ``kwargs``:

    - ``model``: the model name the endpoint serves.
    - ``base_url``: the API root, e.g. ``http://127.0.0.1:8000/v1``.
    - ``api_key_env``: the NAME of the environment variable holding the key ("" for an
      endpoint that needs none). Never the key itself.
    - ``timeout`` (seconds per attempt), ``connect_timeout``, ``max_retries``,
      ``backoff`` (first delay, doubled each retry, with jitter), ``max_backoff``.
    - ``temperature``, ``max_tokens``, ``seed`` (sent to the endpoint, and seeds the
      jitter), ``extra_body`` (merged into every request, e.g. ``{top_p = 0.9}``).
    - ``solve_system``, ``solve_user``, ``propose_system``, ``propose_user``: prompt
      templates with ``{artifact}``, ``{prompt}`` and (propose) ``{output}``,
      ``{reward}``, ``{edit_format}``; ``edit_format``: what one edit looks like.
    """

    def __init__(self, model: str, *, base_url: str = "https://api.openai.com/v1",
                 api_key_env: str = "OPENAI_API_KEY", timeout: float = 60.0,
                 connect_timeout: float = 10.0, max_retries: int = 4, backoff: float = 1.0,
                 max_backoff: float = 30.0, temperature: float | None = 0.0,
                 max_tokens: int | None = None, seed: int | None = None,
                 extra_body: dict[str, Any] | None = None,
                 solve_system: str = SOLVE_SYSTEM, solve_user: str = SOLVE_USER,
                 propose_system: str = PROPOSE_SYSTEM, propose_user: str = PROPOSE_USER,
                 edit_format: str = EDIT_FORMAT, sleep: Callable[[float], None] = time.sleep,
                 **unknown: Any) -> None:
        if "api_key" in unknown:
            raise ConfigError("OpenAIAgent(api_key=...): never put the key in a scenario or "
                              "in code; export it in an environment variable and pass its "
                              "name: api_key_env = \"MY_LLM_KEY\"")
        if unknown:
            raise ConfigError(f"OpenAIAgent: unknown argument(s) {sorted(unknown)}; see "
                              "`help(actors.openai_agent.OpenAIAgent)` for the ones it takes")
        try:  # an optional extra (evobus[llm]): imported only by an agent being built
            import httpx
        except ImportError:
            raise ConfigError('OpenAIAgent needs httpx: pip install "evobus[llm]"') from None
        if not isinstance(model, str) or not model:
            raise ConfigError("OpenAIAgent: model must be the model's name, e.g. "
                              "model = \"gpt-4o-mini\"")
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"OpenAIAgent: base_url {base_url!r} must start with http:// or "
                              "https://, e.g. \"http://127.0.0.1:8000/v1\"")
        for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout),
                            ("backoff", backoff), ("max_backoff", max_backoff)):
            if not isinstance(value, (int, float)) or value < 0 or (
                    name in ("timeout", "connect_timeout") and value == 0):
                raise ConfigError(f"OpenAIAgent: {name} must be a positive number of "
                                  f"seconds, got {value!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ConfigError(f"OpenAIAgent: max_retries must be an integer >= 0, got "
                              f"{max_retries!r}")
        self.api_key_env = api_key_env or ""
        key = None
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ConfigError(
                    f"OpenAIAgent: the environment variable {self.api_key_env} is not set; "
                    f"export {self.api_key_env}=<your key>, or set api_key_env to the "
                    "variable that holds it (api_key_env = \"\" for an endpoint that needs "
                    "no key)")
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        self.max_retries = max_retries
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.timeout = float(timeout)
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.seed = seed
        self.extra_body = dict(extra_body or {})
        self.templates = {"solve_system": solve_system, "solve_user": solve_user,
                          "propose_system": propose_system, "propose_user": propose_user}
        self.edit_format = edit_format
        sample = dict(artifact="a", prompt="p", output="o", reward=0.5, edit_format="e")
        for name, template in self.templates.items():
            try:
                template.format(**sample)
            except (KeyError, IndexError, ValueError) as exc:
                raise ConfigError(f"OpenAIAgent: {name} has a bad placeholder ({exc}); use "
                                  "{artifact}, {prompt}, {output}, {reward}, {edit_format}, "
                                  "and write {{ }} for a literal brace") from None
        self.usage = Usage()
        self._sleep = sleep
        self._rng = random.Random(seed)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        # One client for every worker thread of this process: httpx documents Client as
        # shareable between threads, and its pool keeps connections alive across calls.
        self._client = httpx.Client(
            headers=headers, timeout=httpx.Timeout(self.timeout, connect=float(connect_timeout)))
        self._httpx = httpx

    def __repr__(self) -> str:  # never the key
        return (f"OpenAIAgent(model={self.model!r}, base_url={self.base_url!r}, "
                f"api_key_env={self.api_key_env!r})")

    # -- the agent ---------------------------------------------------------------------

    def solve(self, rendered: str, task) -> str:
        fields = {"artifact": rendered, "prompt": task.prompt}
        return self.chat([
            {"role": "system", "content": self.templates["solve_system"].format(**fields)},
            {"role": "user", "content": self.templates["solve_user"].format(**fields)}])

    def propose(self, rendered: str, task, output: str, reward: float) -> str | None:
        fields = {"artifact": rendered, "prompt": task.prompt, "output": output,
                  "reward": reward, "edit_format": self.edit_format}
        text = self.chat([
            {"role": "system", "content": self.templates["propose_system"].format(**fields)},
            {"role": "user", "content": self.templates["propose_user"].format(**fields)}])
        text = text.strip()
        return None if not text or text.upper().rstrip(".") == "NONE" else text

    # -- the request ---------------------------------------------------------------------

    def chat(self, messages: list[dict[str, str]]) -> str:
        """One chat completion: the reply's text. Retries 429/5xx/timeouts/connection
        errors up to ``max_retries`` times; raises :class:`LLMError` when it gives up."""
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.seed is not None:
            body["seed"] = self.seed
        body.update(self.extra_body)
        httpx = self._httpx
        last = ""
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                response = self._client.post(self.url, json=body)
            except httpx.TimeoutException:
                last = f"no answer within {self.timeout:g} s (timeout)"
            except httpx.TransportError as exc:
                last = f"cannot reach {self.base_url}: {type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if status == 200:
                    return self._content(response)
                detail = _excerpt(response)
                if status not in _RETRY_STATUS:
                    self.usage.count("failures")
                    hint = _HINTS.get(status, "the request was refused: see the server's "
                                              "message").replace("{env}", self.api_key_env
                                                                 or "the key variable")
                    raise LLMError(f"{self.url} answered {status}: {detail}; {hint}")
                last = f"{self.url} answered {status}: {detail}"
                retry_after = _retry_after(response)
            if attempt == self.max_retries:
                break
            delay = min(self.max_backoff, self.backoff * 2 ** attempt)
            delay *= 0.5 + 0.5 * self._rng.random()  # jitter: workers do not retry in step
            if retry_after is not None:
                delay = min(self.max_backoff, max(delay, retry_after))
            self.usage.count("retries")
            log.info("chat completion failed (%s); retry %d of %d in %.2f s", last,
                     attempt + 1, self.max_retries, delay)
            self._sleep(delay)
        self.usage.count("failures")
        raise LLMError(f"gave up after {self.max_retries + 1} attempt(s): {last}")

    def _content(self, response) -> str:
        try:
            data = response.json()
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            self.usage.count("failures")
            raise LLMError(f"{self.url} answered 200 but not with a chat completion: "
                           f"{_excerpt(response)}") from None
        self.usage.add(data.get("usage") if isinstance(data, dict) else None)
        if content is None:
            self.usage.count("failures")
            raise LLMError(f"{self.url}: the reply has no text content (finish_reason "
                           f"{data['choices'][0].get('finish_reason')!r})")
        return str(content)

    def close(self) -> None:
        self._client.close()


def _excerpt(response, limit: int = 200) -> str:
    try:
        text = response.text.strip().replace("\n", " ")
    except Exception:  # undecodable body: say so instead of failing the error path
        text = "<unreadable body>"
    return (text[: limit - 3] + "...") if len(text) > limit else (text or "<empty body>")


def _retry_after(response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:  # an HTTP date: not worth parsing, use the backoff
        return None
