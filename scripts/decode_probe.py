"""Where a decode step's time goes on a device: the trace sampler and the eviction runtime against a bare
transformers loop, on a random-weight Qwen3-4B shape (docs/notes/gpu-acceptance.md's probe table).

    python scripts/decode_probe.py --device cuda        # bf16; 1, 16 and 256 (sampler) or 101 (runtime) rows
    python scripts/decode_probe.py --device cpu         # a two-layer, narrow version of the shape, float32

Prints milliseconds per decode step and tokens/s per loop and row count (32 steps after a 64-token prompt for
the sampler and the bare loop, 64 new tokens for the runtime), then a profiler table of each runtime policy's
16 steps at 16 rows, sorted by host time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from foresight.cache_argument import cache_argument
from foresight.data.sampler import Request, sample_completions
from foresight.models import random_model
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.sampling import REASONING_SAMPLING

MODEL = "configs/models/qwen3-4b.json"
NARROW = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
PROMPT = list(range(3, 67))
T = TypeVar("T")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    device = parser.parse_args().device
    cuda = device == "cuda"
    model = random_model(
        MODEL, dtype=torch.bfloat16 if cuda else torch.float32, device=device, **({} if cuda else NARROW)
    )

    def timed(run: Callable[[], T]) -> tuple[float, T]:
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = run()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started, result

    def sampler(rows: int, steps: int) -> int:
        requests = [Request(row, PROMPT, seed=row) for row in range(rows)]
        completions = sample_completions(
            model, requests, max_new_tokens=steps, eos_token_ids=[], sampling=REASONING_SAMPLING, batch_size=rows
        )
        return sum(len(completion.tokens) for completion in completions)

    @torch.no_grad()
    def bare(rows: int, steps: int) -> int:
        cache = DynamicCache()
        output = model(input_ids=torch.tensor([PROMPT] * rows, device=device), **cache_argument(model, cache))
        for _ in range(steps - 1):
            token = output.logits[:, -1].argmax(-1, keepdim=True)
            output = model(input_ids=token, **cache_argument(model, cache))
        return rows * steps

    for name, loop in (("sampler", sampler), ("bare transformers", bare)):
        loop(2, 2)  # warm-up
        for rows in (1, 16, 256) if cuda else (1, 16):
            seconds, tokens = timed(lambda: loop(rows, 32))
            print(
                f"{name}, {rows} rows: {seconds / 32 * 1000:.1f} ms/step, {tokens / seconds:.0f} tokens/s", flush=True
            )
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    for policy, config in (("full", None), ("snapkv", EvictionConfig(128, 32))):
        engine = EvictionEngine(model, make_policy(policy), config)
        engine.generate([PROMPT] * 2, 4)  # warm-up
        for rows in (1, 16, 101) if cuda else (1, 16):
            seconds, _ = timed(lambda: engine.generate([PROMPT] * rows, 64))
            print(
                f"runtime {policy}, {rows} rows: {seconds / 64 * 1000:.1f} ms/step, {rows * 64 / seconds:.0f} tokens/s"
            )
        with profile(activities=activities) as profiler:
            engine.generate([PROMPT] * 16, 16)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
