"""MLflow tracking (the `tracking` extra), against a local file store, no server: the
run's parameters, per-round metrics and every committed artifact version. Skipped when
MLflow is not installed (.ci/run installs mlflow-skinny)."""

from __future__ import annotations

import importlib.util

import pytest

from actors.errors import ConfigError
from actors.runtime.evolve import evolve
from actors.runtime.launch import evolve_kwargs
from actors.tracking import MlflowTracking
from protocol.scenario import load_scenario, parse_scenario

pytestmark = pytest.mark.timeout(120)

needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason='MLflow is not installed (evobus[tracking])')


@pytest.fixture
def store(tmp_path, monkeypatch):
    # MLflow 3 keeps the file store in maintenance mode behind this opt-in.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


@needs_mlflow
def test_a_scenario_run_is_tracked_in_mlflow(root, tmp_path, store):
    from mlflow.tracking import MlflowClient

    text = (root / "scenarios" / "router.toml").read_text()
    scenario = parse_scenario(text + f'\n[tracking]\nuri = "{store}"\nexperiment = "router"\n')
    kwargs = evolve_kwargs(scenario, "router.toml")
    kwargs["log"] = str(tmp_path / "r.evolog")
    tracker = kwargs["tracking"]
    result = evolve(**kwargs)
    assert tracker.failed is None and tracker.run_id

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == scenario.name
    params = run.data.params
    assert params["rounds"] == str(scenario.rounds) and params["seed"] == "0"
    assert params["n_workers"] == "4" and params["log"] == kwargs["log"]
    held = [m.value for m in client.get_metric_history(tracker.run_id, "heldout_reward")]
    assert held == [r.heldout_reward for r in result.history]
    calls = client.get_metric_history(tracker.run_id, "calls")
    assert calls[-1].value <= result.calls and len(calls) == len(result.history)
    assert run.data.metrics["final_reward"] == result.final_reward
    assert run.data.tags["evobus.stop_reason"] == result.stop_reason
    files = {f.path for f in client.list_artifacts(tracker.run_id, "artifact")}
    assert files == {f"artifact/v{v:04d}.txt" for v in range(result.version + 1)} | \
        {"artifact/final.txt"}
    final = client.download_artifacts(tracker.run_id, f"artifact/v{result.version:04d}.txt",
                                      str(tmp_path / "dl"))
    assert open(final).read() == result.rendered


@needs_mlflow
def test_tracking_takes_a_uri_from_python(tmp_path, store, router_kwargs):
    result = evolve(**router_kwargs, rounds=2, bus="memory", tracking=store)
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(tracking_uri=store).get_experiment_by_name("evobus")
    runs = MlflowClient(tracking_uri=store).search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].data.metrics["total_rollouts"] == result.rollouts


def test_without_mlflow_tracking_is_refused_naming_the_extra(router_kwargs, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mlflow(name, *args, **kwargs):
        if name == "mlflow" or name.startswith("mlflow."):
            raise ImportError("No module named 'mlflow'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    with pytest.raises(ConfigError, match=r'needs MLflow.*pip install "evobus\[tracking\]"'):
        evolve(**router_kwargs, rounds=1, bus="memory", tracking="file:./nowhere")


def test_a_bad_tracking_value_is_refused(router_kwargs):
    with pytest.raises(ConfigError, match="pass an MLflow tracking URI"):
        evolve(**router_kwargs, rounds=1, bus="memory", tracking=42)


def test_the_scenario_tracking_table_is_validated(tmp_path, root):
    path = tmp_path / "t.toml"
    path.write_text((root / "scenarios" / "router.toml").read_text()
                    + '\n[tracking]\nexperiment = "x"\n')
    with pytest.raises(Exception, match=r"tracking.*uri"):
        load_scenario(path)
    assert repr(MlflowTracking("file:./m")) == "MlflowTracking('file:./m', experiment='evobus')"


class _Reporting:
    """The router agent, reporting 10 input and 5 output tokens of model "m" a call."""

    reports_usage = True

    def __init__(self):
        from scenarios.router import RouterAgent
        self.inner = RouterAgent()

    def solve(self, rendered, task):
        from actors.usage import report
        report(model="m", input_tokens=10, output_tokens=5)
        return self.inner.solve(rendered, task)

    def propose(self, rendered, task, output, score):
        from actors.usage import report
        report(model="m", input_tokens=10, output_tokens=5)
        return self.inner.propose(rendered, task, output, score)


@needs_mlflow
def test_each_round_logs_the_ledgers_calls_tokens_and_cost(tmp_path, store, router_kwargs):
    from mlflow.tracking import MlflowClient

    router_kwargs.pop("run"), router_kwargs.pop("propose")
    router_kwargs.update(agent=_Reporting(), prices={"m": (1.0, 2.0)}, max_tokens=10**6,
                         rounds=3)
    tracker = MlflowTracking(store, experiment="ledger")
    result = evolve(**router_kwargs, tracking=tracker)
    client = MlflowClient(tracking_uri=store)
    tokens = client.get_metric_history(tracker.run_id, "tokens")
    cost = client.get_metric_history(tracker.run_id, "cost")
    assert len(tokens) == len(cost) == len(result.history)
    assert [m.value for m in tokens] == sorted(m.value for m in tokens) and tokens[0].value > 0
    assert cost[-1].value == pytest.approx(tokens[-1].value / 15 * (10 + 10) / 1e6)
    run = client.get_run(tracker.run_id)
    assert run.data.metrics["total_tokens"] == result.budget["tokens"]["total"]
    assert run.data.metrics["total_all_calls"] == result.budget["calls"]["total"]
