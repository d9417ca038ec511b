"""Decode throughput of each policy against the first, in turns of a few tokens inside one process.

Runs in separate processes, or one after another in one, see the machine at different moments: on a shared
CPU the median of three runs places a throughput ratio no closer than about ±10%. Here every policy decodes the
same batch and the policies take strict turns in one thread (`take_turns`, each a paused `EvictionEngine.generation`):
policy 1 decodes `slice_tokens` tokens, then policy 2 as many, and so on round after round, so a drift of the
machine's speed reaches every policy within one round. One thread, not one per policy: on a 2-core CPU a parallel
operation ran about 50 µs slower on a second Python thread than on the first (OpenMP), which made the default
model's decode step 22% slower there and charged a policy by its operation count. A round's slices are paired: policy p's throughput against the first's is Σ (first's
slice times) / Σ (p's slice times) over the rounds after every policy's first eviction (the cycle decode pays
then), with a 95% bootstrap interval over rounds.

    foresight bench interleaved --policies snapkv,foresight --scorer checkpoints/default --batch 4 \\
        --new-tokens 2048 --slice-tokens 32
    foresight bench interleaved --policies snapkv,snapkv:pooled,snapkv:pooled:layer --batch 4   # the pooled layout

Size: the turn taking, the run it drives and its report change together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from foresight.bench.common import (
    RuntimeSettings,
    load_benchmark_model,
    machine,
    prompt_ids,
    selected_policies,
)
from foresight.eval.headroom import Estimate
from foresight.eval.stats import percentile_interval, resample_counts
from foresight.models import describe
from foresight.policies import POLICIES
from foresight.runtime.capture import attention_implementation
from foresight.runtime.engine import EvictionEngine
from foresight.runtime.pool import Allocation, Layout, pooled_refusal

NAME = "interleaved"


@dataclass(frozen=True, kw_only=True)
class Settings(RuntimeSettings):
    policies: str = field(
        default="snapkv,foresight",
        metadata={
            "help": "comma-separated policies, the first the reference (full is not added); POLICY:pooled or "
            "POLICY:pooled:layer runs it on one pool per layer (per head or with AdaKV's allocation)",
            "metavar": "LIST",
        },
    )
    batch: int = field(default=1, metadata={"help": "rows every policy decodes at once"})
    new_tokens: int = field(default=2048, metadata={"help": "tokens each policy decodes (EOS ignored)"})
    slice_tokens: int = field(default=32, metadata={"help": "tokens of one turn"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch < 1 or self.slice_tokens < 1 or self.new_tokens < 2 * self.slice_tokens:
            raise ValueError(
                f"need batch >= 1, slice_tokens >= 1 and new_tokens >= 2 * slice_tokens (a turn's tokens past the "
                f"last whole turn are not timed), got batch={self.batch}, slice_tokens={self.slice_tokens}, "
                f"new_tokens={self.new_tokens}"
            )
        named = self.decoders
        if len(named) < 2 or len(set(named)) < len(named):
            raise ValueError(
                f"--policies {self.policies!r}: give at least two different policies by name, the first the reference"
            )
        for name in named:
            self.layout(name)

    @property
    def decoders(self) -> list[str]:
        """The policies that take turns, as given (the full cache only where named)."""
        return [name.strip() for name in self.policies.split(",") if name.strip()]

    def layout(self, decoder: str) -> tuple[str, dict[str, str]]:
        """A decoder's policy and its cache layout (`EvictionConfig` fields): POLICY, POLICY:pooled (per head) or
        POLICY:pooled:ALLOCATION."""
        policy, *layout = decoder.split(":")
        if len(layout) > 2 or (layout and layout[0] != Layout.POOLED.value):
            raise ValueError(
                f"--policies item {decoder!r} must be POLICY, POLICY:pooled or POLICY:pooled:ALLOCATION "
                f"(allocation one of {', '.join(a.value for a in Allocation)})"
            )
        if not layout:
            return policy, {}
        if policy in POLICIES and not POLICIES[policy].runs_pooled:
            raise ValueError(f"--policies item {decoder!r}: {pooled_refusal(policy)}")
        return policy, {"layout": layout[0], "allocation": Allocation.parse(layout[1] if len(layout) > 1 else "head")}

    @property
    def policy_names(self) -> list[str]:
        """The policies the decoders run (their layouts aside), checked as every runtime benchmark checks them."""
        return selected_policies(",".join(dict.fromkeys(self.layout(name)[0] for name in self.decoders)), learned=True)


def take_turns(
    decoders: dict[str, Iterator[int]],
    slice_tokens: int,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Advance every decoder (an iterator yielding its tokens so far after each token) `slice_tokens` tokens a turn,
    in the order given, round after round, until all have ended; a decoder that ends leaves the rotation. Returns
    each decoder's turn times, in order: a turn is timed by `clock` from its start to its last token, after `sync` at
    both ends (on a GPU: the device's queued work, which belongs to the turn that queued it); a turn cut short by the
    decoder's end is not kept."""
    slices: dict[str, list[float]] = {name: [] for name in decoders}
    running = dict(decoders)
    while running:
        for name, decoder in list(running.items()):
            sync()
            started = clock()
            for count in decoder:
                if count % slice_tokens == 0:
                    sync()
                    slices[name].append(clock() - started)
                    break
            else:
                del running[name]
    return slices


