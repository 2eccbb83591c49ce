"""What `evobus run` shows: plain lines off a terminal, a live panel on one, --quiet,
--json on a clean stdout, and Ctrl-C that stops cleanly and says how to resume."""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from actors.cli.progress import RunProgress, interrupt_guard, outcome_text
from bus.log import TornTailWarning, read_log
from protocol import Progress, RoundClosed, RoundRecord, RunDone, decode
from protocol.scenario import parse_scenario
from scenarios.router import RouterAgent

pytestmark = pytest.mark.timeout(60)

TESTS = Path(__file__).resolve().parent
ANSI = "\x1b["


class SlowAgent(RouterAgent):
    """The router agent, slowed down so a run lasts long enough to interrupt."""

    def __init__(self, delay: float = 0.02) -> None:
        self.delay = delay

    def solve(self, rendered, task):
        time.sleep(self.delay)
        return super().solve(rendered, task)


SLOW = """name = "slow"
rounds = 40
[domain]
tasks = "scenarios.router:tasks"
reward = "scenarios.router:reward"
agent = {ref = "test_cli_ux:SlowAgent", kwargs = {delay = 0.01}}
[strategy]
kind = "KeyedRules"
categories = ["billing", "shipping", "technical", "account"]
[workers]
local = 4
"""


