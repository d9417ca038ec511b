"""Cache storage and process memory step by step, held flat from the first eviction on.

For each policy, decode a fixed-length continuation (EOS ignored) and, after every generated token,
note the bytes of the cache's storage, how often it was allocated, and the memory the process holds
(`foresight.bench.process_memory`: CUDA allocations, or the C heap in use on CPU). From the first eviction on (the
full cache: from the second token) the report gives how much each grew and the peak above what was
held then (CUDA: max_memory_allocated; CPU: the resident set's high-water mark).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from foresight.bench.common import RuntimeSettings, load_benchmark_model, machine, prompt_ids
from foresight.bench.process_memory import held_bytes, peak_bytes, reset_peak, resident_bytes
from foresight.models import describe
from foresight.runtime.engine import EvictionEngine
from foresight.runtime.held_memory import held_bytes as held_memory

NAME = "memory"
MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class Settings(RuntimeSettings):
    max_new_tokens: int = field(default=1024, metadata={"help": "tokens decoded per policy (EOS ignored)"})
    batch_size: int = field(default=4, metadata={"help": "rows decoded together"})


@dataclass
class MemoryTrace:
    """What one run held after each generated token, from its reference step on (the first eviction,
    or the second token for a cache that never evicts)."""

    policy: str
    max_entries: int = 0
    start: int | None = None  # generated tokens at the reference step
    tokens: int = 0
    storage_start: int = 0
    storage_end: int = 0
    entry_bytes: int = 0  # one cache entry: K, V, position and state, every layer and row
    accounted: int = 0  # what `foresight.runtime.held_memory` counts the run's rows to hold at their peak
    allocations: int = 0  # storage allocations of a layer, the most of any layer
    held_start: int = 0
    held_end: int = 0
    resident_start: int = 0
    peak: int = 0

    @property
    def held_growth_per_token(self) -> float:
        return (self.held_end - self.held_start) / max(self.tokens - self.start, 1)


class _Sampler:
    """The engine's `on_token` callback: samples memory after each generated token."""

    def __init__(self, engine: EvictionEngine, trace: MemoryTrace, device: str, progress: tqdm):
        self.engine, self.trace, self.device, self.progress = engine, trace, device, progress
        self.filled: int | None = None

    def __call__(self, count: int) -> None:
        self.progress.update(1)
        cache, trace = self.engine.last_cache, self.trace
        filled = cache.layers[0].get_seq_length()
        evicted = self.filled is not None and filled < self.filled
        # The full cache's reference is the second token: the prefill's logits are gone by then.
        if trace.start is None and (evicted or (not self.engine.evicts and count == 2)):
            trace.start = count
            trace.storage_start, trace.held_start = cache.storage_bytes(), held_bytes(self.device)
            trace.resident_start = resident_bytes(self.device)
            reset_peak(self.device)
        self.filled = filled
        trace.tokens = count
        trace.storage_end, trace.held_end = cache.storage_bytes(), held_bytes(self.device)
        storage = cache.layers[0].storage  # every layer's, stacked
        trace.allocations = storage.allocations
        trace.entry_bytes = storage.nbytes // storage.slots
        engine, layer = self.engine, cache.layers[0]
        budget, interval = (engine.config.budget, engine.config.interval) if engine.evicts else (0, 0)
        shape, dtype = describe(engine.model), engine.model.dtype
        held = held_memory(shape, engine.policy, budget, interval, dtype, entries=layer.storage.slots)
        trace.accounted = layer.storage.batch * held.total


def run(settings: Settings) -> str:
    """Trace the memory of a run of every policy; the report's markdown section."""
    device = settings.run_device
    model, tokenizer = load_benchmark_model(settings)
    prompts = [prompt_ids(tokenizer, model.config.vocab_size)] * settings.batch_size
    scorer = settings.learned_scorer(model)
    traces = []
    for name in settings.policy_names:
        policy = settings.policy(name, scorer)
        engine = EvictionEngine(model, policy, settings.eviction if policy.evicts else None)
        trace = MemoryTrace(name)
        with tqdm(total=settings.max_new_tokens, desc=name, unit="tok", leave=False) as progress:
            output = engine.generate(
                prompts, settings.max_new_tokens, on_token=_Sampler(engine, trace, device, progress)
            )
        trace.peak, trace.max_entries = peak_bytes(device), output.stats.max_entries
        if trace.start is None:
            raise ValueError(
                f"{name} never evicted in {settings.max_new_tokens} tokens; raise --max-new-tokens above B + L"
            )
        traces.append(trace)
    return _report(settings, traces, describe(model), model.dtype, len(prompts[0]))


def _report(settings: Settings, traces: list[MemoryTrace], shape, dtype, prompt_length: int) -> str:
    device = settings.run_device
    held = "CUDA allocations" if device == "cuda" else "C heap in use (mallinfo2)"
    peak = "max_memory_allocated" if device == "cuda" else "resident-set high-water mark (VmHWM)"
    lines = [
        f"### Cache memory after the first eviction ({device})",
        "",
        f"Command: `{settings.command}`",
        "",
        f"Model {settings.model} ({shape}), {dtype}, on {machine(device)}; batch {settings.batch_size} x {prompt_length}-token "
        f"prompt, B = {settings.budget}, L = {settings.interval}, {settings.max_new_tokens} new tokens, EOS ignored. From = the "
        "generated token at which the first eviction had happened (full: the second, after the prefill's "
        "logits are freed). Storage = the cache's "
        f"buffers (K, V, positions, policy state, query ring buffer, queries not yet observed); accounted = what "
        "`foresight.runtime.held_memory` counts the rows to hold at their peak (every-query policies: L buffered "
        "queries; the figure eval and the baselines publish); allocations = times a layer allocated them. "
        f"Held = {held}, sampled after every token; peak above held = {peak} after the reference step minus "
        "what was resident then. Entry = the bytes one more cache entry takes (K, V, position, state; every "
        "layer and row): what a cache that grows by a token per step would add per token." + settings.scorer_note(),
        "",
        "| policy | max entries | from token | storage MiB then | storage MiB at end | accounted MiB | allocations | "
        "held growth KiB | held growth B/token | entry B | peak above held MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in traces:
        lines.append(
            f"| {t.policy} | {t.max_entries} | {t.start} | {t.storage_start / MIB:.2f} | {t.storage_end / MIB:.2f} "
            f"| {t.accounted / MIB:.2f} | {t.allocations} | {(t.held_end - t.held_start) / 1024:.1f} | {t.held_growth_per_token:.0f} "
            f"| {t.entry_bytes} | {(t.peak - t.resident_start) / MIB:.1f} |"
        )
    return "\n".join(lines) + "\n"
