"""A short tour on the embedded default model (the main job is `scripts/main.sh`): a generation with eviction,
then a teacher-forced comparison of every heuristic policy on that generation, both at -B and -L.

The prompt is that of the first shipped reasoning trace (data/corpus/gsm-main), a grade-school problem the
default model reasons about for a few hundred tokens, so the generation evicts at B = 128, L = 32."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

from foresight.bench.common import selected_policies
from foresight.commands._model import add_model_arguments, model_options
from foresight.commands._policy import add_policy_arguments, policy_from_args, refuse_old_spelling
from foresight.commands.replay import loss_ratio_after_first_eviction
from foresight.data.trace_store import TraceStore
from foresight.models import load_model
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine

TRACES = Path(__file__).resolve().parents[2] / "data" / "corpus" / "gsm-main"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_policy_arguments(parser)  # the generation's; the comparison replays every heuristic at the same -B and -L
    parser.add_argument("--max-new-tokens", type=int, default=384, help="most tokens generated")
    refuse_old_spelling(parser, "--replay-budget", "-B/--budget (the generation's and the comparison's)")
    refuse_old_spelling(parser, "--replay-interval", "-L/--interval (the generation's and the comparison's)")


def run(args: argparse.Namespace) -> int:
    policy, config = policy_from_args(args)
    model, tokenizer = load_model(args.model, **model_options(args))
    first = next(iter(TraceStore(TRACES)))
    prompt = first.input_ids[: first.prompt_length].tolist()
    engine = EvictionEngine(model, policy, config)
    with tqdm(total=args.max_new_tokens, desc=f"generate ({policy.name})", unit="tok") as bar:
        output = engine.generate(
            [prompt], args.max_new_tokens, eos_token_id=tokenizer.eos_token_id, on_token=lambda n: bar.update(n - bar.n)
        )
    print(tokenizer.decode(output.tokens[0], skip_special_tokens=True))
    stats = output.stats
    print(
        f"\n{len(output.tokens[0])} tokens, largest cache held {stats.max_entries} entries "
        f"(B + L = {args.budget + args.interval}), {stats.evictions} eviction steps\n"
    )

    sequence = torch.tensor(prompt + output.tokens[0])
    if len(sequence) <= args.budget + args.interval:
        raise ValueError(
            f"the generation holds {len(sequence)} tokens, not more than B + L = {args.budget + args.interval}: no policy "
            "evicts; raise --max-new-tokens or lower -B/-L"
        )
    comparison = EvictionConfig(args.budget, args.interval)
    full = EvictionEngine(model, make_policy("full")).replay([sequence], [len(prompt)])
    rows = []
    for name in tqdm(selected_policies("all", learned=False)[1:], desc="replay policies"):
        evicted = EvictionEngine(model, make_policy(name), comparison).replay([sequence], [len(prompt)])
        ratio, scored = loss_ratio_after_first_eviction(full, evicted)
        rows.append((name, ratio, scored))
    print(
        f"Teacher-forced loss ratio on that generation, B = {comparison.budget}, L = {comparison.interval} (1.0 = full cache):"
    )
    for name, ratio, scored in sorted(rows, key=lambda row: row[1]):
        print(f"  {name:<10} {ratio:.4f}  ({scored} tokens)")
    best = min(rows, key=lambda row: row[1])
    print(f"best heuristic at B = {comparison.budget}: {best[0]} (loss ratio {best[1]:.4f})")
    return 0
