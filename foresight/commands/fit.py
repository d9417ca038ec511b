"""Train a scorer with the supervised stage (ForesightKV §3.2) and leave it as a Hub-format folder; a shell
over `trainers.fit`, which Python callers use directly (docs/training.md).

Runs the steps that make the data, then the LightningCLI of `trainers.cli`, on a YAML config
(configs/default.yaml for the embedded default on CPU). Each step is the function of its verb,
prints one line, and skips what is already made, so a rerun resumes: traces (sampled from the
config's `traces` recipe unless --traces names an existing folder, like `foresight traces`), their
golden labels (`foresight labels`), the example cache (`foresight examples`; skipped when
data.examples_dir is null, which replays the traces on every pass), then training. Everything goes
under --out: traces/ and its labels, examples/ (unless the config replays), checkpoints/ (last.ckpt;
resume with --ckpt-path last), lightning_logs/ (TensorBoard) and scorer/ (config.json,
model.safetensors, README.md).

--on-policy-rounds R adds R rounds after that golden fit (docs/algorithms.md §6): round r replays the
training traces under round r-1's scorer, labels the states its own evictions reach with their future
scores, adds them to the golden examples and all earlier rounds' and refits from round r-1's weights.
Round 0 trains in --out as above; round r in --out/round-r (examples/, checkpoints/, lightning_logs/);
each round's scorer is --out/round-r/scorer and the last one is also --out/scorer. A rerun skips the
rounds whose scorer exists and, with --ckpt-path last, resumes the others.

--ensemble N (or the config's `ensemble: {members: N}`) fits the recipe N times instead, member i in
--out/member-i (checkpoints/, lightning_logs/, scorer/) with seed_everything + i, on the same traces and
examples, and writes the mean of their keep scores to --out/scorer as one wider scorer
(`foresight.scorer.ensemble`): fits that differ only in their seed rank entries differently, and their
mean averages that out. With on-policy rounds, each member runs its own in member-i/round-r. A rerun skips the members whose scorer exists. Under a DDP strategy (--set trainer.strategy=ddp --set
trainer.devices=N) every process runs this command; the steps run under a file lock in --out, so one
process makes the data and the others find it made.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from foresight.commands._policy import add_regime_argument
from foresight.commands._training import add_training_arguments
from foresight.labels import LabelKind
from trainers.fitting import FitRequest
from trainers.preparation import OnPolicyRounds, SeedEnsemble


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_arguments(
        parser, "configs/default.yaml", "--set trainer.max_steps=50 --set data.device=cuda --set data.dtype=bfloat16"
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="run folder (traces, examples, checkpoints, logs, scorer)"
    )
    parser.add_argument(
        "--traces",
        type=Path,
        default=None,
        help="use this existing traces folder (labels are made in it if missing) instead of generating traces",
    )
    add_regime_argument(parser, default=None, config_key="data.regime")
    parser.add_argument(
        "--label-kind",
        type=LabelKind.parse,
        default=None,
        help="the labels the targets come from (`foresight labels --label-kind`) (default: the config's "
        "data.label_kind, else alpha)",
    )
    parser.add_argument(
        "--on-policy-rounds",
        type=_checked_by(OnPolicyRounds, "rounds"),
        default=None,
        metavar="R",
        help="after the golden fit, R rounds that add the scorer's own states to its training examples "
        "(default: the config's on_policy.rounds, else 0)",
    )
    parser.add_argument(
        "--round-steps",
        type=_checked_by(OnPolicyRounds, "steps"),
        default=None,
        metavar="N",
        help="optimisation steps of each on-policy round (default: the config's on_policy.steps, else trainer.max_steps)",
    )
    parser.add_argument(
        "--ensemble",
        type=_checked_by(SeedEnsemble, "members"),
        default=None,
        metavar="N",
        help="fit N times under seeds seed_everything, +1, ... and average the fits' keep scores into one scorer "
        "(default: the config's ensemble.members, else 1)",
    )


def _checked_by(settings: type, name: str):
    """An argparse type checked by the `settings` dataclass itself (one rule for the flag and the config
    section), so a bad value stops before any trace is sampled."""

    def parse(text: str) -> int:
        try:
            return getattr(settings(**{name: int(text)}), name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def request(args: argparse.Namespace) -> FitRequest:
    """The fit the parsed command line asks for."""
    return FitRequest(**{setting.name: getattr(args, setting.name) for setting in fields(FitRequest)})


def run(args: argparse.Namespace) -> int:
    from trainers.fitting import fit_scorer  # Lightning is imported only by this verb

    fit_scorer(request(args))
    return 0
