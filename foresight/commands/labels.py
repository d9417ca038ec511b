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
from foresight.commands._model import add_model_arguments, model_of_traces, model_options
from foresight.commands._policy import add_cadence_arguments
from foresight.labels import LabelStore, compute_golden_labels, save_labels
from foresight.models import load_model
from foresight.traces import TraceStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", type=Path, required=True, help="traces folder written by `foresight traces`")
    add_cadence_arguments(parser, budget=None, interval=None)
    add_model_arguments(parser, made_traces=True)
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per forward chunk (bounds working memory)")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    store = LabelStore(args.traces, args.budget, args.interval)
    traces = TraceStore(args.traces)
    made_with = model_of_traces(args, args.traces, traces.settings["model"])
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
        model, _ = load_model(made_with, **model_options(args))
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
