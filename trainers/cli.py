"""LightningCLIs of the two training stages.

Supervised (ForesightKV §3.2): `python -m trainers.cli fit --config configs/default.yaml`.
Reinforcement (§3.3): `python -m trainers.cli rl fit --config configs/default-rl.yaml`.

The YAML files in configs/ hold every setting of a run (trainer, model, data, checkpointing), so
`fit --config FILE` reproduces it, and `fit --config FILE --ckpt_path last` resumes it. The data
module fixes what the model must agree with (the frozen model, B, L, and for the supervised stage
the scorer's shape and features); LightningCLI links it into the model. `foresight fit` and
`foresight rl` wrap these with a run folder and the scorer export.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from trainers.data import GoldenDataModule
from trainers.grpo import GRPOScorer
from trainers.rl_data import RolloutDataModule
from trainers.supervised import SupervisedScorer


def add_checkpoint_section(parser) -> None:
    """A `checkpoint` section: a ModelCheckpoint that keeps `last.ckpt` in a fixed folder, so
    `--ckpt_path last` finds it."""
    parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
    parser.set_defaults({"checkpoint.save_last": True})


class SupervisedCLI(LightningCLI):
    """LightningCLI with a `checkpoint` section and the data -> model link of the scorer's shape."""

    def add_arguments_to_parser(self, parser) -> None:
        add_checkpoint_section(parser)
        parser.link_arguments("data.scorer_spec", "model.scorer", apply_on="instantiate")


class ReinforcementCLI(LightningCLI):
    """LightningCLI with a `checkpoint` section; the data's frozen model, B and L are linked into the module."""

    def add_arguments_to_parser(self, parser) -> None:
        add_checkpoint_section(parser)
        for name in ("model", "budget", "interval"):
            parser.link_arguments(f"data.{name}", f"model.{name}")


def cli_main(args: Sequence[str] | None = None, run: bool = True) -> SupervisedCLI:
    """Run the supervised stage's CLI on `args` (default: the command line)."""
    return SupervisedCLI(
        SupervisedScorer,
        GoldenDataModule,
        args=None if args is None else list(args),
        run=run,
        save_config_kwargs={"overwrite": True},
    )


def rl_cli_main(args: Sequence[str] | None = None, run: bool = True) -> ReinforcementCLI:
    """Run the reinforcement stage's CLI on `args` (default: the command line)."""
    return ReinforcementCLI(
        GRPOScorer,
        RolloutDataModule,
        args=None if args is None else list(args),
        run=run,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["rl"]:
        rl_cli_main(sys.argv[2:])
    else:
        cli_main()
