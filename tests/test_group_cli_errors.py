"""`evobus run` / `evobus resume` on parallel groups: what a user sees when something is
wrong (a failed group, a bad checkpoint, a bad answers file, a group the schema accepts
but the runtime refuses). Exit 2 for a refusal, 1 for a failed group; a message naming
the file and the fix, never a traceback."""

from __future__ import annotations

import json
import os

import pytest

from actors.cli.main import main

MODULE = '''
def pick(i: int, ctx) -> int | str:
    return ctx.ask(f"label for {i}?") if i == 1 else i


def fragile(i: int) -> int:
    if i == 2:
        raise ValueError("no such ticket")
    return i
'''


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "cli_targets.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def scenario(path, target: str, n: int, max_items: int | None = None) -> str:
    path.write_text(f'name = "{path.stem}"\nseed = 0\n\n[[groups]]\nname = "g"\n'
                    f'target = "{target}"\nitems = {list(range(n))}\nmax_concurrency = 1\n'
                    f'max_items = {max_items or n}\ncheckpoint = "g.ckpt"\n')
    return str(path)


def test_a_failed_group_exits_1_and_says_which_branch_and_what_is_left(workdir, capsys):
    assert main(["run", scenario(workdir / "f.toml", "cli_targets:fragile", 5)]) == 1
    err = capsys.readouterr().err
    assert "evobus: group g failed at branch 2: ValueError: no such ticket" in err
    assert "finished 2, failed 1, cancelled 0, never started 2" in err
    assert "Traceback" not in err


def test_a_group_the_runtime_refuses_names_the_scenario_field(workdir, capsys):
    # max_items below the item count: the schema accepts it, the group refuses it.
    assert main(["run", scenario(workdir / "r.toml", "cli_targets:fragile", 5, 3)]) == 2
    err = capsys.readouterr().err
    assert "r.toml: at `$.groups[0].items`:" in err and "never truncates" in err


@pytest.fixture
def paused(workdir, capsys):
    assert main(["run", scenario(workdir / "p.toml", "cli_targets:pick", 3)]) == 3
    capsys.readouterr()
    return workdir / "g.ckpt"


def test_running_a_paused_groups_scenario_again_is_refused_and_overwrite_replaces_it(
        paused, workdir, capsys):
    """The second `evobus run` would replace the paused group's checkpoint (and take its
    effects from its journal): validate and run refuse it, naming how to resume;
    --overwrite starts a new group in its place."""
    path = str(workdir / "p.toml")
    for verb in ("validate", "run"):
        assert main([verb, path]) == 2
        err = capsys.readouterr().err
        assert err.startswith("evobus: ") and len(err.strip().splitlines()) == 1, err
        assert "p.toml: at `$.groups[0]` (g): checkpoint=g.ckpt holds group " in err
        assert "`evobus resume g.ckpt --answers FILE`" in err and "--overwrite" in err
    before = (workdir / "g.ckpt").read_bytes()
    assert main(["run", path, "--overwrite"]) == 3   # a new group, paused again
    assert (workdir / "g.ckpt").read_bytes() != before


def test_resume_refuses_a_file_that_is_not_a_checkpoint(workdir, capsys):
    (workdir / "junk.ckpt").write_bytes(b"not msgpack at all")
    assert main(["resume", str(workdir / "junk.ckpt"), "--answers", "a.json"]) == 2
    err = capsys.readouterr().err
    assert "junk.ckpt: expected a run's message log" in err and "or a parallel group's " \
        "checkpoint; found a text file (it starts with b'not ms')" in err
    (workdir / "bin.ckpt").write_bytes(b"\x01\x02\x03\x04\x05\x06binary")
    assert main(["resume", str(workdir / "bin.ckpt")]) == 2
    assert "bin.ckpt: not a parallel-group checkpoint" in capsys.readouterr().err
    assert main(["resume", str(workdir / "missing.ckpt")]) == 2
    err = capsys.readouterr().err
    assert "missing.ckpt: cannot read it (No such file or directory); expected a run's " \
        "message log" in err and "fix: pass the path of the run's log" in err


