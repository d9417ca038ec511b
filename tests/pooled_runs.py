"""Pooled-layout runs the tests compare with their twins: the cadence and two rows of unequal lengths, the positions
each (layer, row, KV head) holds after every eviction step, the checks that a policy replays and generates on the pool
at allocation 'head' as per head, a policy that records its keep scores, and the check of AdaKV's allocation against
its loop twin over those scores."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from foresight.policies import Policy, make_policy
from foresight.runtime.cache import EvictionCache
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests.reference_policies import pooled_keep

B, L = 12, 4
PROMPTS = [5, 11]  # rows of different lengths: left padding, and rows that evict at different steps


def sequences(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return [torch.randint(0, vocab, (length,), generator=generator) for length in (70, 61)]


def held_by_head(cache) -> list[list[list[list[int]]]]:
    """The positions each (layer, row, KV head) holds, ascending, in either layout."""
    held = []
    for layer in cache.layers:
        positions = layer.entry_positions()
        if layer.pool_heads:
            owners = layer.owners[:, 0]
            heads = [positions[:, 0].masked_fill(owners != head, -1) for head in range(layer.pool_heads)]
            positions = torch.stack(heads, dim=1)
        held.append([[[p for p in head if p >= 0] for head in row] for row in positions.tolist()])
    return held


class AfterEachStep(AbstractContextManager):
    """An engine's `step_observer` that keeps what `read` reads of its cache after every eviction step
    (`held_by_head` unless given)."""

    def __init__(self, read: Callable[[EvictionCache], Any] = held_by_head) -> None:
        self.engine: EvictionEngine | None = None
        self.read = read
        self.held: list = []

    def __exit__(self, *exc) -> None:
        if self.engine.last_stats.evictions > len(self.held):
            self.held.append(self.read(self.engine.last_cache))


def observed_engine(
    model, policy, config: EvictionConfig, read: Callable[[EvictionCache], Any] = held_by_head
) -> tuple[EvictionEngine, AfterEachStep]:
    steps = AfterEachStep(read)
    steps.engine = EvictionEngine(model, policy, config, step_observer=steps)
    return steps.engine, steps


def assert_replays_alike(model, new_policy: Callable[[], Policy], prompts: list[int] = PROMPTS) -> None:
    """Teacher-forced, two rows of unequal `prompts`, per head and pooled at allocation 'head' (a fresh policy each):
    the same kept positions in every (layer, row, head) after every step and the same token losses (float32: the
    masked softmax over a pool sums in another order)."""
    runs = []
    for layout in ("heads", "pooled"):
        engine, steps = observed_engine(model, new_policy(), EvictionConfig(B, L, layout=layout))
        runs.append((engine.replay(sequences(model.config.vocab_size), prompts), steps.held, engine.last_cache))
    (heads, held_heads, _), (pooled, held_pooled, cache) = runs
    assert cache.layers[0].pool_heads == model.config.num_key_value_heads == 2
    assert heads.stats.evictions == pooled.stats.evictions == len(held_pooled) >= 10
    assert held_pooled == held_heads
    assert heads.first_eviction == pooled.first_eviction
    for ours, theirs in zip(pooled.nll, heads.nll, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def assert_generates_alike(model, new_policy: Callable[[], Policy]) -> None:
    """Prefill of unequal prompts, then greedy decode through several steps, per head and pooled at allocation
    'head': the same tokens, logits and held positions."""
    runs = []
    for layout in ("heads", "pooled"):
        engine, steps = observed_engine(model, new_policy(), EvictionConfig(B, L, layout=layout))
        prompts = [ids[:length].tolist() for ids, length in zip(sequences(model.config.vocab_size), PROMPTS)]
        runs.append((engine.generate(prompts, 30, return_logits=True), steps.held))
    (heads, held_heads), (pooled, held_pooled) = runs
    assert heads.stats.evictions == pooled.stats.evictions >= 6
    assert pooled.tokens == heads.tokens and held_pooled == held_heads
    torch.testing.assert_close(pooled.logits, heads.logits, rtol=0, atol=1e-5)


def recording(name: str, **options):
    """Policy `name` recording, at every step, its keep scores and candidate positions [layers, rows, H, C] and the
    run's rows they are."""
    policy = make_policy(name, **options)
    steps = []

    class Recording(type(policy)):
        def step_keep_scores(self, contexts):
            scores = super().step_keep_scores(contexts)
            positions = torch.stack([context.candidate_positions for context in contexts])
            rows = contexts[0].rows
            steps.append((scores.tolist(), positions.tolist(), None if rows is None else rows.tolist()))
            return scores

    return Recording(**policy.options()), steps


def assert_keeps_adakvs_rule(scored: list, held: list, floor: int, heads: int) -> set[int]:
    """At every step of a run at allocation 'layer' (`recording`'s `scored` and `AfterEachStep`'s `held`), in every
    layer and evicting row: each head kept its floor of best-scored candidates and the layer its H·(B - L - floor)
    best of the rest, as `pooled_keep` loops it over the same scores; so every head kept at least the floor and the
    layer H·(B - L) candidates. Returns the counts the heads kept."""
    assert len(scored) == len(held) >= 10
    counts = set()
    for (scores, positions, rows), after in zip(scored, held, strict=True):
        for layer, (layer_scores, layer_positions) in enumerate(zip(scores, positions, strict=True)):
            for index, row in enumerate(range(len(after[layer])) if rows is None else rows):
                expected = pooled_keep(layer_scores[index], layer_positions[index], B - L, floor)
                newest = max(max(head) for head in after[layer][row])
                kept = [[p for p in head if p <= newest - L] for head in after[layer][row]]
                assert kept == expected
                assert min(map(len, kept)) >= floor and sum(map(len, kept)) == heads * (B - L)
                counts.update(map(len, kept))
    return counts
