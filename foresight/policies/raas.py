"""RaaS (Hu et al., 2025, "Reasoning-aware attention sparsity"): an attention-refreshed LRU timestamp.

Time is measured in sequence positions: the query of the token at position t is "decode step t", so
a new entry's timestamp is its own position and every decode query that gives it attention >= theta
moves its timestamp to that query's position. The runtime hands `observe` every decode query (every
query after the prompt) exactly once, in order and in blocks, which equals refreshing the timestamps
at every decode step (docs/algorithms.md sections 2-3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foresight.policies import register
from foresight.runtime.cache import StateField
from foresight.runtime.policy import EvictionContext, ObservedQueries, Policy

NO_HIT = float("-inf")


def attention_hits(attention: torch.Tensor, query_positions: torch.Tensor, threshold: float) -> torch.Tensor:
    """[batch, Hkv, L, N] True where a real query gave an entry attention >= `threshold`.

    The attention [batch, Hkv, G, L, N] is reduced by its max over the G query heads of the group
    (RaaS and LazyEviction score per KV head); unfilled query slots (position -1) never hit."""
    strongest = attention.amax(dim=2)
    return (strongest >= threshold) & (query_positions >= 0)[:, None, :, None]


def hit_times(hits: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """[batch, Hkv, L, N] float: the query's position where it hit the entry, -inf elsewhere."""
    times = query_positions.float()[:, None, :, None].expand_as(hits)
    return times.masked_fill(~hits, NO_HIT)


@register
@dataclass
class RaaS(Policy):
    """Keep the entries with the newest timestamps (RaaS).

    threshold (theta, default 1e-4): attention, max over the G query heads of a KV head, at or above
    which a query refreshes an entry's timestamp. The prompt is protected by default, as in RaaS.
    The state `raas_timestamp` holds the latest refreshing query (-inf before any); the timestamp
    is the later of it and the entry's own position."""

    name = "raas"
    summary = "newest attention-refreshed timestamp"
    needs_attention = True
    observed_queries = ObservedQueries.DECODE
    default_protect_prompt = True
    state_fields = (StateField("raas_timestamp", fill=NO_HIT),)
    threshold: float = 1e-4

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"raas threshold={self.threshold} must be > 0 (masked attention is exactly 0)")

    def observe(self, context: EvictionContext) -> dict[str, torch.Tensor]:
        hits = attention_hits(context.attention, context.query_positions, self.threshold)
        last_hit = hit_times(hits, context.query_positions).amax(dim=2)
        return {"raas_timestamp": torch.maximum(context.state["raas_timestamp"], last_hit)}

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        timestamp = torch.maximum(context.state["raas_timestamp"], context.positions.float())
        return timestamp[..., : context.num_candidates]
