"""Naming code as data: ``module:attr`` references, resolved against an allowlist.

Work crosses a process only as data (DESIGN section 4), so a callable that must run
elsewhere is named by its import path plus JSON arguments. The allowlist is checked
*before* anything is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
from typing import Any, Iterable

import msgspec

from actors.errors import ConfigError
from protocol import Ref, Spec, Task


def parse(spec: "str | Ref") -> Ref:
    return Ref(ref=spec) if isinstance(spec, str) else spec


def allowed(module: str, allow: Iterable[str] | None) -> bool:
    if allow is None:
        return True
    return any(module == a or module.startswith(a + ".") for a in allow)


def resolve(spec: "str | Ref", allow: Iterable[str] | None = None, *, what: str = "ref") -> Any:
    """Import and (if asked) call the object a reference names.

    ``allow`` is a list of module prefixes; None allows everything (trusted, local
    configuration only: a worker resolving refs sent by a peer always passes a list)."""
    ref = parse(spec)
    module, sep, attr = ref.ref.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{what}: {ref.ref!r} is not a reference; write it as "
                          "'package.module:attribute', for example 'scenarios.router:tasks'")
    allow = list(allow) if allow is not None else None
    if not allowed(module, allow):
        raise ConfigError(f"{what}: module {module!r} is not in the allowlist {allow}; add it "
                          "with --allow MODULE on the worker (or 'allow' in the scenario)")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import {module!r} ({exc}); is the module installed "
                          "and on the path?") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{what}: module {module!r} has no attribute {attr!r}") from None
    call = ref.call if ref.call is not None else bool(ref.args or ref.kwargs) or isinstance(obj, type)
    return obj(*ref.args, **ref.kwargs) if call else obj



#: Names a worker may always resolve without --allow (evobus's own artifact strategies).
BUILTIN_ALLOW = ("actors.artifacts",)


def _closure(what: str, obj: Any, kind: str) -> ConfigError:
    return ConfigError(
        f"{what}={obj!r} is {kind}: workers in other processes can only run code named by "
        f"import path. Define it at module level in an importable module (not the script "
        f"you run) and pass that, or name it as data: "
        f"refs={{'{what}': Ref('package.module:attr', kwargs={{...}})}} in Python "
        f"(from actors import Ref), {what} = \"package.module:attr\" in a scenario")


def _importable(obj: Any, what: str) -> str:
    """``module:qualname`` of a module-level function or class, checked by import."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not module or not qualname:
        raise _closure(what, obj, "not a named function or class")
    if "<lambda>" in qualname:
        raise _closure(what, obj, "a lambda")
    if "<locals>" in qualname:
        raise _closure(what, obj, "a closure (defined inside a function)")
    if module in ("__main__", "__mp_main__"):
        raise _closure(what, obj, "defined in the script being run (__main__)")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        raise _closure(what, obj, f"not importable as {module}:{qualname}") from None
    if found is not obj:
        raise _closure(what, obj, f"not what {module}:{qualname} names (decorated or rebound?)")
    return f"{module}:{qualname}"


def _json_ok(value: Any) -> bool:
    try:
        return msgspec.json.decode(msgspec.json.encode(value)) == value
    except (TypeError, msgspec.EncodeError, msgspec.DecodeError):
        return False


def code_ref(obj: Any, what: str) -> Ref:
    """Name ``obj`` as data, or refuse with the fix. Accepts a :class:`~protocol.Ref`, a
    ``"module:attr"`` string, a module-level function or class, or an instance of an
    importable class that is a dataclass (its fields become JSON kwargs) or holds no state."""
    if isinstance(obj, Ref):
        return obj
    if isinstance(obj, str):
        if ":" not in obj:
            raise ConfigError(f"{what}={obj!r} is not a reference; write 'package.module:attr'")
        return Ref(ref=obj)
    if isinstance(obj, functools.partial):
        raise _closure(what, obj, "a functools.partial")
    if inspect.ismethod(obj):
        raise _closure(what, obj, f"a bound method of a {type(obj.__self__).__name__} object")
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return Ref(ref=_importable(obj, what), call=False)
    if inspect.isclass(obj):
        return Ref(ref=_importable(obj, what), call=False)
    cls = type(obj)
    name = _importable(cls, f"{what} (its class {cls.__name__})")
    if dataclasses.is_dataclass(obj):
        kwargs = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
        kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
        if not _json_ok(kwargs):
            raise ConfigError(f"{what}: the fields of {cls.__name__} are not all JSON values, "
                              f"so it cannot be rebuilt in another process; name it as "
                              f"Ref('{name}', kwargs={{...}}) with JSON arguments")
        return Ref(ref=name, kwargs=kwargs, call=True)
    if not getattr(obj, "__dict__", None) and not getattr(cls, "__slots__", None):
        return Ref(ref=name, call=True)
    raise ConfigError(f"{what}: a {cls.__name__} object holds state ({sorted(vars(obj))[:5]}) "
                      f"that cannot travel to another process; name how to build it: "
                      f"refs={{'{what}': Ref('{name}', kwargs={{...}})}} (JSON arguments), "
                      f"or {what} = {{ ref = \"{name}\", kwargs = {{...}} }} in a scenario")


