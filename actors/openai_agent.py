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
artifact strategy).

Throttling is handled, not failed (docs/budgets.md): a 429 or a 503 is retried with
jittered exponential backoff, waiting at least what ``Retry-After`` (seconds or an HTTP
date) or ``retry-after-ms`` asks, until ``retry_deadline`` seconds have passed; other
5xx answers and timeouts are retried ``max_retries`` times; an endpoint that refuses
the connection (nothing listens there) and other errors (400, 401, 404) fail at once,
with the status and the server's words. ``max_concurrent`` and ``requests_per_minute``
keep this process under the endpoint's limits: one limiter per endpoint, shared by
every worker thread of the process. A failure is raised, and the worker records it
as a failed rollout (evidence, not a crash). Each call reports its tokens, cost
(``prices``), HTTP attempts and seconds throttled through :func:`actors.usage.report`
(the run's token and cost budgets count them); they also accumulate in
:attr:`OpenAIAgent.usage`.

Needs the ``llm`` extra: ``pip install "evobus[llm]"``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.errors import ConfigError, EvobusError, RetryLater, Throttled
from actors.throttle import Backoff, limiter_for, parse_retry_after
from actors.usage import report

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
    throttled_seconds: float = 0.0
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

    def count(self, what: str, n: float = 1) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + n)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {"prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens,
                    "total_tokens": self.total_tokens, "requests": self.requests,
                    "retries": self.retries, "failures": self.failures,
                    "throttled_seconds": round(self.throttled_seconds, 3)}


#: Answers that mean "not now": retried until ``retry_deadline``.
_RETRY_LATER = frozenset({429, 503})
#: Other server errors: retried ``max_retries`` times.
_TRANSIENT_STATUS = frozenset(range(500, 600)) - _RETRY_LATER


class _Transient(Exception):
    """One attempt failed in a way worth another try (a timeout, a 5xx); never escapes
    :meth:`OpenAIAgent.chat`."""
_HINTS = {
    401: "the key was refused: check that ${env} holds a valid key for this endpoint",
    403: "the key may not use this model or endpoint: check its permissions",
    404: "check base_url (it usually ends in /v1) and the model name",
}


