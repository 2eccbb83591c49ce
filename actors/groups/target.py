"""What a group knows of its target: whether it takes ``ctx``, its output type R and the
check that converts to R, its import path, and what its branches were measured to take
on its last group that completed here; read once per function, since reading a signature
costs more than a small group's whole work."""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Any, Callable

from actors.errors import ConfigError
from actors.groups.types import converter, output_type
from actors.workers import code as refs
from protocol import Ref


def _wants_ctx(fn: Callable) -> bool:
    """Pass ``ctx`` when the target has a parameter named ``ctx`` or at least two
    positional parameters without defaults."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: item only
        return False
    if "ctx" in sig.parameters:
        return True
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    return len(positional) >= 2


#: What a target's signature says (whether it takes ctx; its return annotation as R),
#: per function: reading a signature costs more than a small group's whole work; and
#: what its branches were measured to take on its last group that completed here.
_facts: "weakref.WeakKeyDictionary[Callable, list]" = weakref.WeakKeyDictionary()
_UNREAD = object()


def _facts_of(fn: Callable) -> list | None:
    """[key, R or _UNREAD, takes ctx or _UNREAD, seconds a branch or None] remembered
    for ``fn`` while its code, annotations and signature stay the same objects (a
    redefinition, or annotations assigned anew, are read again); None for a callable
    that cannot be weakly referenced (a builtin): read every time."""
    key = (getattr(fn, "__code__", None), getattr(fn, "__annotations__", None),
           getattr(fn, "__signature__", None))
    try:
        known = _facts.get(fn)
        if known is None or known[0] != key:
            known = _facts[fn] = [key, _UNREAD, _UNREAD, None]
    except TypeError:
        return None
    return known


def _target_returns(fn: Callable, returns: Any, where: str) -> Any:
    """The output type R: ``returns`` if given, else ``fn``'s return annotation."""
    known = _facts_of(fn) if returns is None else None
    if known is None:
        return output_type(fn, returns, where)
    if known[1] is _UNREAD:
        known[1] = output_type(fn, None, where)   # raises when there is none: not kept
    return known[1]


@functools.lru_cache(maxsize=256)
def _cached_converter(r: Any) -> Callable | None:
    return converter(r)


def _converter(r: Any) -> Callable | None:
    """The check and conversion to R (types.converter), made once per R."""
    try:
        return _cached_converter(r)
    except TypeError:   # an R that cannot be hashed: made every time
        return converter(r)


def _measured(fn: Callable) -> float | None:
    """Seconds a branch of ``fn`` took on its last group that completed on threads of
    this process (the workers' own measure, ``BranchDone.elapsed``), or None."""
    known = _facts_of(fn)
    return None if known is None else known[3]


def _remember(fn: Callable, seconds: float) -> None:
    known = _facts_of(fn)
    if known is not None:
        known[3] = seconds


def _target_wants_ctx(fn: Callable) -> bool:
    known = _facts_of(fn)
    if known is None:
        return _wants_ctx(fn)
    if known[2] is _UNREAD:
        known[2] = _wants_ctx(fn)
    return known[2]


def _infer_ref(fn: Callable) -> Ref | None:
    """The import path of a module-level function or class, if it names this object."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        return None
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return Ref(ref=f"{module}:{qualname}", call=False) if obj is fn else None


def _resolve_target(target, allow) -> tuple[Callable, Ref | None]:
    if isinstance(target, (str, Ref)):
        ref = refs.parse(target)
        fn = refs.resolve(ref, allow, what="target")
        if not callable(fn):
            raise ConfigError(f"target {ref.ref!r} names a {type(fn).__name__}, not a callable")
        return fn, ref
    if not callable(target):
        raise ConfigError(f"target must be a callable taking item or (item, ctx), or an "
                          f"import path 'package.module:function'; got {type(target).__name__}")
    if allow is not None:
        raise ConfigError("allow would be ignored: it checks a target named by import path "
                          "('package.module:function'), and this target is a callable; "
                          "remove allow, or name the target by its path")
    return target, _infer_ref(target)
