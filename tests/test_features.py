"""Attention features against slow loop-based references, over one and several eviction steps; the older
sets pinned, and the standardised set's per-token decays and scale invariance."""

import math

import pytest
import torch

from foresight.scorer.attention_features import DECAY, FEATURE_NAMES, FeatureSet, attention_features, feature_dim
from foresight.scorer.standardised_features import standardise_candidates, standardised_features
from tests.reference_features import (
    STANDARDISED_NAMES,
    loop_attention_features,
    loop_standardise,
    loop_standardised_features,
)

WINDOWS = {"last_8": 8, "last_16": 16, "last_32": 32}


def random_block_attention(batch: int, kv_heads: int, group: int, rows: int, entries: int, seed: int) -> torch.Tensor:
    """Causal softmax of random logits [batch, Hkv, G, L, N]: query row q sees entries 0..N-L+q."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(batch, kv_heads, group, rows, entries, generator=generator, dtype=torch.float64)
    visible = torch.arange(entries)[None, :] <= torch.arange(rows)[:, None] + entries - rows
    return logits.masked_fill(~visible, float("-inf")).softmax(-1)


@pytest.mark.parametrize("feature_set", ["paper", "official-8", "pooled"])
@pytest.mark.parametrize("rows", [12, 40])  # 12: windows 16 and 32 clamp to L; 40: every window is distinct
def test_features_match_loop_reference(feature_set, rows):
    attention = random_block_attention(2, 2, 3, rows, rows + 6, seed=rows)
    state_shape = (2, 2, rows + 6, 3)
    generator = torch.Generator().manual_seed(1)
    cumulative = 5 * torch.rand(state_shape, generator=generator, dtype=torch.float64)
    decayed = 2 * torch.rand(state_shape, generator=generator, dtype=torch.float64)
    got = attention_features(attention, cumulative, decayed, feature_set)
    want = loop_attention_features(attention, cumulative, decayed, feature_set)
    assert got[0].shape == (2, 2, rows + 6, 3 * feature_dim(feature_set))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_feature_dims_and_names():
    assert feature_dim("paper") == 6
    assert feature_dim(FeatureSet.OFFICIAL_8) == 8
    assert feature_dim("pooled") == 8
    assert feature_dim("standardised") == 7
    assert feature_dim("standardised-heuristic") == 9
    with pytest.raises(
        ValueError, match="'bogus'.*'paper', 'official-8', 'pooled', 'standardised', 'standardised-heuristic'"
    ):
        feature_dim("bogus")
    with pytest.raises(ValueError, match="'standardised' features need entry positions"):
        attention_features(torch.zeros(1, 1, 1, 2, 3), torch.zeros(1, 1, 3, 1), torch.zeros(1, 1, 3, 1), "standardised")
    with pytest.raises(ValueError, match="feature_set must be a standardised set, got 'paper'"):
        standardised_features(*standardised_step(12, seed=0), "paper")


def test_uniform_attention_hand_computed_over_three_blocks():
    """Every query spreads its attention evenly over 4 entries: each block adds L/4 = 2 to every entry."""
    attention = torch.full((1, 1, 1, 8, 4), 0.25)
    cumulative = decayed = torch.zeros(1, 1, 4, 1)
    for _ in range(3):
        features, cumulative, decayed = attention_features(attention, cumulative, decayed, "paper")
    assert torch.allclose(cumulative, torch.full_like(cumulative, 6.0))
    assert torch.allclose(decayed, torch.full_like(decayed, 2.0 * (1 + 0.9 + 0.81)))
    # last 8, 16 (clamped to L = 8), 32 (clamped), L: all 2.0; then cumulative 6, decayed 5.42
    expected = torch.log1p(torch.tensor([2.0, 2.0, 2.0, 2.0, 6.0, 5.42]))
    torch.testing.assert_close(features[0, 0], expected.expand(4, 6))


def test_decayed_and_cumulative_across_steps_with_eviction_and_gather():
    """Three eviction steps as the runtime runs them: features, then evict by gather along dim 2, then
    append L fresh entries with state 0. A per-entry ledger keyed by entry identity is the reference."""
    batch, kv_heads, group, rows, budget = 2, 2, 2, 4, 6
    entries = budget + rows
    identity = torch.arange(entries).expand(batch, kv_heads, entries).clone()
    cumulative = torch.zeros(batch, kv_heads, entries, group, dtype=torch.float64)
    decayed = torch.zeros_like(cumulative)
    ledger: dict[tuple[int, int, int, int], tuple[float, float]] = {}
    next_id = entries
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        attention = random_block_attention(batch, kv_heads, group, rows, entries, seed=10 + step)
        features, cumulative, decayed = attention_features(attention, cumulative, decayed, "official-8")
        for b in range(batch):
            for h in range(kv_heads):
                for n in range(entries):
                    for g in range(group):
                        key = (b, h, int(identity[b, h, n]), g)
                        total = float(attention[b, h, g, :, n].sum())
                        cum, dec = ledger.get(key, (0.0, 0.0))
                        ledger[key] = (cum + total, DECAY * dec + total)
                        assert float(cumulative[b, h, n, g]) == pytest.approx(ledger[key][0], abs=1e-12)
                        assert float(decayed[b, h, n, g]) == pytest.approx(ledger[key][1], abs=1e-12)
                        assert math.expm1(float(features[b, h, n, 8 * g + 6])) == pytest.approx(ledger[key][0])
                        assert math.expm1(float(features[b, h, n, 8 * g + 7])) == pytest.approx(ledger[key][1])
        # Each (row, head) keeps its own B - L candidates and the recent window, in order.
        kept = torch.stack(
            [
                torch.cat(
                    [
                        torch.randperm(budget, generator=generator)[: budget - rows].sort().values,
                        torch.arange(budget, entries),
                    ]
                )
                for _ in range(batch * kv_heads)
            ]
        ).view(batch, kv_heads, budget)
        identity = torch.cat(
            [identity.gather(2, kept), torch.arange(next_id, next_id + rows).expand(batch, kv_heads, rows)], 2
        )
        next_id += rows
        fresh = torch.zeros(batch, kv_heads, rows, group, dtype=torch.float64)
        index = kept[..., None].expand(-1, -1, -1, group)
        cumulative = torch.cat([cumulative.gather(2, index), fresh], 2)
        decayed = torch.cat([decayed.gather(2, index), fresh], 2)
    survivors = [key for key, (cum, dec) in ledger.items() if abs(cum - dec) > 1e-6]
    assert survivors, "the decayed sum must differ from the cumulative one after several blocks"


def test_state_dtype_is_preserved_and_features_follow_attention_dtype():
    attention = random_block_attention(1, 1, 2, 4, 6, seed=3).float()
    state = torch.zeros(1, 1, 6, 2, dtype=torch.bfloat16)
    features, cumulative, decayed = attention_features(attention, state, state, "paper")
    assert features.dtype == torch.float32
    assert cumulative.dtype == decayed.dtype == torch.bfloat16


def test_bad_shapes_raise_one_line_errors():
    attention = random_block_attention(1, 2, 2, 4, 6, seed=0)
    with pytest.raises(ValueError, match=r"cumulative state must be .*\(1, 2, 6, 2\).*got \(1, 2, 2, 6\)"):
        attention_features(attention, torch.zeros(1, 2, 2, 6), torch.zeros(1, 2, 6, 2))
    with pytest.raises(ValueError, match=r"block attention must be .*got shape \(2, 4, 6\)"):
        attention_features(attention[0, 0], torch.zeros(1, 2, 6, 2), torch.zeros(1, 2, 6, 2))


# -- old sets pinned, and the "standardised" set ------------------------------------------------------
@pytest.mark.parametrize(
    "feature_set, total, weighted",
    [
        ("paper", 5684.5120637204145, -20.799491847229593),
        ("official-8", 5840.76322542157, -24.63215224600562),
        ("pooled", 6538.911239908564, 16.44021790267691),
    ],
)
def test_older_sets_compute_what_they_computed_before_the_standardised_set(feature_set, total, weighted):
    """Pinned sums of one step's features, computed before the standardised set was added (issue 21).

    Float64 end to end, so the pin holds on any CPU: the runtime's block attention is float32, and a BLAS
    that sums its 64-term dot products in another order moved the total by 1.5e-10 (relative) and the
    weighted sum by ~1e-7, which a pin of the feature rules must not see. (With the runtime's float32
    attention these inputs gave 5684.512062765131 / -20.799491046867924, 5840.763229384863 /
    -24.6321546292493 and 6538.911252256047 / 16.44021426935311, the values first pinned.)
    Tolerance from float64 arithmetic (eps = 1.1e-16): a logit's error is at most D * eps * max sum|q_i k_i|
    * scaling = 64 * 1.1e-16 * 26.4 = 1.9e-13, so a weight's relative error is at most ~2 * 1.9e-13 + N * eps
    (softmax over N = 160) = 4e-13; the total sums 4,320 non-negative terms (<= 4.8e-13 more), so one
    implementation is within 9e-13 of exact and two within 1.8e-12: rel = 1e-11. The weighted sum cancels
    (sum|terms| / |sum| = 150-254), so 254 * 1.8e-12 = 4.6e-10: rel = 2e-9. Both stay far below what any
    change of a feature rule moves (the float32 attention alone moves the weighted sum by 4e-8 to 2e-7)."""
    generator = torch.Generator().manual_seed(21)
    keys = torch.randn(1, 3, 160, 64, generator=generator).double()
    torch.randn(1, 3, 160, 64, generator=generator)  # the values of the pinned step
    cumulative = torch.rand(1, 3, 160, 3, generator=generator) * 30
    decayed = torch.rand(1, 3, 160, 3, generator=generator) * 3
    queries = (torch.randn(1, 9, 32, 64, generator=generator) * 3).double().view(1, 3, 3, 32, 64)
    logits = torch.einsum("bhgld,bhnd->bhgln", queries, keys) * 0.125  # block_attention's product, in float64
    visible = torch.arange(160) <= torch.arange(128, 160)[:, None]  # queries at 128..159, causal
    attention = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    features, _, _ = attention_features(attention, cumulative.double(), decayed.double(), feature_set)
    assert features.sum().item() == pytest.approx(total, rel=1e-11)
    index = torch.arange(features.numel(), dtype=torch.float64).view_as(features).sin()
    assert (features * index).sum().item() == pytest.approx(weighted, rel=2e-9)


def standardised_step(rows: int, seed: int, scale: float = 1.0):
    """One step as the runtime hands it: block attention [2, 2, 3, rows, N] over N = rows + 6 entries whose
    last `rows` are the block's queries, row 1 with 3 invalid slots in front and a padding query, and a
    random state; `scale` multiplies the attention and every raw sum."""
    batch, kv_heads, group, entries = 2, 2, 3, rows + 6
    generator = torch.Generator().manual_seed(seed)
    attention = random_block_attention(batch, kv_heads, group, rows, entries, seed=seed)
    first_query = 100
    positions = torch.cat(
        [
            torch.randperm(first_query, generator=generator)[:6].sort().values.repeat(batch, kv_heads, 1),
            torch.arange(first_query, first_query + rows).repeat(batch, kv_heads, 1),
        ],
        -1,
    )
    positions[1, :, :3] = -1
    query_positions = torch.arange(first_query, first_query + rows).repeat(batch, 1)
    query_positions[1, 0] = -1
    attention[1, :, :, 0] = 0.0  # a padding query sees nothing
    attention[1, ..., :3] = 0.0  # nor does anything see an invalid slot
    sums = (batch, kv_heads, entries, group)
    state = {
        "cumulative": 5 * torch.rand(sums, generator=generator, dtype=torch.float64),
        "decayed": 2 * torch.rand(sums, generator=generator, dtype=torch.float64),
        "recent": torch.rand(sums, generator=generator, dtype=torch.float64),
    }
    state = {name: scale * value for name, value in state.items()}
    return scale * attention, state, positions, query_positions


FIRST_OBSERVED = torch.tensor([37, 101])
"""`standardised_step`'s rows' first observed queries: row 0 observed every query from 37 on before this block;
this block is row 1's first (its padding query at 100 comes before its first observed one)."""


