"""Largest batch within the GPU's memory and throughput against the full cache, per policy (CUDA).

For each generation length T (`--lengths`) and policy, on CUDA:
1. Largest batch. The cache is allocated at the prefill for the whole run (the full cache: prompt + T
   entries a row; an evicting policy: B + L whatever T), so a probe that runs through the first
   eviction (the full cache: `--probe-tokens`) reaches the run's peak memory. That peak is linear in
   the batch (weights, then per-row cache and activations): probes at two small batches fit the line,
   the line gives the largest batch under `--memory-fraction` of the GPU, and a probe at that batch
   confirms it (stepping down 5% while it runs out of memory).
2. Throughput. Decode T tokens at that batch, EOS ignored: tokens/s = batch x decode steps / decode
   time, its ratio to the full cache's at the same T, the eviction time share and the peak memory.
   `--time-limit` stops a run early; its row is marked partial and its tokens/s covers the steps made.
3. Host synchronisations per decode step, counted with torch.cuda.set_sync_debug_mode over a short
   decode of each policy at batch 1 (none of them is per layer).
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from foresight.bench.common import (
    RuntimeSettings,
    budget_field,
    interval_field,
    load_benchmark_model,
    machine,
    prompt_ids,
    random_scorer,
)
from foresight.models import describe
from foresight.runtime.engine import EvictionConfig, EvictionEngine

NAME = "capacity"
GIB = 2**30
SMALL_BATCHES = (4, 8)
SYNC_CONFIG, SYNC_TOKENS = EvictionConfig(64, 16), 160


@dataclass(frozen=True, kw_only=True)
class Settings(RuntimeSettings):
    budget: int = budget_field()
    interval: int = interval_field()
    lengths: tuple[int, ...] = field(
        default=(8192, 16384, 32768), metadata={"help": "comma-separated generation lengths T"}
    )
    memory_fraction: float = field(default=0.9, metadata={"help": "share of the GPU's memory a run may take"})
    probe_tokens: int = field(default=16, metadata={"help": "decode steps of a full-cache memory probe"})
    time_limit: float | None = field(
        default=None, metadata={"help": "seconds a throughput run may decode (None: all T)"}
    )


class _Stop(Exception):
    """Raised from `on_token` to end a run early."""


@dataclass
class CapacityResult:
    policy: str
    length: int
    batch: int
    tokens_per_second: float
    steps: int
    eviction_share: float
    peak_bytes: int
    syncs_per_step: float

    @property
    def partial(self) -> bool:
        return self.steps < self.length - 1


def largest_batch(peak_at: Callable[[int], int | None], memory_budget: int) -> tuple[int, int]:
    """The largest batch whose peak memory fits `memory_budget`, and that peak. `peak_at(batch)` runs
    a probe and returns its peak bytes, or None when it ran out of memory. Fits peak = a + s * batch
    on two small batches, then confirms the line's answer, stepping down 5% while a probe fails."""
    peaks = {batch: peak_at(batch) for batch in SMALL_BATCHES}
    for batch, peak in peaks.items():
        if peak is None or peak > memory_budget:
            raise ValueError(f"a batch of {batch} does not fit the memory budget of {memory_budget / GIB:.1f} GiB")
    (low, low_peak), (high, high_peak) = peaks.items()
    per_row = max((high_peak - low_peak) / (high - low), 1.0)
    batch = int((memory_budget - (low_peak - per_row * low)) / per_row)
    while batch > high:
        peak = peak_at(batch)
        if peak is not None and peak <= memory_budget:
            return batch, peak
        batch = int(batch * 0.95)
    return high, high_peak


