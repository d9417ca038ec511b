"""Slow, obvious twins of the heuristic policies: explicit Python loops over batch, head, query
and entry, on plain floats (float64). Inputs are nested lists from `Tensor.tolist()`:
keys [batch][Hkv][N][D], positions [batch][Hkv][N] (-1 invalid), queries [batch][Hq][L][D],
query_positions [batch][L]. Every scoring function returns scores [batch][Hkv][C]; invalid
candidates get NaN (their score is never used).

The per-query rules (H2O, LazyEviction, RaaS) are written as docs/algorithms.md section 3 states them:
one query at a time, in position order, each updating a per-entry state held in a dict or list
(keyed by slot or by position) from the attention that query gave, `{entry: [weight per query head of
the group]}` (`group_attention`)."""

from __future__ import annotations

import math

NAN = float("nan")
MRI_EPSILON = 1e-5  # LazyEviction's H1 denominator (docs/algorithms.md section 3)


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def softmax(values: dict[int, float]) -> dict[int, float]:
    """Softmax of {slot: logit}; an empty dict stays empty."""
    if not values:
        return {}
    top = max(values.values())
    exps = {slot: math.exp(v - top) for slot, v in values.items()}
    total = sum(exps.values())
    return {slot: e / total for slot, e in exps.items()}


def attention_row(query, keys, positions, query_position, scaling, upto=None) -> dict[int, float]:
    """Attention of one query on one KV head's entries it can see ({slot: weight}); with `upto`,
    only the first `upto` slots take part (softmax over them alone)."""
    count = len(keys) if upto is None else upto
    logits = {
        n: dot(query, keys[n]) * scaling
        for n in range(count)
        if positions[n] >= 0 and positions[n] <= query_position
    }
    return softmax(logits)


def group_attention(query_heads, keys, positions, query_position, scaling) -> dict[int, list[float]]:
    """The attention one token's G query heads give one KV head's entries it can see:
    {slot: [weight per query head]}."""
    rows = [attention_row(query, keys, positions, query_position, scaling) for query in query_heads]
    return {n: [row[n] for row in rows] for n in rows[0]}


def observed_attention(queries, query_positions, keys, positions, scaling):
    """Yield (row, KV head, query position, group attention) for every real query (position >= 0), in order."""
    for b in range(len(keys)):
        group = len(queries[b]) // len(keys[b])
        for h in range(len(keys[b])):
            for l, t in enumerate(query_positions[b]):
                if t >= 0:
                    heads = [queries[b][h * group + g][l] for g in range(group)]
                    yield b, h, t, group_attention(heads, keys[b][h], positions[b][h], t, scaling)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def h2o_observe(cumulative, weights) -> None:
    """H2O: each entry adds the attention this query gives it, mean over the G query heads."""
    for entry, heads in weights.items():
        cumulative[entry] += sum(heads) / len(heads)


def lazy_observe(t_last, mri, weights, t: int, threshold: float) -> None:
    """LazyEviction at decode query t: an entry with attention >= theta (max over the G heads) gets
    MRI = max(MRI, t - t_last), then t_last = t."""
    for entry, heads in weights.items():
        if max(heads) >= threshold:
            mri[entry] = max(mri[entry], t - t_last[entry])
            t_last[entry] = t


def lazy_score(t_last: float, mri: float, now: int) -> float:
    """LazyEviction's keep score H1 + H2 at step `now`."""
    h1 = 2 * sigmoid(-(1 + (now - t_last) / (mri + MRI_EPSILON)))
    return h1 + (2 * sigmoid(1 - mri) if mri > 0 else 0.0)


def raas_observe(timestamps, weights, t: int, threshold: float) -> None:
    """RaaS at decode query t: an entry with attention >= theta (max over the G heads) gets timestamp t."""
    for entry, heads in weights.items():
        if max(heads) >= threshold:
            timestamps[entry] = float(t)


def knorm(keys, positions, candidates):
    return [
        [
            [
                -math.sqrt(sum(x * x for x in keys[b][h][n])) if positions[b][h][n] >= 0 else NAN
                for n in range(candidates)
            ]
            for h in range(len(keys[b]))
        ]
        for b in range(len(keys))
    ]