def evobus(*args, cwd, env, **kw):
    return subprocess.run([sys.executable, "-m", "actors.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=50, **kw)


@pytest.fixture
def env(clean_env):
    clean_env["PYTHONPATH"] = os.pathsep.join([str(TESTS), clean_env["PYTHONPATH"]])
    clean_env.pop("COLUMNS", None)
    return clean_env


def test_off_a_terminal_each_round_is_one_plain_line(root, tmp_path, env):
    out = evobus("run", str(root / "scenarios" / "router.toml"), "--log",
                 str(tmp_path / "r.evolog"), cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert ANSI not in out.stdout
    lines = out.stdout.splitlines()
    assert lines[0].startswith("router: running ") and "4 local workers" in lines[0]
    rounds = [line for line in lines if "  round " in line]
    assert len(rounds) >= 2
    assert all("held-out" in line and "rollouts" in line and "proposals" in line
               for line in rounds)
    assert "held-out reward 0.000 -> 1.000" in out.stdout
    assert f"evobus report {tmp_path / 'r.evolog'}" in out.stdout
    assert out.stderr == ""


def test_quiet_prints_nothing(root, tmp_path, env):
    out = evobus("run", str(root / "scenarios" / "router.toml"), "--quiet", "--log",
                 str(tmp_path / "r.evolog"), cwd=tmp_path, env=env)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


def test_json_keeps_stdout_to_one_json_object(root, tmp_path, env):
    out = evobus("run", str(root / "scenarios" / "router.toml"), "--json", "--log",
                 str(tmp_path / "r.evolog"), cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["final_reward"] == 1.0 and summary["stop_reason"] == "target_reward"
    assert summary["log"] == str(tmp_path / "r.evolog")
    assert "round" in out.stderr  # the progress went to stderr
    # Every held-out call of the baseline answered (docs/budgets.md).
    assert summary["baseline"] == {"calls": 29, "failed": 0, "first_error": None}


def test_a_reader_that_goes_away_does_not_fail_the_run(root, tmp_path, env):
    log = tmp_path / "r.evolog"
    out = subprocess.run(["bash", "-c", "set -o pipefail; " + " ".join(
        [sys.executable, "-m", "actors.cli", "run", str(root / "scenarios" / "router.toml"),
         "--log", str(log), "| head -1"])], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and out.stdout.startswith("router: running")
    from bus.log import read_log

    assert read_log(log).records  # the run went on to the end


def read_until(fd: int, needle: bytes, deadline: float) -> bytes:
    data = b""
    while needle not in data and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            data += chunk
    return data


def on_a_terminal(args: list[str], until: bytes, *, cwd, env, columns: int = 120) -> str:
    """What `evobus ARGS` writes on a pseudo-terminal (its stdin, stdout and stderr) up to
    ``until`` (45 s at most), once it exited 0."""
    primary, secondary = os.openpty()
    env = dict(env, TERM="xterm-256color", COLUMNS=str(columns), LINES="40")
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", *args], cwd=cwd, env=env,
                            stdin=secondary, stdout=secondary, stderr=secondary)
    os.close(secondary)
    try:
        screen = read_until(primary, until, time.monotonic() + 45)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        os.close(primary)
    return screen.decode("utf-8", "replace")


def test_on_a_terminal_a_live_panel_shows_the_budget(tmp_path, env):
    scenario = tmp_path / "slow.toml"
    scenario.write_text(SLOW.replace("rounds = 40", "rounds = 3")
                        + "[budgets]\nmax_rollouts = 5000\n")
    text = on_a_terminal(["run", str(scenario), "--log", str(tmp_path / "s.evolog")],
                         b"artifact v", cwd=tmp_path, env=env)
    assert ANSI in text  # colours and cursor movement: the live display
    for label in ("budget left", "5,000 rollouts", "rounds", "workers", "held-out",
                  "Ctrl-C stops cleanly", "artifact v"):
        assert label in text, label


def test_a_run_waiting_for_remote_workers_says_each_one_that_joins_and_when_all_are_in(
        tmp_path, env):
    """On a terminal, while `evobus run` waits for two remote workers: the panel says how
    many joined (0 of 2, then 1 of 2: the second worker starts only once the first is
    shown), one line above it per worker that joins (who, from where, how many of how
    many, what is left of the wait) and one when all are in. Real processes, 127.0.0.1."""
    from test_remote import free_port, scenario_text

    addr = f"tcp://127.0.0.1:{free_port()}"
    scenario = tmp_path / "remote.toml"
    scenario.write_text(scenario_text(f'local = 0\nremote = 2\nbind = "{addr}"', rounds=2))
    primary, secondary = os.openpty()
    env = dict(env, TERM="xterm-256color", COLUMNS="160", LINES="40")
    procs = [subprocess.Popen([sys.executable, "-m", "actors.cli", "run", str(scenario),
                               "--log", str(tmp_path / "r.evolog")], cwd=tmp_path, env=env,
                              stdin=secondary, stdout=secondary, stderr=secondary)]
    os.close(secondary)

    def worker(name: str) -> None:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "actors.cli", "worker", "--connect", addr, "--id", name,
             "--allow", "tests.remote_domain", "--give-up", "40"], cwd=tmp_path, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    screens = []
    try:
        for needle, then in ((b"0 of 2 joined", "w0"), (b"1 of 2 joined", "w1"),
                             (b"artifact v", None)):
            screens.append(read_until(primary, needle, time.monotonic() + 40))
            assert needle in screens[-1], (needle, screens[-1][-2000:])
            if then is not None:
                worker(then)
        assert procs[0].wait(timeout=15) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        os.close(primary)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(screens).decode("utf-8", "replace"))
    said = [line[line.index("evobus: "):].rstrip() for line in text.split("\r\n")
            if "evobus: " in line]
    assert said[0].startswith(f"evobus: warning: waiting up to 30 s (wait_seconds) for 2 "
                              f"remote worker(s) at {addr}; start each with `"), said
    assert re.fullmatch(r"evobus: worker w0 joined from this machine \(1 of 2\); waiting "
                        r"for 1 more \(up to \d+ s\)", said[1]), said
    assert said[2] == "evobus: worker w1 joined from this machine (2 of 2)", said
    assert re.fullmatch(r"evobus: all 2 worker\(s\) joined after \d+\.\d s; the run "
                        r"starts", said[3]), said
    assert "(work starts once every worker joined)" in text


def test_on_a_terminal_the_report_shows_each_step_then_only_where_the_page_is(tmp_path,
                                                                              env):
    """`evobus report` on a terminal: a status line from the start (reading the log,
    what it holds, each chart, writing the page), replaced step by step and gone at the
    end, which leaves the one line that names the page."""
    pytest.importorskip("matplotlib")
    log = TESTS / "logs" / "sync_data_parallel.evolog"
    text = on_a_terminal(["report", str(log), "-o", str(tmp_path / "rep")],
                         b"open it in a browser", cwd=tmp_path, env=env, columns=200)
    steps = re.findall(r"report: (reading|\d[\d,]* records|drawing [^(]+\(\d of 3\)|writing)",
                       text)
    shown = list(dict.fromkeys(steps))   # each step, in order (redrawn as it spins)
    assert [s if s[0].isalpha() else "N records" for s in shown] == [
        "reading", "N records", "drawing the held-out reward (1 of 3)",
        "drawing the workers' timeline (2 of 3)", "drawing the outcome counts (3 of 3)",
        "writing"], shown
    # The status is transient: erased, then the page's line.
    tail = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text.rsplit("\x1b[2K", 1)[-1])
    assert tail.strip() == (f"report: {tmp_path / 'rep' / 'index.html'}  (open it in a "
                            f"browser; the charts are also in {tmp_path / 'rep'}/)")


def test_the_remote_page_shows_the_waiting_line_as_a_run_prints_it(root):
    """docs/remote.md quoted the wait's first line without its `evobus: warning: `
    (the pseudo-terminal test above pins that prefix): the page shows it whole."""
    from actors.runtime.pools import waiting_text

    line = "evobus: warning: " + waiting_text(
        60, 2, "tcp://127.0.0.1:5555",
        "evobus worker --connect tcp://127.0.0.1:5555 --allow scenarios.router")
    assert line in (root / "docs" / "remote.md").read_text().splitlines()


def test_ctrl_c_stops_cleanly_and_says_how_to_resume(tmp_path, env):
    from bus.log import read_log

    scenario = tmp_path / "slow.toml"
    scenario.write_text(SLOW)
    log = tmp_path / "runs" / "slow.evolog"
    code, stderr = interrupt_after_a_round(["run", str(scenario), "--log", str(log)],
                                           cwd=tmp_path, env=env, signum=signal.SIGINT)
    assert code == 130, stderr
    assert "Traceback" not in stderr
    assert "evobus: interrupted after " in stderr
    assert f"evobus resume {log}" in stderr
    records = read_log(log).records  # closed cleanly: reads back whole, no torn tail
    assert f"holds {len(records):,} messages" in stderr
    assert len(records) > 50


def test_ctrl_c_while_waiting_for_workers_says_so_not_after_0_rounds(tmp_path, env):
    """A run stopped before its first round because its workers had not all joined says
    that, and how many had (it said `after 0 rounds`, as if it had run)."""
    from test_remote import free_port, scenario_text

    scenario = tmp_path / "remote.toml"
    scenario.write_text(scenario_text(f'local = 0\nremote = 1\nbind = '
                                      f'"tcp://127.0.0.1:{free_port()}"'))
    log = tmp_path / "w.evolog"
    code, stderr = interrupt_after(["run", str(scenario), "--log", str(log)],
                                   "waiting up to 30 s (wait_seconds)", on_stderr=True,
                                   cwd=tmp_path, env=env)   # once the wait has begun
    assert code == 130, stderr
    assert stderr.startswith("evobus: interrupted while waiting for workers (0 of 1 "
                             "joined, "), stderr
    assert f"evobus resume {log}" in stderr


def interrupt_after(args, seen: str, *, cwd, env, signum=signal.SIGINT,
                    on_stderr: bool = False) -> tuple[int, str]:
    """Start ``evobus ARGS``, wait for a line holding ``seen`` (on stdout, or stderr),
    send ``signum``: (exit code, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", *args], cwd=cwd, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in proc.stderr if on_stderr else proc.stdout:
            if seen in line:
                break
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    return proc.returncode, stderr


def interrupt_after_a_round(args, *, cwd, env, signum) -> tuple[int, str]:
    """Start ``evobus ARGS``, wait for its first round line (the run is under way), send
    ``signum``: (exit code, stderr)."""
    return interrupt_after(args, "  round ", cwd=cwd, env=env, signum=signum)


def shape(text: str, *paths: Path) -> str:
    """A stop message with its numbers and log paths taken out."""
    for i, path in enumerate(paths):
        text = text.replace(str(path), f"LOG{i}")
    return re.sub(r"(round|merge)s\b", r"\1", re.sub(r"[\d.,]+", "N", text))


@pytest.mark.slow
def test_resume_stopped_by_ctrl_c_says_what_run_says(tmp_path, env):
    signum = signal.SIGINT
    scenario = tmp_path / "slow.toml"
    scenario.write_text(SLOW)
    log = tmp_path / "slow.evolog"
    code, run_err = interrupt_after_a_round(["run", str(scenario), "--log", str(log)],
                                            cwd=tmp_path, env=env, signum=signum)
    assert code == 128 + signum, run_err
    code, resume_err = interrupt_after_a_round(["resume", str(log)], cwd=tmp_path, env=env,
                                               signum=signum)
    assert code == 128 + signum, resume_err
    resumed = tmp_path / "slow.r1.evolog"
    assert f"evobus resume {resumed}" in resume_err and "Traceback" not in resume_err
    # One message from one place: only the numbers and the log differ.
    assert shape(resume_err, resumed) == shape(run_err, log), (run_err, resume_err)


def test_a_second_ctrl_c_while_stopping_only_says_so():
    err = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        with interrupt_guard(err):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # interrupted at once
            finally:
                os.kill(os.getpid(), signal.SIGINT)  # while "closing": must not raise
                time.sleep(0.05)
    assert "still stopping" in err.getvalue()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_inside_pyzmq_is_raised_once_out_of_it():
    """Raised inside pyzmq (a socket being made: one the context does not track yet),
    the interrupt left a socket open and closing the bus waited for it forever (Ctrl-C
    as a run began its wait for workers hung it, 2 times in 12). It comes again a moment
    later, outside, and stops the run as always."""
    import threading

    from actors.cli.progress import _ZMQ_DIRS, Interrupted

    # Code whose file is in pyzmq's directory: a signal that lands in it is inside zmq.
    inside = compile("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n"
                     "left.append(True)\n", os.path.join(_ZMQ_DIRS[0], "stand_in.py"), "exec")
    left, where = [], []
    try:
        with interrupt_guard(io.StringIO()):
            try:
                exec(inside, {"left": left})
            except Interrupted:
                where.append("inside")
                raise
            threading.Event().wait(10)   # interrupted here, a moment later
            where.append("never")
    except Interrupted:
        where.append("outside")
    assert (left, where) == ([True], ["outside"])


SCENARIO = parse_scenario(SLOW.replace("rounds = 40", "rounds = 10")
                          + "[budgets]\nmax_rollouts = 200\npatience = 3\n"
                            "target_reward = 0.9\n", "s.toml")


def record(r, reward, committed, rollouts=43, reasons=None):
    return RoundRecord(round=r, version=r + 1 if committed else r, committed=committed,
                       heldout_reward=reward, rollouts=rollouts, proposals=5,
                       reasons=reasons or {"committed": 1, "duplicate": 4}, elapsed=r + 1.0)


def test_the_budget_left_counts_down():
    p = RunProgress(SCENARIO, stream=io.StringIO(), live=False)
    p(record(0, 0.5, True))
    p(record(1, 0.5, False))
    assert p.budget_left(elapsed=2.0) == ["8 of 10 rounds", "114 of 200 rollouts",
                                          "patience 2 of 3", "target 0.900"]


def test_the_live_panel_renders_every_figure():
    from rich.console import Console

    p = RunProgress(SCENARIO, stream=io.StringIO(), live=True)
    p(record(0, 0.517, True))
    console = Console(file=io.StringIO(), width=120, record=True)
    console.print(p._panel())
    text = console.export_text()
    for part in ("1/10 rounds", "0.517", "best 0.517", "43", "4 local workers",
                 "1 of 1 rounds", "9 of 10 rounds", "157 of 200 rollouts", "target 0.900"):
        assert part in text, (part, text)


def test_outcomes_read_in_a_fixed_order():
    assert outcome_text({"duplicate": 3, "committed": 1, "zzz": 2, "conflict": 0}) == \
        "committed 1, duplicate 3, zzz 2"
    assert outcome_text({}) == "none"


def test_a_warning_is_one_line_naming_evobus_and_verbose_says_where(root, tmp_path, env):
    (tmp_path / "warn.toml").write_text(
        'name = "w"\nasync_ratio = 5\n[domain]\ntasks = "scenarios.router:tasks"\n'
        'reward = "scenarios.router:reward"\nagent = "scenarios.router:RouterAgent"\n')
    out = evobus("validate", "warn.toml", cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        'evobus: warning: warn.toml: `async_ratio` only shapes mode = "async" and is '
        'ignored in sync mode; set mode = "async" to use it']
    verbose = evobus("-v", "validate", "warn.toml", cwd=tmp_path, env=env)
    assert "RuntimeWarning: warn.toml: `async_ratio`" in verbose.stderr


_TIMES = re.compile(r"^\s*\d+\.\d+s|\([\d,.]+/s\)|in \d+\.\d+ s|\s+")
_KEPT = ("  round ", ": held-out reward ", "outcomes: ", "budget: ", "ok  ", "  actors: ")

#: (page, command): the output the page shows after ``$ command`` is what it prints.
SAMPLES = [("quickstart.md", "evobus run scenarios/router.toml"),
           ("budgets.md", "evobus run budget.toml --log budget.evolog"),
           ("replay.md", "evobus replay runs/router.evolog")]


def _shown(lines: list[str]) -> list[str]:
    """The round, summary and replay lines of an output, without what the clock decides
    (seconds, rates) and with runs of spaces folded."""
    return [_TIMES.sub(" ", line).strip() for line in lines
            if any(line.startswith(k) or (k.startswith(" ") and k in line) for k in _KEPT)]


def _sample(page: str, command: str) -> list[str]:
    """The lines a page's console block shows after ``$ command``, to its next command."""
    from test_docs import blocks

    for lang, _, lines in blocks((TESTS.parent / "docs" / page).read_text()):
        if lang == "console" and f"$ {command}" in lines:
            rest = lines[lines.index(f"$ {command}") + 1:]
            return rest[:next((i for i, x in enumerate(rest) if x.startswith("$ ")),
                              len(rest))]
    raise AssertionError(f"docs/{page} has no console block with `$ {command}`")


@pytest.mark.parametrize("page,command", SAMPLES, ids=[p for p, _ in SAMPLES])
def test_the_output_a_page_shows_is_what_the_command_prints(page, command, tmp_path, env):
    """The page's commands run in order in a scratch directory, as tests/test_docs.py runs
    them, up to ``command``; the rounds, proposals, outcomes, calls and replay counts it
    shows are that command's (seed 0, deterministic), all but the clock's figures. When
    behaviour changes, paste the new output into the page."""
    from test_docs import NOT_RUN, commands

    (tmp_path / "scenarios").symlink_to(TESTS.parent / "scenarios", target_is_directory=True)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    for _, cmd, want in commands(TESTS.parent / "docs" / page):
        if NOT_RUN.match(cmd):
            continue
        out = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, text=True,
                             capture_output=True, timeout=50, stdin=subprocess.DEVNULL)
        assert out.returncode == want, (cmd, out.stderr[-1500:])
        if cmd == command:
            break
    else:
        raise AssertionError(f"docs/{page} runs no `{command}`")
    shown, printed = _shown(_sample(page, command)), _shown(out.stdout.splitlines())
    assert shown, f"docs/{page} shows nothing after `$ {command}`"
    n = len(shown)
    assert any(printed[i:i + n] == shown for i in range(len(printed) - n + 1)), (
        f"docs/{page}: the output shown after `$ {command}` is not what it prints now; "
        f"it prints:\n{out.stdout}")


