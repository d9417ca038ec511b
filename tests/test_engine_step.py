"""The eviction step's stacked reads (foresight.runtime.engine) against the cache's own per-layer methods: every
layer's entry positions from one shared mask, and every layer's ring of latest queries rotated at once, equal
`EvictionLayer.entry_positions` and `EvictionLayer.buffered_queries` for all rows and for a subset."""

from __future__ import annotations

import pytest
import torch

from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine, _entry_positions
from tests.prompts import prompts

B, L = 12, 4


@pytest.fixture(scope="module")
def finished(llama):
    """An engine and the cache of a run of rows of unequal prompts (invalid slots in front of the shorter rows),
    stopped where the query ring's cursor is past its first slot."""
    engine = EvictionEngine(llama, make_policy("snapkv", window=3), EvictionConfig(B, L))
    engine.generate(prompts([5, 11, 20], seed=1), 23)
    cache = engine.last_cache
    assert cache.layers[0].query_cursor != 0 and bool((cache.lengths < cache.layers[0].get_seq_length()).any())
    return engine, cache


@pytest.mark.parametrize("rows", [None, [0, 2], [1]])
def test_every_layers_positions_and_latest_queries_equal_the_layers_own(finished, rows):
    engine, cache = finished
    index = None if rows is None else torch.tensor(rows)
    lengths = cache.lengths.tolist() if rows is None else [int(cache.lengths[row]) for row in rows]
    positions = _entry_positions(cache, lengths, index)
    queries, query_positions = engine._window_queries(cache, index)
    for layer, layer_positions, layer_queries in zip(cache.layers, positions, queries, strict=True):
        expected = layer.entry_positions() if index is None else layer.entry_positions()[index]
        assert torch.equal(layer_positions, expected)
        expected_queries, expected_positions = layer.buffered_queries(index)
        assert torch.equal(layer_queries, expected_queries) and torch.equal(query_positions, expected_positions)
