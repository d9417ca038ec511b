"""Attention features against slow loop-based references, over one and several eviction steps."""

import math

import pytest
import torch

from foresight.features import DECAY, FEATURE_NAMES, FeatureSet, attention_features, feature_dim

WINDOWS = {"last_8": 8, "last_16": 16, "last_32": 32}


def random_block_attention(batch: int, kv_heads: int, group: int, rows: int, entries: int, seed: int) -> torch.Tensor:
    """Causal softmax of random logits [batch, Hkv, G, L, N]: query row q sees entries 0..N-L+q."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(batch, kv_heads, group, rows, entries, generator=generator, dtype=torch.float64)
    visible = torch.arange(entries)[None, :] <= torch.arange(rows)[:, None] + entries - rows
    return logits.masked_fill(~visible, float("-inf")).softmax(-1)


def reference_features(attention, cumulative, decayed, feature_set):
    """One python float at a time: the obvious reading of the feature definitions."""
    names = FEATURE_NAMES[FeatureSet(feature_set)]
    batch, kv_heads, group, rows, entries = attention.shape
    features = torch.zeros(batch, kv_heads, entries, group * len(names), dtype=torch.float64)
    new_cumulative = torch.zeros_like(cumulative)
    new_decayed = torch.zeros_like(decayed)
    for b in range(batch):
        for h in range(kv_heads):
            for n in range(entries):
                for g in range(group):
                    column = [float(attention[b, h, g, q, n]) for q in range(rows)]
                    total = sum(column)
                    new_cumulative[b, h, n, g] = float(cumulative[b, h, n, g]) + total
                    new_decayed[b, h, n, g] = DECAY * float(decayed[b, h, n, g]) + total
                    values = {
                        "max": max(column),
                        "min": min(column),
                        "block": total,
                        "last_L": total,
                        "cumulative": float(new_cumulative[b, h, n, g]),
                        "decayed": float(new_decayed[b, h, n, g]),
                    }
                    for name, size in WINDOWS.items():
                        values[name] = sum(column[max(0, rows - size) :])
                    neighbours = range(max(0, n - 3), min(entries, n + 4))  # 7 slots centred on n
                    last_8 = [sum(float(attention[b, h, g, q, m]) for q in range(max(0, rows - 8), rows)) for m in neighbours]
                    values["pooled_last_8"] = max(last_8)
                    values["pooled_last_L"] = max(float(attention[b, h, g, :, m].sum()) for m in neighbours)
                    for f, name in enumerate(names):
                        features[b, h, n, g * len(names) + f] = math.log1p(values[name])
    return features, new_cumulative, new_decayed


@pytest.mark.parametrize("feature_set", ["paper", "official-8", "pooled"])
@pytest.mark.parametrize("rows", [12, 40])  # 12: windows 16 and 32 clamp to L; 40: every window is distinct
def test_features_match_loop_reference(feature_set, rows):
    attention = random_block_attention(2, 2, 3, rows, rows + 6, seed=rows)
    state_shape = (2, 2, rows + 6, 3)
    generator = torch.Generator().manual_seed(1)
    cumulative = 5 * torch.rand(state_shape, generator=generator, dtype=torch.float64)
    decayed = 2 * torch.rand(state_shape, generator=generator, dtype=torch.float64)
    got = attention_features(attention, cumulative, decayed, feature_set)
    want = reference_features(attention, cumulative, decayed, feature_set)
    assert got[0].shape == (2, 2, rows + 6, 3 * feature_dim(feature_set))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_feature_dims_and_names():
    assert feature_dim("paper") == 6
    assert feature_dim(FeatureSet.OFFICIAL_8) == 8
    assert feature_dim("pooled") == 8
    with pytest.raises(ValueError, match="'bogus'.*'paper', 'official-8', 'pooled'"):
        feature_dim("bogus")


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
                torch.cat([torch.randperm(budget, generator=generator)[: budget - rows].sort().values,
                           torch.arange(budget, entries)])
                for _ in range(batch * kv_heads)
            ]
        ).view(batch, kv_heads, budget)
        identity = torch.cat([identity.gather(2, kept), torch.arange(next_id, next_id + rows).expand(batch, kv_heads, rows)], 2)
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