@pytest.mark.parametrize("feature_set", ["standardised", "standardised-heuristic"])
@pytest.mark.parametrize("rows", [12, 40])  # 12: windows 16 and 32 clamp to L; 40: every window is distinct
def test_standardised_features_match_loop_reference(rows, feature_set):
    attention, state, positions, query_positions = standardised_step(rows, seed=rows)
    features, new_state = standardised_features(
        attention, state, positions, query_positions, feature_set, FIRST_OBSERVED
    )
    names = FEATURE_NAMES[FeatureSet.parse(feature_set)]
    want_features, want_state = loop_standardised_features(
        attention, state, positions, query_positions, names, FIRST_OBSERVED
    )
    assert names[:7] == STANDARDISED_NAMES and feature_dim(feature_set) == len(names)
    torch.testing.assert_close(features, want_features, rtol=0, atol=1e-12)
    assert new_state.keys() == want_state.keys()
    for name, value in want_state.items():
        torch.testing.assert_close(new_state[name], value, rtol=0, atol=1e-12)
    valid = positions[..., :6] >= 0
    standardised = standardise_candidates(features[..., :6, :], valid)
    torch.testing.assert_close(standardised, loop_standardise(features[..., :6, :], valid), rtol=0, atol=1e-10)
    assert (standardised[1, :, :3] == 0).all()


