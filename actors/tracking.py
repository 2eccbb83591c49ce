"""Tracking where users already look: an optional MLflow run per evolve() run.

    evolve(..., tracking="file:./mlruns")                  # or any MLflow tracking URI
    evolve(..., tracking=MlflowTracking(uri, experiment="router"))
    [tracking]                                             # in a scenario file
    uri = "sqlite:///mlflow.db"
    experiment = "router"

What is logged: the run's parameters (mode, rounds, workers, seed, strategies,
budgets, run id, log path), per round (or merge) the held-out reward, rollouts,
proposals, commits, backend calls, and every call (scoring too), tokens and cost as
the Scheduler's ledger counts them against the budgets (``all_calls``, ``tokens``,
``cost``; tokens and cost are what calls reported through actors.usage);
each committed artifact version as a text artifact (``artifact/v0003.txt``); and at
the end the final figures and the stop reason. MLflow is an optional extra
(``pip install "evobus[tracking]"``); without it, asking for tracking is a
ConfigError naming the extra, before any rollout.

The runtime hands every delivered message to :meth:`MlflowTracking.watch` on the bus
thread: it only queues the merger's ``Commit`` bodies. Everything that talks to MLflow
runs on the thread that drives the run, between messages. A tracking backend that
fails is warned about once and tracking stops; the run goes on.
"""

from __future__ import annotations

import collections
import logging
import warnings
from typing import Any

from actors.errors import ConfigError
from protocol import Commit, decode

__all__ = ["INSTALL_HINT", "MlflowTracking", "as_tracking"]

log = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "evobus[tracking]"'


class MlflowTracking:
    """One MLflow run for one evolve() run. ``uri``: an MLflow tracking URI (a local
    ``file:`` directory, ``sqlite:///...``, or a server's ``http://``); ``experiment``
    is created if missing; ``run_name`` defaults to the scenario's name or run id."""

    def __init__(self, uri: str, *, experiment: str = "evobus",
                 run_name: str | None = None) -> None:
        if not isinstance(uri, str) or not uri:
            raise ConfigError(f"tracking: expected an MLflow tracking URI (e.g. "
                              f"'file:./mlruns'), got {uri!r}")
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self._client: Any = None
        self._run_id: str | None = None
        self._commits: collections.deque[bytes] = collections.deque()
        self._render = None
        self._step = 0
        self.failed: str | None = None

    def __repr__(self) -> str:
        return f"MlflowTracking({self.uri!r}, experiment={self.experiment!r})"

    # -- what evolve() calls ---------------------------------------------------------------

    def start(self, params: dict[str, Any], *, render, initial_state: dict[str, str],
              tags: dict[str, str]) -> None:
        client = _client(self.uri)
        self._render = render
        self._guard(lambda: self._open(client, params, tags, initial_state))

    def watch(self, sender: str, receiver: str, body: bytes) -> None:
        """The runtime's tap (bus thread): queue the merger's commits, nothing else."""
        if sender == "merger" and receiver == "scheduler" and self.failed is None:
            self._commits.append(body)

    def on_round(self, record: Any, *, rollouts: int, calls: int,
                 usage: dict[str, int] | None, budget: dict | None = None) -> None:
        self._step += 1
        metrics = {"heldout_reward": record.heldout_reward, "rollouts": rollouts,
                   "calls": calls, "round_rollouts": record.rollouts,
                   "proposals": record.proposals, "committed": float(record.committed),
                   "version": record.version}
        metrics.update(_ledger_metrics(budget))
        metrics.update({f"tokens_{k}": v for k, v in (usage or {}).items()
                        if isinstance(v, (int, float))})
        self._guard(lambda: self._metrics(metrics, self._step))
        self._flush_commits()

    def end(self, result: Any, *, usage: dict[str, int] | None) -> None:
        self._flush_commits()
        final = {"final_reward": result.final_reward, "initial_reward": result.initial_reward,
                 "total_rollouts": result.rollouts, "total_calls": result.calls,
                 "final_version": result.version}
        final.update({f"total_tokens_{k}": v for k, v in (usage or {}).items()
                      if isinstance(v, (int, float))})
        final.update({f"total_{k}": v for k, v in
                      _ledger_metrics(getattr(result, "budget", None)).items()})
        self._guard(lambda: self._finish(final, result))

    # -- MLflow -----------------------------------------------------------------------------

    def _open(self, client, params, tags, initial_state) -> None:
        found = client.get_experiment_by_name(self.experiment)
        exp_id = found.experiment_id if found is not None else \
            client.create_experiment(self.experiment)
        run = client.create_run(exp_id, run_name=self.run_name, tags=tags)
        self._client, self._run_id = client, run.info.run_id
        for key, value in params.items():
            client.log_param(self._run_id, key, "-" if value is None else str(value)[:500])
        client.log_text(self._run_id, self._render(initial_state), "artifact/v0000.txt")

    def _metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._client.log_metric(self._run_id, key, float(value), step=step)

    def _flush_commits(self) -> None:
        while self._commits and self._client is not None and self.failed is None:
            msg = decode(self._commits.popleft())
            if isinstance(msg, Commit):
                self._guard(lambda m=msg: self._client.log_text(
                    self._run_id, self._render(m.state), f"artifact/v{m.version:04d}.txt"))

    def _finish(self, final: dict[str, float], result: Any) -> None:
        if self._client is None:
            return
        self._metrics(final, self._step)
        self._client.set_tag(self._run_id, "evobus.stop_reason", result.stop_reason)
        if result.log_path:
            self._client.set_tag(self._run_id, "evobus.log", str(result.log_path))
        self._client.log_text(self._run_id, result.rendered, "artifact/final.txt")
        self._client.set_terminated(self._run_id,
                                    status="FAILED" if result.error and not result.rollouts
                                    else "FINISHED")

    def _guard(self, call) -> None:
        """Run one MLflow call; the first failure is warned about and ends tracking."""
        if self.failed is not None:
            return
        try:
            call()
        except Exception as exc:  # the tracking backend's error: warned, the run goes on
            self.failed = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"tracking to {self.uri} failed and stops for this run (the run "
                          f"goes on): {self.failed}", RuntimeWarning, stacklevel=2)

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id (None before start, or when it could not be created)."""
        return self._run_id


def _client(uri: str):
    try:
        # Imported here, not at the top: mlflow is an optional extra and a heavy import.
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ConfigError(f"tracking to {uri} needs MLflow, which is not installed: "
                          f"{INSTALL_HINT}") from None
    return MlflowClient(tracking_uri=uri)


def as_tracking(tracking: Any) -> MlflowTracking | None:
    """evolve(tracking=...): None, a tracking URI, or an :class:`MlflowTracking`."""
    if tracking is None or isinstance(tracking, MlflowTracking):
        return tracking
    if isinstance(tracking, str):
        return MlflowTracking(tracking)
    raise ConfigError(f"tracking={tracking!r}: pass an MLflow tracking URI (e.g. "
                      "'file:./mlruns') or actors.tracking.MlflowTracking(uri, experiment=...)")


def _ledger_metrics(budget: dict | None) -> dict[str, float]:
    """Every call (scoring too), the tokens and the cost the Scheduler's ledger counted
    (docs/budgets.md), as ``all_calls``, ``tokens`` and ``cost``."""
    if not budget:
        return {}
    return {name: float((budget.get(what) or {}).get("total", 0))
            for name, what in (("all_calls", "calls"), ("tokens", "tokens"),
                               ("cost", "cost"))}
