"""The "standardised" attention features, and "standardised-heuristic" (ours, issue 21; docs/algorithms.md
section 5).

The older sets (`foresight.scorer.attention_features`) generalise poorly to unseen task families. Each
choice here removes one scale that differs between training and use:

- Time in tokens, not eviction steps. The older decayed sum decays 0.9 per step of L tokens, so its time
  constant changes with L; here it decays 0.9 per 256 tokens (the paper's chunk at L = 256) whatever L,
  and inside a block each query is weighted by its own age, so splitting the same queries into blocks
  of another L gives the same sum.
- No duplicated window. "last L" equals "last 32" at L = 32 (the default configs). It is replaced by
  "recent_128", a soft window of about 128 tokens: the attention received, decayed 0.5 per 128 tokens
  (half-life 128 tokens), per token like the decayed sum. A window longer than the block needs history,
  which a decayed sum carries in one number per entry; it is distinct from "last 32" at every L.
- Nothing grows with the trace. The cumulative sum grows with an entry's age, and traces at evaluation
  are longer than in training; "cumulative_rate" divides it by the queries that could attend to the entry
  (its observed count, state), i.e. the mean attention it received per query. "log_age", log1p of the
  entry's age in tokens (newest query position minus its position), says how long that mean ran.
- The low tail is spread out. Evictions are decided among entries whose sums are 1e-4..1e-2, where the
  older sets' log1p(x) ~ x leaves candidates thousandths of an input unit apart; log(x + 1e-6) puts two
  sums a factor 10 apart ln 10 ~ 2.3 apart at every scale.
- Scale-free per step. Every column (feature, query head) is then standardised over the step's valid
  candidates of its (layer, KV head): shifts of the log from one head's peakier attention, one model's
  longer traces or one task's larger age cancel, and the scorer sees each entry's rank-like position
  among the entries it competes with. Multiplying all attention sums by a constant changes nothing.
  `standardise_candidates` is the one function that does it, called by
  `foresight.policies.foresight.observe_features` for the policy and for the supervised recorder alike.
- The heuristics' statistics, in the heuristic set. On unseen task families TOVA and SnapKV are the
  best heuristics, and neither statistic is among the seven: TOVA ranks by the newest query's attention
  ("last_1"), SnapKV by the last 8 queries' attention max-pooled over 7 neighbouring slots
  ("pooled_last_8": an entry beside one that is read is likely read later, which no per-entry sum says).
  They are added as further columns, transformed and standardised like the others.
- Keys and values are L2-normalised per entry in the scorer (`FeatureSet.unit_key_values`): their norms
  vary across models, layers and heads by orders of magnitude; per entry (not over the candidates) so a
  sampled eviction's recorded pool scores exactly as at sampling time.

Per-entry state (raw; new entries start at 0; current block included): cumulative, decayed and recent
sums [batch, Hkv, N, G]. The count of queries that could attend to an entry ("observed", cumulative_rate's
divisor) is derived, not stored: a row observes every query from its first observed one on (its eviction
steps come every L tokens and each reads the L queries since the last), so the count is the newest query's
position minus the later of the entry's position and that first query's, plus one (`observed_queries`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from foresight.masked import masked_moments
from foresight.runtime.capture import attention_logits, first_observed_query
from foresight.scorer.attention_features import (
    FEATURE_NAMES,
    WINDOWS,
    FeatureSet,
    check_state,
    max_pool_slots,
    window_sum,
)

CUMULATIVE, DECAYED, RECENT = "cumulative", "decayed", "recent"
PER_QUERY_HEAD_STATE = (CUMULATIVE, DECAYED, RECENT)
"""State fields: one raw sum per query head of the group."""

DECAY, DECAY_TOKENS = 0.9, 256
"""The decayed sum loses a factor 0.9 per 256 tokens (per step of L tokens: 0.9 ** (L / 256))."""
RECENT_DECAY, RECENT_TOKENS = 0.5, 128
"""The recent sum halves every 128 tokens: a soft window of about 128 tokens."""
LOG_EPS = 1e-6
"""log(x + LOG_EPS): far below the sums that decide evictions, so their ratios survive the log."""
STD_EPS = 1e-2
"""Added to each column's std over the candidates: a column whose spread is below ~1% (relative, in log
units) carries no ranking signal, and stays near 0 instead of blowing float noise up to unit scale."""


def token_decay(factor: float, tokens: int, rows: int, like: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Decay by `factor` per `tokens` tokens, over a block of `rows` queries: the factor that ages the state
    by the block (factor ** (rows / tokens)) and each query's weight [rows], oldest first, the newest 1."""
    per_token = factor ** (1.0 / tokens)
    ages = torch.arange(rows - 1, -1, -1, dtype=like.dtype, device=like.device)
    return per_token**rows, per_token**ages


