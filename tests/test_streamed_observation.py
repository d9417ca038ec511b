"""Streamed observation (`ObservedQueries.STREAM`, issue 41 §2; docs/notes/lean-state.md): the learned policy
observes each query of an eviction window right after the forward that made it and keeps the window's sums per
entry, instead of a ring of the window's L queries read at the step. Its features equal one block's (the loop
reference), and in the engine it keeps what the ring keeps, for replays and generations, ragged rows, a prompt
past the limit, and the sampled mode, while holding fewer bytes. Observation "forward" (`ObservedQueries.FORWARD`)
adds the same sums in the attention of the forward that made each query and is held to the same twins."""

from __future__ import annotations

import pytest
import torch

from foresight.models import describe
from foresight.policies import make_policy
from foresight.runtime.cache import EvictionCache
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.held_memory import held_bytes
from foresight.runtime.policy import ObservedQueries
from foresight.scorer.attention_features import FEATURE_NAMES, FeatureSet
from foresight.scorer.standardised_features import (
    PER_QUERY_HEAD_STATE,
    stream_observe,
    streamed_features,
    window_state,
)
from tests.prompts import random_prompts
from tests.reference_features import loop_standardised_features
from tests.scorers import random_scorer

B, L = 12, 4


@pytest.mark.parametrize("feature_set", ["standardised", "standardised-heuristic"])
def test_streaming_a_window_in_chunks_gives_the_features_of_one_block(feature_set):
    """A window of 40 queries (so the 8-, 16- and 32-query windows are proper parts of it) streamed in chunks of
    3, 1, 16, 7 and 13 queries, then the step's features from the state: the loop reference's features of the
    one block, within float32 rounding of sums of at most 40 terms; the window sums back to 0 after the step."""
    generator = torch.Generator().manual_seed(3)
    batch, kv_heads, group, entries, window = 2, 2, 3, 50, 40
    query_positions = torch.arange(100, 100 + window).repeat(batch, 1)
    positions = torch.cat([torch.randperm(100, generator=generator)[:10].sort().values, query_positions[0]])
    positions = positions.repeat(batch, kv_heads, 1)
    positions[1, :, :2] = -1  # invalid slots in row 1
    attention = torch.rand(batch, kv_heads, group, window, entries, generator=generator) / entries
    sums = (batch, kv_heads, entries, group)
    state = {name: torch.rand(sums, generator=generator) for name in PER_QUERY_HEAD_STATE}
    first_observed = torch.tensor([20, 100])
    streamed = {**state, **{name: torch.zeros(sums) for name in window_state(feature_set)}}
    evicts_after = query_positions[:, -1]
    start = 0
    for size in (3, 1, 16, 7, 13):
        chunk = slice(start, start + size)
        streamed = stream_observe(
            attention[..., chunk, :], streamed, query_positions[:, chunk], evicts_after, feature_set
        )
        start += size
    features, reset = streamed_features(streamed, positions, evicts_after, first_observed, feature_set)
    names = FEATURE_NAMES[FeatureSet.parse(feature_set)]
    expected, expected_state = loop_standardised_features(
        attention.double(), state, positions, query_positions, names, first_observed
    )
    for name in PER_QUERY_HEAD_STATE:
        torch.testing.assert_close(streamed[name].double(), expected_state[name], rtol=1e-5, atol=0)
    # log(x + 1e-6) of float32 sums: x's relative error (<= 40 u ~ 5e-6) moves it by at most that much.
    torch.testing.assert_close(features.double(), expected, rtol=0, atol=1e-5)
    assert set(reset) == set(window_state(feature_set)) and all(bool((value == 0).all()) for value in reset.values())


def test_the_older_sets_read_the_window_and_stream_is_the_default_of_the_standardised(llama):
    """The standardised sets stream by default and hold six sums per query head and no ring; "window" keeps the
    ring of L queries and three sums; an older set (block max and min) always reads the window."""
    standardised = random_scorer(llama, feature_set="standardised")
    streaming = make_policy("foresight", scorer=standardised)
    assert streaming.observed_queries is ObservedQueries.STREAM
    assert [field.name for field in streaming.state_fields] == [*PER_QUERY_HEAD_STATE, *window_state("standardised")]
    assert window_state("standardised") == ("window_8", "window_16", "window_32")
    assert window_state("standardised-heuristic") == ("window_8", "window_16", "window_32", "window_1")
    ring = make_policy("foresight", scorer=standardised, observation="window")
    assert ring.observed_queries is ObservedQueries.WINDOW
    assert [field.name for field in ring.state_fields] == list(PER_QUERY_HEAD_STATE)
    paper = make_policy("foresight", scorer=random_scorer(llama, feature_set="paper"))
    assert paper.observed_queries is ObservedQueries.WINDOW
    with pytest.raises(ValueError, match="observation"):
        make_policy("foresight", scorer=standardised, observation="ring")
    with pytest.raises(ValueError, match="stream_block must be a positive number of queries, got 0"):
        make_policy("foresight", scorer=standardised, stream_block=0)


