"""Make Golden Eviction labels for a traces folder (ForesightKV §3.2).

Each trace is teacher-forced once through the model that made it, with the full cache; per eviction
step and (layer, KV head) the labels hold the B candidates of the golden schedule and their future
score α. They go to TRACES/labels-B{B}-L{L}/trace-{index:06d}.safetensors; a rerun skips traces
already labelled and replaces damaged files (one that does not open, or was made for another trace),
and traces shorter than B + L (no eviction step) are skipped and counted.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from foresight.pipeline import FrozenModel, make_labels
from foresight.traces import TraceStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", type=Path, required=True, help="traces folder written by `foresight traces`")
    parser.add_argument("--budget", "-B", type=int, required=True, help="entries kept after an eviction (B)")
    parser.add_argument("--interval", "-L", type=int, required=True, help="entries evicted per step, every L tokens")
    parser.add_argument(
        "--model", default=None,
        help="the model that made the traces (default: the one named in the traces manifest; another is refused)",
    )
    parser.add_argument("--device", default="cpu", help="torch device of the forward pass, e.g. cuda")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per forward chunk (bounds working memory)")


def run(args: argparse.Namespace) -> int:
    made_with = TraceStore(args.traces).settings["model"]
    if args.model is not None and args.model != made_with:
        raise ValueError(f"--model {args.model!r} is not the model that made the traces in {args.traces} ({made_with!r})")
    frozen = FrozenModel(made_with, device=args.device)
    print(make_labels(frozen, args.traces, args.budget, args.interval, chunk_size=args.chunk_size).describe())
    return 0