def observed_queries(positions: torch.Tensor, newest: torch.Tensor, first_observed: torch.Tensor) -> torch.Tensor:
    """Observed queries that could attend to each entry, from positions alone (the module docstring): positions
    [batch, Hkv, N] (-1: invalid, count 0), newest [batch] the newest observed query's position, first_observed
    [batch] the row's first observed query's -> counts [batch, Hkv, N] = newest - max(position, first) + 1.
    Equals the stored count it replaces, the sum over the row's blocks of the block's queries not before the
    entry (tests/test_lean_state.py's twin)."""
    since = torch.maximum(positions, first_observed[:, None, None])
    return (newest[:, None, None] - since + 1).clamp_min(0).masked_fill(positions < 0, 0)


def standardised_features(
    block_attention: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    positions: torch.Tensor,
    query_positions: torch.Tensor,
    feature_set: str | FeatureSet = FeatureSet.STANDARDISED,
    first_observed: torch.Tensor | None = None,
    logit_moments: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Features of every entry before standardisation, and the updated state.

    block_attention [batch, Hkv, G, l, N] (rows oldest first, the l queries since the last step);
    state: the raw sums [batch, Hkv, N, G] (module docstring); positions [batch, Hkv, N] (-1: invalid),
    query_positions [batch, l] (-1: padding); feature_set: one of the standardised sets (both keep the same
    state); first_observed [batch]: each row's first observed query position (None: this block is the row's
    first observation, `first_observed_query`); logit_moments: the transfer set's window logit columns
    (`window_logit_moments`, each [batch, Hkv, N, G]). Returns features
    [batch, Hkv, N, F*G] (head-major, `FEATURE_NAMES`; log(x + LOG_EPS) of the sums, log1p of the age)
    and the new state in the dtypes it came in. `standardise_candidates` finishes them.
    """
    names = _standardised_names(feature_set)
    check_state(block_attention, {name: state[name] for name in PER_QUERY_HEAD_STATE})
    if first_observed is None:
        first_observed = first_observed_query(query_positions)
    rows = block_attention.transpose(-1, -2)  # [batch, Hkv, G, N, l]
    new = _decayed_sums(rows, state)
    sums = {name: window_sum(rows, size) for name, size in _windows(names).items()}
    features = _columns(sums, new, positions, query_positions.amax(-1), first_observed, names, logit_moments)
    return features, {name: value.to(state[name].dtype) for name, value in new.items()}


LOGIT_MOMENTS = ("mean_logit", "logit_variance")
"""The expected-attention columns of the transfer set (kvpress's expected attention scores an entry by
exp(k·μ_q/√d + kᵀΣ_q k/2d) from the mean μ_q and covariance Σ_q of the window's queries)."""


def window_logit_moments(
    queries: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor, scaling: float
) -> dict[str, torch.Tensor]:
    """The expected-attention terms of each entry over the window's queries, per query head: "mean_logit"
    (k·μ_q × scaling, the mean logit) and "logit_variance" (log(kᵀΣ_q k × scaling² + LOG_EPS), the logits'
    population variance) [batch, Hkv, N, G]. queries [batch, Hq, l, D] oldest first, query_positions
    [batch, l] (-1: padding, left out), keys [batch, Hkv, N, D]. The moments of the logits themselves, which
    equal those of the queries projected on k, so no D×D covariance is formed; the mean's shift by the row's
    softmax normaliser, which is the same for every entry, cancels in `standardise_candidates`. A candidate
    is older than every query of the window, so no causal mask is needed (a window entry's value is unused)."""
    logits = attention_logits(queries, keys, scaling)  # [batch, Hkv, G, l, N] float32
    weights = (query_positions >= 0).to(logits.dtype)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1)
    weights = weights[:, None, None, :, None]
    mean = (logits * weights).sum(-2)
    variance = ((logits - mean.unsqueeze(-2)).square() * weights).sum(-2)
    return {"mean_logit": mean.transpose(-1, -2), "logit_variance": torch.log(variance + LOG_EPS).transpose(-1, -2)}


