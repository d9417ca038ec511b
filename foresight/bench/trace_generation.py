"""Trace generation throughput: batch-1 decode against static and continuous batching, one run.

Every mode samples the same problems with the same per-problem seeds (`foresight.data.sampler`), so each
produces the same completions (checked) and the ratios compare equal work:

- batch 1: one problem at a time;
- static b: problems in consecutive groups of b, each group decoding until its longest row ends
  (the rows that ended wait);
- continuous b: b rows at a time, a row that ends replaced by the next problem at once.

Optionally (--hf) `transformers`' `model.generate` on left-padded groups of each b (static batching,
its own sampling, so other completions): the way traces were sampled before continuous batching.
Tokens/s counts completion tokens (EOS included) over wall time, prompt prefill included. The load
average of the machine (/proc/loadavg) is recorded before and after.

    foresight bench trace-generation                       # default model, CPU, b = 4, 8, 16
    foresight bench trace-generation --device cuda --batch-sizes 32,128,256 --num 512
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig

from foresight.bench.common import ModelSettings, model_field
from foresight.data.sampler import Request, sample_completions
from foresight.data.tasks import chat_prompt_ids, load_problems
from foresight.data.trace_generation import eos_token_ids, problem_seed
from foresight.models import load_model
from foresight.runtime.sampling import REASONING_SAMPLING

NAME = "trace-generation"
SOURCES = "reasoning-gym:gsm_symbolic,reasoning-gym:chain_sum,reasoning-gym:leg_counting,reasoning-gym:lcm"


@dataclass(frozen=True, kw_only=True)
class Settings(ModelSettings):
    model: str = model_field(architecture_configs=False)
    prompts: str = field(default=SOURCES, metadata={"help": "prompt SOURCE (a mixture, so completion lengths vary)"})
    num: int = field(default=32, metadata={"help": "problems sampled by every mode"})
    max_new_tokens: int = field(default=256, metadata={"help": "most new tokens of a completion"})
    batch_sizes: tuple[int, ...] = field(
        default=(4, 8, 16), metadata={"help": "comma-separated b of the static and continuous modes"}
    )
    hf: bool = field(default=False, metadata={"help": "also time transformers' generate in static groups of b"})


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def ours(
    model, requests: list[Request], batch_size: int, static: bool, max_new_tokens: int, eos: list[int]
) -> dict[int, list[int]]:
    """Completions by key, sampled continuously (or in static groups of `batch_size`)."""
    groups = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)] if static else [requests]
    done = {}
    for group in groups:
        for completion in sample_completions(
            model,
            group,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos,
            sampling=REASONING_SAMPLING,
            batch_size=batch_size,
        ):
            done[completion.key] = completion.tokens
    return done


def hf_generate(
    model, requests: list[Request], batch_size: int, max_new_tokens: int, eos: list[int], pad: int
) -> dict[int, list[int]]:
    """Completions by `model.generate` on left-padded groups (its sampling, so other completions)."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=REASONING_SAMPLING.temperature,
        top_k=REASONING_SAMPLING.top_k,
        top_p=REASONING_SAMPLING.top_p,
        eos_token_id=eos,
        pad_token_id=pad,
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
        out = model.generate(
            input_ids=ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config
        )
        for request, row in zip(group, out[:, width:].tolist()):
            stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            done[request.key] = row[:stop]
    return done


def run(settings: Settings) -> str:
    """Sample the same problems in every mode and time each; the report's markdown section."""
    model, tokenizer = load_model(settings.model, device=settings.run_device, dtype=settings.run_dtype)
    eos = eos_token_ids(model, tokenizer, settings.model)
    problems = load_problems(settings.prompts, settings.num, seed=0)
    requests = [Request(p.index, chat_prompt_ids(tokenizer, p.prompt), problem_seed(0, p.index)) for p in problems]
    tokens_max = settings.max_new_tokens
    before = load_average()
    runs: list[tuple[str, int, Callable[[], dict[int, list[int]]]]] = [
        ("batch 1", 1, lambda: ours(model, requests, 1, False, tokens_max, eos))
    ]
    for b in settings.batch_sizes:
        runs.append((f"static {b}", b, lambda b=b: ours(model, requests, b, True, tokens_max, eos)))
        runs.append((f"continuous {b}", b, lambda b=b: ours(model, requests, b, False, tokens_max, eos)))
    if settings.hf:
        pad = tokenizer.pad_token_id or eos[0]
        runs += [
            (f"transformers generate, static {b}", b, lambda b=b: hf_generate(model, requests, b, tokens_max, eos, pad))
            for b in settings.batch_sizes
        ]
    results = []
    for name, batch, sample in runs:
        started = time.perf_counter()
        completions = sample()
        seconds = time.perf_counter() - started
        tokens = sum(map(len, completions.values()))
        results.append((name, batch, completions, tokens, seconds))
        print(
            f"{name}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.1f} tokens/s", file=sys.stderr, flush=True
        )
    after = load_average()
    reference = results[0]
    same = all(r[2] == reference[2] for r in results if not r[0].startswith("transformers"))
    lengths = sorted(map(len, reference[2].values()))
    sampling = REASONING_SAMPLING
    lines = [
        f"### Trace generation throughput ({settings.run_device})",
        "",
        f"Command: `{settings.command}`",
        "",
        f"Model {settings.model}, {model.dtype}, {torch.get_num_threads()} torch threads, {platform.machine()}; "
        f"{settings.num} problems of `{settings.prompts}`, at most {tokens_max} new tokens, T = {sampling.temperature}, "
        f"top-k {sampling.top_k}, top-p {sampling.top_p}. Completion lengths {lengths[0]} / {lengths[len(lengths) // 2]} / "
        f"{lengths[-1]} (min / median / max). Load average (1, 5, 15 min) before {before}, after {after}. Every mode "
        f"of `foresight.data.sampler` produced {'the same' if same else 'DIFFERENT'} completions.",
        "",
        "| mode | rows | tokens | seconds | tokens/s | × batch 1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = reference[3] / reference[4]
    for name, batch, _, tokens, seconds in results:
        rate = tokens / seconds
        lines.append(f"| {name} | {batch} | {tokens} | {seconds:.1f} | {rate:.1f} | {rate / base:.2f} |")
    return "\n".join(lines)
