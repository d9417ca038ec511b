"""LightningCLIs of the two training stages.

Supervised (ForesightKV §3.2): `python -m trainers.cli fit --config configs/default.yaml`.
Reinforcement (§3.3): `python -m trainers.cli rl fit --config configs/default-rl.yaml`.

The YAML files in configs/ hold every setting of a run (trainer, model, data, checkpointing, and for
the supervised stage the `traces` recipe), so `fit --config FILE` reproduces it, and
`fit --config FILE --ckpt_path last` resumes it. The data module fixes what the model must agree with
(the frozen model, B, L, and for the supervised stage the scorer's shape and features); LightningCLI
links it into the model. This CLI only trains: it reads the traces, labels and features the config
names. `foresight fit` makes them first (sampling the traces from the `traces` recipe when the folder
is incomplete), then trains through this CLI and exports the scorer; `foresight rl` does the same for
the reinforcement stage.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from trainers.data import GoldenDataModule
from trainers.data_stage import TraceRecipe
from trainers.preparation import OnPolicyRounds, SeedEnsemble
from trainers.process import keep_freed_memory, quiet_third_party_notices
from trainers.reinforcement.data import RolloutDataModule
from trainers.reinforcement.grpo import GRPOScorer
from trainers.supervised import SupervisedScorer


def add_checkpoint_section(parser) -> None:
    """A `checkpoint` section: a ModelCheckpoint that keeps `last.ckpt` in a fixed folder, so
    `--ckpt_path last` finds it."""
    parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
    parser.set_defaults({"checkpoint.save_last": True})


class SupervisedCLI(LightningCLI):
    """LightningCLI with a `checkpoint` section, an `lr_monitor` section (a LearningRateMonitor that logs
    the learning rate every optimisation step as `train/lr`), `traces`, `on_policy` and `ensemble` sections
    (a `TraceRecipe`, `OnPolicyRounds` and a `SeedEnsemble`, read by `foresight fit` only) and the data ->
    model link of the scorer's shape."""

    def add_arguments_to_parser(self, parser) -> None:
        add_checkpoint_section(parser)
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.add_argument(
            "--traces",
            type=TraceRecipe | None,
            default=None,
            help="how `foresight fit` samples data.traces_dir when it is incomplete (null: the folder must exist)",
        )
        parser.add_argument(
            "--on_policy",
            type=OnPolicyRounds | None,
            default=None,
            help="on-policy rounds `foresight fit` runs after the golden fit (null: none; --on-policy-rounds overrides)",
        )
        parser.add_argument(
            "--ensemble",
            type=SeedEnsemble | None,
            default=None,
            help="fits under several seeds that `foresight fit` averages into one scorer (null: one fit; --ensemble overrides)",
        )
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        parser.link_arguments("data.scorer_spec", "model.scorer", apply_on="instantiate")


class EpochCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint of its own class, so its state key differs from the `checkpoint` section's whatever
    both are set to (Lightning refuses two checkpoint callbacks of one key)."""


class ReinforcementCLI(LightningCLI):
    """LightningCLI with a `checkpoint` section and an `epoch_checkpoint` section (a ModelCheckpoint keeping
    `epoch-N.ckpt` at the end of every epoch, so the run's stopping rule can pick an epoch fixed before any
    evaluation); the data's frozen model, B and L are linked into the module."""

    def add_arguments_to_parser(self, parser) -> None:
        add_checkpoint_section(parser)
        parser.add_lightning_class_args(EpochCheckpoint, "epoch_checkpoint")
        parser.set_defaults(
            {
                "epoch_checkpoint.every_n_epochs": 1,
                "epoch_checkpoint.save_top_k": -1,
                "epoch_checkpoint.filename": "epoch-{epoch}",
                "epoch_checkpoint.auto_insert_metric_name": False,
            }
        )
        for name in ("model", "budget", "interval"):
            parser.link_arguments(f"data.{name}", f"model.{name}")


def cli_main(args: Sequence[str] | None = None, run: bool = True, exit_on_error: bool = True) -> SupervisedCLI:
    """Run the supervised stage's CLI on `args` (default: the command line), freed host memory kept for
    the next step's tensors (`trainers.process`). `exit_on_error=False` raises a bad argument as
    `argparse.ArgumentError` instead of printing the usage, for callers that report it in one line."""
    keep_freed_memory()
    quiet_third_party_notices()
    return SupervisedCLI(
        SupervisedScorer,
        GoldenDataModule,
        args=None if args is None else list(args),
        run=run,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"exit_on_error": exit_on_error},
    )


def rl_cli_main(args: Sequence[str] | None = None, run: bool = True, exit_on_error: bool = True) -> ReinforcementCLI:
    """Run the reinforcement stage's CLI on `args` (default: the command line), freed host memory kept
    for the next step's tensors; `exit_on_error` as in `cli_main`."""
    keep_freed_memory()
    quiet_third_party_notices()
    return ReinforcementCLI(
        GRPOScorer,
        RolloutDataModule,
        args=None if args is None else list(args),
        run=run,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"exit_on_error": exit_on_error},
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["rl"]:
        rl_cli_main(sys.argv[2:])
    else:
        cli_main()
