"""Generate docs/scenarios.md, the scenario file reference, from the scenario schema.

    python docs/gen_scenario_reference.py           # rewrite docs/scenarios.md
    python docs/gen_scenario_reference.py --check   # exit 1 if it is out of date

Types, defaults, bounds, choices and table descriptions come from the JSON Schema that
`evobus schema` prints (``protocol.scenario.json_schema()``, generated from the msgspec
types); the one-line notes per field are below. tests/test_docs.py checks the page is
current, so a new field shows up here the moment the schema has it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from protocol import scenario as sc  # noqa: E402

OUT = ROOT / "docs" / "scenarios.md"

#: One line per field ("Table.field"). A field without one shows a dash.
NOTES = {
    "Scenario.name": "Shown in progress lines and reports.",
    "Scenario.mode": "`sync`: rounds closed by a barrier; `async`: no barrier, merges "
                     "whenever proposals are waiting ([async.md](async.md)).",
    "Scenario.rounds": "At most this many rounds (sync mode).",
    "Scenario.seed": "Seeds the train/held-out split and every strategy; same seed, same "
                     "plan.",
    "Scenario.held_out_frac": "Share of the tasks kept out of training and used to score "
                              "candidates.",
    "Scenario.log": "Write the message log here (relative to the current directory); "
                    "`evobus run --log` overrides it.",
    "Scenario.async_ratio": "Async mode: how many versions a worker may lag behind the "
                            "head, and the staleness tolerance.",
    "Scenario.staleness": "Async mode: what happens to a proposal made on an old version "
                          "([async.md](async.md)).",
    "Scenario.domain": "The tasks, the reward and the agent.",
    "Scenario.strategy": "How the artifact is stored and how a proposal becomes an edit.",
    "Scenario.parallel": "How one round's tasks are split across workers "
                         "([parallelism.md](parallelism.md)).",
    "Scenario.workers": "Where rollouts run.",
    "Scenario.budgets": "When to stop early.",
    "Scenario.groups": "Bounded parallel groups ([groups.md](groups.md)).",
    "Domain.tasks": "A list of `Task`s, or a function returning one.",
    "Domain.reward": "`reward(task, output) -> float` in [0, 1].",
    "Domain.agent": "An object with `solve(rendered, task)` and `propose(rendered, task, "
                    "output, reward)`; a class is instantiated (with `kwargs`).",
    "Domain.run": "`run(rendered, task) -> output`, instead of an agent.",
    "Domain.propose": "`propose(rendered, task, output, reward)` returning a str or None, with `run`.",
    "KeyedRulesSpec.categories": "The artifact's keys; a proposal `\"category: text\"` "
                                 "rewrites one category.",
    "KeyedRulesSpec.title": "First line of the rendered artifact.",
    "AppendRulesSpec.title": "First line of the rendered artifact.",
    "SingleSlotSpec.initial_value": "The artifact's starting text.",
    "SingleSlotSpec.key": "The one key the artifact's state uses.",
    "TensorParallelSpec.n_sections": "Number of sections the artifact's keys are cut into; "
                                     "worker i edits section i mod n_sections.",
    "TensorParallelSpec.keys": "The key space to cut (default: the strategy's categories).",
    "TensorParallelSpec.route": "`route(task_id) -> key`: send each task to the section "
                                "its edits land in.",
    "ClusterParallelSpec.cluster_of": "`cluster_of(task_id) -> cluster`; whole clusters are "
                                      "leased by UCB.",
    "ClusterParallelSpec.c": "UCB exploration constant.",
    "CustomParallelSpec.ref": "An object with `plan(n_workers, round_index, keys)`.",
    "Workers.local": "Worker threads in this process.",
    "Workers.processes": "Worker processes started on this machine.",
    "Workers.remote": "Workers expected to connect from elsewhere "
                      "([remote.md](remote.md)).",
    "Workers.bind": "Address the broker listens on for remote workers, e.g. "
                    "`tcp://0.0.0.0:5555`.",
    "Workers.wait_seconds": "How long to wait for remote workers to join.",
    "Workers.max_concurrency": "At most this many leases out at once (default: one per "
                               "worker).",
    "Workers.allow": "Module prefixes a worker may resolve references from.",
    "Workers.heartbeat": "Seconds between heartbeats of a worker in another process.",
    "Workers.deadline": "A worker silent this long is presumed lost and its leases are "
                        "re-dispatched (must exceed `heartbeat`).",
    "Workers.max_tries": "Dispatch one lease at most this many times.",
    "Workers.keys": "Directory of CURVE keys made by `evobus keys DIR` "
                    "([remote.md](remote.md)).",
    "Workers.insecure": "Allow remote workers without CURVE keys (trusted networks only).",
    "Workers.env": "Names of environment variables workers need (names only, never "
                   "values).",
    "Budgets.max_rollouts": "Stop after this many rollouts.",
    "Budgets.max_calls": "Stop after this many backend calls (solve + propose).",
    "Budgets.max_seconds": "Stop after this much wall time.",
    "Budgets.target_reward": "Stop once the held-out reward reaches this.",
    "Budgets.patience": "Stop after this many rounds in a row without a commit.",
    "GroupSpec.name": "The group's name in progress lines and results.",
    "GroupSpec.target": "The function run once per item.",
    "GroupSpec.items": "The items: a list, or a reference returning one.",
    "GroupSpec.max_concurrency": "At most this many branches at once.",
    "GroupSpec.max_items": "Refuse more items than this.",
    "GroupSpec.checkpoint": "Where a paused group writes its checkpoint.",
    "GroupSpec.approvers": "Who may approve a branch's actions ([groups.md](groups.md)).",
    "RefSpec.ref": "`package.module:attribute`.",
    "RefSpec.args": "Positional arguments (JSON values) to call it with.",
    "RefSpec.kwargs": "Keyword arguments (JSON values) to call it with.",
    "RefSpec.call": "Call it? Default: yes when args/kwargs are given or it is a class.",
}

#: Sections of the page: (heading, TOML form, schema definition or union property).
TABLES = [
    ("Domain", "[domain]", "Domain"),
    ("Workers", "[workers]", "Workers"),
    ("Budgets", "[budgets]", "Budgets"),
    ("Parallel groups", "[[groups]]", "GroupSpec"),
    ("References", "key = \"module:attr\" or key = {ref = ...}", "RefSpec"),
]

INTRO = """\
# Scenario files: reference

