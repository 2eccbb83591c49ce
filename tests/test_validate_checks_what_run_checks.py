"""`evobus validate` makes every static refusal `evobus run` makes before its first
rollout (issue 15). Each case below is a refusal of the runtime itself (run_scenario /
run_groups, under the CLI's pre-flight), is refused by `evobus run` with exit 2, and is
reported by `evobus validate` with the same message, naming the key."""

from __future__ import annotations

import pytest

from actors.cli.groups import run_groups
from actors.cli.main import main
from actors.errors import ConfigError
from actors.runtime.launch import run_scenario
from protocol.scenario import load_scenario

pytestmark = pytest.mark.timeout(60)

DOMAIN = '''[domain]
tasks = "scenarios.router:tasks"
reward = "scenarios.router:reward"
agent = "scenarios.router:RouterAgent"
'''
TWO_KEYS = '''[strategy]
kind = "KeyedRules"
categories = ["billing", "shipping"]
'''
FOUR_KEYS = '''[strategy]
kind = "KeyedRules"
categories = ["billing", "shipping", "technical", "account"]
'''
GROUP = '''[[groups]]
name = "g"
target = "{target}"
items = {items}
max_concurrency = 1
max_items = 2
'''


def tp(n: int, extra: str = "") -> str:
    return f'[parallel]\nkind = "TensorParallel"\nn_sections = {n}\n{extra}'


def remote(extra: str) -> str:
    return f"[workers]\nlocal = 1\nremote = 1\nwait_seconds = 1\n{extra}"


# (id, scenario text ({tmp}: the test's directory), the key named, a fragment of the message)
REFUSALS = [
    ("tp-sections-over-keys", DOMAIN + TWO_KEYS + tp(10), "$.parallel",
     "n_sections=10) but the key space has 2 keys"),
    ("tp-sections-over-workers", DOMAIN + FOUR_KEYS + tp(4) + "[workers]\nlocal = 2\n",
     "$.parallel", "with 2 workers"),
    ("tp-keys-not-declared", DOMAIN + FOUR_KEYS + tp(1, 'keys = ["refunds"]\n'),
     "$.parallel", "['refunds'], which the artifact"),
    ("tp-no-key-space", DOMAIN + tp(2), "$.parallel", "key space"),
    ("custom-parallel-without-plan",
     DOMAIN + '[parallel]\nkind = "Custom"\nref = "scenarios.router:CATEGORIES"\n',
     "$.parallel", "has no plan("),
    ("deadline-under-heartbeat",
     DOMAIN + "[workers]\nlocal = 1\nprocesses = 1\nheartbeat = 2.0\ndeadline = 1.0\n",
     "$.workers.deadline", "must exceed workers.heartbeat"),
    ("remote-without-bind", DOMAIN + remote(""), "$.workers.bind", "needs an address"),
    ("remote-bind-not-loopback", DOMAIN + remote('bind = "tcp://0.0.0.0:5999"\n'),
     "$.workers.bind", "without CURVE keys"),
    ("remote-keys-missing",
     DOMAIN + remote('bind = "tcp://127.0.0.1:5999"\nkeys = "{tmp}/no-keys"\n'),
     "$.workers.keys", "no key file"),
    ("log-directory-impossible", 'log = "/proc/evobus/run.evolog"\n' + DOMAIN, "$.log",
     "cannot create the directory"),
    ("log-under-a-file", 'log = "{tmp}/a-file/run.evolog"\n' + DOMAIN, "$.log",
     "is a file, not a directory"),
    ("log-exists", 'log = "{tmp}/old.evolog"\n' + DOMAIN, "$.log", "already exists"),
    ("log-is-a-directory", 'log = "{tmp}"\n' + DOMAIN, "$.log", "is a directory"),
    ("fsync-env-unknown", 'log = "{tmp}/new.evolog"\n' + DOMAIN, "$EVOBUS_LOG_FSYNC",
     "'sometimes'"),
    ("tokens-without-usage", DOMAIN + "[budgets]\nmax_tokens = 1000\n",
     "$.budgets.max_tokens", "RouterAgent does not report token usage"),
    ("cost-without-usage", DOMAIN + "[budgets]\nmax_cost = 1.5\n",
     "$.budgets.max_cost", "RouterAgent does not report token usage"),
    ("group-items-over-max",
     GROUP.format(target="scenarios.tickets:triage", items='["a", "b", "c"]'),
     "$.groups[0].items", "3 items for max_items=2"),
    ("group-items-attribute-over-max",
     GROUP.format(target="scenarios.tickets:triage", items='"scenarios.router:CATEGORIES"'),
     "$.groups[0].items", "4 items for max_items=2"),
    ("group-target-not-callable",
     GROUP.format(target="scenarios.router:CATEGORIES", items='["a"]'),
     "$.groups[0].target", "not a callable"),
]


@pytest.fixture
def case(request, tmp_path, monkeypatch):
    name, text, key, fragment = next(c for c in REFUSALS if c[0] == request.param)
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "old.evolog").write_bytes(b"a run's log, whatever its bytes")
    if name == "fsync-env-unknown":
        monkeypatch.setenv("EVOBUS_LOG_FSYNC", "sometimes")
    else:
        monkeypatch.delenv("EVOBUS_LOG_FSYNC", raising=False)
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace("{tmp}", str(tmp_path)))
    monkeypatch.chdir(tmp_path)
    return path, key, fragment


IDS = [c[0] for c in REFUSALS]


@pytest.mark.parametrize("case", IDS, indirect=True)
def test_the_runtime_itself_refuses_each_case_before_the_first_rollout(case, capsys):
    path, _, _ = case
    scenario = load_scenario(path)
    if scenario.domain is None:
        assert run_groups(scenario, str(path), quiet=True) == 2
        assert "Traceback" not in capsys.readouterr().err
        return
    with pytest.raises(ConfigError):
        run_scenario(scenario, source=str(path))


@pytest.mark.parametrize("case", IDS, indirect=True)
def test_validate_reports_each_refusal_of_run_naming_the_key(case, capsys):
    path, key, fragment = case
    before = sorted(p.name for p in path.parent.iterdir())
    assert main(["validate", str(path)]) == 2
    out, validated = capsys.readouterr()
    assert out == ""
    assert f"at `{key}`:" in validated and fragment in validated, validated
    assert sorted(p.name for p in path.parent.iterdir()) == before  # validate made nothing
    assert main(["run", str(path), "--quiet"]) == 2
    assert capsys.readouterr().err == validated  # the same refusal, word for word


def test_the_log_flag_is_checked_as_run_would_with_the_flag_named(tmp_path, root, capsys):
    scenario = str(root / "scenarios" / "router.toml")
    (tmp_path / "old.evolog").write_bytes(b"x")
    for verb in ("validate", "run"):
        assert main([verb, scenario, "--log", str(tmp_path / "old.evolog")]) == 2
        err = capsys.readouterr().err
        assert "at `--log`:" in err and "pass another --log PATH" in err, err
    assert main(["validate", scenario, "--log", str(tmp_path / "old.evolog"),
                 "--overwrite"]) == 0
    assert main(["validate", scenario, "--log", "/proc/evobus/x.evolog"]) == 2
    assert "at `--log`: cannot create the directory" in capsys.readouterr().err


def test_insecure_lets_validate_accept_what_run_insecure_accepts(tmp_path, capsys):
    path = tmp_path / "open.toml"
    path.write_text(DOMAIN + remote('bind = "tcp://0.0.0.0:5999"\n'))
    assert main(["validate", str(path)]) == 2
    capsys.readouterr()
    assert main(["validate", str(path), "--insecure"]) == 0