class Compactions:
    """Every compaction's kept positions [layers, batch, Hkv, N] (-1 on dropped and invalid slots)."""

    def __init__(self, monkeypatch):
        self.steps: list[torch.Tensor] = []
        compact = EvictionCache.compact

        def recording(cache, keep, width):
            held = torch.stack([layer.entry_positions() for layer in cache.layers])
            self.steps.append(held.masked_fill(~keep, -1))
            compact(cache, keep, width)

        monkeypatch.setattr(EvictionCache, "compact", recording)

    def take(self) -> list[torch.Tensor]:
        steps, self.steps = self.steps, []
        return steps


BLOCKS = [{"stream_block": 1}, {"stream_block": 3}, {}, {"observation": "forward"}]
"""Every query, blocks across the windows, the default 4, and the sums added by the forward's own attention."""


def _twins(llama, feature_set: str, run, observation: str = "stream", **options):
    """`run(engine)` under the streaming policy (`observation` "stream" or "forward") and under the ring's: their
    outputs, kept sets and held bytes."""
    scorer = random_scorer(llama, feature_set=feature_set)
    results = []
    for twin in (observation, "window"):
        policy = make_policy("foresight", scorer=scorer, observation=twin, **options)
        engine = EvictionEngine(llama, policy, EvictionConfig(B, L, sinks=0, protect_prompt=False))
        results.append((run(engine), policy, engine.last_cache.storage_bytes()))
    return results


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("feature_set", ["standardised", "standardised-heuristic", "standardised-grouped"])
def test_a_streamed_replay_keeps_what_the_ring_keeps(llama, monkeypatch, feature_set, block):
    """Ragged rows (prefills of 21, 7 and 12 tokens: the first past B + L, evicting at its prefill; the others'
    first windows begin inside the prefill or in a later chunk): the same kept (layer, row, head) sets at every
    step and the same losses, with less memory held."""
    log = Compactions(monkeypatch)
    sequences = [torch.tensor(prompt) for prompt in random_prompts([60, 47, 53], seed=8)]
    kept = []

    def replay(engine):
        output = engine.replay(sequences, [21, 7, 12])
        kept.append(log.take())
        return output

    (streamed, _, streamed_bytes), (ring, _, ring_bytes) = _twins(llama, feature_set, replay, **block)
    assert streamed.stats.evictions == ring.stats.evictions >= 8
    assert len(kept[0]) == len(kept[1]) and all(torch.equal(a, b) for a, b in zip(*kept))
    for mine, theirs in zip(streamed.nll, ring.nll, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert streamed_bytes < ring_bytes


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("options", [{}, {"mode": "sampled", "seed": 5}])
def test_a_streamed_generation_keeps_what_the_ring_keeps(llama, monkeypatch, options, block):
    """Generation from prompts of 5, 11 and 14 tokens (rows evicting at different forwards; the last's first window
    begins inside its prefill): the same tokens, kept sets and, in sampled mode, the same draws and pools."""
    log = Compactions(monkeypatch)
    kept = []

    def generate(engine):
        output = engine.generate(random_prompts([5, 11, 14], seed=1), 30)
        kept.append(log.take())
        return output

    (streamed, stream_policy, _), (ring, ring_policy, _) = _twins(llama, "standardised", generate, **options, **block)
    assert streamed.tokens == ring.tokens and streamed.stats.evictions > 5
    assert len(kept[0]) == len(kept[1]) and all(torch.equal(a, b) for a, b in zip(*kept))
    assert len(stream_policy.records) == len(ring_policy.records)
    for mine, theirs in zip(stream_policy.records, ring_policy.records, strict=True):
        assert torch.equal(mine.order, theirs.order) and torch.equal(mine.query_positions, theirs.query_positions)
        torch.testing.assert_close(mine.features, theirs.features, rtol=0, atol=1e-4)


@pytest.mark.parametrize("block", [1, 4])
def test_held_bytes_of_a_streaming_policy_count_its_sums_and_its_waiting_queries(llama, block):
    """Six float32 sums per query head and entry, no ring, and the queries of one block waiting to be observed: the
    accounting equals the live cache's bytes at B + L entries while a whole block waits (after the forward that
    completes it, before its observation)."""
    scorer = random_scorer(llama, feature_set="standardised")
    shape = describe(llama)
    policy = make_policy("foresight", scorer=scorer, stream_block=block)
    stream = held_bytes(shape, policy, B, L, torch.float32)
    ring = held_bytes(shape, make_policy("foresight", scorer=scorer, observation="window"), B, L, torch.float32)
    group = shape.num_query_heads // shape.num_kv_heads
    entries = B + L
    assert stream.state == shape.num_layers * entries * shape.num_kv_heads * 6 * group * 4 == 2 * ring.state
    assert stream.ring == 0 and ring.ring > 0
    per_query = shape.num_query_heads * shape.head_dim * 4 + 4  # float32 vector per query head and its position
    assert stream.buffered == shape.num_layers * block * per_query
    engine = EvictionEngine(llama, policy, EvictionConfig(B, L))
    waiting = []
    stream_queries = engine.evict._stream_queries

    def spy(run, complete_blocks_only):
        if engine.last_stats.evictions and run.cache.layers[0].unobserved_count == block:
            waiting.append(run.cache.storage_bytes())
        stream_queries(run, complete_blocks_only)

    engine.evict._stream_queries = spy
    engine.generate(random_prompts([6], seed=3), 24)
    assert stream.total in waiting and max(waiting) == stream.total


def test_queries_before_every_rows_first_window_are_not_recorded(llama, monkeypatch):
    """Prompts of 5 and 7 tokens at B = 12, L = 4: each row's windows begin at its 13th token, so neither the prefill
    nor the decode tokens before then record a query (each would add nothing to any sum, and the prefill's L would
    be held at the cache's fullest): every block the policy observes holds a query of some window, and the first
    comes with the 13th token of the longer row."""
    policy = make_policy("foresight", scorer=random_scorer(llama, feature_set="standardised"))
    observed = []
    stream_observe = policy.stream_observe

    def spy(contexts):
        observed.append(contexts[0].query_positions.clone())
        return stream_observe(contexts)

    monkeypatch.setattr(policy, "stream_observe", spy)
    EvictionEngine(llama, policy, EvictionConfig(B, L)).generate(random_prompts([5, 7], seed=2), 30)
    assert len(observed) > 4 and all(bool((block >= 0).any()) for block in observed)
    assert int(observed[0].max()) >= B  # position 12 is a row's 13th token


def test_sums_of_16_bits_add_in_the_forward_as_in_a_stream_of_one_query(llama, monkeypatch):
    """Decayed and recent sums stored at float16 (computed in float32 and stored once per query either way): the
    forward's observation keeps exactly what a stream of one query at a time keeps, at every step."""
    log = Compactions(monkeypatch)
    scorer = random_scorer(llama, feature_set="standardised")
    kept = []
    for options in ({"observation": "forward"}, {"observation": "stream", "stream_block": 1}):
        policy = make_policy("foresight", scorer=scorer, sums_dtype="float16", **options)
        engine = EvictionEngine(llama, policy, EvictionConfig(B, L, sinks=0, protect_prompt=False))
        engine.generate(random_prompts([5, 11, 14], seed=4), 30)
        kept.append(log.take())
    assert len(kept[0]) == len(kept[1]) > 5 and all(torch.equal(a, b) for a, b in zip(*kept))


def test_an_observing_forward_holds_no_query(llama):
    """Observation "forward" holds the streamed sums and no query, ring or block: its accounting has neither, and the
    live cache after a run matches it."""
    scorer = random_scorer(llama, feature_set="standardised")
    forward = make_policy("foresight", scorer=scorer, observation="forward")
    assert forward.observed_queries is ObservedQueries.FORWARD
    assert forward.state_fields == make_policy("foresight", scorer=scorer).state_fields
    held = held_bytes(describe(llama), forward, B, L, torch.float32)
    stream = held_bytes(describe(llama), make_policy("foresight", scorer=scorer), B, L, torch.float32)
    assert held.ring == held.buffered == 0 and held.state == stream.state and held.total < stream.total
    engine = EvictionEngine(llama, forward, EvictionConfig(B, L))
    engine.generate(random_prompts([6], seed=3), 24)
    assert engine.last_cache.storage_bytes() == held.total
    assert all(not layer.unobserved and layer.queries is None for layer in engine.last_cache.layers)


def test_an_observing_forward_is_refused_where_attention_is_not_its_own(llama):
    """A static decode step (SDPA over fixed buffers) and the pooled layout (owner-masked SDPA) do not run the
    observing attention: each is one line naming the value and what is allowed."""
    forward = make_policy("foresight", scorer=random_scorer(llama, feature_set="standardised"), observation="forward")
    with pytest.raises(ValueError, match="decode_step='static'.*give observation='stream'"):
        EvictionEngine(llama, forward, EvictionConfig(B, L), decode_step="static")
    with pytest.raises(ValueError, match="observation 'forward'.*give observation='stream'"):
        EvictionEngine(llama, forward, EvictionConfig(B, L, layout="pooled"))
