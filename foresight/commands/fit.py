"""Train a scorer with the supervised stage (ForesightKV §3.2) and leave it as a Hub-format folder.

Runs the steps that make the data, then the LightningCLI of `trainers.cli`, on a YAML config
(configs/default.yaml for the embedded default on CPU). Each step is the function of its verb,
prints one line, and skips what is already made, so a rerun resumes: traces (sampled from the
config's `traces` recipe unless --traces names an existing folder, like `foresight traces`), their
golden labels (`foresight labels`), the example cache (`foresight examples`; skipped when
data.examples_dir is null, which replays the traces on every pass), then training. Everything goes
under --out: traces/ and its labels, examples/ (unless the config replays), checkpoints/ (last.ckpt;
resume with --ckpt-path last), lightning_logs/ (TensorBoard) and scorer/ (config.json,
model.safetensors, README.md). Under a DDP strategy (--set trainer.strategy=ddp --set
trainer.devices=N) every process runs this command; the steps run under a file lock in --out, so one
process makes the data and the others find it made.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import yaml
from filelock import FileLock

from foresight.commands._training import add_training_arguments, checked_config, checked_traces, override_args
from foresight.export import export_scorer, reported_metrics
from trainers.preparation import make_examples, make_labels, make_traces


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_arguments(
        parser, "configs/default.yaml", "--set trainer.max_steps=50 --set data.device=cuda --set data.dtype=bfloat16"
    )
    parser.add_argument("--out", type=Path, required=True, help="run folder (traces, examples, checkpoints, logs, scorer)")
    parser.add_argument(
        "--traces", type=Path, default=None,
        help="use this existing traces folder (labels are made in it if missing) instead of generating traces",
    )


def lightning_args(args: argparse.Namespace) -> list[str]:
    """The LightningCLI arguments of a `foresight fit` call (no subcommand: `prepare` drives the trainer)."""
    checked_config(args.config)
    out = args.out
    cli_args = [
        f"--config={args.config}",
        f"--trainer.default_root_dir={out}",
        f"--checkpoint.dirpath={out / 'checkpoints'}",
        f"--data.traces_dir={args.traces or out / 'traces'}",
    ]
    data = (yaml.safe_load(args.config.read_text()) or {}).get("data") or {}
    if data.get("examples_dir") is not None:  # a config that replays (null) keeps doing so
        cli_args.append(f"--data.examples_dir={out / 'examples'}")
    if args.traces is not None:
        checked_traces(args.traces)
        cli_args.append("--traces=null")
    return cli_args + override_args(args.overrides)  # `run` hands --ckpt-path to trainer.fit


def prepare(args: argparse.Namespace):
    """Build the run from its config, then make what its data module reads: traces (with a recipe),
    labels, examples. Returns the LightningCLI, ready to fit."""
    from trainers.cli import cli_main  # Lightning is imported only by this verb

    with warnings.catch_warnings():  # LightningCLI warns when given args beside a command line: intended here
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = cli_main(lightning_args(args), run=False)
    data, recipe = cli.datamodule, cli.config_init.get("traces")
    show = cli.trainer.is_global_zero
    args.out.mkdir(parents=True, exist_ok=True)
    with FileLock(str(args.out / ".steps.lock")):
        if recipe is not None:
            _report("traces", make_traces(data.frozen, recipe, data.traces_dir, progress=show), show)
        _report("labels", make_labels(data.frozen, data.traces_dir, data.budget, data.interval, progress=show), show)
        if data.examples is not None:
            examples = make_examples(data.frozen, data.examples, replay_batch_size=data.replay_batch_size, progress=show)
            _report("examples", examples, show)
    return cli


def _report(step: str, summary, show: bool) -> None:
    if show:
        print(f"{step}: {summary.describe()}", flush=True)


def run(args: argparse.Namespace) -> int:
    cli = prepare(args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=args.ckpt_path)
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
