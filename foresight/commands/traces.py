"""Generate reasoning traces with the frozen model and the full cache, or import traces made elsewhere.

Each trace keeps its token ids, the full-cache per-token loss and entropy (what eviction is later
measured against), its prompt source and whether its final answer is correct. Traces go to sharded
`datasets` Arrow folders plus a manifest.json in --out; a rerun resumes, skipping finished shards (a complete folder
loads no model).

--prompts SOURCE samples: reasoning-gym:TASK, a JSONL file of {"prompt", "answer"}, a saved
`datasets` folder, or a weighted mixture of them, e.g. reasoning-gym:chain_sum=2,data/arithmetic.jsonl=1
(data/README.md). Problems decode together by continuous batching, --batch-size rows at a time.

--import FILE scores prompt/completion pairs made by another engine (vLLM, SGLang; JSONL or a
`datasets` folder, docs/traces.md), as text or as the engine's token ids, with one teacher-forced pass of
--model; rows that cannot be traces are counted with their reason, never dropped silently, and the
engine's log-probabilities, where given, are compared with the pass's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from foresight.commands._model import add_model_arguments, model_options
from foresight.commands._sampling import add_sampling_arguments
from foresight.data.engine_logprobs import DEFAULT_TOLERANCE
from foresight.data.trace_import import import_traces
from foresight.models import load_model
from foresight.runtime.sampling import Draws
from trainers.data_stage import FrozenModel, TraceRecipe, make_traces

AUTO = "auto"


def _shard_spec(text: str) -> tuple[int, int]:
    """Parse "i/n" (this process writes shards k with k % n == i)."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected i/n such as 0/2, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"expected i/n with 0 <= i < n, got {text!r}")
    return index, count


def _batch_size(text: str) -> int | None:
    """argparse type of --batch-size: a positive count, or auto (None)."""
    if text == AUTO:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of rows or 'auto', got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--prompts",
        metavar="SOURCE",
        help="reasoning-gym:TASK, a JSONL file, a dataset folder, or a mixture SOURCE=WEIGHT,SOURCE=WEIGHT,...",
    )
    what.add_argument(
        "--import",
        dest="import_file",
        type=Path,
        metavar="FILE",
        help="prompt/completion pairs (text or token ids) made by another engine (JSONL or a dataset folder) "
        "to score with --model",
    )
    parser.add_argument(
        "--num",
        type=int,
        default=None,
        help="number of problems (one trace each); with --import, rows to take (default: all)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="most tokens generated per trace (with --prompts)"
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder (shards and manifest.json)")
    parser.add_argument(
        "--min-tokens", type=int, default=0, help="keep traces of at least this many tokens, prompt included"
    )
    parser.add_argument("--only-correct", action="store_true", help="keep only traces whose answer checks as correct")
    add_sampling_arguments(parser)
    parser.add_argument(
        "--batch-size",
        type=_batch_size,
        default=AUTO,
        help="problems decoded together (continuous batching); auto: as many as GPU memory holds (at most 256), "
        "16 on a CPU",
    )
    parser.add_argument(
        "--draws",
        choices=[*(member.value for member in Draws), AUTO],
        default=AUTO,
        help="each problem's random numbers: its own torch generator (one draw per row and step; the traces "
        "sampled before counter existed), or a counter-based hash batched over the rows; auto: generator on "
        "a CPU, counter on an accelerator; greedy decoding (temperature 0) draws nothing",
    )
    parser.add_argument("--shard-size", type=int, default=64, help="problems per stored shard (the unit of resuming)")
    parser.add_argument(
        "--shard", type=_shard_spec, default="0/1", metavar="i/n", help="write only shards k with k %% n == i"
    )
    parser.add_argument(
        "--logprob-tolerance",
        type=float,
        default=None,
        help="with --import: flag a trace whose completion_logprobs differ from --model's pass by more than this "
        f"many nats on average (default {DEFAULT_TOLERANCE})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="picks reasoning-gym problems and, with each problem's index, seeds its sampling",
    )


def run(args: argparse.Namespace) -> int:
    if args.import_file is not None:
        if args.max_new_tokens is not None:
            raise ValueError("--max-new-tokens applies to sampling (--prompts), not to imported completions")
        tolerance = DEFAULT_TOLERANCE if args.logprob_tolerance is None else args.logprob_tolerance
        if tolerance < 0:
            raise ValueError(f"--logprob-tolerance must be >= 0 nats, got {tolerance}")
        model, tokenizer = load_model(args.model, **model_options(args))
        summary = import_traces(
            model,
            tokenizer,
            args.import_file,
            num=args.num,
            out_dir=args.out,
            min_tokens=args.min_tokens,
            only_correct=args.only_correct,
            shard_size=args.shard_size,
            shard=args.shard,
            model_name=args.model,
            logprob_tolerance=tolerance,
        )
        print(summary.describe())
        return 0
    if args.logprob_tolerance is not None:
        raise ValueError("--logprob-tolerance applies to imported traces (--import), not to sampling")
    if args.num is None or args.max_new_tokens is None:
        raise ValueError("--prompts needs --num and --max-new-tokens")
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
        draws=None if args.draws == AUTO else args.draws,
    )
    print(make_traces(FrozenModel(args.model, **model_options(args)), recipe, args.out, shard=args.shard).describe())
    return 0
