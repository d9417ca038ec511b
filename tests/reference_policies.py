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

from foresight.policies.epikv import Z_EPSILON
from foresight.policies.lagkv import RANGE_EPSILON
from tests.reference_features import foresight

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
        n: dot(query, keys[n]) * scaling for n in range(count) if positions[n] >= 0 and positions[n] <= query_position
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


# -- Random Attention, VaSE and TriAttention ---------------------------------------------------------------------------
def uniform_hash(seed: int, layer: int, head: int, position: int, draw: int = 0) -> float:
    """The integer mix of foresight.policies.random.uniform_hash on Python ints, one entry at a time."""
    mixed = position * 0x9E3779B1 + (head + 131 * layer) * 0x85EBCA77 + seed * 0xC2B2AE3D + draw * 0x27D4EB2F
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, 1)):
        mixed = ((mixed ^ (mixed >> shift)) * multiplier) & 0x7FFFFFFF
    return mixed / 2**31


def random(positions, layer, seed, candidates):
    """Uniform random keep scores: one draw per (KV head, entry), fixed by (seed, layer, head, position)."""
    return [
        [[uniform_hash(seed, layer, h, p) if p >= 0 else NAN for p in head[:candidates]] for h, head in enumerate(row)]
        for row in positions
    ]


def random_prompt(positions, layer, seed, candidates):
    """Random Attention: a fresh uniform draw per (KV head, entry) at each step, named by the row's newest position."""
    out = []
    for _b, row in enumerate(positions):
        newest = row[0][-1]
        out.append(
            [
                [uniform_hash(seed, layer, h, p, newest + 1) if p >= 0 else NAN for p in head[:candidates]]
                for h, head in enumerate(row)
            ]
        )
    return out


def vase(queries, query_positions, keys, values, positions, scaling, candidates, layer, seed, share, magnitude):
    """VaSE-AttnV: the top floor(share x valid) candidates by value magnitude score 1 + magnitude; the others
    log(u) / w, w the attention score: per query head, each query's softmax over the candidates it sees, mean
    over the queries, a zero-padded average over 5 slots, mean over the G heads."""
    out = []
    for b in range(len(keys)):
        group = len(queries[b]) // len(keys[b])
        newest, row = positions[b][0][-1], []
        for h in range(len(keys[b])):
            valid = [n for n in range(candidates) if positions[b][h][n] >= 0]
            size = {}
            for n in valid:
                v = values[b][h][n]
                if magnitude == "range":
                    size[n] = max(v) - min(v)
                elif magnitude == "l2":
                    size[n] = math.sqrt(sum(x * x for x in v))
                else:
                    mean = sum(v) / len(v)
                    size[n] = sum((x - mean) ** 2 for x in v) / (len(v) - 1)
            ranked = sorted(valid, key=lambda n: (-size[n], n))
            large = set(ranked[: int(len(valid) * share)])
            weight = [0.0] * candidates
            for g in range(group):
                heads = queries[b][h * group + g]
                mean = [0.0] * candidates
                for l, query in enumerate(heads):
                    row_weights = attention_row(
                        query, keys[b][h], positions[b][h], query_positions[b][l], scaling, candidates
                    )
                    for n, w in row_weights.items():
                        mean[n] += w / len(heads)
                for n in range(candidates):
                    window = [mean[m] for m in range(n - 2, n + 3) if 0 <= m < candidates]
                    weight[n] += sum(window) / 5 / group
            scores = []
            for n in range(candidates):
                p = positions[b][h][n]
                if p < 0:
                    scores.append(NAN)
                elif n in large:
                    scores.append(1.0 + size[n])
                else:
                    u = max(uniform_hash(seed, layer, h, p, newest + 1), 2.0**-32)
                    scores.append(math.log(u) / weight[n] if weight[n] > 0 else -math.inf)
            row.append(scores)
        out.append(row)
    return out


