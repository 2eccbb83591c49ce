"""Malformed scenario files: each one gives a single error line naming the file, the
field path, what was expected and what was found, and the fix; never a traceback.

Most run in-process through the CLI entry point; a few run `evobus validate` and
`evobus run` as subprocesses, the way a user meets them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from actors.cli.main import main

pytestmark = pytest.mark.timeout(60)

DOMAIN = '''[domain]
tasks = "scenarios.router:tasks"
reward = "scenarios.router:reward"
agent = "scenarios.router:RouterAgent"
'''
KEYED = '''[strategy]
kind = "KeyedRules"
categories = ["billing", "shipping", "technical", "account"]
'''

# (id, file text, where the error is (field path or line), a fragment of the fix)
CASES = [
    ("rounds-quoted", 'rounds = "8"\n' + DOMAIN, "`$.rounds`", "rounds = 8"),
    ("rounds-zero", "rounds = 0\n" + DOMAIN, "`$.rounds`", "at least 1"),
    ("rounds-misspelt", "roundz = 3\n" + DOMAIN, "`$.roundz`", "did you mean `rounds`"),
    ("top-level-key-under-table", DOMAIN + "rounds = 4\n", "`$.domain.rounds`",
     "move it above the first [table]"),
    ("mode-unknown", 'mode = "asynch"\n' + DOMAIN, "`$.mode`", 'mode = "async"'),
    ("staleness-unknown", 'staleness = "loose"\n' + DOMAIN, "`$.staleness`",
     '"full", "guarded", "reflective"'),
    ("strategy-kind-unknown", DOMAIN + '[strategy]\nkind = "Keyed"\n', "`$.strategy.kind`",
     'kind = "KeyedRules"'),
    ("strategy-kind-missing", DOMAIN + '[strategy]\ntitle = "x"\n', "`$.strategy.kind`",
     'add kind = "KeyedRules"'),
    ("keyed-rules-without-categories", DOMAIN + '[strategy]\nkind = "KeyedRules"\n',
     "`$.strategy.categories`", 'add categories = ["..."]'),
    ("categories-not-a-list", DOMAIN + '[strategy]\nkind = "KeyedRules"\ncategories = "a"\n',
     "`$.strategy.categories`", 'categories = ["a"]'),
    ("category-not-a-string", DOMAIN + '[strategy]\nkind = "KeyedRules"\ncategories = [1]\n',
     "`$.strategy.categories[0]`", "a string"),
    ("strategy-field-misspelt", DOMAIN + KEYED + 'titel = "x"\n', "`$.strategy.titel`",
     "did you mean `title`"),
    ("parallel-kind-unknown", DOMAIN + '[parallel]\nkind = "datparallel"\n',
     "`$.parallel.kind`", 'kind = "DataParallel"'),
    ("data-parallel-zero-per-worker",
     DOMAIN + KEYED + '[parallel]\nkind = "DataParallel"\nper_worker = 0\n',
     "`$.parallel.per_worker`", "at least 1"),
    ("tensor-parallel-zero-sections",
     DOMAIN + KEYED + '[parallel]\nkind = "TensorParallel"\nn_sections = 0\n',
     "`$.parallel.n_sections`", "at least 1"),
    ("tensor-parallel-zero-per-worker",
     DOMAIN + KEYED + '[parallel]\nkind = "TensorParallel"\nn_sections = 2\nper_worker = 0\n',
     "`$.parallel.per_worker`", "at least 1"),
    ("workers-negative", DOMAIN + "[workers]\nlocal = -1\n", "`$.workers.local`", "at least 0"),
    ("workers-fraction", DOMAIN + "[workers]\nlocal = 2.5\n", "`$.workers.local`",
     "local = 2"),
    ("workers-misspelt", DOMAIN + "[workers]\nlocl = 3\n", "`$.workers.locl`",
     "did you mean `local`"),
    ("workers-none", DOMAIN + "[workers]\nlocal = 0\n", "`$.workers`", "local = 4"),
    ("workers-not-a-table", "workers = 4\n" + DOMAIN, "`$.workers`", "[workers] header"),
    ("allow-not-a-list", DOMAIN + '[workers]\nallow = "scenarios"\n', "`$.workers.allow`",
     'allow = ["scenarios"]'),
    ("held-out-too-big", "held_out_frac = 1.5\n" + DOMAIN, "`$.held_out_frac`", "below 1.0"),
    ("held-out-zero", "held_out_frac = 0\n" + DOMAIN, "`$.held_out_frac`", "above 0"),
    ("target-reward-above-one", DOMAIN + "[budgets]\ntarget_reward = 2\n",
     "`$.budgets.target_reward`", "at most 1.0"),
    ("seed-boolean", "seed = true\n" + DOMAIN, "`$.seed`", "seed = 4"),
    ("log-not-a-string", "log = 5\n" + DOMAIN, "`$.log`", 'log = "5"'),
    ("tasks-not-a-reference", DOMAIN.replace('"scenarios.router:tasks"', "3"),
     "`$.domain.tasks`", '"package.module:attr"'),
    ("reference-table-misspelt", DOMAIN.replace('"scenarios.router:tasks"', '{rf = "x:y"}'),
     "`$.domain.tasks.rf`", "did you mean `ref`"),
    ("tasks-missing", '[domain]\nreward = "scenarios.router:reward"\n'
     'agent = "scenarios.router:RouterAgent"\n', "`$.domain.tasks`", "add tasks = "),
    ("agent-and-run-missing", '[domain]\ntasks = "scenarios.router:tasks"\n'
     'reward = "scenarios.router:reward"\n', "`$.domain`", "add agent = "),
    ("agent-and-run-both", DOMAIN + 'run = "scenarios.router:run"\n', "`$.domain`",
     "keep one of them"),
    ("nothing-to-run", 'name = "empty"\n', "`$.domain`", "add a [domain] table"),
    ("domain-not-a-table", "domain = 3\n", "`$.domain`", "[domain] header"),
    ("group-concurrency-above-items", DOMAIN + '[[groups]]\nname = "g"\n'
     'target = "scenarios.router:run"\nitems = [1]\nmax_concurrency = 5\nmax_items = 1\n',
     "`$.groups[0].max_concurrency`", "lower max_concurrency"),
    ("group-missing-max-items", DOMAIN + '[[groups]]\nname = "g"\n'
     'target = "scenarios.router:run"\nitems = [1]\nmax_concurrency = 1\n',
     "`$.groups[0].max_items`", "add max_items = 1"),
    ("groups-not-tables", 'groups = "x"\n' + DOMAIN, "`$.groups`", "[[groups]] table"),
    ("strategy-as-array-of-tables", '[[strategy]]\nkind = "AppendRules"\n' + DOMAIN,
     "`$.strategy`", "a [strategy] header"),
    ("toml-key-twice", "rounds = 3\nrounds = 4\n" + DOMAIN, "line 2", "given twice"),
    ("toml-value-missing", "rounds =\n" + DOMAIN, "line 1", "give the key a value"),
    ("toml-string-unclosed", 'name = "router\n' + DOMAIN, "line 1", "close the string"),
    ("tasks-attribute-misspelt", DOMAIN.replace("router:tasks", "router:taskz"),
     "`$.domain.tasks`", "did you mean scenarios.router:tasks"),
    ("agent-module-missing", DOMAIN.replace("scenarios.router:RouterAgent",
                                            "scenarios.routr:RouterAgent"),
     "`$.domain.agent`", "check the spelling"),
    ("reference-without-colon", DOMAIN.replace("scenarios.router:reward",
                                               "scenarios.router.reward"),
     "`$.domain.reward`", "name the module and the attribute"),
]


def assert_good_error(text: str, path: str, where: str, fix: str) -> None:
    assert "Traceback" not in text, text
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one error line, got:\n{text}"
    line = lines[0]
    assert line.startswith(f"evobus: {path}: "), line
    assert where in line, f"{where!r} not in {line!r}"
    assert "expected" in line and "found" in line, line
    assert "fix: " in line and fix in line.split("fix: ", 1)[1], f"{fix!r} not in fix: {line!r}"


def test_there_are_at_least_twenty_malformed_scenarios():
    assert len(CASES) >= 20
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,text,where,fix", CASES, ids=[c[0] for c in CASES])
def test_validate_names_file_path_expected_found_and_fix(tmp_path, capsys, name, text,
                                                         where, fix):
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    code = main(["validate", str(path)])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    assert_good_error(err, str(path), where, fix)


SUBPROCESS_CASES = ["rounds-misspelt", "strategy-kind-unknown", "toml-key-twice",
                    "tasks-attribute-misspelt"]


@pytest.mark.parametrize("verb", ["validate", "run"])
@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_the_evobus_command_reports_a_malformed_scenario_in_one_line(tmp_path, clean_env,
                                                                     verb, name):
    _, text, where, fix = next(c for c in CASES if c[0] == name)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    out = subprocess.run([sys.executable, "-m", "actors.cli", verb, str(path)],
                         cwd=tmp_path, env=clean_env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == ""
    assert_good_error(out.stderr, str(path), where, fix)
    assert not (tmp_path / "runs").exists(), "a malformed scenario must not start a run"


def test_a_missing_scenario_file_is_one_line(tmp_path, capsys):
    code = main(["validate", str(tmp_path / "nope.toml")])
    err = capsys.readouterr().err
    assert code == 2
    assert "nope.toml: cannot read the scenario file" in err and "Traceback" not in err


def test_a_good_scenario_validates(root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)   # its log path is relative: no earlier run's log there
    assert main(["validate", str(root / "scenarios" / "router.toml")]) == 0
    assert ": ok (" in capsys.readouterr().out


def test_validate_names_the_minibatch_round(root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = (root / "scenarios" / "router.toml").read_text()
    path = tmp_path / "mini.toml"
    path.write_text(text.replace('kind = "DataParallel"\n',
                                 'kind = "DataParallel"\nper_worker = 1\n'))
    assert main(["validate", str(path)]) == 0
    assert "KeyedRules, DataParallel(per_worker=1))" in capsys.readouterr().out


def test_a_reference_whose_call_fails_is_one_line_at_run_time(tmp_path, capsys):
    # The schema and the imports are fine; calling tasks() with an argument is not.
    path = tmp_path / "bad-call.toml"
    path.write_text(DOMAIN.replace('"scenarios.router:tasks"',
                                   '{ref = "scenarios.router:tasks", args = [1]}'))
    code = main(["run", str(path), "--log", str(tmp_path / "x.evolog")])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{path}: the run failed: TypeError" in err and "-v" in err


def test_validate_names_the_tensor_parallel_minibatch_round(root, tmp_path, monkeypatch,
                                                            capsys):
    monkeypatch.chdir(tmp_path)
    text = (root / "scenarios" / "router.toml").read_text()
    path = tmp_path / "tp.toml"
    path.write_text(text.replace('kind = "DataParallel"\n',
                                 'kind = "TensorParallel"\nn_sections = 4\n'
                                 'route = "scenarios.router:route"\nper_worker = 1\n'))
    assert main(["validate", str(path)]) == 0
    assert "KeyedRules, TensorParallel(per_worker=1))" in capsys.readouterr().out
