"""Refine a trained scorer with the reinforcement stage (GRPO, ForesightKV §3.3) and leave it as a Hub-format folder;
a shell over `trainers.rl`, which Python callers use directly (docs/training.md).

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
from dataclasses import fields
from pathlib import Path

from foresight.commands._policy import add_regime_argument, add_scorer_argument
from foresight.commands._training import add_training_arguments
from foresight.eval.specs import one_scorer
from trainers.reinforcement.stage import RLRequest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_arguments(parser, "configs/default-rl.yaml", "--set trainer.max_steps=20 --set model.group_size=4")
    add_scorer_argument(parser, required=True, what="the supervised scorer to start from (the frozen KL reference too)")
    parser.add_argument("--out", type=Path, required=True, help="run folder (checkpoints, logs, scorer)")
    parser.add_argument(
        "--traces", type=Path, default=None, help="traces folder to roll out (default: the config's data.traces_dir)"
    )
    add_regime_argument(parser, default=None, config_key="model.regime (null: the scorer's own)")


def request(args: argparse.Namespace) -> RLRequest:
    """The reinforcement run the parsed command line asks for (--scorer's source, its row name unused)."""
    settings = {setting.name: getattr(args, setting.name) for setting in fields(RLRequest) if setting.name != "scorer"}
    _, source = one_scorer(args.scorer, "foresight rl")
    return RLRequest(scorer=source, **settings)


def run(args: argparse.Namespace) -> int:
    from trainers.reinforcement.stage import refine_scorer  # Lightning is imported only by the training verbs

    refine_scorer(request(args))
    return 0
