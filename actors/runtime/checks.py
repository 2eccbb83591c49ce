"""Check a scenario before anything runs: the refusals ``evobus run`` makes before its
first rollout that need none of the user's code called, so that ``evobus validate``
(which runs exactly these, see :func:`scenario_problems`) says what ``run`` would.

Every ``module:attr`` must import and exist (a missing attribute gets a "did you mean"
fix); the log's path must be free (a log is never overwritten) and its directory
creatable; the parallelism strategy must fit the artifact's key space and the worker
count; workers in other processes need a deadline longer than their heartbeat, an
address and keys they can use; $EVOBUS_LOG_FSYNC must name a policy; a group's literal
items must fit its max_items and its target must be callable; a token or cost budget
needs an agent (or run/propose) that declares ``reports_usage``. Nothing is called (no
tasks built, no agent constructed), so what depends on what the user's code returns
(at least 4 tasks, unique task ids, every task routed to a section, a ``max_calls``
too small for the baseline's scoring of the held-out tasks, the agent's own settings)
is refused by ``run`` only.
"""

from __future__ import annotations

import difflib
import importlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import msgspec
from msgspec import inspect as mi

from actors.errors import ConfigError
from actors.policies.parallelism import TensorParallel
from actors.runtime.evolve import prepare_parallel, usage_refusal
from actors.runtime.launch import group_log_path
from actors.runtime.specs import build_strategy, n_workers_of
from actors.runtime.pools import workers_problems
from actors.runtime.runtime import FSYNC_ENV, fsync_policy
from actors.usage import reports_usage
from protocol import Ref
from protocol import scenario as sc
from protocol.scenario_errors import _options

__all__ = ["check_refs", "log_problems", "references", "scenario_problems"]


def _is_reference(t: Any) -> bool:
    return any(isinstance(o, mi.StructType) and o.cls is Ref for o in _options(t))


def references(obj: Any, path: str = "$") -> Iterator[tuple[str, str]]:
    """Every (field path, "module:attr") a decoded scenario names, in field order."""
    if isinstance(obj, Ref):
        yield path, obj.ref
        return
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            yield from references(item, f"{path}[{i}]")
        return
    if not isinstance(obj, msgspec.Struct):
        return
    info = mi.type_info(type(obj))
    for field in info.fields:
        value = getattr(obj, field.name)
        where = f"{path}.{field.encode_name}"
        if isinstance(value, str) and _is_reference(field.type):
            yield where, value
        elif isinstance(value, (msgspec.Struct, list)):
            yield from references(value, where)


def _check_one(path: str, ref: str) -> str | None:
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        return (f"at `{path}`: expected a reference \"package.module:attr\", found {ref!r}; "
                "fix: name the module and the attribute, e.g. \"scenarios.router:tasks\"")
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or module
        return (f"at `{path}`: expected an importable module, found no module named "
                f"{missing!r} (in {ref!r}); fix: check the spelling; a module of your own "
                "must be importable: install it, or put its directory on PYTHONPATH "
                "(PYTHONPATH=. evobus ...)")
    except Exception as exc:  # the user's module raised at import: reported, not raised
        return (f"at `{path}`: importing {module!r} raised {type(exc).__name__}: {exc}; "
                "fix: the error is in that module")
    walked = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            near = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            fix = f"did you mean {walked}:{near[0]}?" if near and walked == module else \
                f"did you mean `{near[0]}`?" if near else \
                f"use one of: {', '.join(names[:12])}" if names else "check the name"
            return (f"at `{path}`: expected an attribute {part!r} of {walked!r}, found none "
                    f"(in {ref!r}); fix: {fix}")
        obj = getattr(obj, part)
        walked = f"{walked}.{part}" if walked != module else f"{module}:{part}"
    return None


def check_refs(scenario: sc.Scenario, source: str = "") -> list[str]:
    """One message per reference that does not resolve (empty: all good)."""
    prefix = f"{source}: " if source else ""
    return [f"{prefix}{msg}" for path, ref in references(scenario)
            if (msg := _check_one(path, ref)) is not None]


def scenario_problems(scenario: sc.Scenario, source: str = "", *, log: str | None = None,
                      overwrite: bool = False, insecure: bool = False) -> list[str]:
    """Every refusal ``evobus run SCENARIO [--log LOG] [--overwrite] [--insecure]``
    makes before its first rollout without calling the user's code, one message each,
    naming the key (empty: none). ``evobus validate`` and ``evobus run`` both call it."""
    prefix = f"{source}: " if source else ""
    problems = check_refs(scenario, source)
    found: list[tuple[str, str]] = []
    found += _logs(scenario, log, overwrite)
    if scenario.domain is not None:
        built = _strategy(scenario, refs_ok=not problems)
        found += built or _parallel(scenario, refs_ok=not problems)
        found += workers_problems(scenario.workers, insecure=insecure)
        if not problems:
            found += _budgets(scenario)
    if not problems:
        found += _groups(scenario)
    return problems + [f"{prefix}at `{where}`: {message}" for where, message in found]