class OpenAIAgent:
    #: Every call reports its usage (actors.usage): token and cost budgets may be set.
    reports_usage = True

    """An agent (``solve`` + ``propose``) backed by a chat-completions endpoint.

    Every argument is JSON-friendly, so a scenario can pass them as ``kwargs``:

    - ``model``: the model name the endpoint serves.
    - ``base_url``: the API root, e.g. ``http://127.0.0.1:8000/v1``.
    - ``api_key_env``: the NAME of the environment variable holding the key ("" for an
      endpoint that needs none). Never the key itself.
    - ``timeout`` (seconds per HTTP attempt: a call that stalls fails then and is
      retried), ``connect_timeout``, ``max_retries`` (for timeouts and 5xx other than
      503), ``backoff`` (first delay, doubled each retry, with jitter),
      ``max_backoff``, ``retry_deadline`` (seconds a call keeps retrying 429/503).
    - ``max_concurrent``, ``requests_per_minute``: this process's limits for the
      endpoint (shared by every agent of the process with the same endpoint and limits).
    - ``prices``: ``{model: [input, output]}`` per 1M tokens: each call reports its cost.
    - ``temperature``, ``max_tokens``, ``seed`` (sent to the endpoint, and seeds the
      jitter), ``extra_body`` (merged into every request, e.g. ``{top_p = 0.9}``).
    - ``solve_system``, ``solve_user``, ``propose_system``, ``propose_user``: prompt
      templates with ``{artifact}``, ``{prompt}`` and (propose) ``{output}``,
      ``{reward}``, ``{edit_format}``; ``edit_format``: what one edit looks like.
    """

    def __init__(self, model: str, *, base_url: str = "https://api.openai.com/v1",
                 api_key_env: str = "OPENAI_API_KEY", timeout: float = 60.0,
                 connect_timeout: float = 10.0, max_retries: int = 4, backoff: float = 1.0,
                 max_backoff: float = 30.0, retry_deadline: float = 120.0,
                 max_concurrent: int | None = None,
                 requests_per_minute: float | None = None,
                 prices: dict[str, Any] | None = None, temperature: float | None = 0.0,
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
        _check_limits(retry_deadline, max_concurrent, requests_per_minute, prices, model)
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
        self.prices = {k: (float(v[0]), float(v[1])) for k, v in (prices or {}).items()}
        self.limiter = limiter_for(self.url, max_concurrent, requests_per_minute)
        self.backoff = Backoff(initial=float(backoff), maximum=self.max_backoff,
                               deadline=float(retry_deadline), max_retries=max_retries,
                               transient=(_Transient,), seed=seed, sleep=sleep)
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
        """One chat completion: the reply's text. Retries 429/503 until
        ``retry_deadline``, timeouts and other 5xx ``max_retries`` times; raises
        :class:`LLMError` when it gives up. Reports the call's usage (actors.usage)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.seed is not None:
            body["seed"] = self.seed
        body.update(self.extra_body)
        stats: dict[str, float] = {}
        waited = [0.0]
        usage: dict[str, Any] = {}
        try:
            text, _, _ = self.backoff.call(lambda: self._attempt(body, waited, usage),
                                           stats=stats)
            return text
        except _Transient as exc:
            self.usage.count("failures")
            raise LLMError(f"gave up after {int(stats.get('attempts', 1))} attempt(s): "
                           f"{exc}") from None
        except (Throttled, LLMError) as exc:
            self.usage.count("failures")
            if isinstance(exc, Throttled):
                raise LLMError(f"{self.url}: {exc}") from None
            raise
        finally:
            attempts = int(stats.get("attempts", 1))
            throttled = stats.get("slept", 0.0) + waited[0]
            self.usage.count("retries", max(0, attempts - 1))
            self.usage.count("throttled_seconds", throttled)
            self._report(usage, attempts, throttled)

    def _attempt(self, body: dict[str, Any], waited: list[float], usage: dict) -> str:
        """One HTTP attempt, inside the endpoint's limiter."""
        httpx = self._httpx
        limiter = self.limiter
        try:
            if limiter is not None:
                with limiter:
                    waited[0] += limiter.local.waited
                    response = self._client.post(self.url, json=body)
            else:
                response = self._client.post(self.url, json=body)
        except httpx.TimeoutException:
            raise _Transient(f"no answer within {self.timeout:g} s (timeout)") from None
        except httpx.ConnectError as exc:
            raise LLMError(f"cannot reach {self.base_url}: nothing accepts connections "
                           f"there ({type(exc).__name__}: {exc}); check base_url and that "
                           "the server is up") from None
        except httpx.TransportError as exc:
            raise _Transient(f"cannot reach {self.base_url}: {type(exc).__name__}: "
                             f"{exc}") from None
        status = response.status_code
        if status == 200:
            return self._content(response, usage)
        detail = _excerpt(response)
        if status in _RETRY_LATER:
            raise RetryLater(f"{self.url} answered {status}: {detail}",
                             retry_after=parse_retry_after(response.headers))
        if status in _TRANSIENT_STATUS:
            raise _Transient(f"{self.url} answered {status}: {detail}")
        hint = _HINTS.get(status, "the request was refused: see the server's "
                                  "message").replace("{env}", self.api_key_env
                                                     or "the key variable")
        raise LLMError(f"{self.url} answered {status}: {detail}; {hint}")

    def _report(self, usage: dict, attempts: int, throttled: float) -> None:
        p = int(usage.get("prompt_tokens") or 0)
        c = int(usage.get("completion_tokens") or 0)
        price = self.prices.get(self.model)
        cost = (p * price[0] + c * price[1]) / 1e6 if price is not None else None
        report(model=self.model, input_tokens=p, output_tokens=c, cost=cost,
               attempts=attempts, throttled=throttled)

    def _content(self, response, usage: dict) -> str:
        try:
            data = response.json()
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise LLMError(f"{self.url} answered 200 but not with a chat completion: "
                           f"{_excerpt(response)}") from None
        reported = data.get("usage") if isinstance(data, dict) else None
        self.usage.add(reported)
        usage.update(reported or {})
        if content is None:
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


def _check_limits(retry_deadline, max_concurrent, requests_per_minute, prices, model) -> None:
    if not isinstance(retry_deadline, (int, float)) or retry_deadline <= 0:
        raise ConfigError(f"OpenAIAgent: retry_deadline must be a positive number of "
                          f"seconds, got {retry_deadline!r}")
    if max_concurrent is not None and (not isinstance(max_concurrent, int)
                                       or max_concurrent < 1):
        raise ConfigError(f"OpenAIAgent: max_concurrent must be an integer >= 1 (requests "
                          f"at once from this process), got {max_concurrent!r}")
    if requests_per_minute is not None and (not isinstance(requests_per_minute, (int, float))
                                            or requests_per_minute <= 0):
        raise ConfigError(f"OpenAIAgent: requests_per_minute must be a positive number, "
                          f"got {requests_per_minute!r}")
    for name, price in (prices or {}).items():
        if not (isinstance(price, (list, tuple)) and len(price) == 2
                and all(isinstance(v, (int, float)) and v >= 0 for v in price)):
            raise ConfigError(f"OpenAIAgent: prices[{name!r}] = {price!r}: give [input, "
                              f"output], the price of 1M tokens each, e.g. prices = "
                              f"{{{model!r} = [0.15, 0.6]}}")
