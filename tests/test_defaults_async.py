"""Every run leaves a log (a default path under runs/, said in the summary); evolve()
and scenario files share their defaults; evolve_async() and parallel_async() leave the
caller's event loop free."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import warnings

import msgspec
import pytest

from actors import AppendRules, Task
from actors.cli.paths import default_log_path
from actors.runtime.evolve import evolve, evolve_async
from actors.groups.api import parallel_async
from bus.log import read_header
from protocol.scenario import Scenario

pytestmark = pytest.mark.timeout(90)


def _tasks() -> list[Task]:
    return [Task(f"t{i}", f"say {w}") for i, w in enumerate(["red", "blue"] * 5)]


def _reward(task: Task, output: str) -> float:
    return 1.0 if task.prompt.split()[-1] in output else 0.0


def _run(rendered: str, task: Task) -> str:
    return rendered


def _propose(rendered: str, task: Task, output: str, reward: float) -> str:
    return f"pos: {task.prompt.split()[-1]}"   # reads as a category, and no category is declared


def test_a_run_without_a_log_path_writes_one_under_runs_and_says_so(root, tmp_path,
                                                                    clean_env):
    scenario = tmp_path / "nolog.toml"
    scenario.write_text("\n".join(line for line in (root / "scenarios" / "router.toml")
                                  .read_text().splitlines() if not line.startswith("log")))
    done = subprocess.run([sys.executable, "-m", "actors.cli", "run", str(scenario)],
                          cwd=tmp_path, env=clean_env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    logs = list((tmp_path / "runs").glob("router-*.evolog"))
    assert len(logs) == 1
    rel = logs[0].relative_to(tmp_path)
    assert f"log: {rel}  (evobus inspect {rel}" in done.stdout
    assert "the default path: set `log` in the scenario or pass --log" in done.stdout
    assert read_header(logs[0]).run_id


def test_the_default_log_path_never_reuses_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = default_log_path("my run", now=0)
    (tmp_path / "runs").mkdir()
    (tmp_path / first).write_bytes(b"")
    second = default_log_path("my run", now=0)
    assert first.startswith("runs/my_run-") and second == first[:-len(".evolog")] + "-2.evolog"
    (tmp_path / second[:-len(".evolog")]).with_suffix(".naps.evolog").write_bytes(b"")
    third = default_log_path("my run", now=0)   # a group's log took the name
    assert third == first[:-len(".evolog")] + "-3.evolog"


def test_evolve_and_scenario_files_default_to_the_same_artifact_strategy():
    assert type(Scenario().strategy).__name__ == "AppendRulesSpec"
    result = evolve(_tasks(), _reward, run=_run, propose=_propose, rounds=3, n_workers=2,
                    bus="memory")
    # "pos: red" is kept as a rule (AppendRules), not filed under an undeclared category
    assert result.rendered.startswith(AppendRules().title)
    assert result.final_reward > result.initial_reward


def test_evolve_records_its_artifact_strategy_in_the_log(tmp_path):
    log = tmp_path / "s.evolog"
    evolve(_tasks(), _reward, run=_run, propose=_propose, rounds=1, n_workers=2,
           bus="memory", log=str(log))
    assert json.loads(read_header(log).meta["strategy"]) == {"kind": "AppendRules",
                                                             "title": "# Playbook"}


def test_evolve_inside_a_running_loop_warns_and_names_evolve_async():
    async def main():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            evolve(_tasks(), _reward, run=_run, propose=_propose, rounds=1, n_workers=2,
                   bus="memory")
        return [str(w.message) for w in caught]

    messages = asyncio.run(main())
    assert any("blocks it until the run ends: use `await evolve_async(...)`" in m
               for m in messages)


def test_evolve_async_leaves_the_event_loop_free():
    started = threading.Event()

    def run(rendered, task):
        started.set()
        return rendered

    async def main():
        ticks = 0
        job = asyncio.ensure_future(evolve_async(_tasks(), _reward, run=run,
                                                 propose=_propose, rounds=2, n_workers=2,
                                                 bus="memory"))
        while not job.done():   # the loop keeps turning while the run goes on
            ticks += 1
            await asyncio.sleep(0)
        return ticks, await job

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # no "blocks the loop" warning
        ticks, result = asyncio.run(main())
    assert started.is_set() and ticks > 10
    assert result.stop_reason and result.rollouts > 0


def _double(x: int) -> int:
    return 2 * x


def test_parallel_async_returns_the_results_in_input_order_without_blocking():
    async def main():
        ticks = 0
        job = asyncio.ensure_future(parallel_async(_double, list(range(20)),
                                                   max_concurrency=4, max_items=20))
        while not job.done():
            ticks += 1
            await asyncio.sleep(0)
        return ticks, await job

    ticks, results = asyncio.run(main())
    assert results == [2 * x for x in range(20)] and ticks >= 1


def test_evolve_and_a_minimal_scenario_file_start_the_same_run(tmp_path):
    """Every default evolve() fills in is the scenario file's: the Start message and the
    header's machine settings of the two runs are the same but for their ids."""
    from actors.runtime.launch import run_scenario
    from protocol import Start, decode
    from protocol.scenario import parse_scenario
    from bus.log import read_log
    from scenarios import router

    evolve(router.tasks(), router.reward, agent=router.RouterAgent(),
           log=str(tmp_path / "py.evolog"))
    run_scenario(parse_scenario('name = "x"\n[domain]\ntasks = "scenarios.router:tasks"\n'
                                'reward = "scenarios.router:reward"\n'
                                'agent = "scenarios.router:RouterAgent"\n', "x.toml"),
                 log=str(tmp_path / "file.evolog"))
    seen = []
    for name in ("py", "file"):
        contents = read_log(tmp_path / f"{name}.evolog")
        start = next(m for m in map(decode, (r.body for r in contents.records))
                     if isinstance(m, Start))
        meta = contents.header.meta
        seen.append((msgspec.structs.replace(start, run_id="", lease_key=""),
                     {k: meta.get(k) for k in ("parallel", "machine_args", "strategy",
                                               "task_groups")}))
    assert seen[0] == seen[1]
