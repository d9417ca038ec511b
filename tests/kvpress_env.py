"""NVIDIA kvpress for the cross-checks (tests/test_kvpress_*.py): imported with the attention functions of the
rest of the suite left as they were, or the importing test module skipped where kvpress is not installed
(it pins transformers < 5.3, so it lives in its own virtualenv: docs/kvpress.md)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import pytest
import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from foresight.cache_argument import cache_argument
from foresight.runtime.cache import EvictionCache
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.policy import Policy

_overrides = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
kvpress = pytest.importorskip("kvpress")
# Importing kvpress wraps every attention function registered so far (for AdaKV's head-wise masks,
# which no press compared here uses) and its wrapper passes `dropout` positionally; undo it so that
# the attention functions of the rest of the suite run unwrapped in this virtualenv.
ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
ALL_ATTENTION_FUNCTIONS._local_mapping.update(_overrides)


def kvpress_kept(model, press, ids: torch.Tensor) -> list[list[list[int]]]:
    """Positions [layer][head] kvpress keeps when it compresses the prefill of `ids`, found by
    matching each kept key to the full cache's keys (kvpress stores them in top-k order)."""
    full, compressed = DynamicCache(), DynamicCache()
    with torch.no_grad():
        model(ids, **cache_argument(model, full), use_cache=True)
        with press(model):
            model(ids, **cache_argument(model, compressed), use_cache=True)
    kept = []
    for full_layer, layer in zip(full.layers, compressed.layers):
        matches = (layer.keys[0, :, :, None, :] == full_layer.keys[0, :, None, :, :]).all(-1)  # [Hkv, kept, T]
        assert (matches.sum(-1) == 1).all(), "every kept key is exactly one prefill key"
        kept.append(matches.float().argmax(-1).sort(-1).values.tolist())
    return kept


def held_positions(cache: EvictionCache) -> list[list[list[int]]]:
    """Positions [layer][head] our engine's cache holds, ascending."""
    return [
        [sorted(p for p in head if p >= 0) for head in layer.entry_positions()[0].tolist()] for layer in cache.layers
    ]


def engine_prefill_kept(model, policy: Policy, config: EvictionConfig, ids: torch.Tensor) -> list[list[list[int]]]:
    """Positions [layer][head] our engine keeps after the eviction step that follows the prefill."""
    engine = EvictionEngine(model, policy, config)
    output = engine.generate(ids.tolist(), max_new_tokens=1)
    assert output.stats.evictions == 1
    return held_positions(engine.last_cache)


def teacher_forced(
    model,
    press,
    sequence: torch.Tensor,
    prompt_length: int,
    after_step: Callable[[DynamicCache], None] = lambda _: None,
    cache: DynamicCache | None = None,
) -> torch.Tensor:
    """NLL [T - 1] of each next token of `sequence` [T] under `press` (None: the full cache): the prompt in one
    forward, then one token per forward at its true position id (as `model.generate` and kvpress's pipeline feed
    them), with
    `after_step(cache)` after every forward that compressed the cache."""
    cache, nll = cache if cache is not None else DynamicCache(), []
    targets = sequence[1:]
    with torch.no_grad(), press(model) if press is not None else nullcontext():
        for start, end in [(0, prompt_length), *((t, t + 1) for t in range(prompt_length, len(sequence) - 1))]:
            before = cache.get_seq_length()
            positions = torch.arange(start, end)
            logits = model(sequence[None, start:end], past_key_values=cache, position_ids=positions[None]).logits[0]
            nll.append(torch.nn.functional.cross_entropy(logits.float(), targets[start:end], reduction="none"))
            if cache.get_seq_length() < before + end - start:
                after_step(cache)
    return torch.cat(nll)