def triattention(keys, positions, q_mean, q_abs_mean, inv_freq, rope_scale, offsets, candidates, normalize):
    """TriAttention as the authors' code scores a key: inverse-rotate the cached key by its position (pre-RoPE
    band k_f, (x_f, x_{f+D/2}) as a complex number), then per query head the mean over offsets o of
    Σ_f s² |q̄_f||k_f| cos(ω_f (t - p + o) + φ_f), φ_f = arg(q̄_f conj(k_f)), plus Σ_f s² (E|q_f| - |q̄_f|) |k_f|;
    z-score per query head over the valid candidates, max over the group. q_mean [Hq][F] complex."""
    bands, s = len(inv_freq), rope_scale
    out = []
    for b in range(len(keys)):
        kv_heads = len(keys[b])
        group = len(q_mean) // kv_heads
        start = positions[b][0][-1] + 1
        row = []
        for h in range(kv_heads):
            valid = [n for n in range(candidates) if positions[b][h][n] >= 0]
            per_head = []
            for g in range(group):
                centre, modulus = q_mean[h * group + g], q_abs_mean[h * group + g]
                scores = {}
                for n in valid:
                    p, k = positions[b][h][n], keys[b][h][n]
                    pre = [
                        complex(k[f], k[f + bands])
                        * complex(math.cos(-p * inv_freq[f]), math.sin(-p * inv_freq[f]))
                        / s
                        for f in range(bands)
                    ]
                    extra = sum(s * s * (modulus[f] - abs(centre[f])) * abs(pre[f]) for f in range(bands))
                    total = 0.0
                    for o in offsets:
                        for f in range(bands):
                            relative = centre[f] * pre[f].conjugate()
                            phi = math.atan2(relative.imag, relative.real)
                            total += (
                                s * s * abs(centre[f]) * abs(pre[f]) * math.cos(inv_freq[f] * (start - p + o) + phi)
                            )
                    scores[n] = total / len(offsets) + extra
                if normalize and valid:
                    mean = sum(scores.values()) / len(valid)
                    std = math.sqrt(sum((x - mean) ** 2 for x in scores.values()) / len(valid))
                    scores = {n: (x - mean) / max(std, 1e-6) for n, x in scores.items()}
                per_head.append(scores)
            row.append([max(scores[n] for scores in per_head) if n in valid else NAN for n in range(candidates)])
        out.append(row)
    return out


# -- LagKV, LazyEviction, RaaS and EpiKV ------------------------------------------------------------------------
def lagkv(keys, values, positions, candidates: int, lag: int) -> list:
    """Chunks of `lag` cut from the newest candidate back, each against the `lag` entries after it:
    per-channel min-max normalisation, unbiased std over channels, softmax over the chunk's valid
    entries, keys + values, then the rank within the chunk over its valid entries."""

    def std(vector):
        mean = sum(vector) / len(vector)
        return math.sqrt(sum((x - mean) ** 2 for x in vector) / (len(vector) - 1))

    def lag_std(states, slot, reference):
        result = []
        for d in range(len(states[slot])):
            column = [states[r][d] for r in reference]
            low, high = min(column), max(column)
            result.append((states[slot][d] - low) / max(high - low, RANGE_EPSILON))
        return std(result)

    def softmax(scores):
        top = max(scores.values())
        exps = {slot: math.exp(v - top) for slot, v in scores.items()}
        return {slot: e / sum(exps.values()) for slot, e in exps.items()}

    out = [[[float("nan")] * candidates for _ in positions[0]] for _ in positions]
    for b in range(len(positions)):
        for h in range(len(positions[b])):
            end = candidates
            while end > 0:
                chunk = [n for n in range(max(0, end - lag), end) if positions[b][h][n] >= 0]
                reference = list(range(end, end + lag))
                if chunk:
                    key = softmax({n: lag_std(keys[b][h], n, reference) for n in chunk})
                    value = softmax({n: lag_std(values[b][h], n, reference) for n in chunk})
                    score = {n: key[n] + value[n] for n in chunk}
                    for n in chunk:
                        below = sum(1 for m in chunk if score[m] < score[n] or (score[m] == score[n] and m < n))
                        out[b][h][n] = below / len(chunk)
                end -= lag
    return out


def context_lists(context) -> dict:
    """An `EvictionContext`'s queries, keys and positions as the nested lists these twins read."""
    return dict(
        queries=context.queries.tolist(),
        query_positions=context.query_positions.tolist(),
        keys=context.keys.tolist(),
        positions=context.positions.tolist(),
        scaling=context.scaling,
    )


