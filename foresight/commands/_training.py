"""Arguments shared by the training verbs (`foresight fit`, `foresight rl`), thin shells over `trainers.fit`
and `trainers.rl`: the config, resume, overrides, and the model and cadence every verb takes."""

from __future__ import annotations

import argparse
from pathlib import Path

from foresight.bench.options import BUDGET_FLAGS, BUDGET_HELP, INTERVAL_FLAGS, INTERVAL_HELP


def add_training_arguments(parser: argparse.ArgumentParser, example_config: str, example_overrides: str) -> None:
    """--config, --model, -B, -L, --ckpt-path and --set."""
    parser.add_argument("--config", type=Path, required=True, help=f"LightningCLI YAML config, e.g. {example_config}")
    parser.add_argument(
        "--model", default=None, help="the frozen model (a Hub id or `default`) (default: the config's data.model)"
    )
    parser.add_argument(
        *BUDGET_FLAGS, type=int, default=None, help=f"{BUDGET_HELP} (default: the config's data.budget)"
    )
    parser.add_argument(
        *INTERVAL_FLAGS, type=int, default=None, help=f"{INTERVAL_HELP} (default: the config's data.interval)"
    )
    parser.add_argument(
        "--ckpt-path", default=None, help="checkpoint to resume from, or 'last' for OUT/checkpoints/last.ckpt"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value, e.g. {example_overrides}",
    )
