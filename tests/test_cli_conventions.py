"""The habits users bring from other command-line tools: --version, usage and exit 2
without a verb, a quiet exit on a closed pipe, bad filter values refused with the valid
ones listed, errors that blame the right file, one torn-tail line naming a CLI fix, a
scenario with a byte order mark, every schema error at once, and nothing but JSON on
stdout with --json."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from actors.cli.main import main
from actors.version import PACKAGE_VERSION

pytestmark = pytest.mark.timeout(90)

TESTS = Path(__file__).resolve().parent
LOG = TESTS / "logs" / "sync_data_parallel.evolog"


def evobus(*args, cwd, env, **kw):
    return subprocess.run([sys.executable, "-m", "actors.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, **kw)


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"evobus {PACKAGE_VERSION} ")


def test_no_verb_prints_usage_on_stderr_and_exits_2(capsys):
    assert main([]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("usage: evobus") and "a verb is required" in out.err


@pytest.mark.parametrize("args", [["inspect", str(LOG)], ["schema"]],
                         ids=["inspect", "schema"])
def test_a_closed_pipe_ends_the_command_quietly(args, clean_env, tmp_path):
    read_end, write_end = os.pipe()
    os.close(read_end)   # the reader is gone before the first byte: every write fails
    try:
        done = subprocess.run([sys.executable, "-m", "actors.cli", *args], cwd=tmp_path,
                              env=clean_env, stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 141   # 128 + SIGPIPE, as a shell reports `yes | head`


@pytest.mark.parametrize("args, valid", [
    (["--type", "Nope"], "valid types: Barrier, Baseline, Branch"),
    (["--actor", "nobody"], "its actors: driver, merger, planner, scheduler, worker-0"),
    (["--round", "9"], "its rounds: 0, 1, 2"),
], ids=["type", "actor", "round"])
def test_a_filter_value_that_matches_nothing_is_refused_with_the_valid_ones(args, valid,
                                                                          capsys):
    assert main(["inspect", str(LOG), *args]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert valid in out.err and args[1] in out.err


@pytest.mark.parametrize("args, hint", [
    (["--type", "Comit"], "--type Comit: no such message type (did you mean Commit?)"),
    (["--type", "commit"], "(did you mean Commit?)"),
    (["--actor", "Merger"], "no such actor in"),
], ids=["typo", "case", "actor-case"])
def test_a_filter_value_a_letter_off_names_the_one_meant(args, hint, capsys):
    assert main(["inspect", str(LOG), *args]) == 2
    err = capsys.readouterr().err
    assert hint in err
    if args[0] == "--actor":
        assert "(did you mean merger?)" in err


def test_an_actor_is_not_guessed_from_its_number(capsys):
    assert main(["inspect", str(LOG), "--actor", "worker-9"]) == 2
    assert "did you mean" not in capsys.readouterr().err   # worker-9 is not worker-0


def test_a_negative_limit_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(LOG), "--limit", "-1"])
    assert exit_.value.code == 2
    assert "--limit: expected 0 or more, got -1" in capsys.readouterr().err


def test_report_to_an_unwritable_directory_blames_the_directory(capsys):
    pytest.importorskip("matplotlib")
    assert main(["report", str(LOG), "-o", "/proc/nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("evobus: -o /proc/nope: cannot create the report directory")
    assert "cannot read the log" not in err and str(LOG) not in err


def test_a_torn_tail_is_one_warning_line_naming_evobus_repair(tmp_path, clean_env):
    torn = tmp_path / "torn.evolog"
    torn.write_bytes(LOG.read_bytes() + b"garbage")
    done = evobus("inspect", str(torn), "--limit", "1", cwd=tmp_path, env=clean_env)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert f"`evobus repair {torn}`" in lines[0] and "repair=True" not in lines[0]
    assert "torn tail" not in done.stdout
    fixed = evobus("repair", str(torn), cwd=tmp_path, env=clean_env)
    assert fixed.returncode == 0 and "cut a torn tail of 7 bytes" in fixed.stdout
    assert torn.read_bytes() == LOG.read_bytes()
    again = evobus("inspect", str(torn), "--limit", "1", cwd=tmp_path, env=clean_env)
    assert again.stderr == ""


def test_the_torn_tail_warning_of_other_verbs_names_the_cli_fix(tmp_path, clean_env):
    torn = tmp_path / "torn.evolog"
    torn.write_bytes(LOG.read_bytes() + b"garbage")
    done = evobus("replay", str(torn), "--quiet", cwd=tmp_path, env=clean_env)
    warned = [line for line in done.stderr.splitlines() if "torn or corrupt tail" in line]
    assert len(warned) == 1, done.stderr
    assert f"`evobus repair {torn}` truncates the file there" in warned[0]


def test_a_scenario_with_a_utf8_byte_order_mark_is_accepted(root, tmp_path, capsys,
                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)   # validate checks the scenario's log path from here
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + (root / "scenarios" / "router.toml").read_bytes())
    assert main(["validate", str(path)]) == 0
    assert ": ok (sync" in capsys.readouterr().out


def test_every_schema_error_of_a_file_is_reported_at_once(tmp_path, capsys):
    path = tmp_path / "two.toml"
    path.write_text('rounds = "many"\n[domain]\ntasks = "scenarios.router:tasks"\n'
                    'reward = "scenarios.router:reward"\nagent = "scenarios.router:RouterAgent"'
                    '\n[workers]\nlocal = "four"\nprocs = 2\n')
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: 3 errors:" in err
    assert "at `$.rounds`" in err and "at `$.workers.local`" in err
    assert "at `$.workers.procs`" in err and "did you mean `processes`" in err


def test_run_json_keeps_warnings_off_stdout(root, tmp_path, clean_env):
    text = (root / "scenarios" / "router.toml").read_text()
    path = tmp_path / "warns.toml"
    path.write_text(text.replace("[workers]", "[workers]\nbind = \"tcp://127.0.0.1:0\""))
    done = evobus("run", str(path), "--json", "--log", str(tmp_path / "w.evolog"),
                  cwd=tmp_path, env=clean_env)
    assert done.returncode == 0, done.stderr
    assert "only concern" in done.stderr
    json.loads(done.stdout)   # the whole of stdout is one JSON document


def test_resume_json_prints_only_json_on_stdout(root, tmp_path, clean_env):
    log = tmp_path / "r.evolog"
    first = evobus("run", str(root / "scenarios" / "router.toml"), "--quiet", "--log",
                   str(log), cwd=tmp_path, env=clean_env)
    assert first.returncode == 0, first.stderr
    data = log.read_bytes()
    log.write_bytes(data[: len(data) * 2 // 3])   # what a kill -9 mid-write leaves
    done = evobus("resume", str(log), "--json", cwd=tmp_path, env=clean_env)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["resumed"] == str(log) and summary["stop_reason"]
    assert "cut a torn tail" in done.stderr


# -- inspect: the artifact at a version, JSON lines, following a live log ----------------


def test_inspect_version_prints_the_artifact_at_that_version(capsys):
    assert main(["inspect", str(LOG), "--version", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Config (by category)\n## account\npassword, profile\n")
    assert main(["inspect", str(LOG), "--version", "0", "--json"]) == 0
    v0 = json.loads(capsys.readouterr().out)
    assert v0["version"] == 0 and v0["state"] == {} and v0["heldout"] == 0.0


def test_inspect_version_that_does_not_exist_lists_the_versions(capsys):
    assert main(["inspect", str(LOG), "--version", "7"]) == 2
    assert "its versions: 0, 1, 2, 3" in capsys.readouterr().err


def test_inspect_json_prints_one_json_object_a_message(capsys):
    assert main(["inspect", str(LOG), "--json", "--type", "RoundClosed"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["message"]["round"] for r in rows] == [0, 1, 2]
    assert all(r["type"] == "RoundClosed" and r["sender"] == "merger" for r in rows)


def test_inspect_history_says_what_each_commit_changed_and_who_proposed_it(capsys):
    assert main(["inspect", str(LOG), "--history"]) == 0
    out = capsys.readouterr().out
    assert "v1  round 0: held-out 0.000 -> 0.517, 4 key(s) changed" in out
    assert ("added billing: - -> 'charge'  [proposed by worker-2 on task billing-charge-1 "
            "(round 0)]") in out
    assert "the head (v3) fails no task it was scored on" in out


def test_inspect_follow_prints_records_as_they_are_appended(tmp_path, clean_env):
    data = LOG.read_bytes()
    live = tmp_path / "live.evolog"
    cut = len(data) * 3 // 4 + 3   # inside a record, as a writer may leave it
    live.write_bytes(data[:cut])
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "inspect", str(live),
                             "--follow", "--type", "RoundClosed", "--idle", "50"],
                            cwd=tmp_path, env=clean_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith(f"log {live}:")
        first = proc.stdout.readline()   # round 0 closed in the first 3/4 of the log
        assert "RoundClosed  round=0" in first
        with open(live, "ab") as f:   # the run goes on, and ends (RunDone)
            f.write(data[cut:])
        rest, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert [line.split("round=")[1][0] for line in rest.splitlines()] == ["1", "2"]
    assert err == ""


# -- evobus worker says what it does; evobus replay is quiet ------------------------------


def test_a_worker_started_before_its_broker_says_at_once_it_waits_then_when_it_connects(
        tmp_path):
    """`evobus worker` started before its coordinator: the first line says it waits for
    the broker at ADDR and what it will do, long before its first reconnect (a 30 s
    --broker-timeout: the old worker was silent that long); the coordinator started
    after that line, the worker says it connected (and after how long), what it runs
    and how it ended. Real processes over 127.0.0.1."""
    import time

    from test_remote import Lines, env_with, free_port as below_ephemeral, scenario_text

    addr = f"tcp://127.0.0.1:{below_ephemeral()}"
    env = env_with()
    procs = []
    try:
        t0 = time.monotonic()
        worker = subprocess.Popen(
            [sys.executable, "-m", "actors.cli", "worker", "--connect", addr, "--id", "w0",
             "--allow", "tests.remote_domain", "--allow", "scenarios", "--give-up", "60",
             "--broker-timeout", "30"], cwd=TESTS.parent, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        procs.append(worker)
        said = Lines(worker.stdout)
        waiting = said.wait(r"^evobus worker w0: waiting for the broker", 25)
        took = time.monotonic() - t0
        # Before its first reconnect (30 s): what an interpreter's start takes, loaded.
        assert took < 25, took
        assert waiting.rstrip() == (
            f"evobus worker w0: waiting for the broker at {addr} (a new connection after "
            "each 30 s of silence, --broker-timeout; giving up after 60 s without an "
            "answer, --give-up) ...")
        scenario = tmp_path / "remote.toml"
        scenario.write_text(f'log = "{tmp_path / "remote.evolog"}"\n' + scenario_text(
            f'local = 0\nremote = 1\nbind = "{addr}"'))
        coordinator = subprocess.Popen([sys.executable, "-m", "actors.cli", "run",
                                        str(scenario), "--quiet"], cwd=TESTS.parent,
                                       env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
        procs.append(coordinator)
        connected = said.wait(r"^evobus worker w0: connected to ", 60)
        out, err = coordinator.communicate(timeout=60)
        assert coordinator.returncode == 0, err
        assert worker.wait(45) == 0, said.text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert f"waiting up to 30 s (wait_seconds) for 1 remote worker(s) at {addr}" in err
    assert " joined" not in err   # --quiet: who joined is not said, the wait's line is
    # "after N s" once the wait lasted a second (a coordinator may start faster).
    assert re.fullmatch(rf"evobus worker w0: connected to {re.escape(addr)}( after "
                        r"\d+\.\d s)?; waiting for the run's spec", connected.rstrip()), connected
    mine = [line.rstrip() for line in said.text().splitlines()
            if line.startswith("evobus worker w0: ")]
    assert mine[0] == waiting.rstrip() and mine[1] == connected.rstrip(), mine
    assert mine[2].startswith("evobus worker w0: running run tests.remote_domain:run + "
                              "propose tests.remote_domain:propose (run ")
    assert mine[-1].startswith("evobus worker w0: stopped by the coordinator (")
    assert "lease(s)" in mine[-1]


def free_port() -> int:
    import socket

    with socket.socket() as s:   # bound then closed: nothing listens there afterwards
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_worker_whose_broker_is_not_there_says_it_cannot_reach_it_and_exits_1(clean_env):
    import time

    addr = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    # A new socket after 1.5 s of silence: the old worker said "reconnected" there.
    out = evobus("worker", "--connect", addr, "--give-up", "3", "--broker-timeout", "1.5",
                 cwd=TESTS, env=clean_env)
    took = time.monotonic() - t0
    said = out.stdout + out.stderr
    assert out.returncode == 1, said
    assert "reconnect" not in said and "lost the broker" not in said, said
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("evobus: worker ") and f"cannot reach the broker at {addr}" in last
    # What it tried, for how long, and the fix.
    for part in ("refused: nothing listens there", "for 3 s", "start the coordinator first",
                 f'bind = "{addr}"', "--give-up"):
        assert part in last, (part, last)
    assert f"waiting for the broker at {addr} (" in out.stdout.splitlines()[0], said
    assert f"no broker at {addr} yet after " in out.stdout, said
    # A logged warning reads as evobus's other lines do, not as Python's logging.
    assert out.stderr.startswith("evobus: warning: no --allow given"), out.stderr
    assert "WARNING" not in said
    assert took < 3 + 15, took   # its give-up, the interpreter's start on a loaded machine


def test_a_worker_whose_broker_address_is_another_service_says_so(clean_env):
    import socket

    with socket.socket() as listener:   # accepts TCP connections, speaks no ZeroMQ
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        addr = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        out = evobus("worker", "--connect", addr, "--give-up", "2", "--allow", "scenarios",
                     cwd=TESTS, env=clean_env)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1 and f"cannot reach the broker at {addr}" in last, out.stderr
    assert "a connection was made there, but no evobus broker answered" in last, last
    assert "not another service's" in last


def test_replay_of_a_run_with_a_lost_worker_prints_no_live_warnings(clean_env, tmp_path):
    log = TESTS / "logs" / "redispatched_lease.evolog"
    done = evobus("replay", str(log), cwd=tmp_path, env=clean_env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    assert "presumed lost" not in done.stdout


def test_every_verb_says_what_it_does_and_what_each_argument_is():
    """`evobus VERB --help` has a description (what it does), and every positional
    argument a help line: a new user reads these first."""
    import argparse

    from actors.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for verb, parser in sub.choices.items():
        if not parser.description:
            missing.append(f"{verb}: no description")
        missing += [f"{verb} {a.dest}: no help" for a in parser._actions
                    if not a.option_strings and not a.help]
    assert not missing, missing


#: What a verb's first line must not wait for: the bus, the actor runtime, the live
#: views, the charts. Only the verb that runs imports its code (actors.cli.verbs.Lazy).
HEAVY = ("zmq", "pykka", "rich", "matplotlib", "asyncio", "actors.runtime.evolve",
         "actors.runtime.runtime", "actors.groups", "actors.replay.engine")

#: Prints, after running `evobus ARGS...` in this process, the modules it imported.
IMPORTED = """import sys
from actors.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("IMPORTED", " ".join(sorted(sys.modules)), file=sys.stderr)
"""


def imported_by(*args, env) -> set[str]:
    out = subprocess.run([sys.executable, "-c", IMPORTED, *args], cwd=TESTS, env=env,
                         capture_output=True, text=True, timeout=60)
    line = next(x for x in out.stderr.splitlines() if x.startswith("IMPORTED "))
    return set(line.split()[1:])


@pytest.mark.parametrize("args", [["--help"], ["inspect", "--help"], ["run", "--help"],
                                  ["resume", "--help"], ["--version"]])
def test_help_imports_no_verbs_code(args, clean_env):
    """`evobus --help` printed its first line after 0.6 s of importing every verb's code;
    the parser alone imports nothing of ours but actors.cli.main and .verbs."""
    modules = imported_by(*args, env=clean_env)
    ours = {m for m in modules if m.split(".")[0] in ("actors", "bus", "protocol", "scenarios")}
    assert ours <= {"actors", "actors.cli", "actors.cli.main", "actors.cli.verbs",
                    "actors.version"}, sorted(ours)
    assert not {m for m in modules if m.startswith(HEAVY) or m.startswith("msgspec")}


def test_inspect_prints_a_log_without_the_bus_or_the_runtime(clean_env):
    modules = imported_by("inspect", str(LOG), "--limit", "1", env=clean_env)
    assert "actors.cli.inspect" in modules   # it ran
    loaded = sorted(m for m in modules if m.startswith(HEAVY))
    assert not loaded, loaded


UNPRICED = """name = "unpriced"
[domain]
tasks = "scenarios.router:tasks"
reward = "scenarios.router:reward"
[domain.agent]
ref = "actors.openai_agent:OpenAIAgent"
kwargs = {base_url = "http://127.0.0.1:9/v1", model = "sim", api_key_env = ""}
[budgets]
max_cost = 0.5
"""


def test_max_cost_without_a_price_for_the_model_is_refused_before_a_log_is_written(
        tmp_path, capsys):
    from actors.cli.main import main

    path, log = tmp_path / "unpriced.toml", tmp_path / "unpriced.evolog"
    path.write_text(UNPRICED)
    for verb in ("validate", "run"):
        assert main([verb, str(path), "--log", str(log)]) == 2, verb
        err = capsys.readouterr().err
        assert f"{path}: at `$.budgets.max_cost`: expected a price for the model 'sim'" in err
        assert 'fix: add under [budgets] prices = {"sim" = [INPUT, OUTPUT]}' in err
        assert not log.exists(), verb   # nothing ran: fixing the price, the same log is free
    path.write_text(UNPRICED + 'prices = {"sim" = [0.15, 0.60]}\n')
    assert main(["validate", str(path), "--log", str(log)]) == 0


def test_an_unset_key_variable_is_refused_by_validate_as_run_refuses_it(tmp_path, capsys,
                                                                         monkeypatch):
    """validate said ok and run refused at once (OpenAIAgent built): both refuse it now,
    naming the variable and the fix, before a log is written."""
    from actors.cli.main import main

    monkeypatch.delenv("EVOBUS_TEST_UNSET_KEY", raising=False)
    path, log = tmp_path / "unkeyed.toml", tmp_path / "unkeyed.evolog"
    path.write_text(UNPRICED.replace('api_key_env = ""', 'api_key_env = "EVOBUS_TEST_UNSET_KEY"')
                    .replace("max_cost = 0.5", "max_calls = 100"))
    for verb in ("validate", "run"):
        assert main([verb, str(path), "--log", str(log)]) == 2, verb
        err = capsys.readouterr().err
        assert (f"{path}: at `$.domain.agent`: OpenAIAgent: the environment variable "
                "EVOBUS_TEST_UNSET_KEY is not set; export EVOBUS_TEST_UNSET_KEY=<your key>") \
            in err, err
        assert not log.exists(), verb
    monkeypatch.setenv("EVOBUS_TEST_UNSET_KEY", "sk-test")
    assert main(["validate", str(path), "--log", str(log)]) == 0


def test_the_worker_help_gives_its_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["worker", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for said in ("(threads; default: 1)", "(default: 5.0 s)", "(default: 120.0 s)"):
        assert said in text, said


@pytest.mark.parametrize("flags,says", [
    (["--broker-timeout", "1"], "--broker-timeout 1: expected more than 1 s"),
    (["--give-up", "0"], "--give-up 0: expected a number of seconds > 0"),
])
def test_worker_timings_that_cannot_work_are_refused_in_one_line(flags, says, capsys):
    assert main(["worker", "--connect", "tcp://127.0.0.1:9", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_scenario_path_that_is_no_file_says_the_fix(tmp_path, capsys):
    (tmp_path / "b.toml").write_text("")
    (tmp_path / "a.toml").write_text("")
    assert main(["run", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"(Is a directory); fix: pass one of its scenario files: {tmp_path / 'a.toml'}, "
        f"{tmp_path / 'b.toml'}")
    assert main(["validate", str(tmp_path / "nothere.toml")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"evobus: {tmp_path / 'nothere.toml'}: cannot read the scenario file (No such file "
        "or directory); fix: pass the path of a scenario file (TOML: `evobus schema` prints "
        "its JSON Schema, docs/scenarios.md lists its keys)")
    assert main(["run", str(tmp_path / "a")]) == 2   # the name without .toml
    assert capsys.readouterr().err.strip().endswith(f"; fix: did you mean {tmp_path / 'a'}.toml?")


def test_inspect_lines_leave_out_optional_fields_left_unset(capsys):
    assert main(["inspect", str(LOG), "--type", "Baseline", "--type", "EvalDone",
                 "--limit", "4"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "->" in x]
    assert lines and all("=None" not in x for x in lines), lines
    assert any("Baseline     version=0 heldout_reward=" in x for x in lines), lines


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM],
                         ids=["SIGINT", "SIGTERM"])
def test_a_worker_stopped_by_a_signal_says_so_in_one_line(signum, clean_env):
    """As `evobus run` does: SIGTERM leaves as Ctrl-C does (its slots drained, one line,
    128 + the signal), where it used to die silently."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "worker", "--connect", addr,
                             "--id", "w0", "--allow", "scenarios"], cwd=TESTS,
                            env=clean_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().startswith("evobus worker w0: waiting for the broker")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    how = "interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"
    assert proc.returncode == 128 + signum, err
    assert err.strip() == f"evobus: worker w0: {how} before it reached the broker", err
