"""SnapKV (Li et al., 2024) in R-KV's decoding adaptation (Cai et al., 2025, Eqs. 2-4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from foresight.policies import register
from foresight.runtime.policy import EvictionContext, Policy


@register
@dataclass
class SnapKV(Policy):
    """Observation-window attention, scored every L tokens as R-KV runs SnapKV during decoding.

    For each KV head: take the attention logits of the last `window` queries (R-KV's observation
    tokens) on the candidates, max-pool them over the G query heads of the group (R-KV Eq. 3),
    softmax over the candidates only (R-KV App. A.2: slicing before the softmax keeps each row
    normalised over what can be evicted), average over the queries and max-pool along the cache
    slots with `kernel_size` (stride 1, same padding; R-KV Eq. 4, official code's max_pool1d).

    Candidates a query cannot see (invalid slots, or positions after the query) are left out of
    its softmax, so padding never shifts the weights of valid entries.

    Parameters
    ----------
    window : int, default=8
        α, the number of most recent queries that observe the candidates (clamped to L).
    kernel_size : int, default=7
        Width of the max-pooling along slots (odd, so the pooling is centred).
    """

    name = "snapkv"
    summary = "last-α-query attention over candidates, max-pooled (R-KV's decoding SnapKV)"
    needs_attention = True
    rows_alone = True
    runs_pooled = True
    window: int = 8
    kernel_size: int = 7

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={self.kernel_size} must be a positive odd number")

    @property
    def latest_queries(self) -> int:
        return self.window

    @property
    def scores_compare_across_heads(self) -> bool:
        """Each a share of its own head's attention (AdaKV's allocation over SnapKV's scores)."""
        return True

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        return self.importance(context)

    def importance(self, context: EvictionContext) -> torch.Tensor:
        """R-KV's importance score I (Eq. 4): [batch, Hkv, C]."""
        candidates = context.num_candidates
        logits = context.logits[..., -self.window :, :candidates].amax(dim=2)  # [batch, Hkv, α, C]
        query_positions = context.query_positions[:, None, -self.window :, None]  # [batch, 1, α, 1]
        key_positions = context.candidate_positions[:, :, None, :]  # [batch, Hkv, 1, C]
        visible = (key_positions >= 0) & (key_positions <= query_positions)
        mean = masked_softmax(logits, visible).mean(dim=2)
        batch, heads, _ = mean.shape
        pooled = F.max_pool1d(
            mean.reshape(batch * heads, 1, candidates), self.kernel_size, stride=1, padding=self.kernel_size // 2
        )
        return pooled.reshape(batch, heads, candidates)


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over the entries where `mask` is True; masked entries (and fully masked rows) get 0."""
    weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=dim)
    return weights.masked_fill(~mask, 0.0)