def test_standardised_features_ignore_a_constant_factor_on_every_attention_sum():
    """x -> 10 x shifts log(x + 1e-6) by ln 10 up to the eps, which the standardisation removes."""
    attention, state, positions, query_positions = standardised_step(40, seed=7)
    valid = positions[..., :6] >= 0
    once = standardise_candidates(
        standardised_features(attention, state, positions, query_positions)[0][..., :6, :], valid
    )
    scaled = standardised_step(40, seed=7, scale=10.0)
    tenfold = standardise_candidates(standardised_features(*scaled)[0][..., :6, :], valid)
    torch.testing.assert_close(tenfold, once, rtol=0, atol=1e-3)
    assert not torch.allclose(
        standardised_features(*scaled)[0], standardised_features(attention, state, positions, query_positions)[0]
    )


def test_standardised_decay_is_per_token_whatever_L():
    """The same 256 queries observed in blocks of 32 or of 64 leave the same state and features; with no
    attention after them, 256 more tokens multiply the decayed sum by 0.9 and the recent one by 0.5 ** 2."""
    entries, queries = 300, 256
    attention = random_block_attention(1, 1, 2, queries, entries, seed=5)  # query q at position 44 + q
    positions, query_positions = torch.arange(entries)[None, None], torch.arange(entries - queries, entries)[None]
    finals = []
    for interval in (32, 64):
        state = {
            name: torch.zeros(1, 1, entries, 2, dtype=torch.float64) for name in ("cumulative", "decayed", "recent")
        }
        first = query_positions[:, 0]
        for start in range(0, queries, interval):
            block = slice(start, start + interval)
            features, state = standardised_features(
                attention[..., block, :], state, positions, query_positions[:, block], first_observed=first
            )
        quiet = state
        for _ in range(0, queries, interval):
            _, quiet = standardised_features(
                torch.zeros_like(attention[..., :interval, :]),
                quiet,
                positions,
                query_positions[:, :interval] + queries,
                first_observed=first,
            )
        torch.testing.assert_close(quiet["decayed"], 0.9 * state["decayed"], rtol=1e-12, atol=0)
        torch.testing.assert_close(quiet["recent"], 0.25 * state["recent"], rtol=1e-12, atol=0)
        finals.append((features, state))
    (features_32, state_32), (features_64, state_64) = finals
    torch.testing.assert_close(features_32, features_64, rtol=0, atol=1e-9)
    for name, value in state_32.items():
        torch.testing.assert_close(state_64[name], value, rtol=0, atol=1e-12)
    rate = STANDARDISED_NAMES.index("cumulative_rate")  # the entries before the queries were observed 256 times
    torch.testing.assert_close(
        features_32[0, 0, 0, rate], torch.log(state_32["cumulative"][0, 0, 0, 0] / queries + 1e-6), rtol=1e-12, atol=0
    )


def test_no_standardised_feature_grows_with_the_trace():
    """Uniform attention for 20 steps: the cumulative sum grows twentyfold, its per-query rate does not."""
    attention = torch.full((1, 1, 1, 8, 4), 0.25, dtype=torch.float64)
    state = {name: torch.zeros(1, 1, 4, 1, dtype=torch.float64) for name in ("cumulative", "decayed", "recent")}
    for step in range(20):
        features, state = standardised_features(
            attention,
            state,
            torch.arange(4)[None, None],
            torch.arange(4, 12)[None] + 8 * step,
            first_observed=torch.tensor([4]),
        )
        rate = features[0, 0, :, STANDARDISED_NAMES.index("cumulative_rate")]
        torch.testing.assert_close(rate, torch.full_like(rate, math.log(0.25 + 1e-6)))
    assert float(state["cumulative"][0, 0, 0, 0]) == pytest.approx(40.0)
