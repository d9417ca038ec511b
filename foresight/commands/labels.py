"""Make Golden Eviction labels for a traces folder (ForesightKV §3.2).

Each trace is teacher-forced once through the model that made it, with the full cache; per eviction
step and (layer, KV head) the labels hold the B candidates of the golden schedule and their future
score α (`--label-kind`: another label kind's score, into TRACES/labels-B{B}-L{L}-{kind}/). They go to
TRACES/labels-B{B}-L{L}/trace-{index:06d}.safetensors; a rerun skips traces
already labelled and replaces damaged files (one that does not open, or was made for another trace),
and traces shorter than B + L (no eviction step) are skipped and counted.

Scaling out: start N processes on one folder, or `torchrun --nproc-per-node N --no-python foresight labels ...`
(each rank on its own GPU with --device cuda). They share the traces by per-trace claims (a lock file per trace,
dropped by the kernel when its process dies, so a killed process's trace is taken over); each trace is labelled
once, and each process returns when the folder is complete, its files those one process would write.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from foresight.commands._model import add_model_arguments, model_of_traces, model_options
from foresight.commands._policy import REQUIRED, add_cadence_arguments, add_regime_argument, refuse_old_spelling
from foresight.data.trace_store import TraceStore
from foresight.labels import LabelKind
from trainers.data_stage import FrozenModel, make_labels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", type=Path, required=True, help="traces folder written by `foresight traces`")
    add_cadence_arguments(parser, budget=REQUIRED, interval=REQUIRED)
    add_model_arguments(parser, made_traces=True)
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per forward chunk (bounds working memory)")
    parser.add_argument(
        "--label-kind",
        dest="kind",
        type=LabelKind.parse,
        default=LabelKind.ALPHA.value,
        help="label kind: alpha (Eq. 5), value, gradient, gradient-magnitude or removal (docs/algorithms.md §4); "
        "in the folder's name",
    )
    parser.add_argument(
        "--per-source",
        type=int,
        default=None,
        metavar="N",
        help="label only the first N traces (by index) of each prompt source (default: all of them)",
    )
    add_regime_argument(parser)
    refuse_old_spelling(parser, "--kind", "--label-kind")


def run(args: argparse.Namespace) -> int:
    made_with = model_of_traces(args, args.traces, TraceStore(args.traces).settings["model"])
    frozen = FrozenModel(made_with, **rank_placement(model_options(args)))
    print(
        make_labels(
            frozen,
            args.traces,
            args.budget,
            args.interval,
            chunk_size=args.chunk_size,
            kind=args.kind,
            regime=args.regime,
            per_source=args.per_source,
        ).describe()
    )
    return 0


def rank_placement(options: dict) -> dict:
    """Under torchrun (LOCAL_RANK set), --device cuda is this rank's own GPU, cuda:LOCAL_RANK."""
    rank = os.environ.get("LOCAL_RANK")
    return {**options, "device": f"cuda:{rank}"} if options["device"] == "cuda" and rank is not None else options
