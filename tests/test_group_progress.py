"""``on_progress``: how far a running group has got, from the driver's thread; and the
view ``evobus run`` / ``evobus resume`` show with it (actors/cli/progress.py)."""

from __future__ import annotations

import io
import threading

import pytest

import actors.groups.driver as groups
from actors import ConfigError, GroupProgress, resume_group, run_group
from actors.cli.progress import GroupProgressView


@pytest.fixture
def fast_progress(monkeypatch):
    monkeypatch.setattr(groups, "PROGRESS_S", 0.05)


def test_on_progress_hears_the_group_while_it_runs_and_once_when_it_ends(fast_progress):
    seen: list[GroupProgress] = []
    reported = threading.Event()

    def on_progress(p: GroupProgress) -> None:
        seen.append(p)
        if not p.done:
            reported.set()

    def target(i: int) -> int:
        if i >= 10:   # the second half waits for a report: the group cannot end before one
            assert reported.wait(10), "no progress report within 10 s"
        return i * 2

    outcome = run_group(target, list(range(20)), max_concurrency=2, max_items=20, chunk=1,
                        on_progress=on_progress)
    assert outcome.status == "completed"
    running, final = seen[:-1], seen[-1]
    assert running and not any(p.done for p in running)
    assert all(p.total == 20 and p.failed == 0 and p.finished < 20 for p in running)
    counts = [p.finished for p in seen]
    assert counts == sorted(counts)                      # never goes back
    assert [p.elapsed for p in seen] == sorted(p.elapsed for p in seen)
    assert final.done and final.finished == 20 and final.failed == 0
    assert {p.group_id for p in seen} == {outcome.group_id}


def test_on_progress_counts_failed_branches(fast_progress):
    seen: list[GroupProgress] = []

    def target(i: int) -> int:
        if i == 3:
            raise ValueError("bad item")
        return i

    outcome = run_group(target, list(range(8)), max_concurrency=1, max_items=8, chunk=1,
                        on_progress=seen.append)
    assert outcome.status == "failed"
    assert seen[-1].done and seen[-1].failed == 1 and seen[-1].finished == 3


def test_a_resumed_group_counts_what_it_had_finished_before(tmp_path, fast_progress):
    def target(i: int, ctx) -> int | str:
        return ctx.ask("which?") if i == 2 else i

    paused = run_group(target, list(range(5)), max_concurrency=1, max_items=5, chunk=1,
                       checkpoint=tmp_path / "p.ckpt")
    assert paused.status == "user_input_pending"
    seen: list[GroupProgress] = []
    (p,) = paused.pending_interactions
    resumed = resume_group(paused.checkpoint, target=target, user_inputs={p.id: "this"},
                           on_progress=seen.append)
    assert resumed.results == [0, 1, "this", 3, 4]
    assert seen[-1].finished_before == len(paused.finished)
    assert seen[-1].finished == 5 and seen[-1].done


def test_on_progress_must_be_callable_and_its_error_stops_the_group(fast_progress):
    with pytest.raises(ConfigError, match="on_progress must be a callable"):
        run_group(lambda i: i, [1], max_concurrency=1, max_items=1, on_progress=3,
                  returns=int)
    started = threading.Event()

    def broken(p: GroupProgress) -> None:
        # The display breaks once the group is under way: a report due before the first
        # branch started (a loaded machine) would otherwise stop a group that never ran.
        assert started.wait(10), "no branch started within 10 s"
        raise RuntimeError("the display broke")

    def target(i: int) -> int:
        started.set()
        return i

    with pytest.raises(RuntimeError, match="the display broke"):
        run_group(target, list(range(4)), max_concurrency=1, max_items=4, chunk=1,
                  on_progress=broken)
    assert started.is_set()


def _p(elapsed, finished, total=100, failed=0, done=False, before=0):
    return GroupProgress(group_id="g", total=total, finished=finished, failed=failed,
                         elapsed=elapsed, done=done, finished_before=before)


