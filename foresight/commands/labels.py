"""Make Golden Eviction labels for a traces folder (ForesightKV §3.2).

Each trace is teacher-forced once through the model that made it, with the full cache; per eviction
step and (layer, KV head) the labels hold the B candidates of the golden schedule and their future
score α. They go to TRACES/labels-B{B}-L{L}/trace-{index:06d}.safetensors; a rerun skips traces
already labelled, and traces shorter than B + L (no eviction step) are skipped and counted.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from foresight.cadence import TraceTooShort, eviction_steps
from foresight.labels import LabelStore, compute_golden_labels, save_labels
from foresight.models import load_model
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
    started = time.perf_counter()
    store = LabelStore(args.traces, args.budget, args.interval)
    traces = TraceStore(args.traces)
    made_with = traces.settings["model"]
    if args.model is not None and args.model != made_with:
        raise ValueError(f"--model {args.model!r} is not the model that made the traces in {args.traces} ({made_with!r})")
    todo, too_short, done = [], 0, 0
    for trace in traces:
        try:
            eviction_steps(trace.input_ids.numel(), args.budget, args.interval)
        except TraceTooShort:
            too_short += 1
            continue
        if trace.index in store:
            done += 1
        else:
            todo.append(trace)
    if todo:
        model, _ = load_model(made_with, device=args.device)
        for trace in tqdm(todo, desc="labels", unit="trace"):
            labels = compute_golden_labels(
                model, trace.input_ids, args.budget, args.interval,
                trace_index=trace.index, model_name=made_with, chunk_size=args.chunk_size,
            )
            save_labels(labels, store.path(trace.index))
    print(
        f"{store.directory}: labelled {len(todo)} traces, skipped {too_short} too short "
        f"(< B + L = {args.budget + args.interval} tokens), {done} already labelled; "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0
