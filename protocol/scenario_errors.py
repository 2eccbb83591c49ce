"""Scenario error messages: what msgspec reports, plus what was found and the fix.

msgspec says what was expected and where; these helpers read the value back from the
raw TOML and name the fix, so every message reads
"at `$.path`: expected X, found Y; fix: Z". Used by :mod:`protocol.scenario`.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
import types
import typing
from typing import Any

import msgspec
from msgspec import inspect as mi

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["every_error", "explain", "explain_syntax", "raw_toml"]

_MSGSPEC = re.compile(r"^(?P<body>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.DOTALL)
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_MISSING = object()


def _segments(path: str) -> list[str | int]:
    return [int(i) if i else name for name, i in _SEGMENT.findall(path[1:])]


def _lookup(raw: Any, segments: list[str | int]) -> Any:
    for seg in segments:
        try:
            raw = raw[seg]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return raw


def _options(t: Any) -> list[Any]:
    """The alternatives of a (possibly annotated, possibly union) type, unwrapped."""
    while isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        return [o for u in t.types for o in _options(u)]
    return [t]


def _struct_of(t: Any, raw: Any) -> Any:
    """The struct type a table at this place decodes to (tagged unions: by its kind)."""
    structs = [o for o in _options(t) if isinstance(o, mi.StructType)]
    if len(structs) == 1:
        return structs[0]
    kind = raw.get(structs[0].tag_field) if structs and isinstance(raw, dict) else None
    return next((s for s in structs if s.tag == kind), None)


def _type_at(segments: list[str | int], raw: Any, root: Any) -> Any:
    t: Any = mi.type_info(root)
    for seg in segments:
        if isinstance(seg, int):
            lists = [o for o in _options(t) if isinstance(o, mi.ListType)]
            if not lists:
                return None
            t = lists[0].item_type
        else:
            struct = _struct_of(t, raw)
            field = next((f for f in struct.fields if f.encode_name == seg), None) \
                if struct is not None else None
            if field is None:
                return None
            t = field.type
        raw = _lookup(raw, [seg])
    return t


def _show(value: Any) -> str:
    if value is _MISSING:
        return "nothing"
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (str, int, float, list, dict)):
        try:
            text = json.dumps(value, default=str)
        except (TypeError, ValueError):  # an odd TOML value (a date): show its repr
            text = repr(value)
    else:
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _table(segments: list[str | int]) -> str:
    if not segments:
        return "the top level (before the first [table])"
    if segments[-1:] and isinstance(segments[-1], int):
        return f"[[{'.'.join(str(s) for s in segments[:-1])}]] entry {segments[-1] + 1}"
    return "[" + ".".join(str(s) if isinstance(s, str) else f"[{s}]" for s in segments) + "]"


def _closest(word: str, choices: list[str]) -> str | None:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:
        close = [c for c in choices if c.lower() == word.lower()]
    return close[0] if close else None


def _one_of(values: list[str]) -> str:
    return ", ".join(f'"{v}"' for v in values)


def explain(message: str, raw: Any, root: type) -> str:
    """Turn a msgspec validation message into "at PATH: expected X, found Y; fix: Z"."""
    try:
        return _explain(message, raw, root)
    except Exception:  # a gap in this explainer must not hide the error: say it plainly
        return f"{message}; fix: see `evobus schema` for the expected shape"


def _explain(message: str, raw: Any, root: type) -> str:
    m = _MSGSPEC.match(message)
    body, path = m["body"], m["path"] or "$"
    segs = _segments(path)
    key = next((s for s in reversed(segs) if isinstance(s, str)), "value")
    item = bool(segs) and isinstance(segs[-1], int)  # a list item, not the key itself
    found = _lookup(raw, segs)

    if (u := re.match(r"Object contains unknown field `(.+)`", body)):
        name = u[1]
        struct = _struct_of(_type_at(segs, raw, root), _lookup(raw, segs)) if segs else \
            mi.type_info(root)
        fields = [f.encode_name for f in struct.fields] if struct is not None else []
        where = _table(segs)
        fix = f"remove `{name}` (evobus schema lists every field)"
        if segs and name in {f.encode_name for f in mi.type_info(root).fields}:
            fix = (f"`{name}` is a top-level key: move it above the first [table] header "
                   "(in TOML every key after a header belongs to that table)")
        elif (near := _closest(name, fields)) is not None:
            fix = f"did you mean `{near}`? rename it"
        return (f"at `{path}.{name}`: unknown field `{name}` in {where}; expected one of: "
                f"{', '.join(fields) or 'no fields'}; found `{name}` = "
                f"{_show(_lookup(raw, [*segs, name]))}; fix: {fix}")

    if (r := re.match(r"Object missing required field `(.+)`", body)):
        name = r[1]
        parent_t = _type_at(segs, raw, root)
        structs = [o for o in _options(parent_t) if isinstance(o, mi.StructType)]
        if structs and name == structs[0].tag_field and len(structs) > 1:
            kinds = [s.tag for s in structs]
            return (f"at `{path}.{name}`: expected `{name}` = one of {_one_of(kinds)}, found "
                    f"no `{name}` in {_table(segs)}; fix: add {name} = \"{kinds[0]}\" "
                    f"(or another of {_one_of(kinds)}) under {_table(segs)}")
        want, example = "", "..."
        struct = _struct_of(parent_t, found)
        field = next((f for f in struct.fields if f.encode_name == name), None) \
            if struct is not None else None
        if field is not None:
            want = f" ({_describe(field.type)})"
            example = _example(field.type)
        return (f"at `{path}.{name}`: expected `{name}`{want} in {_table(segs)}, found no "
                f"such key; fix: add {name} = {example} under {_table(segs)}")

    if re.match(r"Invalid (enum )?value (.+)", body):
        t = _type_at(segs, raw, root)
        values = [str(v) for o in _options(t) if isinstance(o, mi.LiteralType)
                  for v in o.values]
        if not values and segs:  # a tag: the kinds of the union one level up
            values = [o.tag for o in _options(_type_at(segs[:-1], raw, root))
                      if isinstance(o, mi.StructType) and o.tag is not None]
        near = _closest(str(found), values) if isinstance(found, str) else None
        fix = f'write {key} = "{near}"' if near else f"use one of {_one_of(values)}"
        return (f"at `{path}`: expected one of {_one_of(values)}, found {_show(found)}; "
                f"fix: {fix}")

    if (c := re.match(r"Expected `([^`]+)` (>=|<=|>|<) (\S+)$", body)):
        word = {">=": "at least", ">": "above", "<=": "at most", "<": "below"}[c[2]]
        return (f"at `{path}`: expected `{c[1]}` {c[2]} {c[3]}, found {_show(found)}; fix: set "
                f"{key} to a value {word} {c[3]}")

    if (x := re.match(r"Expected `([^`]+)`, got `([^`]+)`", body)):
        want, got = x[1], x[2]
        t = _type_at(segs, raw, root)
        fix = _type_fix(want, key, found, item)
        if any(isinstance(o, mi.ListType) and isinstance(o.item_type, mi.StructType)
               for o in _options(t)):  # a list of tables: TOML's [[key]] entries
            fix = f"write each entry as a [[{key}]] table with key = value lines"
        return (f"at `{path}`: expected `{want}` ({_describe(t)}), found "
                f"`{got}` {_show(found)}; fix: {fix}")

    return f"at `{path}`: {body}; fix: see `evobus schema` for the expected shape"


def _describe(t: Any) -> str:
    """A type in words, for the 'expected' half of a message."""
    if t is None:
        return "see evobus schema"
    words = []
    for o in _options(t):
        if isinstance(o, mi.NoneType):
            continue
        if isinstance(o, mi.StructType) and o.cls.__name__ == "Ref":
            words.append('a reference "package.module:attr" or a table {ref = "...", '
                         "kwargs = {...}}")
        elif isinstance(o, mi.StrType):
            words.append("a string")
        elif isinstance(o, mi.BoolType):
            words.append("true or false")
        elif isinstance(o, mi.IntType):
            words.append("a whole number")
        elif isinstance(o, mi.FloatType):
            words.append("a number")
        elif isinstance(o, mi.ListType):
            words.append(f"a list of {_describe(o.item_type).removeprefix('a ')}s"
                         if not isinstance(o.item_type, mi.AnyType) else "a list")
        elif isinstance(o, mi.LiteralType):
            words.append("one of " + _one_of([str(v) for v in o.values]))
        elif isinstance(o, mi.StructType):
            words.append("a table" if o.tag is None else f'a table with kind = "{o.tag}"')
        elif isinstance(o, mi.DictType):
            words.append("a table")
        else:
            words.append("any value")
    words = list(dict.fromkeys(words))
    if 'a reference "package.module:attr" or a table {ref = "...", kwargs = {...}}' in words:
        words = [w for w in words if w != "a string"]
    return " or ".join(words) or "see evobus schema"


def _article(want: str) -> str:
    return {"str": "a string", "int": "a whole number", "float": "a number"}.get(
        want.split(" ")[0], f"`{want}`")


def _example(t: Any) -> str:
    """A placeholder value of the right shape, for 'add key = ...' fixes."""
    for o in _options(t):
        if isinstance(o, mi.ListType):
            return '["..."]' if isinstance(o.item_type, mi.StrType) else "[...]"
        if isinstance(o, mi.StructType) and o.cls.__name__ == "Ref":
            return '"package.module:attr"'
        if isinstance(o, (mi.IntType, mi.FloatType)):
            bound = o.ge if o.ge is not None else (o.gt if o.gt is not None else None)
            return str(max(1, int(bound or 0)))
        if isinstance(o, mi.StrType):
            return '"..."'
    return "..."


def _type_fix(want: str, key: str, found: Any, item: bool = False) -> str:
    if item:
        shown = f'"{found}"' if want.startswith("str") else "a value of that type"
        return f"make every item of {key} {_article(want)}: write {shown}"
    if "object" in want and "str" in want:
        return (f'write {key} = "package.module:attr", or a table {key} = {{ref = '
                '"package.module:Class", kwargs = {...}}')
    if want.startswith("int") or want.startswith("float"):
        if isinstance(found, str):
            try:
                number = int(found) if want.startswith("int") else float(found)
            except ValueError:
                return f"write {key} as a number without quotes, e.g. {key} = 4"
            return f"write {key} = {number} (a number, without quotes)"
        if want.startswith("int") and isinstance(found, float):
            return f"write a whole number, e.g. {key} = {int(found)}"
        return f"write {key} as a number, e.g. {key} = 4"
    if want.startswith("bool"):
        return f"write {key} = true or {key} = false, without quotes"
    if want.startswith("str"):
        return f'quote it: {key} = "{found if found is not _MISSING else "..."}"'
    if want.startswith("array"):
        if isinstance(found, str):
            return f'write a list: {key} = ["{found}"]'
        return f'write a list, e.g. {key} = ["a", "b"]'
    if want.startswith("object"):
        return f"write {key} as a table: a [{key}] header followed by key = value lines"
    return "see `evobus schema` for the expected shape"


def explain_syntax(error: str, data: bytes | str) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    pos = re.search(r"\(at line (\d+), column (\d+)\)", error)
    what = re.sub(r"\s*\(at line \d+, column \d+\)", "", error).strip().rstrip(".")
    if not pos:
        return f"not valid TOML: {what}; fix: check the file's syntax (key = value lines)"
    line_no, col = int(pos[1]), int(pos[2])
    lines = text.splitlines()
    line = lines[line_no - 1].strip() if 0 < line_no <= len(lines) else ""
    fixes = {
        "Cannot overwrite a value": "the key is given twice (or a table is declared twice): "
                                    "keep one",
        "Invalid value": 'give the key a value: a number, "a string", true/false or a [list]',
        "Expected '=' after a key": "write key = value (strings in double quotes)",
        "Unclosed": "close the string, list or table opened on this line",
        "Illegal character '\\n'": "close the string: add the missing quote at the end",
        "Illegal character": "remove the character or quote the value",
    }
    fix = next((f for needle, f in fixes.items() if error.startswith(needle)),
               "fix the syntax at that position (key = value, strings in double quotes)")
    return (f"line {line_no}, column {col}: not valid TOML: {what}; expected TOML syntax, "
            f"found {line!r}; fix: {fix}")


def raw_toml(data: bytes | str) -> Any:
    try:
        return tomllib.loads(data.decode() if isinstance(data, bytes) else data)
    except (ValueError, UnicodeDecodeError):  # unreadable: messages go without "found"
        return None


def every_error(raw: Any, root: type) -> list[str]:
    """Every schema error of a decoded TOML document, as msgspec words them ("Expected
    `int`, got `str` - at `$.workers.local`"), not only the first one msgspec stops at:
    each table is walked field by field and each value checked on its own. A tagged
    table (``[strategy]``, ``[parallel]``) is checked as a whole, so it gives at most one."""
    if not isinstance(raw, dict):
        return []
    return _errors_in(raw, root, "$")


def _single_struct(tp: Any) -> type | None:
    """The one Struct class ``tp`` names (``X`` or ``X | None``); None for a union of
    several (a tagged union is checked whole) or anything else."""
    options = [a for a in typing.get_args(tp) if a is not type(None)] \
        if typing.get_origin(tp) in (typing.Union, types.UnionType) else [tp]
    if len(options) == 1 and isinstance(options[0], type) \
            and issubclass(options[0], msgspec.Struct) and options[0].__struct_config__.tag is None:
        return options[0]
    return None


def _errors_in(value: Any, tp: Any, path: str) -> list[str]:
    struct = _single_struct(tp)
    if struct is not None and isinstance(value, dict):
        fields = {f.encode_name: f for f in msgspec.structs.fields(struct)}
        out = [f"Object contains unknown field `{k}` - at `{path}`"
               for k in value if k not in fields]
        out += [f"Object missing required field `{f.encode_name}` - at `{path}`"
                for f in fields.values() if f.required and f.encode_name not in value]
        for key, item in value.items():
            if key in fields:
                out += _errors_in(item, fields[key].type, f"{path}.{key}")
        return out
    if typing.get_origin(tp) is list and isinstance(value, list):
        (item_type,) = typing.get_args(tp) or (Any,)
        if _single_struct(item_type) is not None:
            return [e for i, item in enumerate(value)
                    for e in _errors_in(item, item_type, f"{path}[{i}]")]
    try:
        msgspec.convert(value, type=tp)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if " - at `$" in text:
            return [text.replace(" - at `$", f" - at `{path}", 1)]
        return [f"{text} - at `{path}`"]
    return []