def window_state(feature_set: str | FeatureSet) -> tuple[str, ...]:
    """State fields of a streamed observation beside the three sums: one running window sum per window feature
    of the set ("window_8" holds the attention the newest 8 queries before the next eviction step gave)."""
    return tuple(f"window_{size}" for size in _windows(_standardised_names(feature_set)).values())


def stream_observe(
    block_attention: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    query_positions: torch.Tensor,
    evicts_after: torch.Tensor,
    feature_set: str | FeatureSet = FeatureSet.STANDARDISED,
) -> dict[str, torch.Tensor]:
    """The state after a streamed observation of one forward's queries (docs/algorithms.md section 2): every sum
    as `standardised_features` would leave it after a block ending at these queries, and each window sum plus the
    attention of the queries that fall in its window of the next eviction step.

    block_attention [batch, Hkv, G, l, N] of the forward's queries (query_positions [batch, l], oldest first; a
    query outside the row's next eviction window is given position -1, so it adds nothing); state: the sums and
    window sums [batch, Hkv, N, G]; evicts_after [batch]: the position of the query after which each row's next
    eviction step runs. The sums are block-size invariant, so observing L queries one forward at a time gives
    the window's block sums up to float32 rounding, from a state of G sums per window instead of a ring of L
    queries of every query head. `stream_weights` then `stream_update`: the weights are the same for every layer,
    so a caller that observes the layers one at a time (`ObservedQueries.FORWARD`) makes them once."""
    weights = stream_weights(query_positions, evicts_after, feature_set, block_attention.dtype)
    return stream_update(block_attention, state, weights)


@dataclass(frozen=True)
class StreamWeights:
    """How one block of l queries adds to each streamed sum: `weights` [batch, l, sums] (a query's weight in each
    sum: 1 in the cumulative one, its decay by age in the decayed and recent ones, whether it falls in each window;
    0 for a query of position -1), `factors` the ageing of each sum's old value over the block, `names` the
    sums."""

    names: tuple[str, ...]
    weights: torch.Tensor
    factors: tuple[float, ...]

    @cached_property
    def newest(self) -> list[torch.Tensor]:
        """Each sum's weight of the block's newest query, [batch, 1, 1, 1] (one per sum): a decode forward's one."""
        return list(self.weights[:, -1, :, None, None, None].unbind(1))


def stream_weights(
    query_positions: torch.Tensor,
    evicts_after: torch.Tensor,
    feature_set: str | FeatureSet = FeatureSet.STANDARDISED,
    dtype: torch.dtype = torch.float32,
) -> StreamWeights:
    """`StreamWeights` of the queries at query_positions [batch, l] (oldest first, -1: not observed) for rows whose
    next eviction step follows the query at evicts_after [batch]. A few operations: a decode forward makes them for
    every token."""
    batch, count = query_positions.shape
    sizes = tuple(_windows(_standardised_names(feature_set)).values())
    decays, factors = _decay_weights(count, dtype, query_positions.device)
    before = evicts_after[:, None] - query_positions  # [batch, l] queries from each one to the eviction step
    inside = before[..., None] < _window_sizes(sizes, query_positions.device)  # [batch, l, windows]
    observed = (query_positions >= 0)[..., None]
    weights = torch.cat([decays.expand(batch, count, 3) * observed, (inside & observed).to(dtype)], -1)
    names = (*PER_QUERY_HEAD_STATE, *(f"window_{size}" for size in sizes))
    return StreamWeights(names, weights, (*factors, *(1.0 for _ in sizes)))


