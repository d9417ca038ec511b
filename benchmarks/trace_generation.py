"""Trace generation throughput: batch-1 decode against static and continuous batching, one run.

Every mode samples the same problems with the same per-problem seeds (`foresight.sampler`), so each
produces the same completions (checked) and the ratios compare equal work:

- batch 1: one problem at a time;
- static b: problems in consecutive groups of b, each group decoding until its longest row ends
  (the rows that ended wait);
- continuous b: b rows at a time, a row that ends replaced by the next problem at once.

Optionally (--hf) `transformers`' `model.generate` on left-padded groups of each b (static batching,
its own sampling, so other completions): the way traces were sampled before continuous batching.
Tokens/s counts completion tokens (EOS included) over wall time, prompt prefill included. The load
average of the machine (/proc/loadavg) is recorded before and after.

    python benchmarks/trace_generation.py                       # default model, CPU, b = 4, 8, 16
    python benchmarks/trace_generation.py --device cuda --batch-sizes 32,128,256 --num 512
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

from foresight.models import load_model
from foresight.report import write_section
from foresight.runtime.engine import SamplingConfig
from foresight.sampler import Request, sample_completions
from foresight.tasks import chat_prompt_ids, load_problems
from foresight.traces import eos_token_ids, problem_seed

REPORT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
SOURCES = "reasoning-gym:gsm_symbolic,reasoning-gym:chain_sum,reasoning-gym:leg_counting,reasoning-gym:lcm"
SAMPLING = SamplingConfig(temperature=0.6, top_k=20, top_p=0.95)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", default=SOURCES, help="prompt SOURCE (a mixture, so completion lengths vary)")
    parser.add_argument("--num", type=int, default=32, help="problems sampled by every mode")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", default="4,8,16", help="comma-separated b of the static and continuous modes")
    parser.add_argument("--hf", action="store_true", help="also time transformers' generate in static groups of b")
    parser.add_argument("--out", type=Path, default=REPORT)
    parser.add_argument("--section", default=None, help="report section (default: trace-generation-DEVICE)")
    return parser.parse_args()


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def timed(run) -> tuple[list, float]:
    started = time.perf_counter()
    result = run()
    return result, time.perf_counter() - started


def ours(model, requests: list[Request], batch_size: int, static: bool, max_new_tokens: int, eos: list[int]) -> dict[int, list[int]]:
    """Completions by key, sampled continuously (or in static groups of `batch_size`)."""
    groups = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)] if static else [requests]
    done = {}
    for group in groups:
        for completion in sample_completions(
            model, group, max_new_tokens=max_new_tokens, eos_token_ids=eos, sampling=SAMPLING, batch_size=batch_size
        ):
            done[completion.key] = completion.tokens
    return done


def hf_generate(model, requests: list[Request], batch_size: int, max_new_tokens: int, eos: list[int], pad: int) -> dict[int, list[int]]:
    """Completions by `model.generate` on left-padded groups (its sampling, so other completions)."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=True, temperature=SAMPLING.temperature, top_k=SAMPLING.top_k,
        top_p=SAMPLING.top_p, eos_token_id=eos, pad_token_id=pad,
    )
    done = {}
    torch.manual_seed(0)
    for start in range(0, len(requests), batch_size):
        group = requests[start : start + batch_size]
        width = max(len(r.prompt) for r in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(group):
            ids[row, width - len(request.prompt) :] = torch.tensor(request.prompt)
            mask[row, width - len(request.prompt) :] = 1
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config)
        for request, row in zip(group, out[:, width:].tolist()):
            stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            done[request.key] = row[:stop]
    return done


def main() -> None:
    args = arguments()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    model, tokenizer = load_model(args.model, device=args.device)
    eos = eos_token_ids(model, tokenizer, args.model)
    problems = load_problems(args.prompts, args.num, seed=0)
    requests = [Request(p.index, chat_prompt_ids(tokenizer, p.prompt), problem_seed(0, p.index)) for p in problems]
    before = load_average()
    runs = [("batch 1", 1, lambda: ours(model, requests, 1, False, args.max_new_tokens, eos))]
    for b in batch_sizes:
        runs.append((f"static {b}", b, lambda b=b: ours(model, requests, b, True, args.max_new_tokens, eos)))
        runs.append((f"continuous {b}", b, lambda b=b: ours(model, requests, b, False, args.max_new_tokens, eos)))
    if args.hf:
        runs += [(f"transformers generate, static {b}", b, lambda b=b: hf_generate(
            model, requests, b, args.max_new_tokens, eos, tokenizer.pad_token_id or eos[0])) for b in batch_sizes]
    results = []
    for name, batch, run in runs:
        completions, seconds = timed(run)
        tokens = sum(map(len, completions.values()))
        results.append((name, batch, completions, tokens, seconds))
        print(f"{name}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.1f} tokens/s", file=sys.stderr, flush=True)
    after = load_average()
    reference = results[0]
    same = all(r[2] == reference[2] for r in results if not r[0].startswith("transformers"))
    lengths = sorted(map(len, reference[2].values()))
    command = "python benchmarks/trace_generation.py " + shlex.join(sys.argv[1:])
    lines = [
        f"### Trace generation throughput ({args.device})",
        "",
        f"Command: `{command}`",
        "",
        f"Model {args.model}, {model.dtype}, {torch.get_num_threads()} torch threads, {platform.machine()}; "
        f"{args.num} problems of `{args.prompts}`, at most {args.max_new_tokens} new tokens, T = 0.6, top-k 20, "
        f"top-p 0.95. Completion lengths {lengths[0]} / {lengths[len(lengths) // 2]} / {lengths[-1]} (min / median / "
        f"max). Load average (1, 5, 15 min) before {before}, after {after}. Every mode of `foresight.sampler` "
        f"produced {'the same' if same else 'DIFFERENT'} completions.",
        "",
        "| mode | rows | tokens | seconds | tokens/s | × batch 1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = reference[3] / reference[4]
    for name, batch, _, tokens, seconds in results:
        rate = tokens / seconds
        lines.append(f"| {name} | {batch} | {tokens} | {seconds:.1f} | {rate:.1f} | {rate / base:.2f} |")
    write_section(args.out, args.section or f"trace-generation-{args.device.split(':')[0]}", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
