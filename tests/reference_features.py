"""Slow, obvious twins of the learned scorer: its attention features by loops over batch, head, entry and
query, and its per-(layer, KV head) MLPs as independent modules (docs/algorithms.md section 5)."""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from foresight.scorer.attention_features import DECAY, FEATURE_NAMES, WINDOWS, FeatureSet
from foresight.scorer.model import ForesightScorer

PAPER_WINDOWS = (8, 16, 32)  # the paper set's query windows


def independent_mlp(scorer: ForesightScorer, layer: int, head: int) -> nn.Sequential:
    """The paper's per-(layer, head) MLP as plain modules, holding the stacked weights of that slice."""
    config = scorer.config
    mlp = nn.Sequential(nn.Linear(config.input_dim, config.hidden), nn.GELU(), nn.Linear(config.hidden, 1))
    with torch.no_grad():
        mlp[0].weight.copy_(scorer.w1[layer, head].T)
        mlp[0].bias.copy_(scorer.b1[layer, head])
        mlp[2].weight.copy_(scorer.w2[layer, head][None])
        mlp[2].bias.copy_(scorer.b2[layer, head][None])
    return mlp


STANDARDISED_NAMES = ("last_8", "last_16", "last_32", "recent_128", "decayed", "cumulative_rate", "log_age")


def stored_count(position: int, queries: list[int], first_observed: int | None) -> int:
    """The observed count the cache once stored for an entry, counted query by query: every query a row observed
    before this block (all of them from its first observed query on, L at a time) and the block's valid `queries`,
    that is not before the entry. `first_observed` None: this block is the row's first."""
    earlier = range(first_observed, min(q for q in queries if q >= 0)) if first_observed is not None else ()
    return sum(position <= q for q in earlier) + sum(0 <= q and position <= q for q in queries)


def loop_standardised_features(
    attention, state, positions, query_positions, names=STANDARDISED_NAMES, first_observed=None
):
    """A standardised set's features (`names`, per query head) before standardisation and the new state,
    one python float at a time: attention [batch, Hkv, G, l, N]; state {cumulative, decayed, recent:
    [batch, Hkv, N, G]}; positions [batch, Hkv, N]; query_positions [batch, l]; first_observed [batch] or None
    (`stored_count`). Every query weighs factor ** (1 / tokens) per token it is older than the block's newest;
    "pooled_last_8" is the largest "last_8" among the slots n - 3 .. n + 3; "cumulative_rate" divides by the
    stored count."""
    batch, kv_heads, group, rows, entries = attention.shape
    width = len(names)
    features = torch.zeros(batch, kv_heads, entries, group * width, dtype=torch.float64)
    new = {name: torch.zeros_like(value, dtype=torch.float64) for name, value in state.items()}

    def last(b, h, g, n, size):
        return sum(float(attention[b, h, g, q, n]) for q in range(max(0, rows - size), rows))

    for b, h, n in itertools.product(range(batch), range(kv_heads), range(entries)):
        position, queries = int(positions[b, h, n]), [int(q) for q in query_positions[b]]
        first = None if first_observed is None else int(first_observed[b])
        observed = stored_count(position, queries, first) if position >= 0 else 0
        age = max(max(queries) - position, 0)
        for g in range(group):
            column = [float(attention[b, h, g, q, n]) for q in range(rows)]
            new["cumulative"][b, h, n, g] = float(state["cumulative"][b, h, n, g]) + sum(column)
            for name, factor, tokens in (("decayed", 0.9, 256), ("recent", 0.5, 128)):
                per_token = factor ** (1 / tokens)
                history = per_token**rows * float(state[name][b, h, n, g])
                new[name][b, h, n, g] = history + sum(per_token ** (rows - 1 - q) * a for q, a in enumerate(column))
            values = {f"last_{size}": last(b, h, g, n, size) for size in (1, 8, 16, 32)}
            values["pooled_last_8"] = max(last(b, h, g, m, 8) for m in range(max(0, n - 3), min(entries, n + 4)))
            values["recent_128"] = float(new["recent"][b, h, n, g])
            values["decayed"] = float(new["decayed"][b, h, n, g])
            values["cumulative_rate"] = float(new["cumulative"][b, h, n, g]) / max(observed, 1)
            for f, name in enumerate(names):
                value = math.log1p(age) if name == "log_age" else math.log(values[name] + 1e-6)
                features[b, h, n, g * width + f] = value
    return features, new


def loop_standardise(features: torch.Tensor, valid: torch.Tensor, eps: float = 1e-2) -> torch.Tensor:
    """Each column of features [batch, Hkv, C, W] standardised over the valid candidates valid [batch, Hkv, C]
    of its (row, head): (x - mean) / (population std + eps); invalid candidates 0."""
    out = torch.zeros_like(features, dtype=torch.float64)
    batch, kv_heads, candidates, width = features.shape
    for b, h, w in itertools.product(range(batch), range(kv_heads), range(width)):
        kept = [c for c in range(candidates) if valid[b, h, c]]
        xs = [float(features[b, h, c, w]) for c in kept]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
        for c, x in zip(kept, xs):
            out[b, h, c, w] = (x - mean) / (std + eps)
    return out


def loop_features(attention: torch.Tensor, cumulative: torch.Tensor, decayed: torch.Tensor) -> torch.Tensor:
    """Paper features (F = 6) of one (row, KV head) by loops: attention [G, L, N], states [N, G] -> [N, 6G]."""
    group, window, entries = attention.shape
    rows = []
    for n in range(entries):
        row = []
        for g in range(group):
            received = [float(attention[g, q, n]) for q in range(window)]
            sums = [sum(received[max(0, window - size) :]) for size in PAPER_WINDOWS] + [sum(received)]
            row += sums + [float(cumulative[n, g]) + sum(received), DECAY * float(decayed[n, g]) + sum(received)]
        rows.append(row)
    return torch.log1p(torch.tensor(rows))


def foresight(
    scorer: ForesightScorer, layer: int, head: int, keys, values, attention, cumulative, decayed, candidates: int
):
    """The learned policy's keep scores of one (row, KV head): its independent MLP of [k || v || a] on the
    loop features, for the first `candidates` entries (keys, values [N, D]; attention [G, L, N]; states [N, G])."""
    inputs = torch.cat([keys, values, loop_features(attention, cumulative, decayed)], -1)[:candidates]
    return independent_mlp(scorer, layer, head)(inputs).squeeze(-1)


def loop_attention_features(attention, cumulative, decayed, feature_set):
    """A log1p feature set (paper, official-8, pooled) and the new cumulative and decayed states, one python
    float at a time: the obvious reading of the feature definitions (attention [batch, Hkv, G, L, N])."""
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
                    last_8 = [
                        sum(float(attention[b, h, g, q, m]) for q in range(max(0, rows - 8), rows)) for m in neighbours
                    ]
                    values["pooled_last_8"] = max(last_8)
                    values["pooled_last_L"] = max(float(attention[b, h, g, :, m].sum()) for m in neighbours)
                    for f, name in enumerate(names):
                        features[b, h, n, g * len(names) + f] = math.log1p(values[name])
    return features, new_cumulative, new_decayed