def run(settings: Settings) -> str:
    """Find each policy's largest batch at every T and time it there; the report's markdown section."""
    if not torch.cuda.is_available():
        raise ValueError("`foresight bench capacity` measures GPU memory and needs a CUDA device; none is available")
    model, tokenizer = load_benchmark_model(settings)
    prompt = prompt_ids(tokenizer, model.config.vocab_size)
    budget = int(settings.memory_fraction * torch.cuda.get_device_properties(0).total_memory)
    results = []
    scorer = settings.learned_scorer(model)  # and one at SYNC_CONFIG's B and L for the synchronisation count
    sync_scorer = None if scorer is None else random_scorer(model, SYNC_CONFIG.budget, SYNC_CONFIG.interval)

    def engine(name: str, config: EvictionConfig = settings.eviction, learned=scorer) -> EvictionEngine:
        policy = settings.policy(name, learned)
        return EvictionEngine(model, policy, config if policy.evicts else None)

    for name in settings.policy_names:
        syncs = _syncs_per_step(engine(name, SYNC_CONFIG, sync_scorer), prompt)
        fitted: tuple[int, int] | None = None  # an evicting policy's cache does not depend on T
        for length in settings.lengths:
            if fitted is None or name == "full":
                fitted = largest_batch(lambda batch: _probe(engine(name), settings, prompt, batch, length), budget)
            results.append(_throughput(engine(name), settings, prompt, fitted[0], length, syncs))
    return _report(settings, results, describe(model), model.dtype, len(prompt), budget)


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _probe(engine: EvictionEngine, settings: Settings, prompt: list[int], batch: int, length: int) -> int | None:
    """Peak memory of a run of `length` new tokens at `batch`, decoded until its memory is at its
    largest: one step past the first eviction, or `--probe-tokens` for the full cache."""
    filled: list[int] = []

    def stop_when_steady(count: int) -> None:
        filled.append(engine.last_cache.layers[0].get_seq_length())
        evicted = len(filled) > 2 and filled[-2] < filled[-3]
        if evicted or (not engine.evicts and count >= settings.probe_tokens):
            raise _Stop

    _release()
    torch.cuda.reset_peak_memory_stats()
    try:
        engine.generate([prompt] * batch, length, on_token=stop_when_steady)
    except _Stop:
        pass
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        engine.last_cache = None
        _release()
    return torch.cuda.max_memory_allocated()


def _throughput(
    engine: EvictionEngine, settings: Settings, prompt: list[int], batch: int, length: int, syncs: float
) -> CapacityResult:
    name = engine.policy.name
    time_limit = settings.time_limit
    _release()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with tqdm(total=length, desc=f"{name} x{batch} T={length}", unit="tok", leave=False) as progress:

        def stop_at_time_limit(count: int) -> None:
            progress.update(1)
            if time_limit is not None and time.perf_counter() - started > time_limit:
                raise _Stop

        try:
            engine.generate([prompt] * batch, length, on_token=stop_at_time_limit)
        except _Stop:
            pass
    stats = engine.last_stats
    peak = torch.cuda.max_memory_allocated()
    engine.last_cache = None
    _release()
    steps = len(stats.step_seconds)
    return CapacityResult(
        policy=name,
        length=length,
        batch=batch,
        tokens_per_second=batch * steps / max(sum(stats.step_seconds), 1e-9),
        steps=steps,
        eviction_share=stats.eviction_share,
        peak_bytes=peak,
        syncs_per_step=syncs,
    )


def _syncs_per_step(engine: EvictionEngine, prompt: list[int]) -> float:
    """Host synchronisations per decode step at batch 1, over SYNC_TOKENS tokens with B, L = SYNC_CONFIG
    (several evictions; what synchronises depends on the code path, not on B and L)."""
    tokens = SYNC_TOKENS
    engine.generate([prompt], 4)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.generate([prompt], tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine.last_cache = None
    return sum("synchronizing" in str(w.message) for w in caught) / (tokens - 1)


def _report(settings: Settings, results: list[CapacityResult], shape, dtype, prompt_length: int, budget: int) -> str:
    full = {r.length: r.tokens_per_second for r in results if r.policy == "full"}
    lines = [
        "### Capacity: largest batch and throughput against the full cache (cuda)",
        "",
        f"Command: `{settings.command}`",
        "",
        f"Model {settings.model} ({shape}), {dtype}, on {machine('cuda')}; {prompt_length}-token prompt, "
        f"B = {settings.budget}, L = {settings.interval}, EOS ignored; memory budget {budget / GIB:.1f} GiB "
        f"({settings.memory_fraction:.0%} of the GPU). Largest batch: from probes (see `foresight bench capacity "
        "--help`). Tokens/s = batch x decode steps / decode time at that batch; ratio = tokens/s / the full "
        "cache's at the same T. Evict share = time in scoring and eviction / decode time. Syncs/step = host "
        "synchronisations per decode step (batch 1, B = 64, L = 16, 160 tokens: evictions included)."
        + settings.scorer_note(),
        "",
        "| T | policy | largest batch | tokens/s | ratio to full | evict share | peak GiB | syncs/step | steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r.tokens_per_second / full[r.length]:.2f}x" if r.length in full else "n/a"
        steps = f"{r.steps} (partial)" if r.partial else str(r.steps)
        lines.append(
            f"| {r.length} | {r.policy} | {r.batch} | {r.tokens_per_second:.0f} | {ratio} "
            f"| {100 * r.eviction_share:.2f}% | {r.peak_bytes / GIB:.1f} | {r.syncs_per_step:.2f} | {steps} |"
        )
    return "\n".join(lines) + "\n"