def paired_ratio(reference: Sequence[float], other: Sequence[float], seed: int = 0) -> Estimate:
    """Throughput of `other` over `reference` from their paired turn times (equal tokens a turn): Σ reference /
    Σ other, with a 95% bootstrap interval over the pairs."""
    first, second = np.asarray(reference, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if first.shape != second.shape or first.size < 2:
        raise ValueError(f"need two equally long series of at least 2 turns, got {first.size} and {second.size}")
    counts = resample_counts(first.size, seed=seed)
    low, high = percentile_interval((counts @ first) / (counts @ second))
    return Estimate(float(first.sum() / second.sum()), low, high)


def run(settings: Settings) -> str:
    model, tokenizer = load_benchmark_model(settings)
    prompt = prompt_ids(tokenizer, model.config.vocab_size)
    scorer = settings.learned_scorer(model)
    names = settings.decoders
    engines = {}
    for name in names:
        policy_name, layout = settings.layout(name)
        policy = settings.policy(policy_name, scorer)
        engines[name] = EvictionEngine(model, policy, replace(settings.eviction, **layout) if policy.evicts else None)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    prompts = [prompt] * settings.batch
    attention = {engine.attention for engine in engines.values()}.pop()  # one attention function for every engine
    with attention_implementation(model, attention):  # held for the whole run: no generation's end resets it
        decoders = {name: engine.generation(prompts, settings.new_tokens) for name, engine in engines.items()}
        turns = take_turns(decoders, settings.slice_tokens, sync=sync)
    # The first eviction comes B + L tokens into the cache (after the prompt for a policy that protects it).
    first_eviction = max(
        settings.budget + settings.interval - (0 if engine.protect_prompt else len(prompt))
        for engine in engines.values()
    )
    skipped = -(-max(first_eviction, 0) // settings.slice_tokens) + 1  # the turns before it, and the prefill's
    rounds = min(len(slices) for slices in turns.values())
    if rounds - skipped < 2:
        raise ValueError(
            f"new_tokens={settings.new_tokens} leaves {max(rounds - skipped, 0)} turns of {settings.slice_tokens} "
            f"tokens after the first eviction ({first_eviction} tokens in): decode more tokens"
        )
    steady = {name: slices[skipped:rounds] for name, slices in turns.items()}
    return _report(settings, steady, describe(model), model.dtype)


def _report(settings: Settings, steady: dict[str, list[float]], shape, dtype) -> str:
    reference, *_ = settings.decoders
    rows = len(steady[reference])
    lines = [
        f"### Interleaved decode throughput ({settings.run_device})",
        "",
        f"Command: `{settings.command}`",
        "",
        f"Model {settings.model} ({shape}), {dtype}, on {machine(settings.run_device)}; B = {settings.budget}, "
        f"L = {settings.interval}, batch {settings.batch}, {settings.new_tokens} new tokens (EOS ignored), turns of "
        f"{settings.slice_tokens} tokens in one process; {rows} paired rounds after every policy's first eviction. "
        f"Ratio: tokens/s against {reference}, 95% bootstrap over rounds." + settings.scorer_note(),
        "",
        "| policy | tokens/s (steady) | ratio to " + reference + " |",
        "|---|---:|---:|",
    ]
    tokens = settings.slice_tokens * settings.batch
    for name, slices in steady.items():
        rate = tokens * len(slices) / sum(slices)
        ratio = "–" if name == reference else str(paired_ratio(steady[reference], slices))
        lines.append(f"| {name} | {rate:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"
