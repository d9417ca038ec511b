"""The eviction step over every layer at once (foresight.runtime.engine): its stacked reads against the cache's own
per-layer methods (every layer's entry positions from one shared mask, and every layer's ring of latest queries
rotated at once, equal `EvictionLayer.entry_positions` and `EvictionLayer.buffered_queries` for all rows and for a
subset); policies scoring the layers as the rows of one batch against each layer on its own; and a step's
operations, the same whatever the model's depth."""

from __future__ import annotations

import pytest
import torch

from foresight.models import tiny_model
from foresight.policies import make_policy
from foresight.runtime.device_ops import DeviceOps
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.eviction_step import _entry_positions
from tests.prompts import prompts
from tests.scorers import random_scorer

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
    queries, query_positions = engine.evict._window_queries(cache, index)
    for layer, layer_positions, layer_queries in zip(cache.layers, positions, queries, strict=True):
        expected = layer.entry_positions() if index is None else layer.entry_positions()[index]
        assert torch.equal(layer_positions, expected)
        expected_queries, expected_positions = layer.buffered_queries(index)
        assert torch.equal(layer_queries, expected_queries) and torch.equal(query_positions, expected_positions)


def one_layer_at_a_time(name: str):
    """Policy `name` observing and scoring each layer on its own: the reference of `rows_alone`."""
    policy = make_policy(name)
    return type(f"{type(policy).__name__}AloneByLayer", (type(policy),), {"rows_alone": False})(**policy.options())


@pytest.mark.parametrize("name", ["snapkv", "tova", "h2o"])
def test_layers_scored_as_rows_of_one_batch_keep_what_each_layer_keeps_alone(llama, name):
    """Ragged rows (steps of some rows only, invalid slots) and rows in step: the same held entries in every layer
    and the same logits, whether the policy sees the step's layers as one batch or one layer at a time."""
    runs = []
    for policy in (make_policy(name), one_layer_at_a_time(name)):
        assert policy.rows_alone is (len(runs) == 0)
        engine = EvictionEngine(llama, policy, EvictionConfig(B, L))
        output = engine.generate(prompts([5, 11, 20, 20], seed=2), 30, return_logits=True)
        runs.append((output, [layer.entry_positions() for layer in engine.last_cache.layers]))
    (batched, held), (alone, held_alone) = runs
    assert batched.stats.evictions == alone.stats.evictions >= 5
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(held, held_alone, strict=True))
    assert torch.equal(batched.logits, alone.logits)


@pytest.mark.parametrize("name", ["snapkv", "tova", "h2o", "foresight"])
def test_an_eviction_step_runs_as_many_operations_whatever_the_depth(name):
    """Every field stacked across layers (one gather per field compacts them all) and the policy's layers scored at
    once: a whole eviction step, H2O's observation of every query included, runs the same operations for a model
    of 2 layers as for one of 4."""
    counted = []
    for layers in (2, 4):
        model = tiny_model("llama", num_hidden_layers=layers)
        policy = make_policy(name, scorer=random_scorer(model)) if name == "foresight" else make_policy(name)
        ops = DeviceOps()
        engine = EvictionEngine(model, policy, EvictionConfig(B, L), step_observer=ops)
        output = engine.replay([torch.tensor(p) for p in prompts([40, 40])], [8, 8])
        assert output.stats.evictions >= 5
        counted.append(ops.total / output.stats.evictions)
    assert counted[0] == counted[1] > 0
