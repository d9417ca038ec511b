"""Export a trained scorer as a Hugging Face Hub folder (config.json, model.safetensors, README.md model card).

--scorer is a scorer folder (`foresight fit` OUT/scorer), a Hub id, or a Lightning checkpoint of the
supervised stage (e.g. RUN/checkpoints/last.ckpt); given several times, the exported scorer is the mean of their keep scores
(`foresight.scorer.ensemble`: e.g. fits of one recipe under other seeds). --evaluation adds a markdown file (e.g. the table of `foresight eval`) to the card.
--sums-dtype writes the dtype the learned policy holds its bounded sums at by default (a 16-bit one
where the state gate passed it). --push-to-hub uploads the folder through huggingface_hub; without a token or a network it stops
with a one-line error and the folder stays complete.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from foresight.commands._policy import add_scorer_argument, refuse_old_spelling
from foresight.eval.specs import split_scorer
from foresight.scorer.ensemble import ensemble
from foresight.scorer.model import ForesightScorer
from trainers.export import ensemble_record, export_scorer, push_folder, read_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scorer_argument(
        parser,
        required=True,
        what="here also a supervised-stage .ckpt file; repeated: export the mean of their keep scores",
    )
    refuse_old_spelling(parser, "--checkpoint", "--scorer")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    parser.add_argument(
        "--evaluation", type=Path, default=None, help="markdown file with an evaluation table for the card"
    )
    parser.add_argument(
        "--sums-dtype",
        default=None,
        help="the dtype the learned policy holds the scorer's bounded sums at unless told otherwise, written in its "
        "config (float32, float16, bfloat16; gate a 16-bit one first: scripts/state_gate.py) (default: the scorer's)",
    )
    parser.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="upload the folder to this Hub repo")
    parser.add_argument("--private", action="store_true", help="create the Hub repo as private")


def run(args: argparse.Namespace) -> int:
    if args.evaluation is not None and not args.evaluation.is_file():
        raise ValueError(f"--evaluation {args.evaluation} does not exist")
    members = [read_checkpoint(split_scorer(text)[1]) for text in args.scorer]
    if len(members) == 1:
        scorer, training = members[0]
    else:
        scorer, training = (
            ensemble([member for member, _ in members]),
            ensemble_record([record for _, record in members]),
        )
    if args.sums_dtype is not None:
        scorer = _restated(scorer, sums_dtype=args.sums_dtype)
    evaluation = args.evaluation.read_text() if args.evaluation is not None else None
    folder = export_scorer(scorer, args.out, training=training, evaluation=evaluation)
    config = scorer.config
    summary = f"{folder}: scorer for {config.base_model} (B={config.budget}, L={config.interval}, {config.feature_set.value} features)"
    if args.push_to_hub:
        url = push_folder(folder, args.push_to_hub, private=args.private)
        summary += f", pushed to {url}"
    print(summary)
    return 0


def _restated(scorer: ForesightScorer, **changes) -> ForesightScorer:
    """The scorer with its config changed, its weights the same (the config a folder saves is the one the scorer
    was made with)."""
    restated = ForesightScorer(dataclasses.replace(scorer.config, **changes))
    restated.load_state_dict(scorer.state_dict())
    return restated.eval()