def messages_on_disk(log: Path) -> list[tuple[str, object]]:
    """(receiver, message) of every record the log on disk holds; a torn tail is the
    writer mid-flush or the kill, not damage (resume cuts it back too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornTailWarning)
        return [(r.receiver, decode(r.body)) for r in read_log(log).records]


def closed_rounds_on_disk(log: Path) -> list[int]:
    """The rounds whose RoundClosed to the planner, and the Progress that reported it to
    the driver, the log on disk holds (the rounds `evobus resume` goes on from without
    saying them again: a Progress the log never recorded is sent again on resume)."""
    messages = messages_on_disk(log)
    reported = {m.record.round for receiver, m in messages
                if receiver == "driver" and isinstance(m, Progress)}
    return [m.round for receiver, m in messages
            if receiver == "planner" and isinstance(m, RoundClosed) and m.round in reported]


def wait_for_closed_round(log: Path, proc: subprocess.Popen, deadline_s: float) -> None:
    """Poll the growing log until it holds a closed round (bounded), the run still on."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {log} "
                                 "held a closed round")
        if closed_rounds_on_disk(log):
            return
        time.sleep(0.01)  # polling period, not a synchronisation
    raise AssertionError(f"{log} held no RoundClosed {deadline_s} s after the round line")


@pytest.mark.slow
def test_a_resumed_run_shows_what_a_run_shows(tmp_path, env):
    """kill -9 after the first round, then `evobus resume`: the same round lines (going
    on from the killed run's rounds, rollouts and clock) and the same summary as `evobus
    run` (outcomes, budget, the log), and --json carries the budget too."""
    scenario = tmp_path / "slow.toml"
    scenario.write_text(SLOW.replace("rounds = 40", "rounds = 6"))
    log = tmp_path / "slow.evolog"
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "run", str(scenario),
                             "--log", str(log)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        for line in proc.stdout:  # the first round has closed: kill it there
            if "  round " in line:
                break
        # The round line is printed when the RoundClosed is delivered, but the log hands
        # it to the OS only at the writer's next flush (within FLUSH_EVERY_S): a kill at
        # once could leave a log with no closed round, and resume would redo round 0.
        wait_for_closed_round(log, proc, deadline_s=20)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any(isinstance(m, RunDone) for _, m in messages_on_disk(log)), \
        "the run finished before the kill: slow SlowAgent down or add rounds"
    out = evobus("resume", str(log), cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"slow: resuming {log} with 4 local workers"), lines[0]
    rounds = [line for line in lines if "  round " in line]
    assert rounds and "round 0 " not in rounds[0], rounds   # round 0 was in the old log
    first_t = float(rounds[0].split("s", 1)[0])
    assert first_t > 0.0
    for key in ("outcomes: ", "budget: calls ", f"log: {tmp_path / 'slow.r1.evolog'}"):
        assert any(line.startswith(key) for line in lines), (key, out.stdout)
    again = evobus("resume", str(tmp_path / "slow.r1.evolog"), "--json", cwd=tmp_path,
                   env=env)
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout)
    assert summary["already_finished"] and "budget" in summary and "elapsed" in summary