def lazy(context, t_last, mri, threshold):
    """The written rule on one step's entries: every query in order, then H1 + H2 at the newest token."""
    t_last, mri = [[list(h) for h in b] for b in t_last], [[list(h) for h in b] for b in mri]
    for b, h, t, weights in observed_attention(**context_lists(context)):
        lazy_observe(t_last[b][h], mri[b][h], weights, t, threshold)
    now = context.positions[:, 0, -1].tolist()
    scores = [
        [[lazy_score(tl, m, now[b]) for tl, m in zip(t_last[b][h], mri[b][h])] for h in range(len(t_last[b]))]
        for b in range(len(t_last))
    ]
    return t_last, mri, scores


def raas(context, last_hits, threshold):
    """The written rule: each entry's timestamp is its own position until a query with attention
    >= theta refreshes it to that query's position; every query in order."""
    stamps = [
        [[max(s, float(p)) for s, p in zip(hits, head)] for hits, head in zip(row_hits, row)]
        for row_hits, row in zip(last_hits, context.positions.tolist())
    ]
    for b, h, t, weights in observed_attention(**context_lists(context)):
        raas_observe(stamps[b][h], weights, t, threshold)
    return stamps


def epikv(hidden_a, hidden_b, positions, window: int) -> list:
    """Per row, per token in order: g = ||h(t) - h(t-1)||, z against the last `window` g values
    (population std), score z_a - z_b; tokens at position < 1 get no g and score 0."""
    scores = []
    for b in range(len(positions)):
        history = {"a": [], "b": []}
        row = []
        for t, position in enumerate(positions[b]):
            if position < 1:
                row.append(0.0)
                continue
            z = {}
            for band, hidden in (("a", hidden_a), ("b", hidden_b)):
                g = math.sqrt(sum((x - y) ** 2 for x, y in zip(hidden[b][t], hidden[b][t - 1])))
                history[band].append(g)
                recent = history[band][-window:]
                mean = sum(recent) / len(recent)
                std = math.sqrt(sum((x - mean) ** 2 for x in recent) / len(recent))
                z[band] = (g - mean) / (std + Z_EPSILON)
            row.append(z["a"] - z["b"])
        scores.append(row)
    return scores


# -- the golden schedule ---------------------------------------------------------------------------------------
def golden(candidates, alpha, keep):
    """One golden step of one (layer, KV head): of its candidates (positions) keep the `keep` with the largest
    future score α, ties to the older; 1 for a kept candidate, 0 for an evicted one."""
    order = sorted(range(len(candidates)), key=lambda n: (-alpha[n], candidates[n]))
    kept = set(order[:keep])
    return [1.0 if n in kept else 0.0 for n in range(len(candidates))]


# -- the pooled layout's allocation ----------------------------------------------------------------------------
def pooled_keep(scores, positions, keep, floor):
    """AdaKV's allocation over one layer's heads in one row: scores[h][n] and positions[h][n] (-1: invalid) of
    each head's candidates. Each head keeps its `floor` best (ties to the older), then the layer keeps the best
    H·(keep - floor) of the rest whichever head holds them (ties to the lower head, then the older). Returns each
    head's kept positions, sorted."""
    heads = len(scores)
    kept = [[] for _ in range(heads)]
    rest = []
    for h in range(heads):
        mine = sorted((-scores[h][n], positions[h][n]) for n in range(len(scores[h])) if positions[h][n] >= 0)
        kept[h] += [position for _, position in mine[:floor]]
        rest += [(score, h, position) for score, position in mine[floor:]]
    for _, h, position in sorted(rest)[: heads * (keep - floor)]:
        kept[h].append(position)
    return [sorted(positions) for positions in kept]


TWINS = {
    "epikv": epikv,
    "foresight": foresight,
    "golden": golden,
    "h2o": h2o_observe,
    "knorm": knorm,
    "lagkv": lagkv,
    "lazy": lazy,
    "raas": raas,
    "random": random,
    "random-prompt": random_prompt,
    "rkv": rkv,
    "snapkv": snapkv,
    "streaming": streaming,
    "tova": tova,
    "triattention": triattention,
    "vase": vase,
}
"""Each evicting policy's twin, which a test compares it with (`full` keeps every entry: no rule to twin)."""
