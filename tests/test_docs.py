"""Every command in docs/*.md runs (the convention is in docs/index.md, "How these docs
are tested"), every scenario shown in a toml block fits the schema, and the generated
scenario reference is current.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
#: Shown, not run: installing, and the test suite itself (tests/test_readme.py runs both).
NOT_RUN = re.compile(r"^(pip |python -m pip |python -m pytest\b|pytest\b)")
EXITS = re.compile(r"#\s*exits\s+(\d+)\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
COMMAND_TIMEOUT_S = 60
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced block."""
    out, lang, start, lines = [], None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if lang is None and m:
            lang, start, lines = m.group(1), n + 1, []
        elif lang is not None and line.startswith("```"):
            out.append((lang, start, lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    return out


def commands(page: Path) -> list[tuple[int, str, int]]:
    """(line number, command, expected exit code) of a page's console blocks, in order.
    ``$ `` starts a command; ``> `` lines continue it (a heredoc, say)."""
    out: list[list] = []
    for lang, start, lines in blocks(page.read_text()):
        if lang != "console":
            continue
        for i, line in enumerate(lines):
            if line.startswith("$ "):
                out.append([start + i, line[2:], 0])
            elif line.startswith("> ") or line == ">":
                if out and out[-1][0] + len(out[-1][1].splitlines()) == start + i:
                    out[-1][1] += "\n" + line[2:]
    result = []
    for n, cmd, _ in out:
        m = EXITS.search(cmd.splitlines()[0])
        result.append((n, cmd, int(m.group(1)) if m else 0))
    return result


PAGES_WITH_COMMANDS = [p for p in PAGES if commands(p)]


def test_the_docs_have_commands_to_run():
    names = {p.name for p in PAGES_WITH_COMMANDS}
    assert {"quickstart.md", "concepts.md", "llm.md", "scenarios.md"} <= names


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", PAGES_WITH_COMMANDS, ids=lambda p: p.name)
def test_every_command_in_the_page_runs(page, tmp_path):
    (tmp_path / "scenarios").symlink_to(ROOT / "scenarios", target_is_directory=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("COLUMNS", None)
    ran = 0
    for line_no, cmd, want in commands(page):
        if NOT_RUN.match(cmd):
            continue
        if cmd.startswith("evobus report") and not HAVE_MATPLOTLIB:
            continue  # the report extra is not installed here; tests/test_report.py says so
        out = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, text=True,
                             capture_output=True, timeout=COMMAND_TIMEOUT_S,
                             stdin=subprocess.DEVNULL)
        assert out.returncode == want, (
            f"{page.name}:{line_no}: `{cmd}` exited {out.returncode}, expected {want}\n"
            f"stdout: {out.stdout[-1500:]}\nstderr: {out.stderr[-1500:]}")
        assert "Traceback" not in out.stderr, f"{page.name}:{line_no}: {out.stderr[-1500:]}"
        ran += 1
    assert ran, f"{page.name}: every command was skipped"


PAGES_WITH_PYTHON = [p for p in PAGES
                     if any(lang == "python" for lang, _, _ in blocks(p.read_text()))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", PAGES_WITH_PYTHON, ids=lambda p: p.name)
def test_every_python_block_in_the_page_runs(page, tmp_path):
    """The page's python blocks, joined in order into one script, run as written in a
    scratch directory (docs/index.md, "How these docs are tested")."""
    from test_openai_agent import FakeServer, router_model   # a local model endpoint

    parts = [f"# {page.name}:{start}\n" + "\n".join(lines)
             for lang, start, lines in blocks(page.read_text()) if lang == "python"]
    script = tmp_path / f"{page.stem}_blocks.py"
    script.write_text("\n\n".join(parts) + "\n")
    (tmp_path / "scenarios").symlink_to(ROOT / "scenarios", target_is_directory=True)
    server = FakeServer(default=router_model)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path), env.get("PYTHONPATH", "")])
    env["OPENAI_BASE_URL"] = server.url
    try:
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                             capture_output=True, timeout=240, stdin=subprocess.DEVNULL)
    finally:
        server.close()
    assert out.returncode == 0, (f"{page.name}: its python blocks failed\n"
                                 f"stdout: {out.stdout[-1500:]}\nstderr: {out.stderr[-3000:]}")


def test_the_commands_of_the_readme_and_docs_skip_only_install_and_pytest():
    skipped = [cmd for p in PAGES for _, cmd, _ in commands(p) if NOT_RUN.match(cmd)]
    assert all(c.startswith(("pip ", "python -m pytest")) for c in skipped), skipped


TOML_BLOCKS = [(p, start, "\n".join(lines)) for p in PAGES
               for lang, start, lines in blocks(p.read_text())
               if lang == "toml" and any(line.strip() == "[domain]" for line in lines)]


@pytest.mark.parametrize("page,line,text", TOML_BLOCKS,
                         ids=[f"{p.name}:{n}" for p, n, _ in TOML_BLOCKS])
def test_every_scenario_shown_in_the_docs_fits_the_schema(page, line, text):
    from protocol.scenario import ScenarioError, parse_scenario

    try:
        parse_scenario(text, f"{page.name}:{line}")
    except ScenarioError as exc:
        pytest.fail(str(exc))


def test_the_scenario_reference_is_generated_from_the_current_schema():
    out = subprocess.run([sys.executable, str(DOCS / "gen_scenario_reference.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr + "\n(run: python docs/gen_scenario_reference.py)"


def test_the_scenario_reference_lists_every_field_of_every_table():
    from protocol import scenario as sc

    text = (DOCS / "scenarios.md").read_text()
    for cls in (sc.Scenario, sc.Domain, sc.Workers, sc.Budgets, sc.GroupSpec, sc.Ref,
                sc.KeyedRulesSpec, sc.TensorParallelSpec, sc.ClusterParallelSpec):
        for name in cls.__struct_encode_fields__:
            assert f"| `{name}` |" in text, f"{cls.__name__}.{name} missing from scenarios.md"


def test_the_json_schema_is_what_evobus_schema_prints(capsys):
    import json

    from actors.cli.main import main
    from protocol.scenario import Scenario, json_schema

    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json_schema()
    assert printed["$schema"].endswith("2020-12/schema")
    # msgspec's schema, plus a description for editors on every documented field.
    plain = msgspec.json.schema(Scenario)
    assert printed["$defs"].keys() == plain["$defs"].keys()
    rounds = printed["$defs"]["Scenario"]["properties"]["rounds"]
    assert rounds["minimum"] == 1 and rounds["description"].startswith("At most")


def test_every_page_is_linked_from_the_index():
    index = (DOCS / "index.md").read_text()
    for page in PAGES:
        if page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not link {page.name}"


def test_links_between_pages_point_at_pages_that_exist_or_are_planned():
    # groups.md, replay.md and remote.md are written alongside this page set.
    planned = {"groups.md", "replay.md", "remote.md"}
    for page in PAGES:
        for target in re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]+)?\)", page.read_text()):
            assert (DOCS / target).exists() or target in planned, f"{page.name} -> {target}"