@pytest.mark.slow   # ~10 s: a run with a remote worker, then a resume waiting for one
def test_a_resume_refused_for_its_configuration_leaves_the_log_as_it_was(tmp_path, env):
    """A run with one remote worker (a real `evobus worker` process over 127.0.0.1) is
    stopped by SIGTERM mid-rollout; `evobus resume` with no worker there is refused for
    its configuration (the worker never came within wait_seconds, exit 2). The chain on
    disk is byte for byte what it was: no new segment, the old one untouched."""
    from test_remote import Lines, env_with, free_port, scenario_text

    addr = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "remote.evolog"
    scenario = tmp_path / "remote.toml"
    # The worker is up and waiting before the coordinator binds: 5 s is plenty to join.
    scenario.write_text(f'log = "{log}"\n' + scenario_text(
        f'local = 0\nremote = 1\nbind = "{addr}"').replace("wait_seconds = 30",
                                                            "wait_seconds = 5"))
    gate = tmp_path / "gate"
    gate.mkdir()
    run_env = env_with(EVOBUS_TEST_GATE=gate)
    procs = []
    try:
        worker = subprocess.Popen(
            [sys.executable, "-m", "actors.cli", "worker", "--connect", addr, "--id", "w0",
             "--allow", "tests.remote_domain", "--give-up", "30"], cwd=TESTS.parent,
            env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(worker)
        Lines(worker.stdout).wait(r"waiting for the broker at", 30)
        run = subprocess.Popen([sys.executable, "-m", "actors.cli", "run", str(scenario)],
                               cwd=TESTS.parent, env=run_env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        procs.append(run)
        deadline = time.monotonic() + 30   # the worker's first rollout waits at the gate
        while not list(gate.glob("started-*")):
            assert time.monotonic() < deadline and run.poll() is None, run.stderr.read()
            time.sleep(0.01)  # polling period, not a synchronisation
        run.send_signal(signal.SIGTERM)
        _, run_err = run.communicate(timeout=30)
        assert run.returncode == 143, run_err
        worker.kill()   # no worker for the resume
        worker.wait(10)
    finally:
        (gate / "release").touch()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.evolog")}
    assert list(before) == [log.name] and len(before[log.name]) > 0
    out = evobus("resume", str(log), cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "expected 1 worker(s)" in out.stderr and "0 registered" in out.stderr, out.stderr
    after = {p.name: p.read_bytes() for p in tmp_path.glob("*.evolog")}
    assert after == before, sorted(after)
    assert f"evobus resume {log}" in out.stderr, out.stderr   # how to go on, once fixed
