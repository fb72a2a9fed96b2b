"""Typed, checked config dataclasses: one mechanism for every settings table captionkit reads.

A config dataclass declares each field's type by its annotation and its range or choices by
:func:`spec`; its ``__post_init__`` calls :func:`check_fields`, which checks every field
against both (integer fields refuse floats and booleans, number fields refuse strings and
non-finite values, lists and tables are checked item by item) and raises :class:`FieldError`
naming the field. Checks that relate two fields stay in ``__post_init__`` and raise
:class:`FieldError` too. The same check runs whether the values come from a TOML file (the
config reader, :mod:`captionkit.training.config`, adds the file and section to the message) or from a
checkpoint's ``config.json``.

Kept free of heavy imports: model modules and the config reader both use it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tomllib
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any

from .errors import UserError


class FieldError(UserError):
    """A field holds a value its declaration refuses. ``owner.path message``, e.g.
    ``train.lr must be a number, got 'fast'``; the config reader puts the file in front and the
    section it read in place of ``owner``."""

    def __init__(self, owner: str, path: str, message: str):
        self.owner, self.path, self.message = owner, path, message
        super().__init__(f"{owner}.{path} {message}")


@dataclass(frozen=True)
class Rule:
    """What a field's values must satisfy besides their type. Numeric bounds apply to numbers
    (each number of a list or table); ``choices`` to strings; ``min_len``/``length`` to the
    length of a string or list. ``describe`` replaces the generated message ("must be
    <describe>, got <value>")."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    min_len: int | None = None
    length: int | None = None
    describe: str | None = None


_RULE = "captionkit.rule"


def spec(default: Any = MISSING, *, default_factory: Any = MISSING, **rule: Any) -> Any:
    """A dataclass field with a :class:`Rule`: ``epochs: int = spec(20, ge=1)``."""
    if "choices" in rule:
        rule["choices"] = tuple(rule["choices"])
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_RULE: Rule(**rule)})


def owner_name(obj_or_cls: Any) -> str:
    """How messages name a config's fields: its ``SECTION`` ("train") if it declares one, else
    its class name ("SATConfig")."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return getattr(cls, "SECTION", cls.__name__)


def field_error(obj: Any, path: str, message: str) -> FieldError:
    """A :class:`FieldError` about ``obj``'s field ``path`` (for checks in ``__post_init__``)."""
    return FieldError(owner_name(obj), path, message)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def required_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)
            if f.default is MISSING and f.default_factory is MISSING]


def show(value: Any, limit: int = 60) -> str:
    """A value as a message shows it: repr (so newlines stay escaped), shortened."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_dotted_key(key: str) -> bool:
    """Is ``key`` a config field as ``--set`` names it: TABLE.FIELD (train.lr), or deeper
    (train.lr_groups.lora)?"""
    return re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", key) is not None


def parse_value(text: str) -> Any:
    """A value given on the command line for a config field (``--set``): TOML's spelling (1e-4,
    true, [0.0, 1.0], "x"), or the text itself as a string (``adamw``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text.strip()


def _kind(tp: Any) -> str:
    """The type as a message names it."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_kind(t) for t in typing.get_args(tp))
    if origin is list:
        return f"a list of {_kind(typing.get_args(tp)[0]).split(' ', 1)[1]}s"
    if origin is dict:
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]


class _Bad(Exception):
    """A value refused below ``path`` (relative to the field: "", "[2]", ".projector")."""

    def __init__(self, path: str, message: str):
        self.path, self.message = path, message


def _check_rule(value: Any, rule: Rule) -> str | None:
    """The message for a value outside ``rule``, or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for bound, ok, sign in ((rule.ge, lambda b: value >= b, ">="), (rule.gt, lambda b: value > b, ">"),
                                (rule.le, lambda b: value <= b, "<="), (rule.lt, lambda b: value < b, "<")):
            if bound is not None and not ok(bound):
                if rule.ge is not None and rule.lt is not None:
                    return f"must be in [{rule.ge:g}, {rule.lt:g}), got {value!r}"
                if rule.ge is not None and rule.le is not None:
                    return f"must be in [{rule.ge:g}, {rule.le:g}], got {value!r}"
                return f"must be {sign} {bound:g}, got {value!r}"
    if isinstance(value, str) and rule.choices is not None and value not in rule.choices:
        return f"must be one of {', '.join(rule.choices)}, not {show(value)}"
    return None


def _check_length(value: Any, rule: Rule) -> str | None:
    if rule.length is not None and len(value) != rule.length:
        return f"must have {rule.length} items, got {show(value)}"
    if rule.min_len is not None and len(value) < rule.min_len:
        return "must not be empty" if rule.min_len == 1 else f"needs at least {rule.min_len} items"
    return None


def _convert(value: Any, tp: Any, rule: Rule) -> Any:
    """``value`` checked against type ``tp`` and ``rule``; returns it in its one form (ints as
    floats in float fields, tuples as lists). Raises _Bad."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        for member in typing.get_args(tp):
            try:
                return _convert(value, member, rule)
            except _Bad as bad:
                if bad.path or _fits(value, member):  # right type, wrong value: that is the message
                    raise
        raise _Bad("", f"must be {rule.describe or _kind(tp)}, got {show(value)}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _Bad("", f"must be {_kind(tp)}, got {show(value)}")
        problem = _check_length(value, rule)
        if problem:
            raise _Bad("", problem)
        item_rule = dataclasses.replace(rule, length=None, min_len=None)
        out = []
        for i, item in enumerate(value):
            try:
                out.append(_convert(item, typing.get_args(tp)[0], item_rule))
            except _Bad as bad:
                raise _Bad(f"[{i}]{bad.path}", bad.message) from None
        return out
    if origin is dict:
        if not isinstance(value, dict):
            raise _Bad("", f"must be a table, got {show(value)}")
        key_type, value_type = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, key_type):
                raise _Bad("", f"has a key that is not a string: {show(k)}")
            try:
                out[k] = _convert(v, value_type, rule)
            except _Bad as bad:
                raise _Bad(f".{k}{bad.path}" if k.isidentifier() else f"[{show(k)}]{bad.path}", bad.message) from None
        return out
    if not _fits(value, tp):
        raise _Bad("", f"must be {rule.describe or _kind(tp)}, got {show(value)}")
    if tp is float:
        value = float(value)
        if not math.isfinite(value):
            raise _Bad("", f"must be a finite number, got {value!r}")
    problem = _check_rule(value, rule) or (_check_length(value, rule) if tp is str else None)
    if problem:
        raise _Bad("", f"must be {rule.describe}, got {show(value)}" if rule.describe else problem)
    return value


def _fits(value: Any, tp: Any) -> bool:
    """Is ``value`` of the plain type ``tp``? (A bool is not a number here, a float never an
    integer; an integer is a number.)"""
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if typing.get_origin(tp) in (list, dict, types.UnionType, typing.Union):
        return False
    raise TypeError(f"fields.py cannot check values of type {tp!r}")  # a declaration to extend, not a user error


def check_fields(obj: Any) -> None:
    """Check (and normalise) every field of the dataclass instance ``obj`` against its
    annotation and :class:`Rule`; raise :class:`FieldError` naming the first bad field."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        rule = f.metadata.get(_RULE, Rule())
        try:
            setattr(obj, f.name, _convert(getattr(obj, f.name), hints[f.name], rule))
        except _Bad as bad:
            raise FieldError(owner_name(obj), f.name + bad.path, bad.message) from None