<!-- Generated by docs/gen_scenario_reference.py from the scenario schema. Do not edit:
     change protocol/scenario.py (or the notes in the script) and run
     python docs/gen_scenario_reference.py -->

A scenario is a TOML file that declares a whole run: the domain (tasks, reward,
agent), the artifact strategy, the parallelism strategy, the workers, the budgets
and where the message log goes. `evobus run FILE` runs it; `evobus validate FILE`
checks it (the schema, and that every reference imports) without running anything.
Unknown keys are refused, never ignored: a typo is an error that names the key and
suggests the closest one.

```toml
name = "router"
rounds = 8
log = "runs/router.evolog"

[domain]
tasks = "scenarios.router:tasks"
reward = "scenarios.router:reward"
agent = "scenarios.router:RouterAgent"

[strategy]
kind = "KeyedRules"
categories = ["billing", "shipping", "technical", "account"]

[budgets]
target_reward = 1.0
```

**Editor support.** `evobus schema` prints the JSON Schema of this format. Save it
and point your editor's TOML support at it; with Taplo (the VS Code extension "Even
Better TOML") a first line `#:schema ./scenario.schema.json` in the scenario is
enough:

```console
$ evobus schema > scenario.schema.json
```

Every key below is optional unless marked **required**.
"""


def _type(prop: dict, defs: dict) -> str:
    """A schema property in words: `integer >= 1`, `"sync" | "async"`, a table, ..."""
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[1]
        if name == "RefSpec":
            return "reference"
        return "table"
    if "enum" in prop:
        return " \\| ".join(json.dumps(v) for v in prop["enum"])
    if "anyOf" in prop:
        options = [o for o in prop["anyOf"] if o.get("type") != "null"]
        words = []
        for o in options:
            w = _type(o, defs)
            if w not in words:
                words.append(w)
        if {"string", "reference"} <= set(words):
            words = [w for w in words if w != "string"]
        return " or ".join(words)
    t = prop.get("type")
    if t == "array":
        item = _type(prop.get("items", {}), defs) if prop.get("items") else "any"
        return f"list of {item}" if item != "any" else "list"
    if t == "object":
        return "table"
    words = {"integer": "integer", "number": "number", "string": "string",
             "boolean": "boolean", None: "any"}.get(t, str(t))
    bounds = [f"{op} {prop[key]}" for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                   ("maximum", "<="), ("exclusiveMaximum", "<"))
              if key in prop]
    return " ".join([words, " and ".join(bounds)]).strip()


def _default(prop: dict) -> str:
    if "default" not in prop:
        return "**required**"
    value = prop["default"]
    if value is None:
        return "none"
    if isinstance(value, dict):
        return "see below" if value else "`{}`"
    text = json.dumps(value)
    return f"`{text}`"


def _order(def_name: str, props: dict) -> list[str]:
    cls = getattr(sc, def_name, None)
    fields = list(getattr(cls, "__struct_encode_fields__", ()) or ())
    return [f for f in fields if f in props] + sorted(p for p in props if p not in fields)


def _table(def_name: str, defs: dict, skip: tuple[str, ...] = ()) -> list[str]:
    d = defs[def_name]
    props = d.get("properties", {})
    required = set(d.get("required", []))
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name in _order(def_name, props):
        if name in skip:
            continue
        prop = props[name]
        default = "**required**" if name in required else _default(prop)
        note = NOTES.get(f"{def_name}.{name}", "-")
        rows.append(f"| `{name}` | {_type(prop, defs)} | {default} | {note} |")
    if len(rows) == 2:
        rows.append("| *(no other keys)* | | | |")
    return rows


def _union(title: str, header: str, prop: dict, defs: dict) -> list[str]:
    mapping = prop["discriminator"]["mapping"]
    default = prop.get("default", {}).get("kind")
    kinds = ", ".join(f"`{k}`" for k in mapping)
    out = [f"## {title}: `{header}`", "",
           f"`kind` is one of {kinds}" + (f" (default `{default}`)." if default else "."), ""]
    for kind, ref in mapping.items():
        def_name = ref.rsplit("/", 1)[1]
        doc = (defs[def_name].get("description") or "").strip()
        out += [f"### kind = \"{kind}\"", ""]
        if doc:
            out += [doc.replace("``", "`"), ""]
        out += _table(def_name, defs, skip=("kind",)) + [""]
    return out


def render() -> str:
    schema = sc.json_schema()
    defs = schema["$defs"]
    top = defs["Scenario"]
    out = [INTRO, "## The top level", "",
           "Keys before the first `[table]` header (in TOML every key after a header "
           "belongs to that table).", ""]
    out += _table("Scenario", defs) + [""]
    props = top["properties"]
    for title, header, def_name in TABLES[:1]:
        out += [f"## {title}: `{header}`", "", defs[def_name].get("description", ""), ""]
        out += _table(def_name, defs) + [""]
    out += _union("Artifact strategy", "[strategy]", props["strategy"], defs)
    out += _union("Parallelism strategy", "[parallel]", props["parallel"], defs)
    for title, header, def_name in TABLES[1:]:
        doc = (defs[def_name].get("description") or "").replace("``", "`")
        out += [f"## {title}: `{header}`", ""] + ([doc, ""] if doc else [])
        out += _table(def_name, defs) + [""]
    known = {d for _, _, d in TABLES} | {"Scenario"} | {
        r.rsplit("/", 1)[1] for key in ("strategy", "parallel")
        for r in props[key]["discriminator"]["mapping"].values()}
    for def_name in sorted(set(defs) - known):  # a table added to the schema since
        out += [f"## `{def_name}`", "", defs[def_name].get("description", ""), ""]
        out += _table(def_name, defs) + [""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python docs/gen_scenario_reference.py",
                  file=sys.stderr)
            return 1
        print(f"{OUT}: up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