def module_of(ref: Ref) -> str:
    return ref.ref.partition(":")[0]


def module_fingerprint(module: str) -> str:
    """sha256 (16 hex digits) of a module's source file; "-" when it has none."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None)
    if not origin or not os.path.isfile(origin):
        return "-"
    with open(origin, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def combined_fingerprint(fingerprints: dict[str, str]) -> str:
    text = "\n".join(f"{m}={fp}" for m, fp in sorted(fingerprints.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- the run's code as data, for workers in other processes --------------------------

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def task_digest(tasks: Iterable[Task]) -> str:
    data = msgspec.msgpack.encode([(t.id, t.prompt, t.meta) for t in tasks])
    return hashlib.sha256(data).hexdigest()[:16]


def build_spec(*, tasks: list[Task], reward, run, propose, agent, strategy,
               initial_state: dict[str, str], solved: float, heartbeat: float,
               package_version: str, refs: dict[str, Any] | None = None,
               env: Iterable[str] = (), run_id: str = "") -> Spec:
    """The run's code as data, for workers in other processes (refuses closures)."""
    named = dict(refs or {})
    unknown = sorted(set(named) - {"tasks", "reward", "run", "propose", "agent", "strategy"})
    if unknown:
        raise ConfigError(f"refs: unknown keys {unknown}; use tasks, reward, run, propose, "
                          "agent, strategy")

    def ref(key: str, obj: Any) -> Ref:
        return code_ref(named.get(key, obj), key)

    fields: dict[str, Any] = {"reward": ref("reward", reward),
                              "strategy": ref("strategy", strategy)}
    if agent is not None or "agent" in named:
        fields["agent"] = ref("agent", agent)
    else:
        fields["run"] = ref("run", run)
        fields["propose"] = ref("propose", propose)
    if "tasks" in named:
        fields["tasks"] = code_ref(named["tasks"], "tasks")
    else:
        fields["inline_tasks"] = list(tasks)
    env = sorted(set(env))
    bad = [e for e in env if not _ENV_NAME.fullmatch(e)]
    if bad:
        raise ConfigError(f"env: {bad} are not environment variable names; list the *names* "
                          "of the variables workers need (their values never travel)")
    modules = sorted({module_of(r) for r in fields.values() if isinstance(r, Ref)})
    fingerprints = {m: module_fingerprint(m) for m in modules}
    spec = Spec(**fields, run_id=run_id, task_digest=task_digest(tasks),
                initial_state=dict(initial_state), solved=solved, env=env,
                fingerprints=fingerprints, fingerprint=combined_fingerprint(fingerprints),
                package_version=package_version, heartbeat=heartbeat)
    _no_secret_values(spec)
    return spec


def _no_secret_values(spec: Spec) -> None:
    """Secrets travel as variable names only: refuse a spec that holds a listed value."""
    encoded = msgspec.msgpack.encode(spec)
    for name in spec.env:
        value = os.environ.get(name, "")
        if len(value) >= 8 and value.encode() in encoded:
            raise ConfigError(f"the value of ${name} appears in the code references sent to "
                              f"workers; pass the variable's name instead (env = [\"{name}\"]) "
                              "and read it with os.environ on the worker")


def spec_refs(spec: Spec) -> list[tuple[str, Ref]]:
    pairs = [("tasks", spec.tasks), ("reward", spec.reward), ("agent", spec.agent),
             ("run", spec.run), ("propose", spec.propose), ("strategy", spec.strategy)]
    return [(k, r) for k, r in pairs if r is not None]
