"""What the report and `evobus inspect --history` show of what a run learned: the
artifact at every version, what each commit changed (the key, the worker and task that
proposed it, the held-out evidence), the tasks the head still fails, the whole chain of
a resumed run, and statistics in plain words. The page is checked as text, and as
headless Chromium renders it (skipped only when Chromium is not installed)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest

from actors import evolve
from actors.cli.inspect import history_lines
from actors.cli.learned import learned_from
from actors.replay.chain import read_chain
from actors.cli.main import main
from actors.cli.render import STAT_NAMES, analyse, render_html
from actors.policies.parallelism import ClusterParallel
from actors.runtime.grouping import TaskGroups, task_groups
from bus.log import FORMAT_VERSION, LogHeader, LogWriter
from protocol import Task

pytestmark = pytest.mark.timeout(90)

LOGS = Path(__file__).resolve().parent / "logs"
RESUMED = LOGS / "resumed_after_kill.r1.evolog"
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason='matplotlib is not installed (evobus[report])')
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                "google-chrome"))), None)


def test_each_commit_is_matched_to_the_proposal_that_wrote_it():
    learned = learned_from(read_chain(LOGS / "sync_data_parallel.evolog"))
    assert [v.version for v in learned.versions] == [0, 1, 2, 3]
    v1 = learned.at(1)
    assert v1.round == 0 and v1.previous_heldout == 0.0 and v1.heldout == pytest.approx(0.517, abs=1e-3)
    billing = next(e for e in v1.edits if e.key == "billing")
    assert (billing.before, billing.after) == (None, "charge")
    assert (billing.worker, billing.task, billing.round) == ("worker-2", "billing-charge-1", 0)
    assert learned.at(3).heldout == 1.0 and learned.failing() == []


def test_a_resumed_run_is_read_as_one_chain():
    learned = learned_from(read_chain(RESUMED))
    assert [v.version for v in learned.versions] == [0, 1, 2]   # v1 is in the first log
    a = analyse(RESUMED)
    assert len(a.segments) == 2 and [r.round for r in a.rounds] == [0, 1]
    assert a.records == sum(len(c.records) for c in read_chain(RESUMED))
    assert [t for t in (r.t for r in a.rounds)] == sorted(r.t for r in a.rounds)


def test_the_page_shows_the_artifact_the_diffs_and_the_failing_tasks():
    a = analyse(RESUMED)
    page = render_html(a, {})
    assert "<h2>The artifact (v2)</h2>" in page and "password, profile" in page
    assert "<h2>What each commit changed</h2>" in page
    assert "worker-0 on <code>account-password-5</code> (round 1)" in page
    assert "0.517 → 0.793" in page
    assert "<h2>Tasks the head still fails (6)</h2>" in page and "billing-invoice-5" in page
    assert "Grouped by the tasks' <code>category</code>" in page
    assert "<tr><td class=l>billing</td><td>3</td><td>10</td>" in page
    assert page.count("<details") == 4   # every failing task; the artifact at v0, v1, v2
    assert "A resumed run: 2 logs" in page


def test_run_statistics_have_plain_names(tmp_path):
    a = analyse(LOGS / "async_router.evolog")
    assert a.stats
    page = render_html(a, {})
    for key in a.stats:
        assert key in STAT_NAMES, f"no plain name for the statistic {key!r}"
        assert STAT_NAMES[key] in page


def test_a_header_only_log_is_an_unfinished_run_not_a_group(tmp_path):
    path = tmp_path / "empty.evolog"
    with LogWriter(path, LogHeader(format_version=FORMAT_VERSION, scenario="x", seed=0,
                                   run_id="r"), fsync="never"):
        pass
    page = render_html(analyse(path), {})
    assert "group status" not in page and "did not finish" in page


def test_inspect_history_of_a_resumed_run_covers_the_chain(capsys):
    assert main(["inspect", str(RESUMED), "--history"]) == 0
    out = capsys.readouterr().out
    assert "v1  round 0: held-out 0.000 -> 0.517" in out
    assert "v2  round 1: held-out 0.517 -> 0.793" in out
    assert "tasks the head (v2) still fails (6), by category:" in out
    assert "billing   3 of 10 scored: billing-invoice-1 (held-out 0.00)" in out


@needs_matplotlib
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (.ci/run installs "
                                              "it with apt-get where it can)")
def test_headless_chromium_renders_the_artifact_diffs_and_failing_tasks(tmp_path, capsys):
    assert main(["report", str(RESUMED), "-o", str(tmp_path)]) == 0
    page = tmp_path / "index.html"
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True,
                         text=True, timeout=60)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for text in ("The artifact (v2)", "What each commit changed", "account-password-5",
                 "Tasks the head still fails (6)", "billing-invoice-5",
                 "Grouped by the tasks' ", "for example"):
        assert text in dom.stdout
    shot = tmp_path / "shot.png"
    done = subprocess.run([*browser, "--window-size=1100,2000", f"--screenshot={shot}",
                           page.as_uri()], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    import matplotlib.image as mpimg   # the report extra: only this test reads pixels

    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (2000, 1100)
    # The top 2000 px hold the artifact, the commits table and the failing tasks (the
    # charts come after them): each band of the page has ink on it, none is blank.
    bands = [pixels[y:y + 250, :, :3] for y in range(0, 1250, 250)]
    assert all((band < 0.5).any() for band in bands)

    def has(colour: str) -> bool:   # some pixel within a small distance of the colour
        rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        return bool((abs(pixels[..., :3] - rgb).max(axis=-1) < 0.06).any())

    assert has("#f7f7f7")   # the artifact's box
    assert has("#176b1f") and has("#aa3333")   # a diff's new (green) and old (red) text


def test_failing_tasks_are_counted_per_category_with_examples(capsys):
    assert main(["inspect", str(LOGS / "resumed_after_kill.evolog"), "--history"]) == 0
    out = capsys.readouterr().out
    assert "tasks the head (v1) still fails (14), by category:" in out
    # Most failing first, three examples a group, the rest counted.
    assert out.index("    billing ") < out.index("    account ") < out.index("    shipping ")
    assert ("billing    6 of 10 scored: billing-invoice-1 (held-out 0.00), billing-invoice-4 "
            "(held-out 0.00), billing-invoice-5 (held-out 0.00), and 3 more") in out


def test_inspect_json_names_each_failing_tasks_group(capsys):
    assert main(["inspect", str(RESUMED), "--history", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert last["grouped_by"] == "category"
    assert last["groups"] == {"billing": {"failing": 3, "scored": 10},
                              "account": {"failing": 2, "scored": 9},
                              "shipping": {"failing": 1, "scored": 4}}
    assert {f["task"]: f["group"] for f in last["failing"]}["shipping-tracking-1"] == "shipping"


def test_a_cluster_parallel_runs_groups_are_its_clusters():
    tasks = [Task(f"t{i}", "p", {"category": "same"}) for i in range(6)]
    groups = task_groups(tasks, ClusterParallel(lambda tid: f"c{int(tid[1:]) % 3}"))
    assert groups.by == "cluster_of"
    assert groups.groups == {"c0": ["t0", "t3"], "c1": ["t1", "t4"], "c2": ["t2", "t5"]}
    # Without cluster_of the meta field groups them; one group only is no grouping.
    assert task_groups(tasks) is None
    assert task_groups(tasks[:4], None) is None


def test_a_meta_field_that_is_an_id_is_no_grouping():
    tasks = [Task(f"t{i}", "p", {"topic": f"x{i}", "kind": "a" if i < 2 else "b"})
             for i in range(4)]
    found = task_groups(tasks)
    assert (found.by, found.groups) == ("kind", {"a": ["t0", "t1"], "b": ["t2", "t3"]})
    assert task_groups([Task("a", "p"), Task("b", "p")]) is None


def test_evolve_records_the_task_groups_in_the_log_header(tmp_path, capsys):
    from scenarios import router
    log = tmp_path / "run.evolog"
    evolve(router.tasks(), router.reward, agent=router.RouterAgent(), rounds=1, n_workers=2,
           log=str(log), bus="memory",
           parallel=ClusterParallel(router.cluster_of, per_worker=1))
    meta = read_chain(log)[0].header.meta
    groups = TaskGroups.from_json(meta["task_groups"])
    assert groups.by == "cluster_of"
    assert sorted(groups.groups) == ["account", "billing", "shipping", "technical"]
    lines = history_lines(learned_from(read_chain(log)))
    assert any(line.endswith("still fails (%d), by cluster_of:" % n) for line in lines
               for n in range(1, 73)), lines[-6:]


def test_the_quickstarts_failing_groups_are_what_inspect_prints(capsys):
    doc = (Path(__file__).resolve().parent.parent / "docs" / "quickstart.md").read_text()
    shown = doc.split("tasks the head (v2) still fails (6), by category:\n")[1].split("```")[0]
    assert main(["inspect", str(LOGS / "redispatched_lease.evolog"), "--history"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("tasks the head (v2) still fails (6), by category:\n" + shown)


def test_an_old_log_whose_domain_cannot_be_imported_lists_failing_tasks_ungrouped(tmp_path,
                                                                                 capsys):
    contents = read_chain(LOGS / "redispatched_lease.evolog")[0]
    meta = dict(contents.header.meta)
    meta["scenario_toml"] = meta["scenario_toml"].replace("tests.remote_domain:tasks",
                                                          "no_such_module:tasks")
    moved = tmp_path / "moved.evolog"
    with LogWriter(moved, msgspec.structs.replace(contents.header, meta=meta),
                   fsync="never") as w:
        for r in contents.records:
            w.append(r.seq, r.t, r.sender, r.receiver, r.body)
    assert main(["inspect", str(moved), "--history"]) == 0
    out = capsys.readouterr().out
    assert "tasks the head (v2) still fails (6):\n    held-out account-username-0  0.000" in out