def streaming(positions, candidates):
    return [[[float(p) if p >= 0 else NAN for p in head[:candidates]] for head in row] for row in positions]


def block_received(queries, query_positions, keys, positions, scaling):
    """Attention each entry receives from the L queries, summed over queries, mean over the G heads:
    [batch][Hkv][N] (H2O's per-step increment)."""
    out = []
    for b in range(len(keys)):
        kv_heads = len(keys[b])
        group = len(queries[b]) // kv_heads
        row = []
        for h in range(kv_heads):
            received = [0.0] * len(keys[b][h])
            for g in range(group):
                for l, query in enumerate(queries[b][h * group + g]):
                    weights = attention_row(query, keys[b][h], positions[b][h], query_positions[b][l], scaling)
                    for n, w in weights.items():
                        received[n] += w / group
            row.append(received)
        out.append(row)
    return out


def tova(queries, query_positions, keys, positions, scaling, candidates):
    out = []
    for b in range(len(keys)):
        kv_heads = len(keys[b])
        group = len(queries[b]) // kv_heads
        layer = [0.0] * candidates
        for h in range(kv_heads):
            for g in range(group):
                last = queries[b][h * group + g][-1]
                weights = attention_row(last, keys[b][h], positions[b][h], query_positions[b][-1], scaling)
                for n in range(candidates):
                    layer[n] += weights.get(n, 0.0) / (kv_heads * group)
        out.append([[layer[n] if positions[b][h][n] >= 0 else NAN for n in range(candidates)] for h in range(kv_heads)])
    return out


def snapkv(queries, query_positions, keys, positions, scaling, candidates, window, kernel_size):
    out = []
    for b in range(len(keys)):
        kv_heads = len(keys[b])
        group = len(queries[b]) // kv_heads
        observed = range(max(0, len(query_positions[b]) - window), len(query_positions[b]))
        row = []
        for h in range(kv_heads):
            mean = [0.0] * candidates
            for l in observed:
                pooled = {}
                for n in range(candidates):
                    p = positions[b][h][n]
                    if p >= 0 and p <= query_positions[b][l]:
                        logits = [dot(queries[b][h * group + g][l], keys[b][h][n]) * scaling for g in range(group)]
                        pooled[n] = max(logits)
                for n, w in softmax(pooled).items():
                    mean[n] += w / len(observed)
            half = kernel_size // 2
            smoothed = [max(mean[max(0, n - half) : n + half + 1]) for n in range(candidates)]
            row.append([smoothed[n] if positions[b][h][n] >= 0 else NAN for n in range(candidates)])
        out.append(row)
    return out


def redundancy(keys, positions, candidates, threshold, epsilon=1e-8):
    """R-KV Eqs. 5-6 over the valid candidates, one (row, column) pair at a time."""
    out = []
    for b in range(len(keys)):
        row = []
        for h in range(len(keys[b])):
            valid = [n for n in range(candidates) if positions[b][h][n] >= 0]
            unit = {}
            for n in valid:
                norm = math.sqrt(sum(x * x for x in keys[b][h][n]))
                unit[n] = [x / (norm + epsilon) for x in keys[b][h][n]]
            sim = {(u, v): (dot(unit[u], unit[v]) if u != v else 0.0) for u in valid for v in valid}
            for u in valid:
                similar = [v for v in valid if sim[(u, v)] > threshold]
                if similar:
                    latest = max(similar, key=lambda v: positions[b][h][v])
                    sim[(u, latest)] = 0.0
            column_mean = {v: sum(sim[(u, v)] for u in valid) / len(valid) for v in valid}
            r = softmax(column_mean)
            row.append([r.get(n, NAN) for n in range(candidates)])
        out.append(row)
    return out


def rkv(queries, query_positions, keys, positions, scaling, candidates, window, kernel_size, mix_lambda, threshold):
    importance = snapkv(queries, query_positions, keys, positions, scaling, candidates, window, kernel_size)
    redundant = redundancy(keys, positions, candidates, threshold)
    return [
        [[mix_lambda * i - (1 - mix_lambda) * r for i, r in zip(ih, rh)] for ih, rh in zip(ib, rb)]
        for ib, rb in zip(importance, redundant)
    ]
