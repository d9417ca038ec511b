"""Refine a trained scorer with the reinforcement stage (GRPO, ForesightKV §3.3) and leave it as a Hub-format folder.

Runs the reinforcement LightningCLI of `trainers.cli` on a YAML config (configs/default-rl.yaml for the
embedded default on CPU), starting from --scorer (a `foresight fit` folder or a Hub id, trained for
the config's B and L), which is also the frozen KL reference. Every step rolls out each trace of a
batch G times with the scorer sampling its evictions, rewards low loss damage on low-entropy tokens,
and takes a clipped-ratio step. Everything goes under --out: checkpoints/ (last.ckpt, resume with
--ckpt-path last; epoch-N.ckpt at the end of every epoch), lightning_logs/ (TensorBoard: reward, KL per
(layer, KV head) set, clip fraction, policy entropy, loss ratio, low-entropy damage) and scorer/ (config.json, model.safetensors and a model card saying it is
the reinforcement stage and what it started from). Under a DDP strategy (--set trainer.strategy=ddp
--set trainer.devices=N) every process runs this command; each replays G / N rollouts of every trace.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from foresight.commands._policy import add_regime_argument, add_scorer_argument
from foresight.commands._training import (
    add_training_arguments,
    checked_config,
    checked_traces,
    one_line_config_errors,
    override_args,
)
from foresight.data.trace_store import folder_sources
from foresight.eval.specs import one_scorer
from foresight.export import export_scorer, reported_metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_arguments(parser, "configs/default-rl.yaml", "--set trainer.max_steps=20 --set model.group_size=4")
    add_scorer_argument(parser, required=True, what="the supervised scorer to start from (the frozen KL reference too)")
    parser.add_argument("--out", type=Path, required=True, help="run folder (checkpoints, logs, scorer)")
    parser.add_argument(
        "--traces", type=Path, default=None, help="traces folder to roll out (default: the config's data.traces_dir)"
    )
    add_regime_argument(parser, default=None, config_key="model.regime (null: the scorer's own)")


def lightning_args(args: argparse.Namespace) -> list[str]:
    """The LightningCLI arguments of a `foresight rl` call."""
    checked_config(args.config)
    _, scorer = one_scorer(args.scorer, "foresight rl")
    cli_args = [
        "fit",
        f"--config={args.config}",
        f"--trainer.default_root_dir={args.out}",
        f"--checkpoint.dirpath={args.out / 'checkpoints'}",
        f"--epoch_checkpoint.dirpath={args.out / 'checkpoints'}",
        f"--model.scorer={scorer}",
    ]
    if args.traces is not None:
        checked_traces(args.traces)
        cli_args.append(f"--data.traces_dir={args.traces}")
    if args.regime is not None:
        cli_args.append(f"--model.regime={args.regime.value}")
    return cli_args + override_args(args.overrides, args.ckpt_path)


def run(args: argparse.Namespace) -> int:
    from trainers.cli import rl_cli_main  # Lightning is imported only by the training verbs

    with warnings.catch_warnings():  # LightningCLI warns when given args beside a command line: intended here
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        with one_line_config_errors():
            cli = rl_cli_main(lightning_args(args), exit_on_error=False)
    if not cli.trainer.is_global_zero:
        return 0
    module = cli.model
    config = module.scorer.config  # the sources of both stages: a reinforced scorer has seen its rollouts' traces
    config.training_sources = sorted({*config.training_sources, *folder_sources(cli.datamodule.traces_dir)})
    record = module.training_record()
    folder = export_scorer(module.scorer, args.out / "scorer", training=record)
    metrics = ", ".join(f"{name} {value:.4f}" for name, value in reported_metrics(record).items())
    _, source = one_scorer(args.scorer, "foresight rl")
    print(f"{folder}: scorer refined by GRPO for {module.global_step} steps from {source}; {metrics}")
    return 0
