"""The generation mode of `foresight eval` (--prompts): sampled completions of problems with checkable
answers under every policy and budget, scored against their answers and the full cache
(foresight.eval.generation)."""

from __future__ import annotations

import argparse
import logging
import time

from foresight.commands._model import model_options
from foresight.commands._sampling import add_sampling_arguments
from foresight.data.benchmarks import BENCHMARKS
from foresight.data.tasks import load_problems
from foresight.eval.generation import (
    CompletionStore,
    GenerationSettings,
    by_agreement,
    columns,
    generate_completions,
    plan_jobs,
    source_columns,
    summarize,
    summarize_sources,
    write_generation_report,
)
from foresight.eval.report import markdown_table
from foresight.models import DEFAULT_MODEL, load_model

log = logging.getLogger(__name__)

DEFAULT_BATCH = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompts",
        action="append",
        default=[],
        metavar="SOURCE",
        help=f"generate instead of replaying traces: problems from a named set ({', '.join(BENCHMARKS)}; NAME:PATH "
        "reads a local copy), reasoning-gym:TASK, a JSONL file or a saved dataset folder "
        "(foresight.data.tasks); repeat to pool several sources. --model then defaults to the embedded one",
    )
    parser.add_argument("--num", type=int, default=20, help="problems per source")
    parser.add_argument("--problem-seed", type=int, default=0, help="seed that picks the reasoning-gym problems")
    parser.add_argument("--samples", "-k", type=int, default=4, help="completions sampled per problem (k)")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="most tokens generated per completion")
    add_sampling_arguments(parser)
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the sampling (each completion's own is derived from it)"
    )


def run(args: argparse.Namespace, specs, notes: list[str]) -> int:
    started = time.perf_counter()
    model_name = args.model or DEFAULT_MODEL
    settings = GenerationSettings(
        model=model_name,
        sources=tuple(args.prompts),
        problems=args.num,
        problem_seed=args.problem_seed,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    problems = [p for source in args.prompts for p in load_problems(source, args.num, args.problem_seed)]
    unanswered = next((p for p in problems if p.answer is None), None)
    if unanswered is not None:
        raise ValueError(f"problem {unanswered.index} of {unanswered.source} has no answer to check accuracy against")
    plans, skipped = plan_jobs(specs, args.budgets, args.interval)
    notes = notes + skipped
    store = CompletionStore(args.out / "completions", settings)
    model, tokenizer = load_model(model_name, **model_options(args))
    made = generate_completions(model, tokenizer, problems, plans, store, batch_size=args.batch_size or DEFAULT_BATCH)
    rows, source_rows = summarize(problems, plans, store), summarize_sources(problems, store)
    report_settings = {
        "model": model_name,
        "sources": ", ".join(args.prompts),
        "problems": len(problems),
        "samples per problem": args.samples,
        "sampling": f"T = {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, seed {args.seed}",
        "max new tokens": args.max_new_tokens,
        "budgets": ", ".join(map(str, args.budgets)),
        "interval": args.interval,
        "intervals": "95% bootstrap over problems",
    }
    paths = write_generation_report(rows, source_rows, args.out, report_settings, notes, args.samples)
    for note in notes:
        log.info("note: %s", note)
    print(markdown_table(by_agreement(rows), columns(args.samples)))
    print()
    print(markdown_table(source_rows, source_columns(args.samples)))
    print(
        f"generated {made} completions ({len(problems)} problems x {args.samples} samples x {sum(len(p.jobs) - 1 for p in plans) + 1} "
        f"runs, the rest found on disk) in {time.perf_counter() - started:.1f} s; results written to {args.out} "
        f"({', '.join(p.name for p in paths)})"
    )
    return 0