@functools.cache
def _decay_weights(count: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, tuple[float, ...]]:
    """The three sums' weights of a block of `count` queries [count, 3] (1 in the cumulative sum, the decay by age in
    the decayed and recent ones) and how each sum's old value ages over the block."""
    like = torch.empty(0, dtype=dtype, device=device)
    decayed_step, decayed_weights = token_decay(DECAY, DECAY_TOKENS, count, like)
    recent_step, recent_weights = token_decay(RECENT_DECAY, RECENT_TOKENS, count, like)
    weights = torch.stack([torch.ones_like(decayed_weights), decayed_weights, recent_weights], -1)
    return weights, (1.0, decayed_step, recent_step)


@functools.cache
def _window_sizes(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The window sizes as a tensor on `device`, made once."""
    return torch.tensor(sizes, device=device)


def stream_update_(block_attention: torch.Tensor, state: Mapping[str, torch.Tensor], weights: StreamWeights) -> None:
    """`stream_update` written into the float32 sums `state` in place: two multi-tensor operations for every sum
    at once where a decode forward's query is the block. Leading dims before the batch (a layer dim: every layer's
    sums at once) broadcast against the weights' rows."""
    sums = [state[name] for name in weights.names]
    torch._foreach_mul_(sums, list(weights.factors))
    if block_attention.shape[-2] == 1:
        newest = block_attention[..., 0, :].transpose(-1, -2)  # [batch, Hkv, N, G]
        torch._foreach_addcmul_(sums, [newest] * len(sums), weights.newest)
        return
    torch._foreach_add_(sums, _weighted_block(block_attention, weights))


def stream_update(
    block_attention: torch.Tensor, state: Mapping[str, torch.Tensor], weights: StreamWeights
) -> dict[str, torch.Tensor]:
    """The streamed sums `state` [batch, Hkv, N, G] after the block block_attention [batch, Hkv, G, l, N] weighed by
    `weights` (`stream_weights`), in the state's dtypes. One product weighs the queries for every sum at once."""
    aged = torch._foreach_mul([state[name].to(block_attention.dtype) for name in weights.names], list(weights.factors))
    new = torch._foreach_add(aged, _weighted_block(block_attention, weights))
    return {name: value.to(state[name].dtype) for name, value in zip(weights.names, new, strict=True)}


def _weighted_block(block_attention: torch.Tensor, weights: StreamWeights) -> list[torch.Tensor]:
    """What the block [..., G, l, N] adds to each sum: one product weighs its queries for every sum at once, each
    [..., N, G]."""
    rows = block_attention.transpose(-1, -2)  # [..., G, N, l]
    return list((rows @ weights.weights[:, None, None].to(rows.dtype)).transpose(-2, -3).unbind(-1))


