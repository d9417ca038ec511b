"""Arguments and helpers shared by the verbs that run a policy."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from foresight.policies import POLICIES, Policy, make_policy
from foresight.runtime.engine import EvictionConfig


def add_policy_arguments(parser: argparse.ArgumentParser, default_policy: str) -> None:
    parser.add_argument("--model", default="default", help="'default', a local folder or a Hub id")
    parser.add_argument("--policy", default=default_policy, help=f"one of: {', '.join(sorted(POLICIES))}")
    parser.add_argument("--budget", "-B", type=int, default=128, help="entries kept after an eviction (B)")
    parser.add_argument("--interval", "-L", type=int, default=32, help="entries evicted per step, every L tokens")
    parser.add_argument("--sinks", type=int, default=None, help="first S entries never evicted (policy default)")
    parser.add_argument(
        "--protect-prompt", action=argparse.BooleanOptionalAction, default=None,
        help="never evict prompt entries; the budget applies to the rest (policy default)",
    )
    parser.add_argument(
        "--option", "-o", action="append", default=[], metavar="KEY=VALUE",
        help="a policy option, e.g. -o seed=3 (see `foresight policies`)",
    )


def policy_from_args(args: argparse.Namespace) -> tuple[Policy, EvictionConfig | None]:
    """The policy and eviction config the arguments ask for (one-line errors on bad values)."""
    options = dict(_parse_option(text) for text in args.option)
    policy = make_policy(args.policy, **_typed_options(args.policy, options))
    config = EvictionConfig(args.budget, args.interval, args.sinks, args.protect_prompt)
    return policy, (config if policy.evicts else None)


def _parse_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"policy option {text!r} must look like KEY=VALUE")
    return key.strip(), value.strip()


def _typed_options(name: str, options: dict[str, str]) -> dict[str, object]:
    """Convert option strings to the type of the policy's default for that option; options without
    a default (a scorer folder, a labels path) stay strings."""
    defaults = {f.name: f.default for f in fields(POLICIES[name]) if f.init} if name in POLICIES else {}
    typed: dict[str, object] = {}
    for key, value in options.items():
        default = defaults.get(key, MISSING)
        if default is MISSING or default is None:
            typed[key] = value
            continue
        try:
            typed[key] = value.lower() in ("1", "true", "yes") if isinstance(default, bool) else type(default)(value)
        except ValueError:
            raise ValueError(f"policy option {key}={value!r} must be a {type(default).__name__}") from None
    return typed
