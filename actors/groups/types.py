"""A group's output type R: declared by the target's return annotation, ``returns=``, or
``returns = "..."`` in a scenario group; each branch's value is checked and converted to
R with msgspec, and the group returns ``list[R]``.
"""

from __future__ import annotations

import builtins
import collections.abc
import functools
import inspect
import typing
from typing import Any, Callable

import msgspec

from actors.errors import ConfigError
from actors.workers import code as refs

#: ``returns=object`` (or ``typing.Any``) opts out: any value that crosses the bus.
ANY_TYPES = (object, Any)


def _annotated(fn: Callable) -> Any:
    """The return annotation of ``fn`` (resolved), or ``inspect.Signature.empty``."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        call = getattr(type(target), "__call__", None)
        if inspect.isclass(target) or call is None or not inspect.isfunction(call):
            return inspect.Signature.empty
        target = call
    try:
        hints = typing.get_type_hints(target)
    except Exception:   # a forward reference that does not resolve: read it raw below
        hints = None
    if hints is not None:
        return hints.get("return", inspect.Signature.empty)
    raw = inspect.signature(target).return_annotation
    if isinstance(raw, str):
        raise ConfigError(f"the target's return annotation {raw!r} does not resolve to a "
                          "type; import it where the target is defined, or pass returns=R")
    return raw


def _awaited(r: Any, fn: Callable) -> Any:
    """An ``async def`` target's annotation is already R; a callable annotated as
    returning ``Awaitable[R]`` or ``Coroutine[..., ..., R]`` gives R."""
    origin = typing.get_origin(r)
    if origin in (collections.abc.Awaitable, collections.abc.Coroutine):
        args = typing.get_args(r)
        return args[-1] if args else Any
    return r


def output_type(fn: Callable, returns: Any, where: str) -> Any:
    """R for this target: ``returns`` (a type, or a builtin name or import path) if
    given, else the target's return annotation. Refused, naming both ways to declare one,
    when there is neither."""
    if returns is None:
        r = _annotated(fn)
        if r is inspect.Signature.empty:
            name = getattr(fn, "__name__", None) or type(fn).__name__
            shown = name if name.isidentifier() else "target"
            raise ConfigError(
                f"{where}: the target {name!r} declares no output type: a group of it "
                f"returns list[R] and checks every branch's value is an R; annotate it "
                f"(def {shown}(item) -> R) or pass returns=R (returns=object accepts any "
                "value that crosses the bus; in a scenario group: returns = \"int\" or "
                "\"package.module:Type\")")
        r = _awaited(r, fn)
    elif isinstance(returns, str):
        r = type_named(returns, f"{where}: returns")
    else:
        r = returns
    check_type(r, where)
    return r


def check_type(r: Any, where: str) -> None:
    if r in ANY_TYPES or r is None or r is type(None):
        return
    try:
        msgspec.msgpack.Decoder(r)
    except TypeError as exc:
        raise ConfigError(f"{where}: the output type {type_name(r) or r!r} cannot be "
                          f"checked with msgspec ({exc}): declare a msgspec-supported "
                          "type (int, str, dict[str, float], a msgspec.Struct, a "
                          "dataclass...) or returns=object") from None


def type_named(name: str, where: str) -> Any:
    """A builtin's name (``"int"``, ``"dict"``, ``"object"``) or an import path
    (``"package.module:Type"``)."""
    if ":" not in name:
        value = getattr(builtins, name, None)
        if not isinstance(value, type):
            raise ConfigError(f"{where}: {name!r} is not a builtin type; name a builtin "
                              "(int, str, float, bool, dict, list, object) or an import "
                              "path 'package.module:Type'")
        return value
    value = refs.resolve(refs.Ref(ref=name, call=False), None, what=where)
    if not isinstance(value, type) and typing.get_origin(value) is None:
        raise ConfigError(f"{where}: {name!r} names a {type(value).__name__}, not a type")
    return value


def type_name(r: Any) -> str:
    """How a checkpoint names R so that a resume finds it again: a builtin's name or
    ``module:qualname``; "" for a type without one (then resume takes ``returns=``)."""
    if r is Any:
        return "object"
    if isinstance(r, type):
        if getattr(builtins, r.__name__, None) is r:
            return r.__name__
        module, qualname = r.__module__, r.__qualname__
        if module != "__main__" and "<" not in qualname:
            return f"{module}:{qualname}"
    return ""


def converter(r: Any) -> Callable[[int, Any], Any] | None:
    """Check and convert one branch's value to R (None: any value goes). The error names
    the branch, R and what came back."""
    if r in ANY_TYPES:
        return None
    exact = r if isinstance(r, type) else None
    label = type_name(r) or repr(r)

    def convert(index: int, value: Any) -> Any:
        if type(value) is exact:
            return value
        try:
            return msgspec.convert(value, r)
        except (msgspec.ValidationError, TypeError) as exc:
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise TypeError(f"branch {index} returned {type(value).__name__} {shown}, not "
                            f"{label} ({exc}): return a value of type {label}, or declare the "
                            "type the target returns") from None
    convert.exact = exact   # a caller may pass a value of exactly this type as it is
    return convert


def as_results(r: Any, values: list[Any]) -> list[Any]:
    """The join's values (decoded from the bus, or from a checkpoint) as ``list[R]``."""
    if r in ANY_TYPES or not values:
        return values
    return msgspec.convert(values, list[r])


def as_partial(r: Any, values: dict[int, Any]) -> dict[int, Any]:
    if r in ANY_TYPES or not values:
        return values
    return msgspec.convert(values, dict[int, r])
