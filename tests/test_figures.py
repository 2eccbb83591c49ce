"""One source for the live panel and `evobus inspect --summary`: both fold the same
messages with actors.cli.figures.RunFigures (the panel from the runtime's tap, the
summary from the log), so on a recorded async log they agree with each other and with
the Planner's own records; rates are over working time (a wait for workers to connect
is not in them); the panel shows calls, tokens and cost against their budgets and an
ETA at a moment inside a round."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
from rich.console import Console

from actors.cli.live import InRound
from actors.cli.main import main
from actors.cli.progress import RunProgress
from actors.cli.summary import summarize
from actors.machines.planner import split_tasks
from actors.runtime.launch import evolve_kwargs
from actors.usage import report
from bus.log import LogWriter, read_log
from protocol import Progress, RunDone, decode
from protocol.scenario import parse_scenario
from scenarios.router import RouterAgent
from test_live_progress import inside_round_0

pytestmark = pytest.mark.timeout(60)

LOGS = Path(__file__).resolve().parent / "logs"


def _fed(path: Path) -> tuple[InRound, list]:
    """The live fold fed a log's records as the tap would be, on the log's clock."""
    records = read_log(path).records
    clock = [0.0]
    live = InRound(clock=lambda: clock[0])
    for rec in records:
        clock[0] = rec.t
        live.push(rec.sender, rec.receiver, rec.body)
    return live, records


def test_live_figures_and_inspect_summary_agree_on_a_recorded_async_log(capsys):
    path = LOGS / "async_router.evolog"
    live, records = _fed(path)
    now = live.snapshot()
    messages = [(rec, decode(rec.body)) for rec in records]
    summary = summarize(messages)
    planner = [m.record for _, m in messages if isinstance(m, Progress)]
    done = next(m for _, m in messages if isinstance(m, RunDone))
    # Rollouts per merge, as the Planner recorded them, as the summary tabulates them
    # and as the live fold counts them.
    recorded = [c for c in live.figures.closed if c.recorded]
    assert [(r.round, r.rollouts) for r in planner] == \
        [(c.round, c.rollouts) for c in recorded]
    assert all(summary.rounds[r.round]["rollouts"] == r.rollouts for r in planner)
    assert now.per_close == pytest.approx(sum(r.rollouts for r in planner) / len(planner))
    assert now.rollouts == done.rollouts == summary.figures.rollouts == 240
    assert now.closes == len(summary.figures.closed) and now.committed == 12
    assert main(["inspect", str(path), "--summary"]) == 0
    out = capsys.readouterr().out
    assert f"{now.per_close:.1f} per merge" in out and "merges 29 closed" in out
    assert f"calls {now.calls:,}" in out
    assert main(["inspect", str(path), "--summary", "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["rollouts_per_merge"] == pytest.approx(now.per_close)
    assert as_json["budget"]["calls"]["total"] == now.calls and as_json["rollouts"] == 240
    # The panel, fed the same run, shows the same figures.
    progress = RunProgress(parse_scenario(read_log(path).header.meta["scenario_toml"], "x"),
                           live=False, stream=io.StringIO())
    progress.in_round = live
    for r in planner:
        progress(r)
    text = _panel_text(progress, 120)
    assert f"12 of {now.closes} merges · {now.per_close:.1f} rollouts per merge" in text, text


def _panel_text(progress: RunProgress, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(progress._panel())
    return console.export_text()


def test_rates_are_over_working_time_not_the_wait_for_workers(tmp_path, capsys):
    src = LOGS / "sync_data_parallel.evolog"
    contents = read_log(src)
    start = next(r.t for r in contents.records if type(decode(r.body)).__name__ == "Start")
    waited = tmp_path / "waited.evolog"   # the same run, 30 s waiting for its workers
    with LogWriter(waited, contents.header, fsync="never") as w:
        for r in contents.records:
            w.append(r.seq, r.t + (30.0 if r.t >= start else 0.0), r.sender, r.receiver,
                     r.body)
    lines = []
    for path in (src, waited):
        assert main(["inspect", str(path), "--summary"]) == 0
        lines.append(next(line for line in capsys.readouterr().out.splitlines()
                          if line.startswith("rollouts ")))
    assert lines[0] == lines[1] and "s of work" in lines[0]
    live, _ = _fed(waited)
    assert live.snapshot().working == pytest.approx(contents.records[-1].t - start)


class PricedAgent(RouterAgent):
    """The router agent, reporting 100 input and 20 output tokens a call, holding one
    training task until ``gate`` is set."""

    reports_usage = True

    def __init__(self, held: str, gate: threading.Event) -> None:
        self.held, self.gate = held, gate

    def solve(self, rendered, task):
        report(model="m", input_tokens=100, output_tokens=20)
        if task.id == self.held:
            assert self.gate.wait(30), "the test never released the held task"
        return super().solve(rendered, task)

    def propose(self, rendered, task, output, score):
        report(model="m", input_tokens=100, output_tokens=20)
        return super().propose(rendered, task, output, score)


def test_the_panel_shows_calls_tokens_and_cost_against_budgets_inside_a_round(root):
    text = (root / "scenarios" / "router.toml").read_text().replace(
        "[budgets]\n", "[budgets]\nmax_calls = 5000\nmax_tokens = 1000000\nmax_cost = 5.0\n"
        "prices = {m = [1.0, 2.0]}\n")
    scenario = parse_scenario(text, "priced.toml")
    kwargs = evolve_kwargs(scenario, "priced.toml")
    kwargs.pop("log")
    train, _ = split_tasks([t.id for t in kwargs["tasks"]], scenario.held_out_frac,
                           scenario.seed)
    gate = threading.Event()
    kwargs["agent"] = PricedAgent(train[0], gate)
    progress = RunProgress(scenario, source="priced.toml", live=True, stream=io.StringIO())
    # inside round 0: one lease held
    run, (panel, now) = inside_round_0(
        progress, kwargs, gate,
        lambda: (_panel_text(progress, 200), progress.in_round.snapshot()))
    assert "3/4 leases done" in panel and "ETA" in panel, panel
    tokens = now.calls * 120   # every call so far reported 120 tokens
    assert now.tokens == tokens and now.cost == pytest.approx(now.calls * 140 / 1e6)
    flat = " ".join(panel.split())
    assert f"{now.calls:,} calls · {tokens:,} tokens · ${now.cost:,.4f} cost" in flat, flat
    assert f"{5000 - now.calls:,} of 5,000 calls" in flat
    assert f"{1_000_000 - tokens:,} of 1,000,000 tokens" in flat
    assert "of $5.0000 cost" in flat, panel
    assert run.budget["tokens"]["total"] >= tokens
