"""Calibrate TriAttention's query statistics on a traces folder (the `triattention` policy's -o stats=DIR).

Traces are teacher-forced, in order, through the model that made them (full cache, in chunks) until
--max-tokens tokens are seen (whole traces; the authors calibrate on about 32K-100K tokens of any text).
The post-RoPE queries of every layer are rotated back to their pre-RoPE form and averaged per (layer,
query head, RoPE band): the mean query E[q_f] and mean modulus E|q_f|. --out gets config.json and
model.safetensors, recording the model and its shape; the policy refuses stats made for another model.
A rerun replaces the folder's files.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from foresight.commands._model import add_model_arguments, model_of_traces, model_options
from foresight.data.trace_store import TraceStore
from foresight.models import load_model
from foresight.policies.triattention_stats import calibrate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", type=Path, required=True, help="traces folder written by `foresight traces`")
    parser.add_argument(
        "--out", type=Path, required=True, help="stats folder to write (config.json, model.safetensors)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=100_000, help="stop after the trace that brings the count to this many tokens"
    )
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per forward chunk (bounds working memory)")
    add_model_arguments(parser, made_traces=True)


def _sequences(store: TraceStore, max_tokens: int, bar: tqdm) -> Iterator[torch.Tensor]:
    """The store's token ids in order, until `max_tokens` tokens have been handed out."""
    seen = 0
    for trace in store:
        if seen >= max_tokens:
            return
        seen += trace.input_ids.numel()
        bar.update(trace.input_ids.numel())
        yield trace.input_ids


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1 or args.chunk_size < 1:
        raise ValueError(f"--max-tokens ({args.max_tokens}) and --chunk-size ({args.chunk_size}) must be at least 1")
    store = TraceStore(args.traces)
    name = model_of_traces(args, args.traces, store.settings["model"])
    model, _ = load_model(name, **model_options(args))
    with tqdm(total=args.max_tokens, unit="tok", desc="calibrate") as bar:
        stats = calibrate(
            model,
            _sequences(store, args.max_tokens, bar),
            model_name=name,
            source=str(args.traces),
            chunk_size=args.chunk_size,
        )
    stats.save(args.out)
    print(f"{args.out}: TriAttention stats of {name} ({stats.shape}) from {stats.tokens} tokens of {args.traces}")
    return 0
