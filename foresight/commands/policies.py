"""List the registered eviction policies: what each needs from the runtime and its defaults."""

from __future__ import annotations

import argparse

from foresight.policies import POLICIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    rows = []
    for name in sorted(POLICIES):
        cls = POLICIES[name]
        try:
            policy = cls()
        except TypeError:  # needs arguments (labels, a scorer): show its declared needs only
            rows.append((name, cls.summary, "see --help of its command", ""))
            continue
        defaults = {**policy.options(), "sinks": cls.default_sinks, "protect_prompt": cls.default_protect_prompt}
        rows.append((name, cls.summary, policy.needs, ", ".join(f"{k}={v}" for k, v in defaults.items())))
    widths = [max(len(str(row[i])) for row in rows + [("policy", "rule", "needs", "defaults")]) for i in range(4)]
    for row in [("policy", "rule", "needs", "defaults")] + rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0
