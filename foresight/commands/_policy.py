"""Policy arguments of the verbs that run eviction: which policy or policies, a policy's options typed
from its own dataclass fields (-o KEY=VALUE), and the eviction cadence (B, L, sinks, protected prompt)."""

from __future__ import annotations

import argparse
from typing import Any

from foresight.bench.options import int_list
from foresight.eval.specs import ROW_OPTIONS_HELP
from foresight.policies import POLICIES, Policy, make_policy
from foresight.policies.options import (
    describe_type,
    required_options,
    settable_options,
    typed_options,
)
from foresight.runtime.engine import EvictionConfig


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
            "--budgets",
            "-B",
            type=int_list,
            default=budget,
            required=budget is None,
            help="budgets B to evaluate, comma-separated, e.g. 64,128",
        )
    else:
        parser.add_argument(
            "--budget",
            "-B",
            type=int,
            default=budget,
            required=budget is None,
            help="entries kept after an eviction (B)",
        )
    parser.add_argument(
        "--interval",
        "-L",
        type=int,
        default=interval,
        required=interval is None,
        help="entries evicted per step, every L tokens",
    )


def add_policy_arguments(parser: argparse.ArgumentParser, default_policy: str) -> None:
    """--policy, its -o options, the cadence, --sinks and --protect-prompt (see `policy_from_args`)."""
    parser.add_argument("--policy", default=default_policy, help=f"one of: {', '.join(sorted(POLICIES))}")
    parser.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy option, typed as the policy declares it, e.g. -o seed=3 or -o lag_size=none; repeat for "
        "several (options and defaults: `foresight policies`)",
    )
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


def add_row_options_argument(parser: argparse.ArgumentParser) -> None:
    """-o ROW.KEY=VALUE: options of the rows of --policies (`foresight.eval.specs.resolve_policies`)."""
    parser.add_argument("--option", "-o", action="append", default=[], metavar="ROW.KEY=VALUE", help=ROW_OPTIONS_HELP)


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
    options = typed_options(cls, texts)
    missing = [key for key in required_options(cls) if key not in options]
    unsettable = [key for key in missing if key not in settable]
    if unsettable:
        raise ValueError(f"policy {name!r} needs {', '.join(unsettable)}, which cannot be given on the command line")
    if missing:
        needed = ", ".join(f"-o {key}=VALUE ({describe_type(settable[key])})" for key in missing)
        raise ValueError(f"policy {name!r} needs {needed}")
    return options


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"policy option {text!r} must look like KEY=VALUE")
    return key.strip(), value.strip()
