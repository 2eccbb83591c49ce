"""Naming code as data: ``module:attr`` references, resolved against an allowlist.

Work crosses a process only as data (DESIGN section 4), so a callable that must run
elsewhere is named by its import path plus JSON arguments. The allowlist is checked
*before* anything is imported.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable

import msgspec

from actors.errors import ConfigError


class Ref(msgspec.Struct, frozen=True, kw_only=True):
    """``ref = "package.module:attr"``; ``args``/``kwargs`` call it (JSON values only)."""

    ref: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    call: bool | None = None  # None: call when args/kwargs given or when attr is a class


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
