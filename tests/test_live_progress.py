"""The live panel of `evobus run` moves inside a round: leases done of those planned,
rollouts and calls so far, held-out evals, an ETA; round lines wrap on a narrow
terminal instead of being cut. Checked with rich's capture at a moment inside a round
(one lease held back on purpose), on a real run."""

from __future__ import annotations

import io
import threading

import pytest
from rich.console import Console

from actors.cli.progress import RunProgress
from actors.machines.planner import split_tasks
from actors.runtime.evolve import evolve
from actors.runtime.launch import evolve_kwargs
from protocol import LeaseDone, RoundRecord, decode
from protocol.scenario import load_scenario
from scenarios.router import RouterAgent

pytestmark = pytest.mark.timeout(60)


class GatedAgent(RouterAgent):
    """The router agent, holding one training task until ``gate`` is set."""

    def __init__(self, held: str, gate: threading.Event) -> None:
        self.held, self.gate = held, gate

    def solve(self, rendered, task):
        if task.id == self.held:
            assert self.gate.wait(30), "the test never released the held task"
        return super().solve(rendered, task)


def _render(progress: RunProgress, width: int) -> list[str]:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(progress._panel())
    return console.export_text().splitlines()


def inside_round_0(progress: RunProgress, kwargs: dict, gate: threading.Event, look):
    """Run evolve() with the live panel until three of round 0's four leases are answered
    (the fourth is held by `gate`), call `look()` at that moment, then let the run end.
    Returns (the run's result, what look returned)."""
    three_done = threading.Event()
    answered = []

    def watch(sender, receiver, body):   # the runtime's tap, seen by the test too
        progress.in_round.push(sender, receiver, body)
        if receiver == "scheduler":
            msg = decode(body)
            if isinstance(msg, LeaseDone) and msg.kind == "rollout" and msg.round == 0:
                answered.append(msg.lease_id)
                if len(answered) == 3:
                    three_done.set()

    progress.watch = watch
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(r=evolve(**kwargs,
                                                                    on_progress=progress)))
    with progress:
        runner.start()
        try:
            assert three_done.wait(30), "three of round 0's four leases never came back"
            seen = look()
        finally:
            gate.set()
            runner.join(30)
    return result["r"], seen


def test_the_panel_shows_leases_done_inside_a_round(root):
    scenario = load_scenario(root / "scenarios" / "router.toml")
    kwargs = evolve_kwargs(scenario, "router.toml")
    kwargs.pop("log")
    train, _ = split_tasks([t.id for t in kwargs["tasks"]], scenario.held_out_frac,
                           scenario.seed)
    gate = threading.Event()
    kwargs["agent"] = GatedAgent(train[0], gate)
    progress = RunProgress(scenario, source="router.toml", live=True, stream=io.StringIO())
    # a moment inside round 0: one lease held
    run, (lines, closed_then) = inside_round_0(
        progress, kwargs, gate, lambda: (_render(progress, 60), len(progress.records)))
    text = "\n".join(lines)
    assert "round 0" in text and "3/4 leases done" in text, text
    assert "rollouts" in text and "calls" in text
    assert closed_then == 0   # no round had closed when the panel was drawn
    assert max(len(line) for line in lines) <= 60
    assert run.rollouts > 0


def test_the_eta_counts_the_open_rounds_share_of_leases(root):
    scenario = load_scenario(root / "scenarios" / "router.toml")   # 15 rounds
    progress = RunProgress(scenario, live=False, stream=io.StringIO())
    from actors.cli.live import RoundSnapshot

    half = RoundSnapshot(round=0, leases_planned=4, leases_done=2, rollouts=10, calls=20,
                         evals_asked=0, evals_done=0, closed=False)
    assert progress.eta(1.0, half) == "at most ~29.0s left (at this pace)"   # 0.5 of 15 in 1 s


def test_a_round_line_wraps_on_a_narrow_terminal_instead_of_being_cut(root):
    scenario = load_scenario(root / "scenarios" / "router.toml")
    out = io.StringIO()
    progress = RunProgress(scenario, live=True, stream=out)
    progress._console = Console(file=out, width=40, color_system=None)
    progress(RoundRecord(round=0, version=1, committed=True, heldout_reward=0.5,
                         rollouts=43, proposals=43, reasons={"committed": 4,
                                                             "duplicate": 31}, elapsed=1.0))
    text = out.getvalue()
    assert "…" not in text and "..." not in text
    assert "proposals" in text and "duplicate 31" in text.replace("\n", "")
    assert max(len(line) for line in text.splitlines()) <= 40


class FileGatedAgent(RouterAgent):
    """For `evobus run` in a subprocess: holds training task ``held`` until the file
    ``$EVOBUS_TEST_RELEASE`` exists (the test creates it once it has seen the panel)."""

    def __init__(self, held: str) -> None:
        self.held = held

    def solve(self, rendered, task):
        if task.id == self.held:
            import os
            import pathlib
            import time

            release = pathlib.Path(os.environ["EVOBUS_TEST_RELEASE"])
            deadline = time.monotonic() + 40
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.01)   # a rollout held in another process: polls a file
        return super().solve(rendered, task)


def test_under_a_pseudo_terminal_the_panel_shows_an_open_rounds_leases(root, tmp_path,
                                                                      clean_env):
    import os
    import subprocess
    import sys
    import time

    from test_cli_ux import read_until

    scenario = load_scenario(root / "scenarios" / "router.toml")
    held = split_tasks([t.id for t in evolve_kwargs(scenario)["tasks"]],
                       scenario.held_out_frac, scenario.seed)[0][0]
    text = (root / "scenarios" / "router.toml").read_text().replace(
        'agent = "scenarios.router:RouterAgent"',
        f'agent = {{ref = "test_live_progress:FileGatedAgent", kwargs = {{held = "{held}"}}}}')
    text = text.replace("[budgets]\n", "[budgets]\nmax_calls = 5000\n")
    assert "FileGatedAgent" in text and "max_calls = 5000" in text
    path = tmp_path / "gated.toml"
    path.write_text(text)
    release = tmp_path / "release"
    env = dict(clean_env, TERM="xterm-256color", COLUMNS="80", LINES="40",
               EVOBUS_TEST_RELEASE=str(release))
    env["PYTHONPATH"] = os.pathsep.join([str(root / "tests"), env["PYTHONPATH"]])
    primary, secondary = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "run", str(path), "--log",
                             str(tmp_path / "g.evolog")], cwd=tmp_path, env=env,
                            stdin=secondary, stdout=secondary, stderr=secondary)
    os.close(secondary)
    try:
        inside = read_until(primary, b"3/4 leases done", time.monotonic() + 40)
        # The rest of that frame (its ETA, budgets and border) may come in a later read.
        at = inside.find(b"3/4 leases done")
        if at >= 0 and b"Ctrl-C stops cleanly" not in inside[at:]:
            inside += read_until(primary, b"Ctrl-C stops cleanly", time.monotonic() + 40)
        release.touch()   # the held rollout goes on; the run ends
        rest = read_until(primary, b"artifact v", time.monotonic() + 40)
        assert proc.wait(timeout=20) == 0
    finally:
        release.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        os.close(primary)
    screen = inside.decode("utf-8", "replace")
    assert "3/4 leases done" in screen, screen[-2000:]
    assert "round 0" in screen and "ETA" in screen
    assert "of 5,000 calls" in screen and "of work" in screen   # budgets, working time
    assert "v1   held-out" not in screen   # round 0 had not closed yet
    assert b"artifact v" in rest
