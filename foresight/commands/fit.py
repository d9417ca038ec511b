"""Train a scorer with the supervised stage (ForesightKV §3.2) and leave it as a Hub-format folder.

Runs the LightningCLI of `trainers.cli` on a YAML config (configs/default.yaml for the embedded
default on CPU). Everything goes under --out: traces/ (made from the config's `data.generate`
recipe unless --traces names an existing traces folder), their golden labels, features/ (the cached
training examples), checkpoints/ (last.ckpt; resume with --ckpt-path last), lightning_logs/
(TensorBoard) and scorer/ (config.json, model.safetensors, README.md). Under a DDP strategy
(--set trainer.strategy=ddp --set trainer.devices=N) every process runs this command.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from foresight.export import export_scorer, reported_metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="LightningCLI YAML config, e.g. configs/default.yaml")
    parser.add_argument("--out", type=Path, required=True, help="run folder (traces, features, checkpoints, logs, scorer)")
    parser.add_argument(
        "--traces", type=Path, default=None,
        help="use this existing traces folder (labels are made in it if missing) instead of generating traces",
    )
    parser.add_argument("--ckpt-path", default=None, help="checkpoint to resume from, or 'last' for OUT/checkpoints/last.ckpt")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set trainer.max_steps=50 --set data.batch_size=4",
    )


def lightning_args(args: argparse.Namespace) -> list[str]:
    """The LightningCLI arguments of a `foresight fit` call."""
    if not args.config.is_file():
        raise ValueError(f"config {args.config} does not exist; see configs/ for examples")
    out = args.out
    cli_args = [
        "fit",
        f"--config={args.config}",
        f"--trainer.default_root_dir={out}",
        f"--checkpoint.dirpath={out / 'checkpoints'}",
        f"--data.traces_dir={args.traces or out / 'traces'}",
        f"--data.cache_dir={out / 'features'}",
    ]
    if args.traces is not None:
        if not args.traces.is_dir():
            raise ValueError(f"--traces {args.traces} is not a folder; make one with `foresight traces`")
        cli_args.append("--data.generate=null")
    return cli_args + override_args(args.overrides, args.ckpt_path)


def override_args(overrides: list[str], ckpt_path: str | None) -> list[str]:
    """LightningCLI arguments of `--set KEY=VALUE` overrides and `--ckpt-path`."""
    cli_args = []
    for text in overrides:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {text!r} must look like KEY=VALUE, e.g. trainer.max_steps=50")
        cli_args.append(f"--{key.strip()}={value.strip()}")
    if ckpt_path is not None:
        cli_args.append(f"--ckpt_path={ckpt_path}")
    return cli_args


def run(args: argparse.Namespace) -> int:
    from trainers.cli import cli_main  # Lightning is imported only by this verb

    with warnings.catch_warnings():  # LightningCLI warns when given args beside a command line: intended here
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = cli_main(lightning_args(args))
    train_metrics = {name: value for name, value in cli.trainer.callback_metrics.items() if name.startswith("train/")}
    if cli.datamodule.val_dataloader():  # final figures of the scorer being exported
        cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    if not cli.trainer.is_global_zero:
        return 0
    module = cli.model
    record = module.training_record(extra_metrics=train_metrics)
    folder = export_scorer(module.scorer, args.out / "scorer", training=record)
    metrics = ", ".join(f"{name} {value:.4f}" for name, value in reported_metrics(record).items())
    print(f"{folder}: scorer trained for {module.global_step} steps; {metrics}")
    return 0
