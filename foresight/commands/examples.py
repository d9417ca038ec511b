"""Make the supervised stage's training examples (the example cache) from labelled traces (ForesightKV §3.2).

Each labelled trace is replayed through the model that made it, its cache following the golden
schedule, and the scorer's inputs of every eviction step (keys, values, attention features) are
stored with the candidates' future scores α: one safetensors file per trace in --out, beside a
examples.json naming the key (model, dtype, B, L, feature set, storage dtype). A folder made with
another key is refused; a rerun skips finished traces and replaces damaged files. `foresight fit`
runs this step itself; make the labels first with `foresight labels`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from foresight.commands._model import add_model_arguments, model_of_traces, model_options
from foresight.commands._policy import REQUIRED, add_cadence_arguments, add_regime_argument
from foresight.data.trace_store import TraceStore
from foresight.labels import LabelKind
from foresight.models import dtype_name
from foresight.scorer.attention_features import FeatureSet
from trainers.data_stage import FrozenModel
from trainers.example_cache import ExampleCache, ExampleKey
from trainers.preparation import make_examples


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", type=Path, required=True, help="labelled traces folder (`foresight labels`)")
    add_cadence_arguments(parser, budget=REQUIRED, interval=REQUIRED)
    parser.add_argument(
        "--out", type=Path, required=True, help="the cache folder (examples.json and one file per trace)"
    )
    parser.add_argument(
        "--feature-set",
        default=FeatureSet.PAPER.value,
        choices=[member.value for member in FeatureSet],
        help="the scorer's attention features",
    )
    parser.add_argument("--storage-dtype", default="float16", help="dtype of the stored keys, values and features")
    parser.add_argument(
        "--label-kind",
        default=LabelKind.ALPHA.value,
        choices=[member.value for member in LabelKind],
        help="the labels the targets come from (`foresight labels --label-kind`); part of the cache's key",
    )
    add_regime_argument(parser)
    add_model_arguments(parser, made_traces=True)
    parser.add_argument("--replay-batch-size", type=int, default=4, help="traces replayed together")


def run(args: argparse.Namespace) -> int:
    model = model_of_traces(args, args.traces, TraceStore(args.traces).settings["model"])
    frozen = FrozenModel(model, **model_options(args))
    key = ExampleKey(
        model,
        dtype_name(frozen.dtype),
        args.budget,
        args.interval,
        args.feature_set,
        args.storage_dtype,
        label_kind=args.label_kind,
        regime=args.regime.value,
    )
    summary = make_examples(frozen, ExampleCache(args.out, args.traces, key), replay_batch_size=args.replay_batch_size)
    print(summary.describe())
    return 0
