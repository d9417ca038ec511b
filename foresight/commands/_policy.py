"""Policy arguments of the verbs that run eviction, in the one grammar of every verb, benchmark and study
(`foresight.bench.options`' shared words): which policy or policies, a learned scorer (--scorer
[NAME=]DIR_OR_HUB_ID), a policy's options typed from its own dataclass fields (-o [ROW.]KEY=VALUE), and the
eviction cadence (-B, -L, sinks, protected prompt); old spellings answered with the new one."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from foresight.bench import options as words
from foresight.cadence import Regime
from foresight.commands._grammar import int_list
from foresight.eval.specs import LAYOUT_DEFAULTS, LEARNED, cadence_overrides, one_scorer, options_by_row, options_of
from foresight.policies import DEFAULT_POLICY, POLICIES, Policy, make_policy
from foresight.policies.options import describe_type, required_options, settable_options, typed_options
from foresight.runtime.engine import EvictionConfig

REQUIRED = None
"""A cadence default that makes -B or -L required (a verb whose artifact is made for one B and L)."""


def add_cadence_arguments(
    parser: argparse.ArgumentParser,
    budget: int | None = words.DEFAULT_CADENCE[0],
    interval: int | None = words.DEFAULT_CADENCE[1],
    several_budgets: bool = False,
) -> None:
    """-B/--budget and -L/--interval (a default of `REQUIRED` makes them required); with `several_budgets`,
    -B/--budgets takes a comma-separated list."""
    if several_budgets:
        parser.add_argument(
            *words.BUDGETS_FLAGS, type=int_list, default=budget, required=budget is None, help=words.BUDGETS_HELP
        )
    else:
        parser.add_argument(
            *words.BUDGET_FLAGS, type=int, default=budget, required=budget is None, help=words.BUDGET_HELP
        )
    parser.add_argument(
        *words.INTERVAL_FLAGS, type=int, default=interval, required=interval is None, help=words.INTERVAL_HELP
    )


def add_regime_argument(
    parser: argparse.ArgumentParser, default: Regime | None = Regime.STREAMING, config_key: str | None = None
) -> None:
    """--regime: where the eviction steps fall (`foresight.cadence.Regime`); `config_key` names the config value
    a training verb's flag sets (its default: the config's)."""
    fallback = f"the config's {config_key}, else streaming" if config_key else "streaming"
    parser.add_argument(
        "--regime",
        type=Regime.parse,
        default=default,
        help=f"{words.REGIME_HELP} (default: {fallback})",
    )


def add_scorer_argument(parser: argparse.ArgumentParser, required: bool = False, what: str = "") -> None:
    """--scorer [NAME=]DIR_OR_HUB_ID, repeatable (a verb that runs one scorer refuses a second); `what` adds
    what the verb does with it to the shared help."""
    parser.add_argument(
        *words.SCORER_FLAGS,
        action="append",
        default=[],
        required=required,
        metavar=words.SCORER_METAVAR,
        help=words.SCORER_HELP + (f"; {what}" if what else ""),
    )


def add_option_argument(parser: argparse.ArgumentParser) -> None:
    """-o [ROW.]KEY=VALUE, repeatable."""
    parser.add_argument(
        *words.OPTION_FLAGS, action="append", default=[], metavar=words.OPTION_METAVAR, help=words.OPTION_HELP
    )


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """--policy, --scorer, -o, the cadence, --sinks and --protect-prompt (see `policy_from_args`)."""
    parser.add_argument(
        "--policy",
        default=None,
        help=f"one of: {', '.join(sorted(POLICIES))} (default: {DEFAULT_POLICY}, or {LEARNED} with --scorer)",
    )
    add_scorer_argument(parser)
    add_option_argument(parser)
    add_cadence_arguments(parser)
    parser.add_argument(
        "--sinks",
        type=int,
        default=None,
        help="first S entries never evicted (default: the policy's own, see `foresight policies`)",
    )
    parser.add_argument(
        "--protect-prompt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="never evict prompt entries; the budget applies to the rest (default: the policy's own)",
    )


def add_policies_argument(parser: argparse.ArgumentParser, all_means: str) -> None:
    """--policies: 'all' (whose meaning the verb states in `all_means`) or a comma-separated list."""
    parser.add_argument(
        "--policies",
        default="all",
        metavar="all|NAME,...",
        help=f"'all' ({all_means}) or a comma-separated list of: {', '.join(sorted(POLICIES))}",
    )


class _Refused(argparse.Action):
    """An old spelling: refused at parse time with the one that replaced it."""

    def __init__(self, option_strings, dest, new: str, **keywords) -> None:
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **keywords)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is spelled {self.new} now")


def refuse_old_spelling(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Answer `old VALUE` with a one-line error naming `new` (exit status 2), hidden from the help."""
    parser.add_argument(old, action=_Refused, new=new, default=None)


def policy_from_args(args: argparse.Namespace) -> tuple[Policy, EvictionConfig | None]:
    """The policy and eviction config the arguments ask for (one-line errors on bad values): --policy, or
    the learned policy with --scorer, its -o options and the cadence."""
    learned = one_scorer(args.scorer, f"foresight {args.verb}")
    name = args.policy or (LEARNED if learned else DEFAULT_POLICY)
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
    if learned and name != LEARNED:
        raise ValueError(f"--scorer runs the learned policy {LEARNED!r}; leave out --policy {name}")
    row = learned[0] if learned else name
    texts = options_of(options_by_row(args.option), [row], f"the policy `foresight {args.verb}` runs")
    texts = texts.get(row, {})
    cadence = cadence_overrides(row, texts)
    given = {"scorer": learned[1]} if learned else {}
    options = policy_options(POLICIES[name], texts, given)
    policy = make_policy(name, **options, **given)
    for key in ("sinks", "protect_prompt"):
        if key in cadence and getattr(args, key) is not None:
            raise ValueError(f"give --{key.replace('_', '-')} or -o {key}, not both")
    sinks, protect = (cadence.get(key, getattr(args, key)) for key in ("sinks", "protect_prompt"))
    layout = {key: cadence[key] for key in LAYOUT_DEFAULTS if key in cadence}  # -o layout=pooled, allocation, floor
    config = EvictionConfig(args.budget, args.interval, sinks, protect, **layout)
    return policy, (config if policy.evicts else None)


def policy_options(cls: type[Policy], texts: dict[str, str], given: Sequence[str] = ()) -> dict[str, Any]:
    """Option texts of a policy converted to the types of its dataclass fields; an unknown option, a
    value of the wrong type or a missing required option (other than those `given` apart) is a one-line error."""
    name, settable = cls.name, settable_options(cls)
    options = typed_options(cls, texts)
    missing = [key for key in required_options(cls) if key not in options and key not in given]
    if "scorer" in missing:
        raise ValueError(f"policy {name!r} needs a trained scorer: give --scorer {words.SCORER_METAVAR}")
    unsettable = [key for key in missing if key not in settable]
    if unsettable:
        raise ValueError(f"policy {name!r} needs {', '.join(unsettable)}, which cannot be given on the command line")
    if missing:
        needed = ", ".join(f"-o {key}=VALUE ({describe_type(settable[key])})" for key in missing)
        raise ValueError(f"policy {name!r} needs {needed}")
    return options
