"""Validation of the files users write (the configuration, adapter descriptors, batch task files) with msgspec,
and errors that say which key is wrong and what it accepts.

A schema is a ``msgspec.Struct`` (``forbid_unknown_fields=True``: a misspelt key is an error, never ignored). A
number's constraint is built from its :class:`~proxyvisor.rules.Range` (:func:`integer`, :func:`real`), whose
text is also what the error says it accepts; any field may carry a ``description`` (``msgspec.Meta``) that the
error uses the same way. :func:`convert` raises :class:`Invalid`, whose :class:`Problem` names the table path, the
key and what is wrong, for the caller to place in its file (``FILE: [table] key ...``, ``FILE:LINE: 'key' ...``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args, get_origin

import msgspec
import msgspec.structs

from .rules import Range

T = TypeVar("T")

_FLOAT_MAX = sys.float_info.max
LARGEST_INT = 2**63 - 1
"""The largest integer a file's setting takes (a size in bytes, a count, a token budget), whatever its own range:
the largest 64-bit signed integer. TOML's integers end there (Python's reader takes larger ones), and so do the
integers a setting reaches: SQLite's and Redis's, and a C ``ssize_t`` on a 64-bit machine (a buffer's or a queue's
length). A larger one is refused naming its key, rather than fail where it lands."""


def integer(rule: Range, description: str = "") -> msgspec.Meta:
    """The constraint of an integer field that follows ``rule``, at most :data:`LARGEST_INT` (``description``: what
    errors say it accepts; default: the range, e.g. ``0-65535``)."""
    rule = dataclasses.replace(rule, high=min(rule.high, LARGEST_INT))
    high = int(rule.high)
    if rule.low_open:
        return msgspec.Meta(gt=int(rule.low), le=high, description=description or str(rule))
    return msgspec.Meta(ge=int(rule.low), le=high, description=description or str(rule))


def real(rule: Range, description: str = "") -> msgspec.Meta:
    """The constraint of a float field (an integer is accepted as a float) that follows ``rule``. The upper bound is
    at most the largest finite float, so ``inf`` is refused; ``nan`` fails every bound."""
    high = min(float(rule.high), _FLOAT_MAX)
    if rule.low_open:
        return msgspec.Meta(gt=float(rule.low), le=high, description=description or str(rule))
    return msgspec.Meta(ge=float(rule.low), le=high, description=description or str(rule))


@dataclass(frozen=True)
class Problem:
    """Why a value does not fit its schema. ``tables``: the path of the table (object) holding the key, from the
    converted value; ``key``: the key at fault, empty when the table itself is (a value that is not a table, or
    ``unknown`` keys); ``message``: what is wrong, a phrase to follow the key (``must be 0-65535, got 70000``);
    ``unknown``/``known``: the table's unknown keys and the keys it has, when that is the problem."""

    tables: tuple[str, ...]
    key: str
    message: str
    unknown: tuple[str, ...] = ()
    known: tuple[str, ...] = ()


class Invalid(ValueError):
    """A value does not fit its schema: :attr:`problem` says where and why."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


def convert(value: Any, schema: type[T], table: str = "table") -> T:
    """``value`` (TOML or JSON data: dicts, lists, scalars) validated into ``schema``. ``table``: what the errors
    call a table (``"table"`` in TOML, ``"object"`` in JSON).

    Raises:
        Invalid: naming the key at fault and what it accepts.
    """
    try:
        return msgspec.convert(value, schema)
    except msgspec.ValidationError as exc:
        raise Invalid(explain(str(exc), schema, value, table)) from None


_AT = re.compile(r"(?P<text>.*?)(?: - at `\$(?P<path>[^`]*)`)?", re.S)
_PART = re.compile(r"\.([A-Za-z_]\w*)|\[(\d+|\.\.\.)\]")
_WRONG_TYPE = re.compile(r"Expected `([^`]+)`, got `[^`]+`")
_UNKNOWN = re.compile(r"Object contains unknown field `(.+)`")
_MISSING = re.compile(r"Object missing required field `(.+)`")


def _literals(annotation: Any) -> tuple[Any, ...]:
    """The values of the first ``Literal`` in ``annotation``, in the order they are declared."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return next((found for arg in get_args(annotation) if (found := _literals(arg))), ())


