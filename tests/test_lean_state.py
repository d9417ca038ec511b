"""The learned policy's lean state (issue 41 §2, docs/notes/lean-state.md): the dtype of every field it holds,
the observed count derived from positions against the stored count it replaces, observation in sub-blocks of
32 against one block, and the float16 query ring against a float32 one within fp16's rounding."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from foresight.models import tiny_model
from foresight.policies import foresight as foresight_policy
from foresight.policies import make_policy
from foresight.runtime.cache import POSITION_DTYPE, EvictionLayer, StateField, ring_dtype
from foresight.runtime.capture import block_attention, sub_blocks
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.policy import EvictionContext, Policy
from foresight.scorer.standardised_features import observed_queries
from tests.prompts import prompts
from tests.reference_features import stored_count
from tests.scorers import random_scorer

B, L = 12, 4


# -- dtypes ---------------------------------------------------------------------------------------
def test_every_field_is_held_at_its_declared_dtype(llama):
    """After a generation that evicts: K/V at the model's dtype, positions and query positions int32, each state
    field at its declared dtype (cumulative float32, the bounded sums float16), the ring float16 as asked."""
    scorer = random_scorer(llama, feature_set="standardised")
    assert make_policy("foresight", scorer=scorer).buffered_query_dtype == torch.float32  # the default
    policy = make_policy("foresight", scorer=scorer, sums_dtype="float16", query_dtype="float16", observation="window")
    assert {f.name: f.dtype for f in policy.state_fields} == {
        "cumulative": torch.float32,
        "decayed": torch.float16,
        "recent": torch.float16,
    }
    engine = EvictionEngine(llama, policy, EvictionConfig(B, L))
    assert engine.generate(prompts([5, 9]), 24).stats.evictions >= 3
    for layer in engine.last_cache.layers:
        buffers = layer.storage.buffers
        assert buffers["keys"].dtype == buffers["values"].dtype == torch.float32
        assert buffers["positions"].dtype == layer.query_positions.dtype == POSITION_DTYPE == torch.int32
        assert {f.name: layer.state[f.name].dtype for f in policy.state_fields} == {
            f.name: f.dtype for f in policy.state_fields
        }
        assert {f.name: layer.state[f.name].shape for f in policy.state_fields} == dict.fromkeys(
            (f.name for f in policy.state_fields), (2, llama.config.num_key_value_heads, B, 2)
        )  # [batch, Hkv, N, G]: packed by dtype, each field a view of its pack
        assert layer.queries.dtype == torch.float16


def test_the_ring_narrows_only_where_it_saves_bytes():
    assert ring_dtype(torch.float32, torch.float16) == torch.float16
    assert ring_dtype(torch.bfloat16, torch.float16) == torch.bfloat16  # a bf16 model's queries are not rounded again
    assert ring_dtype(torch.float32, None) == torch.float32
    with pytest.raises(ValueError, match="float64"):
        StateField("sum", dtype=torch.float64)
    with pytest.raises(ValueError, match="sums_dtype"):
        make_policy("foresight", scorer=random_scorer(tiny_model("llama")), sums_dtype="int8")


# -- observed: derived against stored -------------------------------------------------------------
def test_derived_observed_equals_the_stored_count_block_after_block():
    """Rows observing blocks of L consecutive queries from their own first (the first block of row 1 padded):
    the derived count equals, after every block, the count summed block by block as the cache once stored it."""
    generator = torch.Generator().manual_seed(0)
    interval, blocks = 8, 5
    starts = torch.tensor([40, 3])  # each row's first block starts here (row 1: 2 padding queries in front)
    positions = torch.stack([torch.randperm(90, generator=generator)[:50].sort().values for _ in range(2)])[:, None]
    positions = torch.cat([positions, positions.flip(-1)], 1)  # [2, 2 heads, 50], one head in reverse order
    positions[1, :, :4] = -1
    stored = torch.zeros(positions.shape, dtype=torch.long)
    first = None
    for block in range(blocks):
        query_positions = starts[:, None] + block * interval + torch.arange(interval)
        if block == 0:
            query_positions[1, :2] = -1
            first = torch.tensor([40, 5])
        queries = query_positions[:, None, None, :]
        stored += ((positions[..., None] <= queries) & (queries >= 0)).sum(-1)
        derived = observed_queries(positions, query_positions.amax(-1), first)
        torch.testing.assert_close(derived, stored.masked_fill(positions < 0, 0), rtol=0, atol=0)  # invalid: 0
        for b, h, n in ((0, 0, 0), (1, 1, 7), (1, 0, 2)):  # and against the loop twin's count
            position = int(positions[b, h, n])
            want = stored_count(position, query_positions[b].tolist(), None if block == 0 else int(first[b]))
            assert int(derived[b, h, n]) == (want if position >= 0 else 0)


@dataclass
class StoredCount(Policy):
    """A WINDOW policy that stores the observed count as the learned policy's state once did (one float per
    entry, + the block's queries not before it, gathered on eviction) and records it beside the derived count."""

    name = "stored-count"
    needs_attention = True
    state_fields = (StateField("observed"),)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def observe(self, context: EvictionContext) -> dict[str, torch.Tensor]:
        queries = context.query_positions[:, None, None, :]
        counted = ((context.positions[..., None] <= queries) & (queries >= 0)).sum(-1)
        stored = context.state["observed"] + counted
        derived = observed_queries(context.positions, context.query_positions.amax(-1), context.first_observed)
        self.pairs.append((stored.masked_fill(context.positions < 0, 0), derived))
        return {"observed": stored}

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        return context.keys[..., : context.num_candidates, 0]  # any score: entries leave with their counts


