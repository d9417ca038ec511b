"""LightningCLI of the supervised stage: `python -m trainers.cli fit --config configs/default.yaml`.

The YAML files in configs/ hold every setting of a run (trainer, model, data, checkpointing, and the
`traces` recipe), so `fit --config FILE` reproduces it, and `fit --config FILE --ckpt_path last`
resumes it. The data module fixes the scorer's shape (the frozen model's layers and heads, B, L,
features); LightningCLI links it into the model. This CLI only trains: it reads the traces, labels
and features the config names. `foresight fit` makes them first (sampling the traces from the
`traces` recipe when the folder is incomplete), then trains through this CLI and exports the scorer.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from foresight.pipeline import TraceRecipe
from trainers.data import GoldenDataModule
from trainers.supervised import SupervisedScorer


class SupervisedCLI(LightningCLI):
    """LightningCLI with a `checkpoint` section (a ModelCheckpoint that keeps `last.ckpt` in a fixed
    folder, so `--ckpt_path last` finds it), an `lr_monitor` section (a LearningRateMonitor that logs
    the learning rate every optimisation step as `train/lr`), a `traces` section (a `TraceRecipe`, read
    by `foresight fit` only) and the data -> model link."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.add_argument(
            "--traces", type=TraceRecipe | None, default=None,
            help="how `foresight fit` samples data.traces_dir when it is incomplete (null: the folder must exist)",
        )
        parser.set_defaults({"checkpoint.save_last": True, "lr_monitor.logging_interval": "step"})
        parser.link_arguments("data.scorer_spec", "model.scorer", apply_on="instantiate")


def cli_main(args: Sequence[str] | None = None, run: bool = True) -> SupervisedCLI:
    """Run the CLI on `args` (default: the command line)."""
    return SupervisedCLI(
        SupervisedScorer,
        GoldenDataModule,
        args=None if args is None else list(args),
        run=run,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    cli_main()
