"""LightningCLI of the supervised stage: `python -m trainers.cli fit --config configs/default.yaml`.

The YAML files in configs/ hold every setting of a run (trainer, model, data, checkpointing), so
`fit --config FILE` reproduces it, and `fit --config FILE --ckpt_path last` resumes it. The data
module fixes the scorer's shape (the frozen model's layers and heads, B, L, features); LightningCLI
links it into the model. `foresight fit` wraps this with a run folder and the scorer export.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from trainers.data import GoldenDataModule
from trainers.supervised import SupervisedScorer


class SupervisedCLI(LightningCLI):
    """LightningCLI with a `checkpoint` section (a ModelCheckpoint that keeps `last.ckpt` in a fixed
    folder, so `--ckpt_path last` finds it), an `lr_monitor` section (a LearningRateMonitor that logs
    the learning rate every optimisation step as `train/lr`) and the data -> model link."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
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
