"""Where a decode step's time goes on a device: the trace sampler and the eviction runtime against a bare
transformers loop, on a random-weight Qwen3-4B shape (docs/notes/gpu-acceptance.md's probe table).

    python scripts/decode_probe.py --device cuda        # bf16; 1, 16 and 256 (sampler) or 101 (runtime) rows
    python scripts/decode_probe.py --device cpu         # a two-layer, narrow version of the shape, float32
    python scripts/decode_probe.py --device cuda --loop snapkv   # one loop, in this process

Every loop runs in a fresh process of its own (this script, with --loop), so no loop inherits another's
warm allocator, kernels or caches. The sampler and the bare loop decode 32 steps after a 64-token prompt;
the sampler's admission (its rows' prompts prefilled together) and decoding are timed apart. The runtime
decodes `NEW_TOKENS` tokens after a `PROMPT_TOKENS`-token prompt at B = 128, L = 32: every row of every
policy evicts at least `LEAST_EVICTIONS` times (checked, and printed per row), so the eviction share is
that of a run that evicts. Its seconds are the device's (CUDA events on a GPU, `DeviceClock`): the share of
decode time in eviction steps and the milliseconds of one step. Each runtime loop ends with a profiler
table of one run at 16 rows, sorted by host time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from foresight.bench.common import random_scorer
from foresight.cache_argument import cache_argument
from foresight.data.sampler import Request, SamplerSeconds, sample_completions
from foresight.models import TINY_SIZES, random_model
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.sampling import REASONING_SAMPLING

MODEL = "configs/models/qwen3-4b.json"
SAMPLER_PROMPT = list(range(3, 67))
SAMPLER_STEPS = 32
BUDGET, INTERVAL = 128, 32
LEAST_EVICTIONS = 3
PROMPT_TOKENS = BUDGET
NEW_TOKENS = BUDGET + INTERVAL  # fed: 128 + 159 tokens, so every row evicts at 160, 192, 224 and 256 entries
RUNTIME_POLICIES = ("full", "snapkv", "foresight")
LOOPS = ("sampler", "bare", *RUNTIME_POLICIES)
T = TypeVar("T")


@dataclass(frozen=True)
class RuntimeRow:
    """One runtime run: `rows` rows of `steps` decode steps, its device seconds and each row's eviction steps."""

    policy: str
    rows: int
    steps: int
    decode_seconds: float
    eviction_share: float
    eviction_steps: int
    eviction_seconds: float
    row_evictions: list[int]

    def line(self) -> str:
        evicting = self.eviction_steps > 0
        step_ms = f", {1000 * self.eviction_seconds / self.eviction_steps:.2f} ms/eviction step" if evicting else ""
        return (
            f"runtime {self.policy}, {self.rows} rows: {1000 * self.decode_seconds / self.steps:.1f} ms/step, "
            f"{self.rows * self.steps / self.decode_seconds:.0f} tokens/s, eviction share "
            f"{100 * self.eviction_share:.2f}%{step_ms}, evictions per row {min(self.row_evictions)}-"
            f"{max(self.row_evictions)}"
        )


def probe_model(device: str) -> torch.nn.Module:
    cuda = device == "cuda"
    return random_model(
        MODEL, dtype=torch.bfloat16 if cuda else torch.float32, device=device, **({} if cuda else TINY_SIZES)
    )


def runtime_prompt(vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab_size, (PROMPT_TOKENS,), generator=generator).tolist()


def runtime_engine(model: torch.nn.Module, policy: str) -> EvictionEngine:
    """The engine of a runtime loop at B = 128, L = 32; the learned policy runs a scorer of the model's shape with
    seeded random weights (its cost does not depend on them)."""
    options = {"scorer": random_scorer(model, BUDGET, INTERVAL)} if policy == "foresight" else {}
    made = make_policy(policy, **options)
    return EvictionEngine(model, made, EvictionConfig(BUDGET, INTERVAL) if made.evicts else None)


def runtime_run(engine: EvictionEngine, prompt: list[int], rows: int) -> RuntimeRow:
    """Decode `NEW_TOKENS` tokens in `rows` rows; a policy that evicts must evict every row `LEAST_EVICTIONS` times."""
    stats = engine.generate([prompt] * rows, NEW_TOKENS).stats
    if engine.evicts and min(stats.row_evictions) < LEAST_EVICTIONS:
        raise AssertionError(
            f"{engine.policy.name}: a row evicted {min(stats.row_evictions)} times, not {LEAST_EVICTIONS}"
        )
    return RuntimeRow(
        engine.policy.name,
        rows,
        len(stats.step_seconds),
        sum(stats.step_seconds),
        stats.eviction_share,
        stats.evictions,
        stats.eviction_seconds,
        stats.row_evictions,
    )


def run_loop(loop: str, device: str) -> None:
    """One loop (a runtime policy, the sampler or the bare transformers loop) at every row count, printed."""
    cuda = device == "cuda"
    model = probe_model(device)

    def timed(run: Callable[[], T]) -> tuple[float, T]:
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = run()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started, result

    if loop in RUNTIME_POLICIES:
        engine, prompt = runtime_engine(model, loop), runtime_prompt(model.config.vocab_size)
        engine.generate([prompt[:8]] * 2, 4)  # warm-up
        for rows in (1, 16, 101) if cuda else (1, 16):
            print(runtime_run(engine, prompt, rows).line(), flush=True)
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as profiler:
            engine.generate([prompt] * 16, NEW_TOKENS)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
        return

    def sampler(rows: int, steps: int, parts: SamplerSeconds) -> int:
        requests = [Request(row, SAMPLER_PROMPT, seed=row) for row in range(rows)]
        completions = sample_completions(
            model,
            requests,
            max_new_tokens=steps,
            eos_token_ids=[],
            sampling=REASONING_SAMPLING,
            batch_size=rows,
            seconds=parts,
        )
        return sum(len(completion.tokens) for completion in completions)

    @torch.no_grad()
    def bare(rows: int, steps: int, parts: SamplerSeconds) -> int:
        cache = DynamicCache()
        output = model(input_ids=torch.tensor([SAMPLER_PROMPT] * rows, device=device), **cache_argument(model, cache))
        for _ in range(steps - 1):
            token = output.logits[:, -1].argmax(-1, keepdim=True)
            output = model(input_ids=token, **cache_argument(model, cache))
        return rows * steps

    run = sampler if loop == "sampler" else bare
    run(2, 2, SamplerSeconds())  # warm-up
    for rows in (1, 16, 256) if cuda else (1, 16):
        parts = SamplerSeconds()
        seconds, tokens = timed(lambda: run(rows, SAMPLER_STEPS, parts))
        line = f"{loop}, {rows} rows: {seconds / SAMPLER_STEPS * 1000:.1f} ms/step, {tokens / seconds:.0f} tokens/s"
        if loop == "sampler":
            line += (
                f" (admission {parts.admission_seconds:.3f} s in {parts.admissions} prefill(s); decode "
                f"{parts.decode_seconds:.3f} s, {tokens / parts.decode_seconds:.0f} tokens/s)"
            )
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--loop", choices=LOOPS, help="run this loop alone, in this process (default: each, fresh)")
    args = parser.parse_args()
    if args.loop:
        run_loop(args.loop, args.device)
        return
    for loop in LOOPS:
        subprocess.run([sys.executable, __file__, "--device", args.device, "--loop", loop], check=True)


if __name__ == "__main__":
    main()