def _logs(scenario: sc.Scenario, log: str | None, overwrite: bool) -> list[tuple[str, str]]:
    path = log if log is not None else scenario.log
    if not path:
        return []
    where = "--log" if log is not None else "$.log"
    out = log_problems(path, where, overwrite=overwrite)
    for g in scenario.groups:
        out += log_problems(group_log_path(path, g.name), where, overwrite=overwrite,
                            of=f" (group {g.name!r}'s, beside the run's)")
    try:
        fsync_policy()
    except ConfigError as exc:
        out.append((f"${FSYNC_ENV}", str(exc)))
    return out


def log_problems(path: str, where: str, *, overwrite: bool = False,
                 of: str = "") -> list[tuple[str, str]]:
    """Why a run could not write a new log at ``path`` (``where``: the key or flag that
    set it): a log already there (never overwritten unless ``overwrite``), or a
    directory that cannot be created. The directory is tried for real (a probe directory
    made and removed), not guessed from permission bits."""
    what = f"the log {path!r}{of}"
    p = Path(path)
    if p.is_dir():
        return [(where, f"{what} is a directory; fix: name a file, e.g. "
                        f"{os.path.join(path, 'run.evolog')!r}")]
    if os.path.lexists(p):
        if overwrite:
            return []
        again = "pass another --log PATH" if where == "--log" else \
            "set another `log` in the scenario or pass --log PATH"
        return [(where, f"{what} already exists, and a log is never overwritten "
                        f"(it may be the base of a resume chain); fix: {again}, or pass "
                        "--overwrite to replace it")]
    parent = p.absolute().parent
    ancestor = next(a for a in (parent, *parent.parents) if os.path.lexists(a))
    why = None
    if not ancestor.is_dir():
        why = f"{str(ancestor)!r} is a file, not a directory"
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".evobus-probe-", dir=ancestor))
        except OSError as exc:
            why = f"nothing can be created in {str(ancestor)!r} ({exc.strerror or exc})"
    if why is None:
        return []
    return [(where, f"cannot create the directory of {what}: {why}; fix: choose a "
                    "log path in a directory you can write")]


def _strategy(scenario: sc.Scenario, *, refs_ok: bool) -> list[tuple[str, str]]:
    """The artifact strategy's own refusals (an AppendRules' sections), as run makes
    them when it builds the strategy (a reference in it must resolve first)."""
    if not refs_ok:
        return []
    try:
        build_strategy(scenario.strategy)
    except ConfigError as exc:
        return [("$.strategy", str(exc))]
    return []


def _parallel(scenario: sc.Scenario, *, refs_ok: bool) -> list[tuple[str, str]]:
    """The strategy/artifact pairing run checks in `prepare_parallel`, on what the file
    says (a TensorParallel's route needs the task list: run checks it)."""
    spec = scenario.parallel
    parallel: Any = None
    if isinstance(spec, sc.CustomParallelSpec) and refs_ok:
        parallel = _uncalled(spec.ref)
        if parallel is None or callable(getattr(parallel, "plan", None)):
            return []   # a factory's result is seen by run only; a plan() is what it needs
    elif not isinstance(spec, sc.TensorParallelSpec):
        return []
    try:
        if parallel is None:
            parallel = TensorParallel(spec.n_sections, keys=spec.keys,
                                      per_worker=spec.per_worker)
        prepare_parallel(parallel, build_strategy(scenario.strategy), None,
                         n_workers_of(scenario.workers))
    except ConfigError as exc:
        return [("$.parallel", str(exc))]
    return []


def _budgets(scenario: sc.Scenario) -> list[tuple[str, str]]:
    """A token or cost budget needs code that reports usage (``reports_usage = True`` on
    the agent's class or the run/propose functions, read without calling them)."""
    b, d = scenario.budgets, scenario.domain
    for name, value in (("max_tokens", b.max_tokens), ("max_cost", b.max_cost)):
        if value is None:
            continue
        named = [_attribute(x) for x in (d.agent, d.run, d.propose) if x is not None]
        if not reports_usage(*named):
            who = _name(d.agent).rpartition(":")[2] if d.agent is not None else "run/propose"
            return [(f"$.budgets.{name}", usage_refusal(name, value, who))]
    return []


def _attribute(spec: Any) -> Any:
    """The attribute a reference names, imported, never called."""
    module, _, attr = _name(spec).partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _groups(scenario: sc.Scenario) -> list[tuple[str, str]]:
    out = []
    for i, g in enumerate(scenario.groups):
        where = f"$.groups[{i}]"
        items = g.items if isinstance(g.items, list) else _uncalled(g.items)
        if isinstance(items, (list, tuple)) and len(items) > g.max_items:
            out.append((f"{where}.items", f"{len(items)} items for max_items="
                                          f"{g.max_items}: a group never truncates its "
                                          "input; raise max_items or split the list"))
        target = _uncalled(g.target)
        if target is not None and not callable(target):
            out.append((f"{where}.target", f"{_name(g.target)!r} names a "
                                           f"{type(target).__name__}, not a callable"))
    return out


def _name(spec: Any) -> str:
    return spec if isinstance(spec, str) else spec.ref


def _uncalled(spec: Any) -> Any:
    """The object a reference names, when resolving it calls nothing of the user's
    (actors.workers.code.resolve calls classes and refs with arguments); else None."""
    ref = spec if isinstance(spec, str) else spec.ref
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    call = getattr(spec, "call", None)
    if call is None:  # the rule resolve() applies
        call = bool(getattr(spec, "args", None) or getattr(spec, "kwargs", None)) \
            or isinstance(obj, type)
    return None if call else obj
