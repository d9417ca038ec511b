"""Decode latency against generated length, KV memory and eviction time share, per policy and batch size.

For each batch size and policy, decode `--max-new-tokens` tokens (EOS ignored) from copies of the
benchmark prompt and report the latency per decode step over windows of generated tokens, how flat it
stays after the first eviction, the share of decode time spent scoring and evicting, and the cache's
storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from foresight.bench.common import RuntimeSettings, load_benchmark_model, machine, prompt_ids
from foresight.models import describe
from foresight.runtime.engine import EvictionConfig, EvictionEngine, RunStats

NAME = "decode"
WINDOW = 512  # tokens per latency window


@dataclass(frozen=True, kw_only=True)
class Settings(RuntimeSettings):
    max_new_tokens: int = field(default=2048, metadata={"help": "tokens decoded per policy and batch size"})
    batch_sizes: tuple[int, ...] = field(default=(1, 8), metadata={"help": "comma-separated batch sizes"})


@dataclass
class DecodeResult:
    policy: str
    batch: int
    stats: RunStats
    kv_bytes: int
    first_eviction_step: int | None  # decode step at which the first eviction happens

    def window_ms(self, start: int, stop: int) -> float:
        steps = self.stats.step_seconds[start:stop]
        return 1000 * sum(steps) / max(len(steps), 1)

    @property
    def flatness(self) -> float | None:
        """Latency of the last window over the first full window after the first eviction."""
        steps = len(self.stats.step_seconds)
        first_eviction = self.first_eviction_step
        if first_eviction is None or steps - first_eviction < 2 * WINDOW:
            return None
        return self.window_ms(steps - WINDOW, steps) / self.window_ms(first_eviction, first_eviction + WINDOW)


def run(settings: Settings) -> str:
    """Decode under every policy at every batch size; the report's markdown section."""
    model, tokenizer = load_benchmark_model(settings)
    prompt = prompt_ids(tokenizer, model.config.vocab_size)
    scorer = settings.learned_scorer(model)
    results = []
    for batch in settings.batch_sizes:
        for name in settings.policy_names:
            policy = settings.policy(name, scorer)
            results.append(
                _decode(model, policy, settings.eviction, [prompt] * batch, settings.max_new_tokens, len(prompt))
            )
    return _report(settings, results, describe(model), model.dtype)


def _decode(model, policy, config: EvictionConfig, prompts, max_new_tokens: int, prompt_length: int) -> DecodeResult:
    name = policy.name
    engine = EvictionEngine(model, policy, config if policy.evicts else None)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with tqdm(total=max_new_tokens, desc=f"{name} x{len(prompts)}", unit="tok", leave=False) as bar:
        output = engine.generate(prompts, max_new_tokens, on_token=lambda n: bar.update(n - bar.n))
    kv_bytes = engine.last_cache.storage_bytes()
    first = config.budget + config.interval - prompt_length if policy.evicts else None
    return DecodeResult(name, len(prompts), output.stats, kv_bytes, first)


def _report(settings: Settings, results: list[DecodeResult], shape, dtype) -> str:
    device = settings.run_device
    steps = max(len(r.stats.step_seconds) for r in results)
    windows = [(start, min(start + WINDOW, steps)) for start in range(0, steps, WINDOW)]
    lines = [
        f"### Decode benchmark ({device})",
        "",
        f"Command: `{settings.command}`",
        "",
        f"Model {settings.model} ({shape}), {dtype}, on {machine(device)}; B = {settings.budget}, L = {settings.interval}, "
        f"{settings.max_new_tokens} new tokens, EOS ignored. Latency is ms per decode step (the whole batch), "
        f"averaged over windows of generated tokens. Flatness = latency of the last {WINDOW} tokens / the "
        f"first {WINDOW} after the first eviction (target <= 1.10). Evict share = time in scoring and "
        "eviction / decode time (target <= 5% for snapkv and rkv). KV held = the cache's storage (K, V, "
        "positions, policy state, query ring buffer), allocated once per run." + settings.scorer_note(),
        "",
    ]
    header = (
        ["policy", "batch"]
        + [f"ms/step {a + 1}-{b}" for a, b in windows]
        + ["flatness", "evict share", "KV held MiB", "max entries", "tokens/s"]
    )
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        flat = "n/a" if r.flatness is None else f"{r.flatness:.3f}"
        decode_seconds = sum(r.stats.step_seconds)
        row = (
            [r.policy, str(r.batch)]
            + [f"{r.window_ms(a, b):.2f}" for a, b in windows]
            + [
                flat,
                f"{100 * r.stats.eviction_share:.2f}%",
                f"{r.kv_bytes / 2**20:.1f}",
                str(r.stats.max_entries),
                f"{r.batch * len(r.stats.step_seconds) / max(decode_seconds, 1e-9):.1f}",
            ]
        )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