def test_resume_given_a_scenario_file_says_to_run_it_or_resume_its_log(workdir, capsys):
    path = workdir / "s.toml"
    path.write_text('name = "s"\n')
    assert main(["resume", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: expected a run's message log" in err
    assert f"fix: to run a scenario file, `evobus run {path}`" in err
    assert "checkpoint (it does not start" not in err


def test_resume_without_answers_shows_what_waits_and_names_the_template(paused, capsys):
    assert main(["resume", str(paused)]) == 2
    out, err = capsys.readouterr()
    assert "label for 1?" in out
    assert "pass --answers FILE" in err and "g.answers.json" in err


@pytest.mark.parametrize("content,message", [
    (None, "cannot read the answers file"),
    ("{not json", "not valid JSON"),
    ('["an", "array"]', "expected a JSON object {interaction id: answer}"),
])
def test_a_bad_answers_file_is_refused_by_name(paused, capsys, content, message):
    answers = paused.parent / "answers.json"
    if content is not None:
        answers.write_text(content)
    assert main(["resume", str(paused), "--answers", str(answers)]) == 2
    err = capsys.readouterr().err
    assert f"answers.json: {message}" in err and "Traceback" not in err


def test_answers_in_the_user_inputs_form_resume_the_group(paused, capsys):
    from actors.groups.checkpoint import load_checkpoint

    (pending,) = load_checkpoint(paused).pending
    answers = paused.parent / "answers.json"
    answers.write_text(json.dumps({"user_inputs": {pending.id: "one"}, "approvals": {}}))
    assert main(["resume", str(paused), "--answers", str(answers), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["status"] == "completed" and summary["results"] == [0, "one", 2]


def test_a_scenario_with_a_domain_and_groups_runs_evolve_then_the_groups(tmp_path,
                                                                          monkeypatch,
                                                                          capsys, root):
    monkeypatch.chdir(tmp_path)
    text = (root / "scenarios" / "router.toml").read_text()
    path = tmp_path / "both.toml"
    path.write_text(text + '\n[[groups]]\nname = "lengths"\ntarget = "builtins:len"\n'
                           'items = ["a", "bb", "ccc"]\nmax_concurrency = 2\nmax_items = 3\n'
                           'returns = "int"\n')
    assert main(["run", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.index("held-out reward") < out.index("group lengths: completed, 3 results")
    # --json: one JSON document per line, the run's then each group's. The scenario
    # names no log: this second run writes new ones beside the first run's.
    assert main(["run", str(path), "--json"]) == 0
    run, group = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert run["final_reward"] == 1.0 and run["log"].startswith("runs/router-")
    assert group == {**group, "group": "lengths", "status": "completed", "results": [1, 2, 3]}
    # The group's log is next to the run's, named after the group.
    assert (tmp_path / run["log"].replace(".evolog", ".lengths.evolog")).exists()


@pytest.mark.parametrize("verb", ["inspect", "report", "replay"])
def test_a_checkpoint_given_as_a_log_is_named_once_and_pointed_at_resume(paused, capsys,
                                                                          verb):
    code = main([verb, str(paused)])
    assert code == 2
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert text.count(str(paused)) == 2, text   # once as the file, once in the hint
    assert "not an evobus log" in text
    assert f"it is a parallel group's checkpoint, not a log: `evobus resume {paused} " \
           "--show`" in text


def test_a_missing_log_is_one_line_with_the_reason_and_where_logs_are(tmp_path, capsys,
                                                                        monkeypatch, root):
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "nope.evolog"]) == 2
    assert capsys.readouterr().err.strip() == (
        "evobus: nope.evolog: cannot read the log (No such file or directory); fix: pass a "
        "run's log (the `log:` line of `evobus run`'s summary, "
        "runs/NAME-YYYYmmdd-HHMMSS.evolog by default)")
    (tmp_path / "runs").mkdir()   # a run's default log there: named, newest first
    for i, name in enumerate(["router-1.evolog", "router-2.evolog"]):
        (tmp_path / "runs" / name).write_bytes(b"")
        os.utime(tmp_path / "runs" / name, (1e9 + i, 1e9 + i))
    assert main(["inspect", "nope.evolog"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "; the newest under runs/: runs/router-2.evolog, runs/router-1.evolog)")


def test_a_scenario_file_given_as_a_log_is_pointed_at_run(capsys, root):
    path = root / "scenarios" / "router.toml"
    assert main(["inspect", str(path)]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"not an evobus log: it starts with b'# The ', expected b'EVOLOG'; fix: it is a "
        f"scenario file: `evobus run {path}` runs it and says where its log is")


def test_resume_refuses_flags_for_the_other_kind_of_file(paused, capsys, root, tmp_path):
    assert main(["resume", str(paused), "--log", str(tmp_path / "new.evolog")]) == 2
    assert ("is not a run's message log (it is read as a group checkpoint): --log only "
            "applies to a run's message log; remove it") in capsys.readouterr().err
    log = root / "tests" / "logs" / "sync_data_parallel.evolog"
    assert main(["resume", str(log), "--answers", "a.json", "--as", "lead"]) == 2
    assert (f"{log} is a run's message log: --answers, --as only apply to a group "
            "checkpoint; remove them") in capsys.readouterr().err


def test_insecure_on_a_groups_only_scenario_is_warned_about(workdir, capsys):
    assert main(["run", scenario(workdir / "f.toml", "cli_targets:pick", 1),
                 "--insecure"]) == 0
    assert any(line.startswith("evobus: warning: ") and
               line.endswith("--insecure concerns remote workers and is ignored")
               for line in capsys.readouterr().err.splitlines())


def test_evobus_validate_checks_a_groups_returns_and_refuses_a_target_without_one(workdir,
                                                                                  capsys):
    (workdir / "untyped.py").write_text("def f(i):\n    return i\n")
    path = scenario(workdir / "untyped.toml", "untyped:f", 3)
    assert main(["validate", path]) == 2
    err = capsys.readouterr().err
    assert "$.groups[0]" in err and "declares no output type" in err and "returns" in err
    with open(path, "a") as f:
        f.write('returns = "evobus_no_such_module:T"\n')
    assert main(["validate", path]) == 2
    assert "evobus_no_such_module" in capsys.readouterr().err
    text = (workdir / "untyped.toml").read_text().replace("evobus_no_such_module:T", "int")
    (workdir / "untyped.toml").write_text(text)
    assert main(["validate", path]) == 0
    assert main(["run", path]) == 0
    assert "completed, 3 results" in capsys.readouterr().out


def test_a_group_waiting_for_remote_workers_says_so_as_the_wait_begins(caplog):
    """As a run does: the wait's first line names the address and the command that starts
    a worker; the error, once wait_seconds ran out, names the same command."""
    import logging

    from actors import ConfigError, run_group
    from protocol.scenario import Workers
    from tests.test_remote import free_port

    addr = f"tcp://127.0.0.1:{free_port()}"
    command = f"evobus worker --connect {addr} --allow tests.group_remote_domain"
    with caplog.at_level(logging.WARNING, logger="actors.groups.fleet"), \
            pytest.raises(ConfigError) as info:
        run_group("tests.group_remote_domain:square", [1, 2], max_concurrency=2, max_items=2,
                  workers=Workers(local=0, remote=1, bind=addr, wait_seconds=0.3))
    said = [r.getMessage() for r in caplog.records if r.name == "actors.groups.fleet"]
    assert said and said[0] == (f"waiting up to 0.3 s (wait_seconds) for 1 remote worker(s) "
                                f"at {addr}; start each with `{command}`"), said
    assert f"start each missing one with `{command}`" in str(info.value)