def test_the_plain_view_prints_a_line_every_few_seconds_and_none_at_the_end():
    out = io.StringIO()
    with GroupProgressView("triage", stream=out, live=False, every=5.0) as view:
        for second in range(1, 12):
            view(_p(float(second), finished=second * 5))
        view(_p(11.5, finished=100, done=True))
    lines = out.getvalue().splitlines()
    assert lines == [
        "group triage: 25/100 finished (5.0/s), 5.0s elapsed, ~15.0s left",
        "group triage: 50/100 finished (5.0/s), 10.0s elapsed, ~10.0s left",
    ]


def test_the_plain_view_says_a_group_is_stopping_and_rates_only_this_calls_work():
    out = io.StringIO()
    view = GroupProgressView("g", stream=out, live=False, every=1.0)
    view(_p(2.0, finished=60, failed=1, before=50))
    assert out.getvalue().strip() == ("group g: 60/100 finished (5.0/s), 1 failed (stopping), "
                                      "2.0s elapsed")


def test_quiet_shows_nothing_and_the_live_bar_ends_with_the_group():
    out = io.StringIO()
    quiet = GroupProgressView("g", stream=out, quiet=True, every=0.0)
    quiet(_p(9.0, finished=9))
    assert out.getvalue() == "" and not quiet.live
    live = GroupProgressView("g", stream=out, live=True)
    live(_p(1.0, finished=10))
    assert live._bar is not None
    live(_p(2.0, finished=100, done=True))
    assert live._bar is None


def _group_scenario(path, name: str, target: str, n: int, bound: int,
                    returns: str = "") -> None:
    """A scenario file with one group: ``target`` over the integers below ``n``."""
    path.write_text(f'name = "{path.stem}"\nseed = 0\n\n[[groups]]\nname = "{name}"\n'
                    f'target = "{target}"\nitems = {list(range(n))}\n'
                    f'max_concurrency = {bound}\nmax_items = {n}\n'
                    + (f'returns = "{returns}"\n' if returns else ""))


def test_evobus_run_prints_a_long_groups_progress_and_keeps_stdout_for_json(tmp_path,
                                                                             monkeypatch,
                                                                             capsys):
    import json

    import actors.cli.progress as progress
    from actors.cli.main import main

    monkeypatch.setattr(groups, "PROGRESS_S", 0.02)
    monkeypatch.setattr(progress, "GROUP_LINE_EVERY_S", 0.0)   # a line per report
    (tmp_path / "slowmod.py").write_text(
        "import time\n\ndef nap(i: int) -> int:\n    time.sleep(0.01)\n    return i\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    _group_scenario(tmp_path / "slow.toml", "naps", "slowmod:nap", 30, 1)
    assert main(["run", "slow.toml"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("group naps: ")]
    assert lines and "/30 finished" in lines[0], out
    assert "completed, 30 results" in out
    assert main(["run", "slow.toml", "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)                        # stdout: the JSON summary alone
    assert "/30 finished" in captured.err


def test_a_large_groups_report_lists_the_first_results_and_says_how_many_more(tmp_path,
                                                                              monkeypatch,
                                                                              capsys):
    from actors.cli.main import main

    monkeypatch.chdir(tmp_path)
    _group_scenario(tmp_path / "many.toml", "ids", "json:dumps", 25, 2, returns="str")
    assert main(["run", "many.toml"]) == 0
    out = capsys.readouterr().out
    listed = [line for line in out.splitlines() if line.startswith('  "')]
    assert listed == [f'  "{i}"' for i in range(20)], out
    assert "  ... 5 more (--json prints every result)" in out


def test_a_result_that_cannot_cross_the_bus_counts_as_failed_not_finished(fast_progress):
    seen: list[GroupProgress] = []
    outcome = run_group(lambda i: object() if i == 1 else i, [0, 1, 2], max_concurrency=1,
                        max_items=3, chunk=1, on_progress=seen.append, returns=object)
    assert outcome.status == "failed"
    assert (seen[-1].finished, seen[-1].failed) == (1, 1)