def explain(error: str, schema: type[Any], value: Any, table: str = "table") -> Problem:
    """The :class:`Problem` of msgspec's ``error`` (``Expected `int` <= 65535 - at `$.proxy.port```) when
    ``value`` was converted to ``schema``."""
    from msgspec import inspect

    def unwrap(info: Any) -> Any:
        return info.type if isinstance(info, inspect.Metadata) else info

    def stated(info: Any) -> str:
        """The field's own ``description``."""
        if isinstance(info, inspect.UnionType):  # an optional value: what its value may be
            return next((text for t in info.types if (text := stated(t))), "")
        extra = info.extra_json_schema if isinstance(info, inspect.Metadata) else None
        return str((extra or {}).get("description") or "")

    def kind(info: Any) -> str:
        """What the field's type accepts, in words."""
        info = unwrap(info)
        if isinstance(info, inspect.LiteralType):
            values = declared if set(declared) == set(info.values) else info.values  # msgspec sorts them
            return "one of " + ", ".join(str(v) for v in values)
        if isinstance(info, (inspect.VarTupleType, inspect.ListType)):
            item = kind(info.item_type)
            return "a list of " + (item[len("one of "):] if item.startswith("one of ") else
                                   item.split(" ", 1)[-1] + "s")
        if isinstance(info, inspect.UnionType):
            return " or ".join(kind(t) for t in info.types)
        words: dict[type[Any], str] = {
            inspect.StrType: "a string", inspect.IntType: "an integer", inspect.FloatType: "a number",
            inspect.BoolType: "a boolean (true or false)", inspect.DictType: f"a {table}",
            inspect.StructType: f"a {table}", inspect.NoneType: "none"}
        return words.get(type(info), "")

    def child(obj: Any, part: str) -> Any:
        if isinstance(obj, dict) and part in obj:
            return obj[part]
        if isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            return obj[int(part)]
        return obj

    declared: tuple[Any, ...] = ()
    match = _AT.fullmatch(error)
    assert match is not None  # every part of _AT is optional
    text, parts = match["text"], [a or b for a, b in _PART.findall(match["path"] or "")]
    node, obj, tables = unwrap(inspect.type_info(schema)), value, []
    fields: dict[str, Any] = {f.name: f.type for f in node.fields} if isinstance(node, inspect.StructType) else {}
    while parts and parts[0] in fields and isinstance(unwrap(fields[parts[0]]), inspect.StructType) \
            and isinstance(child(obj, parts[0]), dict):
        tables.append(parts[0])
        obj, node = obj[parts.pop(0)], unwrap(fields[tables[-1]])
        fields = {f.name: f.type for f in node.fields}
    where = tuple(tables)
    unknown, missing = _UNKNOWN.fullmatch(text), _MISSING.fullmatch(text)
    if parts and isinstance(node, inspect.StructType) and parts[0] in fields:
        unknown = missing = None  # deeper than a table, in a list: the key's own problem, told below
    if unknown:
        names = sorted(set(obj) - set(fields)) if isinstance(obj, dict) else [unknown[1]]
        return Problem(where, "", f"unknown key(s) {', '.join(names)}", tuple(names), tuple(sorted(fields)))
    if missing:
        accepts = stated(fields.get(missing[1])) or kind(fields.get(missing[1]))
        return Problem(where, missing[1], f"must be {accepts} (it is missing)" if accepts else "is missing")
    if isinstance(node, inspect.StructType):
        if not parts or parts[0] not in fields:
            return Problem(where, "", f"must be a {table}")
        key, info, given = parts[0], fields[parts[0]], child(obj, parts[0])
        declared = _literals({f.name: f.type for f in msgspec.structs.fields(node.cls)}[key])
    else:  # the schema of a single value: the caller names its key
        key, info, given = "", inspect.type_info(schema), obj
    if isinstance(unwrap(info), inspect.StructType):
        return Problem(where + ((key,) if key else ()), "", f"must be a {table}")
    number = isinstance(unwrap(info), (inspect.IntType, inspect.FloatType))
    accepts = kind(info) if number and _WRONG_TYPE.fullmatch(text) else stated(info) or kind(info)
    finite = "" if not isinstance(given, float) or math.isfinite(given) else " (every number must be finite)"
    shown = ("true" if given else "false") if isinstance(given, bool) else repr(given)  # as TOML and JSON spell it
    if accepts:
        return Problem(where, key, f"must be {accepts}, got {shown}{finite}")
    return Problem(where, key, f"{text[:1].lower()}{text[1:]}, got {shown}{finite}")


def json_kind(value: object) -> str:
    """What a decoded JSON value is, as a message names it: ``null``, ``an array``, ``a string``, ``a number``,
    ``true`` or ``false``, ``an object``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    kinds = ((list, "an array"), (str, "a string"), ((int, float), "a number"), (dict, "an object"))
    return next((kind for types, kind in kinds if isinstance(value, types)), type(value).__name__)
