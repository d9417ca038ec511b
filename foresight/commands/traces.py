"""Generate reasoning traces with the frozen model and the full cache, and store them.

Each trace keeps its token ids, the full-cache per-token loss and entropy (what eviction is later
measured against) and whether its final answer is correct. Traces go to sharded `datasets` Arrow
folders plus a manifest.json in --out; a rerun resumes, skipping finished shards (a complete folder
loads no model). Prompt sources:
reasoning-gym:TASK, a JSONL file of {"prompt", "answer"}, or a saved `datasets` folder (data/README.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from foresight.commands._model import add_model_arguments, model_options
from foresight.pipeline import FrozenModel, TraceRecipe, make_traces


def _shard_spec(text: str) -> tuple[int, int]:
    """Parse "i/n" (this process writes shards k with k % n == i)."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected i/n such as 0/2, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"expected i/n with 0 <= i < n, got {text!r}")
    return index, count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--prompts", required=True, metavar="SOURCE", help="reasoning-gym:TASK, a JSONL file or a dataset folder"
    )
    parser.add_argument("--num", type=int, required=True, help="number of problems (one trace each)")
    parser.add_argument("--max-new-tokens", type=int, required=True, help="most tokens generated per trace")
    parser.add_argument("--out", type=Path, required=True, help="output folder (shards and manifest.json)")
    parser.add_argument(
        "--min-tokens", type=int, default=0, help="keep traces of at least this many tokens, prompt included"
    )
    parser.add_argument("--only-correct", action="store_true", help="keep only traces whose answer checks as correct")
    parser.add_argument("--temperature", type=float, default=0.6, help="sampling temperature; 0 is greedy")
    parser.add_argument("--top-k", type=int, default=20, help="sample from the k most likely tokens; 0 disables")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts generated together (left-padded)")
    parser.add_argument("--shard-size", type=int, default=64, help="problems per stored shard (the unit of resuming)")
    parser.add_argument(
        "--shard", type=_shard_spec, default="0/1", metavar="i/n", help="write only shards k with k %% n == i"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="picks reasoning-gym problems and seeds each shard's sampling"
    )


def run(args: argparse.Namespace) -> int:
    recipe = TraceRecipe(
        prompts=args.prompts,
        num=args.num,
        max_new_tokens=args.max_new_tokens,
        min_tokens=args.min_tokens,
        only_correct=args.only_correct,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        seed=args.seed,
    )
    print(make_traces(FrozenModel(args.model, **model_options(args)), recipe, args.out, shard=args.shard).describe())
    return 0
