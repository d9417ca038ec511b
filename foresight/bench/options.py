"""A benchmark's options, declared once as the fields of its frozen `Settings` dataclass, and the shared words of
every verb, benchmark and study (flags and help of -B, -L, --scorer, -o, --regime). The command layer's grammar
(`foresight.commands._grammar`) turns the fields into argparse options; the command that reproduces a report
is made here from the same fields, as a policy's -o options are made from its own (`foresight.policies.options`).

A field `name: T = field(default=..., metadata={"help": "..."})` is the option --name (underscores become
dashes; metadata "flags" overrides the spelling, "metavar" the placeholder); a field without a
default is a required option; a field without help is no option. Its type says how text
is read:
- bool: a switch (the option alone sets it);
- tuple[int, ...]: integers, comma- or space-separated (--budgets 64,128 or --budgets 64 128);
- tuple[str, ...]: an option given once per value (--scorer A --scorer B);
- Literal[...]: one of the values listed;
- int, float, str, Path, or one of them | None: read as `foresight.policies.options.parse_value` reads it.
"""

from __future__ import annotations

import shlex
import sys
import typing
from dataclasses import MISSING, Field, fields
from types import ModuleType
from typing import Any

from foresight.cadence import DEFAULT_BUDGET, DEFAULT_INTERVAL

# -- the shared words: every verb, benchmark and study spells these options so (tests/test_grammar.py) ---------
BUDGET_FLAGS = ("--budget", "-B")
BUDGETS_FLAGS = ("--budgets", "-B")
INTERVAL_FLAGS = ("--interval", "-L")
BUDGET_HELP = "entries kept after an eviction (B)"
BUDGETS_HELP = "budgets B, comma-separated, e.g. 64,128"
INTERVAL_HELP = "entries evicted per step, every L tokens"
DEFAULT_CADENCE = (DEFAULT_BUDGET, DEFAULT_INTERVAL)
"""-B and -L where a command leaves them out (`foresight.cadence`); a command that makes or reads an artifact of one
B and L (labels, examples, an evaluation) requires them instead."""

REGIME_HELP = (
    "where the eviction steps fall: streaming (the paper's: the prompt streamed through the window from the first "
    "token) or decode (as `foresight generate`: the whole prompt prefilled, one compression step to B, then a step "
    "every L tokens); docs/algorithms.md §1"
)
SCORER_FLAGS = ("--scorer",)
SCORER_METAVAR = "[NAME=]DIR_OR_HUB_ID"
SCORER_HELP = (
    "a trained scorer run as the learned `foresight` policy at the B and L it was trained for: a folder "
    "(`foresight fit` OUT/scorer, checkpoints/NAME) or a Hub id, NAME= naming its rows"
)
OPTION_FLAGS = ("--option", "-o")
OPTION_METAVAR = "[ROW.]KEY=VALUE"
OPTION_HELP = (
    "a policy option, typed as the policy declares it (`foresight policies`), e.g. -o lag_size=none; ROW. names "
    "the row of --policies it is for (left out where one policy runs; a row ROW=POLICY runs a policy under settings of "
    "its own), e.g. "
    "-o triattention.stats=checkpoints/triattention-default; the keys protect_prompt and sinks override the policy's "
    "own defaults; repeat for several (in `foresight eval` a --scorer NAME names a row too, e.g. "
    "-o default.observation=window)"
)


def options(settings_class: type) -> list[Field]:
    """The fields of a settings class that are command-line options (those with help), the report's last."""
    declared = [f for f in fields(settings_class) if "help" in f.metadata]
    return sorted(declared, key=lambda f: f.metadata.get("report", False))


def flags(option: Field) -> tuple[str, ...]:
    """The option's spellings, the long one first."""
    return tuple(option.metadata.get("flags", ("--" + option.name.replace("_", "-"),)))


def command_line(settings: Any) -> str:
    """The `foresight bench NAME ...` command (a study's `python -m studies NAME ...`: its module's COMMAND)
    that parses back into `settings`: every option but those left at an empty default (None, off, nothing
    given)."""
    given = {}
    for option in options(type(settings)):
        value = getattr(settings, option.name)
        if value not in (None, False, (), "") or option.default != value:
            given[option.name] = value
    module = declaring_module(settings)
    words = [*getattr(module, "COMMAND", "foresight bench").split(), module.NAME]
    return " ".join(words + [shlex.quote(word) for word in option_words(type(settings), given)])


def option_words(settings_class: type, values: dict[str, Any]) -> list[str]:
    """The command-line words that give these option values, each named by its field or its long flag (with
    dashes or underscores, as a study's spec file writes them); an unknown name is refused, naming the options
    there are."""
    declared = {option.name: option for option in options(settings_class)}
    declared |= {flags(option)[0][2:].replace("-", "_"): option for option in declared.values()}
    hints = typing.get_type_hints(settings_class)
    words: list[str] = []
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in declared:
            known = ", ".join(dict.fromkeys(flags(option)[0] for option in declared.values()))
            raise ValueError(f"{key!r} is not an option here; the options are {known}")
        option = declared[name]
        flag, kind = flags(option)[0], hints[option.name]
        if kind is bool:
            words += [flag] if value else []
        elif element_type(kind) is str:
            words += [word for item in _items(value) for word in (flag, str(item))]
        else:
            words += [flag, option_text(tuple(value) if isinstance(value, list) else value)]
    return words


def declaring_module(settings: Any) -> ModuleType:
    """The benchmark (or study) module that declares the settings' class: its NAME, and COMMAND and REPORTS
    where it runs as a study."""
    return sys.modules[type(settings).__module__]


def _items(value: Any) -> tuple:
    """One value or several (a list or tuple) as a tuple."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def option_default(option: Field) -> Any:
    return option.default_factory() if option.default is MISSING else option.default


def option_text(value: Any) -> Any:
    """How a value is written on the command line (None stays None: argparse's unset default)."""
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def element_type(kind: Any) -> type | None:
    """int or str for tuple[int, ...] or tuple[str, ...]; None for any other type."""
    if typing.get_origin(kind) is tuple:
        element, *rest = typing.get_args(kind)
        if rest == [Ellipsis] and element in (int, str):
            return element
    return None
