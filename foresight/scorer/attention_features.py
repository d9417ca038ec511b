"""Attention features a_n of the learned scorer (ForesightKV §3.1 Eq. 1, App. B.1; docs/algorithms.md section 5).

At an eviction step the runtime hands one layer's block attention A [batch, Hkv, G, L, N]: the softmax
over the N cache entries of the last L buffered queries, rows oldest first, causally masked entries 0.
Each entry n gets F numbers per query head of its group, concatenated over the G heads, so
a_n has F*G numbers. Two per-entry state tensors [batch, Hkv, N, G] carry history across steps:
the cumulative sum of attention received over all blocks so far, and the decayed sum
d <- 0.9 d + (this block's sum). Both include the current block. They hold RAW sums; new entries
start at 0 and the cache gathers them along dim 2 on eviction.

Feature order (part of a saved scorer's contract; never reorder): a_n[g*F + f] is feature f of query
head g of the group (head-major), with f following `FEATURE_NAMES`:
- "paper" (F = 6, the paper's App. B.1): sums of attention received from the last 8, 16, 32 and L
  queries of the block, cumulative sum, decayed sum.
- "official-8" (F = 8, the authors' released feature set): max and min over the block's queries,
  sum over the block, sums over the last 16, 8 and 32 queries, cumulative sum, decayed sum.
- "pooled" (F = 8, ours): the paper's six, then the sums over the last 8 and the last L queries
  max-pooled along the cache slots (width 7, stride 1, centred; SnapKV's clustering of attention):
  an entry next to entries the recent queries read is likely read later, which no per-entry sum says.
- "standardised" (F = 7, ours, issue 21): windows and decays in tokens, a per-query cumulative rate and
  the entry's age, log(x + eps) then standardised over each step's candidates, with unit-norm keys and
  values; computed in `foresight.scorer.standardised_features`, which documents why.
- "standardised-heuristic" (F = 9, ours): the standardised seven, then the statistics of the two best
  heuristics: TOVA's attention from the newest query ("last_1") and SnapKV's sum over the last 8 queries
  max-pooled along the cache slots ("pooled_last_8"), transformed and standardised like the seven.
- "standardised-norms" (F = 7, ours, issue 42): the standardised seven; its scorer also reads each entry's
  log‖k‖ and log‖v‖ beside the unit-norm key and value (`FeatureSet.key_value_norms`, `ForesightScorer`).
- "standardised-grouped" (F = 7, ours, issue 41): the standardised seven of the attention the G query heads of
  the group pay together (A summed over the group before any sum), so a_n has F numbers, not F*G, and the
  per-entry state is one set of sums per KV head, G times smaller (`FeatureSet.per_query_head`).
- "transfer" (F = 11, ours, issue 55): the heuristic set's nine, then the expected-attention terms of the
  window's queries: "mean_logit" (k·μ_q, the mean logit over the window's queries) and "logit_variance"
  (kᵀΣ_q k, their variance, logged), standardised like the rest; its scorer reads no key or value vector,
  only three projections of them: log‖k‖, log‖v‖ and log‖W_o v‖ (`FeatureSet.projected_key_values`).
  Nothing in it reads absolute position (RoPE writes it into the raw keys), so what it learns is about how
  entries are read, not which tokens or where: what carries to families it never saw.
A window larger than L covers the whole block (it clamps to L), so with L < 32 some window sums equal
the block sum.

The authors' evaluation code overwrote the decayed sum with the cumulative one; we compute the
decayed sum in training and inference alike.

Normalisation (the three older sets): every feature is passed through log1p. Raw sums grow with the window (up to 32 or L)
and the cumulative sum grows without bound with the trace (an attention sink collects thousands
after a few blocks of 256 queries), which would swamp the keys and values in the first linear layer
and blow up gradients. log1p is monotone (no ranking information is lost), near identity for the
small sums of ordinary entries, and logarithmic for sinks. It is applied here and nowhere else, so
training and inference see identical features; the state keeps raw sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from foresight.choices import Choice

DECAY = 0.9
"""Per-block decay factor of the decayed sum (ForesightKV App. B.1)."""


class FeatureSet(Choice):
    """Which attention features the scorer reads."""

    PAPER = "paper"
    OFFICIAL_8 = "official-8"
    POOLED = "pooled"
    STANDARDISED = "standardised"
    STANDARDISED_HEURISTIC = "standardised-heuristic"
    STANDARDISED_NORMS = "standardised-norms"
    STANDARDISED_GROUPED = "standardised-grouped"
    TRANSFER = "transfer"

    @property
    def standardised(self) -> bool:
        """Whether the set is computed by `foresight.scorer.standardised_features` (token time scales,
        log then standardised over each step's candidates, a per-entry observed count in the state)."""
        return self in (
            FeatureSet.STANDARDISED,
            FeatureSet.STANDARDISED_HEURISTIC,
            FeatureSet.STANDARDISED_NORMS,
            FeatureSet.STANDARDISED_GROUPED,
            FeatureSet.TRANSFER,
        )

    @property
    def per_query_head(self) -> bool:
        """Whether a_n holds the F features of every query head of the group (F*G numbers, sums [.., N, G] in the
        state), or, for the grouped set, F of the group's summed attention (sums [.., N]): what a learned
        policy holds per entry beside K/V is most of its memory, and this divides it by G."""
        return self != FeatureSet.STANDARDISED_GROUPED

    @property
    def key_value_norms(self) -> bool:
        """Whether the scorer also reads log‖k‖ and log‖v‖ of each entry beside its unit-norm key and value
        (`ForesightScorer`): how far an entry's value can move an output, which unit vectors hide."""
        return self == FeatureSet.STANDARDISED_NORMS

    @property
    def projected_key_values(self) -> bool:
        """Whether the scorer reads each key and value through three numbers, log‖k‖, log‖v‖ and log‖W_o v‖
        (`ForesightScorer.output_factors`), instead of the vectors: the raw vectors carry token content and
        RoPE's absolute position, which a scorer memorises on its training families."""
        return self == FeatureSet.TRANSFER

    @property
    def reads_window_logits(self) -> bool:
        """Whether the set reads the window's attention logits at the step (the expected-attention terms are
        moments of logits, not sums of probabilities), so its policy holds the window's queries and never
        streams (`Foresight.observed_queries`)."""
        return self == FeatureSet.TRANSFER

    @property
    def unit_key_values(self) -> bool:
        """Whether the scorer reads L2-normalised keys and values (`ForesightScorer`): only the standardised
        sets, whose inputs must all sit on scales that do not depend on the model or the head; the older
        sets' scorers were trained on raw keys and values and keep reading them."""
        return self.standardised and not self.projected_key_values

    @property
    def transform(self) -> str:
        """How the features are normalised, in words (an exported scorer's model card says it)."""
        if self.key_value_norms:
            return "log(x + 1e-6), standardised over each step's candidates; unit-norm keys and values, their log norms"
        if self.projected_key_values:
            return "log(x + 1e-6), standardised over each step's candidates; log‖k‖, log‖v‖ and log‖W_o v‖"
        if not self.per_query_head:
            return "the group's summed attention; log(x + 1e-6), standardised over each step's candidates; unit-norm keys and values"
        if self.standardised:
            return "log(x + 1e-6), standardised over each step's candidates; unit-norm keys and values"
        return "log1p"


STANDARDISED_NAMES = ("last_8", "last_16", "last_32", "recent_128", "decayed", "cumulative_rate", "log_age")
"""The standardised seven, which every standardised set starts with."""

FEATURE_NAMES: dict[FeatureSet, tuple[str, ...]] = {
    FeatureSet.PAPER: ("last_8", "last_16", "last_32", "last_L", "cumulative", "decayed"),
    FeatureSet.OFFICIAL_8: ("max", "min", "block", "last_16", "last_8", "last_32", "cumulative", "decayed"),
    FeatureSet.POOLED: (
        "last_8",
        "last_16",
        "last_32",
        "last_L",
        "cumulative",
        "decayed",
        "pooled_last_8",
        "pooled_last_L",
    ),
    FeatureSet.STANDARDISED: STANDARDISED_NAMES,
    FeatureSet.STANDARDISED_HEURISTIC: (*STANDARDISED_NAMES, "last_1", "pooled_last_8"),
    FeatureSet.STANDARDISED_NORMS: STANDARDISED_NAMES,  # the norms are the scorer's inputs, not features
    FeatureSet.STANDARDISED_GROUPED: STANDARDISED_NAMES,  # of the group's summed attention
    FeatureSet.TRANSFER: (*STANDARDISED_NAMES, "last_1", "pooled_last_8", "mean_logit", "logit_variance"),
}
"""Per-query-head feature order of each set (see the module docstring)."""

WINDOWS = {"last_8": 8, "last_16": 16, "last_32": 32}
"""Query windows of the window-sum features, in tokens (every set shares them)."""
POOL_WIDTH = 7
"""Slots covered by the max-pooling of the "pooled" features (SnapKV's kernel size)."""


def feature_dim(feature_set: str | FeatureSet) -> int:
    """F, the number of features per query head (per KV head for the grouped set)."""
    return len(FEATURE_NAMES[FeatureSet.parse(feature_set)])


def feature_width(feature_set: str | FeatureSet, group_size: int) -> int:
    """The width of a_n in a group of `group_size` query heads: F*G, or F for the grouped set."""
    return feature_dim(feature_set) * (group_size if FeatureSet.parse(feature_set).per_query_head else 1)


def cumulative_feature(feature_set: str | FeatureSet) -> int:
    """Index f of the set's whole-history feature (the cumulative sum; the standardised set's per-query
    cumulative rate), which the supervised stage scores as an H2O-like baseline."""
    names = FEATURE_NAMES[FeatureSet.parse(feature_set)]
    return names.index("cumulative" if "cumulative" in names else "cumulative_rate")


def check_state(block_attention: torch.Tensor, states: dict[str, torch.Tensor], per_query_head: bool = True) -> None:
    """One-line errors unless block_attention is [batch, Hkv, G, L, N] and every state is [batch, Hkv, N, G]
    ([batch, Hkv, N] when not `per_query_head`)."""
    if block_attention.dim() != 5:
        raise ValueError(f"block attention must be [batch, Hkv, G, L, N], got shape {tuple(block_attention.shape)}")
    batch, kv_heads, group, _, entries = block_attention.shape
    expected = (batch, kv_heads, entries, group)[: 4 if per_query_head else 3]
    layout = "[batch, Hkv, N, G]" if per_query_head else "[batch, Hkv, N]"
    for name, state in states.items():
        if tuple(state.shape) != expected:
            raise ValueError(
                f"{name} state must be {layout} = {expected} to match block attention "
                f"{tuple(block_attention.shape)}, got {tuple(state.shape)}"
            )


def window_sum(rows: torch.Tensor, size: int) -> torch.Tensor:
    """Attention received from the newest `size` queries (all of them when fewer): rows [batch, Hkv, G, N, L]
    -> [batch, Hkv, N, G]."""
    return rows[..., -min(size, rows.shape[-1]) :].sum(-1).transpose(-1, -2)


def attention_features(
    block_attention: torch.Tensor,
    cumulative: torch.Tensor,
    decayed: torch.Tensor,
    feature_set: str | FeatureSet = FeatureSet.PAPER,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features of every cache entry from one step's block attention, and the updated state.

    block_attention: [batch, Hkv, G, L, N]; cumulative, decayed: [batch, Hkv, N, G] raw sums before this
    block. Returns (features [batch, Hkv, N, F*G] after log1p, new cumulative, new decayed), the states
    in the dtype they came in.
    """
    feature_set = FeatureSet.parse(feature_set)
    if feature_set.standardised:
        raise ValueError(
            f"the {feature_set.value!r} features need entry positions: use foresight.scorer.standardised_features"
        )
    names = FEATURE_NAMES[feature_set]
    check_state(block_attention, {"cumulative": cumulative, "decayed": decayed})

    # Everything below is laid out [batch, Hkv, N, G].
    rows = block_attention.transpose(-1, -2)  # [batch, Hkv, G, N, L]
    block_sum = rows.sum(-1).transpose(-1, -2)
    new_cumulative = cumulative + block_sum
    new_decayed = DECAY * decayed + block_sum

    compute: dict[str, Callable[[], torch.Tensor]] = {
        "max": lambda: rows.amax(-1).transpose(-1, -2),
        "min": lambda: rows.amin(-1).transpose(-1, -2),
        "block": lambda: block_sum,
        "last_L": lambda: block_sum,
        "cumulative": lambda: new_cumulative,
        "decayed": lambda: new_decayed,
        **{name: (lambda size=size: window_sum(rows, size)) for name, size in WINDOWS.items()},
        "pooled_last_8": lambda: max_pool_slots(window_sum(rows, 8)),
        "pooled_last_L": lambda: max_pool_slots(block_sum),
    }
    stacked = torch.stack([compute[name]().to(block_attention.dtype) for name in names], dim=-1)
    features = torch.log1p(stacked.flatten(-2))  # [batch, Hkv, N, G*F], head-major
    return features, new_cumulative.to(cumulative.dtype), new_decayed.to(decayed.dtype)


def max_pool_slots(sums: torch.Tensor) -> torch.Tensor:
    """Max over the POOL_WIDTH slots centred on each entry, along N: sums [batch, Hkv, N, G] -> same shape."""
    batch, kv_heads, entries, group = sums.shape
    rows = sums.permute(0, 1, 3, 2).reshape(-1, 1, entries)
    pooled = torch.nn.functional.max_pool1d(rows, POOL_WIDTH, stride=1, padding=POOL_WIDTH // 2)
    return pooled.reshape(batch, kv_heads, group, entries).permute(0, 1, 3, 2)
