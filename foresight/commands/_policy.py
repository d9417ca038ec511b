"""Policy arguments of the verbs that run eviction: which policy or policies, a policy's options typed
from its own dataclass fields (-o KEY=VALUE), and the eviction cadence (B, L, sinks, protected prompt)."""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import MISSING, fields
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union

from foresight.policies import POLICIES, Policy, make_policy
from foresight.runtime.engine import EvictionConfig

_NONE = ("none", "null")
_BOOLEANS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def add_cadence_arguments(
    parser: argparse.ArgumentParser,
    budget: int | list[int] | None = 128,
    interval: int | None = 32,
    several_budgets: bool = False,
) -> None:
    """-B/--budget and -L/--interval (a default of None makes them required); with `several_budgets`,
    -B/--budgets takes a comma-separated list."""
    if several_budgets:
        parser.add_argument(
            "--budgets", "-B", type=int_list, default=budget, required=budget is None,
            help="budgets B to evaluate, comma-separated, e.g. 64,128",
        )
    else:
        parser.add_argument(
            "--budget", "-B", type=int, default=budget, required=budget is None, help="entries kept after an eviction (B)"
        )
    parser.add_argument(
        "--interval", "-L", type=int, default=interval, required=interval is None,
        help="entries evicted per step, every L tokens",
    )


def add_policy_arguments(parser: argparse.ArgumentParser, default_policy: str) -> None:
    """--policy, its -o options, the cadence, --sinks and --protect-prompt (see `policy_from_args`)."""
    parser.add_argument("--policy", default=default_policy, help=f"one of: {', '.join(sorted(POLICIES))}")
    parser.add_argument(
        "--option", "-o", action="append", default=[], metavar="KEY=VALUE",
        help="a policy option, typed as the policy declares it, e.g. -o seed=3 or -o lag_size=none; repeat for "
        "several (options and defaults: `foresight policies`)",
    )
    add_cadence_arguments(parser)
    parser.add_argument(
        "--sinks", type=int, default=None,
        help="first S entries never evicted (default: the policy's own, see `foresight policies`)",
    )
    parser.add_argument(
        "--protect-prompt", action=argparse.BooleanOptionalAction, default=None,
        help="never evict prompt entries; the budget applies to the rest (default: the policy's own)",
    )


def add_policies_argument(parser: argparse.ArgumentParser, all_means: str) -> None:
    """--policies: 'all' (whose meaning the verb states in `all_means`) or a comma-separated list."""
    parser.add_argument(
        "--policies", default="all", metavar="all|NAME,...",
        help=f"'all' ({all_means}) or a comma-separated list of: {', '.join(sorted(POLICIES))}",
    )


def selected_policies(text: str) -> list[str]:
    """The full cache and the policies of --policies ('all': every one that needs no labels or scorer)."""
    names = sorted(n for n, cls in POLICIES.items() if _constructible(cls)) if text == "all" else text.split(",")
    for name in names:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from: {', '.join(sorted(POLICIES))}")
        if not _constructible(POLICIES[name]):
            raise ValueError(f"policy {name!r} needs labels or a scorer, which bench does not provide")
    return ["full"] + [n for n in names if n != "full"]


def _constructible(cls) -> bool:
    try:
        cls()
    except TypeError:  # needs labels or a scorer
        return False
    return True


def policy_from_args(args: argparse.Namespace) -> tuple[Policy, EvictionConfig | None]:
    """The policy and eviction config the arguments ask for (one-line errors on bad values)."""
    if args.policy not in POLICIES:
        raise ValueError(f"unknown policy {args.policy!r}; choose one of: {', '.join(sorted(POLICIES))}")
    options = policy_options(POLICIES[args.policy], dict(_key_value(text) for text in args.option))
    policy = make_policy(args.policy, **options)
    config = EvictionConfig(args.budget, args.interval, args.sinks, args.protect_prompt)
    return policy, (config if policy.evicts else None)


def policy_options(cls: type[Policy], texts: dict[str, str]) -> dict[str, Any]:
    """Option texts of a policy converted to the types of its dataclass fields; an unknown option, a
    value of the wrong type or a missing required option is a one-line error."""
    name, settable = cls.name, settable_options(cls)
    options = {}
    for key, text in texts.items():
        if key not in settable:
            raise ValueError(
                f"policy {name!r} has no option {key!r}; its options are: {', '.join(settable) or 'none'}"
            )
        try:
            options[key] = parse_value(text, settable[key])
        except ValueError:
            raise ValueError(
                f"policy {name!r} option {key} expects {describe_type(settable[key])}, got {text!r}"
            ) from None
    missing = [f.name for f in fields(cls) if f.init and f.name not in options and _required(f)]
    unsettable = [key for key in missing if key not in settable]
    if unsettable:
        raise ValueError(f"policy {name!r} needs {', '.join(unsettable)}, which cannot be given on the command line")
    if missing:
        needed = ", ".join(f"-o {key}=VALUE ({describe_type(settable[key])})" for key in missing)
        raise ValueError(f"policy {name!r} needs {needed}")
    return options


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


def int_list(text: str) -> list[int]:
    """argparse type of a comma-separated list of integers, e.g. 64,128."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 64,128, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"policy option {text!r} must look like KEY=VALUE")
    return key.strip(), value.strip()


def _required(field: Any) -> bool:
    return field.default is MISSING and field.default_factory is MISSING


def _text_types(annotation: Any) -> list[Any]:
    """The members of `annotation` (a union or a single type) that can be read from text."""
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else (annotation,)
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
