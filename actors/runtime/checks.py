"""Check the references a scenario names before anything runs: every ``module:attr``
must import and exist. Nothing is called (no tasks built, no agent constructed), so
``evobus validate`` stays cheap; a missing attribute gets a "did you mean" fix.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Iterator

import msgspec
from msgspec import inspect as mi

from protocol import Ref
from protocol import scenario as sc
from protocol.scenario_errors import _options

__all__ = ["check_refs", "references"]


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