@pytest.mark.parametrize("lengths", [[5, 9, 3], [30, 6]])  # ragged rows; a prompt longer than B + L
def test_derived_observed_equals_the_stored_count_in_the_engine(llama, lengths):
    policy = StoredCount()
    engine = EvictionEngine(llama, policy, EvictionConfig(B, L))
    assert engine.generate(prompts(lengths), 30).stats.evictions >= 5
    assert len(policy.pairs) >= 5 * llama.config.num_hidden_layers
    for stored, derived in policy.pairs:
        torch.testing.assert_close(derived.float(), stored, rtol=0, atol=0)


# -- sub-blocks -----------------------------------------------------------------------------------
def learned_step(scorer, interval: int, seed: int = 0) -> EvictionContext:
    """A step of layer 1 with `interval` buffered queries over 20 candidates and the recent window, row 1 with
    invalid slots, and a running state from earlier steps."""
    config = scorer.config
    generator = torch.Generator().manual_seed(seed)
    rows, entries, candidates = 2, 20 + interval, 20
    start = 100
    positions = torch.cat(
        [torch.randperm(start, generator=generator)[:candidates].sort().values, start + torch.arange(interval)]
    )
    positions = positions.repeat(rows, config.num_kv_heads, 1)
    positions[1, :, :3] = -1
    sums = (rows, config.num_kv_heads, entries, config.num_query_heads // config.num_kv_heads)
    return EvictionContext(
        layer_idx=1,
        num_layers=config.num_layers,
        keys=torch.randn(rows, config.num_kv_heads, entries, config.head_dim, generator=generator),
        values=torch.randn(rows, config.num_kv_heads, entries, config.head_dim, generator=generator),
        positions=positions,
        num_candidates=candidates,
        scaling=config.head_dim**-0.5,
        state={name: torch.rand(sums, generator=generator) for name in ("cumulative", "decayed", "recent")},
        queries=torch.randn(rows, config.num_query_heads, interval, config.head_dim, generator=generator) * 2,
        query_positions=(start + torch.arange(interval)).repeat(rows, 1),
        first_observed=torch.tensor([10, 30]),
    )


@pytest.mark.parametrize("feature_set", ["standardised", "standardised-heuristic"])
def test_sub_blocks_of_32_give_the_features_of_one_block(llama, feature_set):
    """L = 96: three sub-blocks of 32 against one product of all 96 queries. The sums differ by float32
    summation order only (at most 96 terms: ~96 * 2**-24 ~ 6e-6 relative), the log features by as much
    absolutely, and the standardised ones by that over (std + 1e-2) >= 1e-2: atol 1e-3."""
    scorer = random_scorer(llama, feature_set=feature_set, budget=128, interval=96)
    context = learned_step(scorer, 96)
    one = [
        (
            block_attention(context.queries, context.query_positions, context.keys, context.positions, context.scaling),
            context.query_positions,
        )
    ]
    arguments = (context.state, context.positions, context.query_positions, 20, feature_set, context.first_observed)
    want, want_state = foresight_policy._features(one, *arguments)
    blocks = list(
        sub_blocks(context.queries, context.query_positions, context.keys, context.positions, context.scaling)
    )
    assert [attention.shape[3] for attention, _ in blocks] == [32, 32, 32]
    features, state = foresight_policy.observe_features(context, feature_set)
    torch.testing.assert_close(features, want, rtol=0, atol=1e-3)
    for name, value in want_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-7)


# -- float16 ring ---------------------------------------------------------------------------------
def test_a_float16_ring_moves_attention_within_fp16_rounding(llama):
    """Queries round-tripped through the fp16 ring: each element moves by at most u = 2**-11 relative (fp16's
    unit roundoff), so each logit q·k·s by at most δ = u·s·Σ|q_d k_d|, and each softmax weight p by at most
    p·(exp(2δ) − 1) (log p = logit − logsumexp moves by ≤ 2δ); every window sum of weights then moves by at
    most the same relative amount, and its log feature by at most 2δ (+ float32 noise)."""
    scorer = random_scorer(llama, feature_set="standardised", budget=20, interval=8)
    context = learned_step(scorer, 8, seed=3)
    rings = []
    for dtype in (torch.float32, torch.float16):
        layer = EvictionLayer(query_window=8, query_dtype=dtype)
        layer.record_queries(context.queries, context.query_positions)
        rings.append(layer.buffered_queries()[0])
    assert rings[1].dtype == torch.float16
    assert ((rings[1].float() - rings[0]).abs() <= rings[0].abs() * 2**-11).all()
    exact, rounded = (
        block_attention(ring, context.query_positions, context.keys, context.positions, context.scaling)
        for ring in rings
    )
    grouped = context.queries.reshape(2, context.keys.shape[1], -1, 8, context.keys.shape[-1])
    delta = 2**-11 * context.scaling * torch.einsum("bhgld,bhnd->bhgln", grouped.abs(), context.keys.abs())
    bound = (2 * delta.amax(-1, keepdim=True)).expm1() * exact + 1e-6
    assert ((rounded - exact).abs() <= bound).all()
    assert (rounded != exact).any()  # the ring did round
    states = [
        foresight_policy.observe_features(dataclasses.replace(context, queries=ring.float()), "standardised")[1]
        for ring in rings
    ]
    bound = 2 * float(delta.amax())  # |log(S'/S)| <= -log(2 - exp(2δ)) = 2δ + O(δ²), δ ~ 1e-3 here
    for name in ("cumulative", "decayed", "recent"):
        moved = (states[1][name] / states[0][name]).log().abs()
        assert float(moved.amax()) <= 1.05 * bound + 1e-5
