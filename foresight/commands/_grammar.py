"""The command layer's grammar: a benchmark's or study's `Settings` fields as argparse options and back, and the
argparse types every verb shares (foresight.bench.options declares the fields and the shared words)."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Sequence
from dataclasses import MISSING
from typing import Any, Literal

from foresight.bench.options import element_type, flags, option_default, option_text, options
from foresight.policies.options import describe_type, parse_value


def add_options(parser: argparse.ArgumentParser, settings_class: type) -> None:
    """One argparse option per option field of `settings_class`, stored under the field's name."""
    hints = typing.get_type_hints(settings_class)
    for option in options(settings_class):
        kind, required = hints[option.name], option.default is MISSING and option.default_factory is MISSING
        keywords: dict[str, Any] = dict(dest=option.name, help=option.metadata["help"], required=required)
        default = None if required else option_default(option)
        if "metavar" in option.metadata:
            keywords["metavar"] = option.metadata["metavar"]
        if kind is bool:
            keywords.update(action="store_true", default=False)
        elif element_type(kind) is int:
            keywords.update(
                nargs="+",
                type=int_list,
                action=_Joined,
                default=None if required or not default else option_text(default),
            )
        elif element_type(kind) is str:
            keywords.update(action="append", default=None)
        elif typing.get_origin(kind) is Literal:
            keywords.update(choices=[str(value) for value in typing.get_args(kind)], default=default)
        else:
            keywords.update(type=_reader(kind), default=default)
        parser.add_argument(*flags(option), **keywords)


def settings_from(settings_class: type, namespace: argparse.Namespace) -> Any:
    """The settings that parsed options ask for (a dataclass check of their values raises ValueError)."""
    hints = typing.get_type_hints(settings_class)
    values = {}
    for option in options(settings_class):
        value = getattr(namespace, option.name)
        if element_type(hints[option.name]) is not None:
            value = option_default(option) if value is None else tuple(value)
        values[option.name] = value
    return settings_class(**values)


def _reader(kind: Any):
    """argparse type of one value of `kind`, with a one-line error naming what it accepts."""

    def read(text: str) -> Any:
        try:
            return parse_value(text, kind)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {describe_type(kind)}, got {text!r}") from None

    return read


def int_list(text: str) -> list[int]:
    """argparse type of a comma-separated list of integers, e.g. 64,128 (every command's budgets)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 64,128, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


class _Joined(argparse.Action):
    """Stores the integers of every value given (space-separated words, each comma-separated) as one tuple."""

    def __call__(self, parser, namespace, values: Sequence[list[int]], option_string=None) -> None:
        setattr(namespace, self.dest, tuple(value for part in values for value in part))


HelpParts = dict[str, tuple[str, tuple[int, ...], tuple[str, ...]]]
"""A verb's help split by mode: part name -> (its title, the docstring paragraphs that explain it, the
destinations of its options). The options of no part are the verb's common ones."""


class PartedHelp(argparse.Action):
    """-h/--help [PART]: a long help in parts. Alone: the verb's first paragraph and its common options, with the
    parts named; with a PART: that part's paragraph and options; `all`: the whole help."""

    def __init__(self, option_strings: Sequence[str], dest: str, parts: HelpParts, **kwargs: Any) -> None:
        names = ", ".join([*parts, "all"])
        super().__init__(
            option_strings,
            dest,
            nargs="?",
            choices=[*parts, "all"],
            default=argparse.SUPPRESS,
            metavar="PART",
            help=f"show the common options and exit; with a PART ({names}) its options and what they do",
            **kwargs,
        )
        self.parts = parts

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values == "all":
            parser.print_help()
        else:
            print(parted_help(parser, self.parts, values), end="")
        parser.exit()


def parted_help(parser: argparse.ArgumentParser, parts: HelpParts, part: str | None) -> str:
    """The help of one part of `parser`'s options (None: the common ones, the parts named at the end)."""
    paragraphs = (parser.description or "").split("\n\n")
    in_parts = {dest for _, _, dests in parts.values() for dest in dests}
    if part is None:
        title, paragraph = "common options", paragraphs[0]
        actions = [action for action in parser._actions if action.dest not in in_parts]
    else:
        title, indices, dests = parts[part]
        paragraph = "\n\n".join(paragraphs[index] for index in indices)
        actions = [action for action in parser._actions if action.dest in dests]
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, actions, [])
    for text in paragraph.split("\n\n"):
        formatter.add_text(" ".join(text.split()))
    formatter.start_section(title)
    formatter.add_arguments(actions)
    formatter.end_section()
    if part is None:
        named = "; ".join(f"--help {name}: {part_title}" for name, (part_title, _, _) in parts.items())
        formatter.add_text(f"{named}; --help all: the whole help")
    return formatter.format_help()
