"""A policy's options from text (the command line's -o [ROW.]KEY=VALUE): typed from the policy's own
dataclass fields, so a new policy's options need no parsing code."""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, fields
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union

from foresight.runtime.policy import Policy

_NONE = ("none", "null")
_BOOLEANS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def typed_options(
    cls: type[Policy], texts: Mapping[str, str], label: str | None = None, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """Option texts of a policy converted to the types of its dataclass fields; an unknown option or a
    value of the wrong type is a one-line error naming `label` (default: the policy) and, among the
    allowed options, the `extra` keys the caller reads itself."""
    name, settable = label or cls.name, settable_options(cls)
    options = {}
    for key, text in texts.items():
        if key not in settable:
            allowed = [*settable, *extra]
            raise ValueError(f"policy {name!r} has no option {key!r}; its options are: {', '.join(allowed) or 'none'}")
        try:
            options[key] = parse_value(text, settable[key])
        except ValueError:
            raise ValueError(
                f"policy {name!r} option {key} expects {describe_type(settable[key])}, got {text!r}"
            ) from None
    return options


def required_options(cls: type[Policy]) -> list[str]:
    """The constructor fields of a policy class that have no default."""
    return [f.name for f in fields(cls) if f.init and f.default is MISSING and f.default_factory is MISSING]


def settable_options(cls: type[Policy]) -> dict[str, Any]:
    """{option: type} of the constructor fields of a policy class whose type can be read from text
    (a field that text could only set to None is not one)."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in fields(cls)
        if f.init and any(kind is not type(None) for kind in _text_types(hints[f.name]))
    }


def parse_value(text: str, annotation: Any) -> Any:
    """`text` as a value of `annotation`: bool, int, float, str, a path, an Enum, a Literal, None, or a
    union of these (None first, then the members in order). Raises ValueError when none accepts it."""
    kinds = _text_types(annotation)
    for kind in sorted(kinds, key=lambda kind: kind is not type(None)):
        try:
            return _convert(text, kind)
        except (ValueError, KeyError):
            continue
    raise ValueError(f"{text!r} is not {describe_type(annotation)}")


def describe_type(annotation: Any) -> str:
    """The types `parse_value` accepts for `annotation`, in words ("an int or none")."""
    return " or ".join(_describe(kind) for kind in _text_types(annotation))


def _text_types(annotation: Any) -> list[Any]:
    """The members of `annotation` (a union or a single type) that can be read from text."""
    members = (
        typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    )
    return [kind for kind in members if _readable(kind)]


def _readable(kind: Any) -> bool:
    if typing.get_origin(kind) is Literal:
        return True
    return kind in (bool, int, float, str, Path, os.PathLike, type(None)) or (
        isinstance(kind, type) and issubclass(kind, Enum)
    )


def _convert(text: str, kind: Any) -> Any:
    if kind is type(None):
        if text.lower() not in _NONE:
            raise ValueError(text)
        return None
    if kind is bool:
        return _BOOLEANS[text.lower()]
    if kind in (Path, os.PathLike):
        if not text:
            raise ValueError(text)  # Path("") would be the working directory
        return Path(text)
    if typing.get_origin(kind) is Literal:
        return {str(value): value for value in typing.get_args(kind)}[text]
    return kind(text)  # int, float, str, an Enum by value


def _describe(kind: Any) -> str:
    if kind is type(None):
        return "none"
    if typing.get_origin(kind) is Literal:
        return "one of " + ", ".join(repr(str(value)) for value in typing.get_args(kind))
    if isinstance(kind, type) and issubclass(kind, Enum):
        return "one of " + ", ".join(repr(str(member.value)) for member in kind)
    names = {bool: "a bool (true or false)", int: "an int", float: "a float", str: "a string", Path: "a path"}
    return names.get(kind, "a path")