def streamed_features(
    state: Mapping[str, torch.Tensor],
    positions: torch.Tensor,
    newest: torch.Tensor,
    first_observed: torch.Tensor,
    feature_set: str | FeatureSet = FeatureSet.STANDARDISED,
    candidates: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`standardised_features` at an eviction step whose queries were streamed (`stream_observe`): the features
    from the state alone, newest [batch] the step's newest query position, and the state the step changes (the
    window sums, back to 0 for the next window; the three sums stay as they are). With `candidates`, the features
    of the first `candidates` entries only, computed for them alone where no column reads a neighbouring slot."""
    names = _standardised_names(feature_set)
    entries = slice(None) if candidates is None or "pooled_last_8" in names else slice(0, candidates)
    sums = {name: state[f"window_{size}"][..., entries, :].float() for name, size in _windows(names).items()}
    running = {name: state[name][..., entries, :].float() for name in PER_QUERY_HEAD_STATE}
    features = _columns(sums, running, positions[..., entries], newest, first_observed, names)
    if candidates is not None:
        features = features[..., :candidates, :]
    return features, {name: torch.zeros_like(state[name]) for name in window_state(feature_set)}


def _standardised_names(feature_set: str | FeatureSet) -> tuple[str, ...]:
    feature_set = FeatureSet.parse(feature_set)
    if not feature_set.standardised:
        raise ValueError(f"feature_set must be a standardised set, got {feature_set.value!r}")
    return FEATURE_NAMES[feature_set]


def _windows(names: tuple[str, ...]) -> dict[str, int]:
    """The set's window features and their sizes in queries (TOVA's "last_1" is a window of one)."""
    windows = {**WINDOWS, "last_1": 1}
    return {name: size for name, size in windows.items() if name in names}


def _decayed_sums(rows: torch.Tensor, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The three sums after the block rows [batch, Hkv, G, N, l] (oldest first), in the block's dtype."""
    dtype, count = rows.dtype, rows.shape[-1]

    def decayed(name: str, factor: float, tokens: int) -> torch.Tensor:
        step, weights = token_decay(factor, tokens, count, rows)
        return step * state[name].to(dtype) + (rows @ weights).transpose(-1, -2)

    return {
        CUMULATIVE: state[CUMULATIVE].to(dtype) + rows.sum(-1).transpose(-1, -2),
        DECAYED: decayed(DECAYED, DECAY, DECAY_TOKENS),
        RECENT: decayed(RECENT, RECENT_DECAY, RECENT_TOKENS),
    }


def _columns(
    sums: dict[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    positions: torch.Tensor,
    newest: torch.Tensor,
    first_observed: torch.Tensor,
    names: tuple[str, ...],
    logit_moments: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The features [batch, Hkv, N, F*G] of the window sums `sums` and the three sums `new` [batch, Hkv, N, G]
    as of the newest query position `newest` [batch], with the window's logit moments where the set reads them."""
    if any(name in names for name in LOGIT_MOMENTS) and logit_moments is None:
        raise ValueError("the transfer set's features need the window's queries (its logit moments) at the step")
    dtype = new[CUMULATIVE].dtype
    observed = observed_queries(positions, newest, first_observed).to(dtype)
    sums = {**sums, "recent_128": new[RECENT], "decayed": new[DECAYED]}
    if "pooled_last_8" in names:
        sums["pooled_last_8"] = max_pool_slots(sums["last_8"])
    sums["cumulative_rate"] = new[CUMULATIVE] / observed.clamp_min(1)[..., None]
    age = (newest[:, None, None] - positions).clamp_min(0).to(dtype)
    columns = {name: torch.log(value + LOG_EPS) for name, value in sums.items()}
    columns["log_age"] = torch.log1p(age)[..., None].expand_as(sums["decayed"])
    columns.update({name: value.to(dtype) for name, value in (logit_moments or {}).items()})
    return torch.stack([columns[name] for name in names], dim=-1).flatten(-2)  # [batch, Hkv, N, G*F]


def standardise_candidates(features: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each column of features [..., C, W] minus its mean, divided by its std + STD_EPS, over the valid
    candidates valid [..., C] of its (row, KV head) (population std); invalid candidates get 0.

    Why: see the module docstring (a constant factor on every attention sum shifts the logs by a
    constant, which this removes). The one place the standardised set is standardised, for training and
    inference alike."""
    mask = valid[..., None]
    mean, std = masked_moments(features, mask, dim=-2)
    return (features - mean).masked_fill(~mask, 0) / (std + STD_EPS)
