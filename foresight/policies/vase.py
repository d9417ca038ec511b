"""VaSE (Chang et al., 2026): protect the largest value states, evict stochastically among the rest.

"Value-Aware Stochastic KV Cache Eviction for Reasoning Models", the VaSE-AttnV recipe as the authors'
code runs it (mode `range_sink_sample_attn`): a small share of value vectors have abnormally large
magnitudes and evicting them sends the model into repetition loops, so the `large_share` of candidates
with the largest value range (max - min over channels) are kept outright; the rest of the keep budget is
sampled without replacement with probability proportional to an attention score, for cache diversity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from foresight.cadence import top_k_mask
from foresight.policies import register
from foresight.policies.random import uniform_hash
from foresight.policies.snapkv import masked_softmax
from foresight.runtime.policy import EvictionContext, Policy

POOL_KERNEL = 5  # the authors' avg_pool1d smoothing of the attention score (their --smooth, always on)
SMALLEST_UNIFORM = 2.0**-32  # keeps log(u) finite when the hash draws exactly 0


def value_magnitude(values: torch.Tensor, measure: str) -> torch.Tensor:
    """Magnitude of each value vector [..., N, D] -> [..., N]: range (max - min), l2 norm or variance."""
    if measure == "range":
        return values.amax(-1) - values.amin(-1)
    if measure == "l2":
        return values.norm(dim=-1)
    return values.var(dim=-1)


def sampling_weights(context: EvictionContext) -> torch.Tensor:
    """The authors' attention score [batch, Hkv, C]: per query head, the softmax of each buffered
    query's logits over the candidates (only those it can see), averaged over the queries, average-pooled
    along the slots (kernel 5, zero padding counted), then averaged over the G heads of the group."""
    candidates = context.num_candidates
    logits = context.logits[..., :candidates]  # [batch, Hkv, G, L, C]
    query_positions = context.query_positions[:, None, None, :, None]
    key_positions = context.candidate_positions[:, :, None, None, :]
    visible = (key_positions >= 0) & (key_positions <= query_positions)
    weights = masked_softmax(logits, visible).mean(dim=3)  # [batch, Hkv, G, C]
    pooled = F.avg_pool1d(weights.flatten(0, 2)[:, None], POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2)
    return pooled.reshape(weights.shape).mean(dim=2)


@register
@dataclass
class VaSE(Policy):
    """VaSE-AttnV: the top `large_share` of the valid candidates by value magnitude score 1 + magnitude
    (always above the rest, so they are kept first, largest first); every other candidate scores the
    Efraimidis-Spirakis key log(u) / w, w its attention score and u uniform, so the engine's top-k keeps a
    sample drawn without replacement with probability proportional to w, which is the authors'
    `torch.multinomial(w, replacement=False)`.

    large_share (default 0.25): share of the valid candidates protected by magnitude. The authors protect
      n_large = B / 4 (their throughput runs; 1024 of B = 4096 on AIME) of the B candidates an eviction
      step sees; ours is floor(share x valid candidates), which is B / 4 in steady state.
    magnitude (default "range"): "range" (max - min over channels, the paper's), "l2" or "var" (ablations).
    seed (default 0): u is a fixed hash of (seed, layer, KV head, position, the row's newest position):
      a fresh draw at every step, as the authors sample anew, yet a batch evicts as its rows alone.

    Choices where our cadence differs from the authors' code: the attention score reads the L buffered
    queries (theirs: the last `residual_length` = L queries too) at the context's scaling (1/sqrt(D) for
    the models here; their temperature is 1); S = 4 sinks by default, kept by the engine on top of the
    protected share (the authors count their 4 sinks inside n_large).
    """

    name = "vase"
    summary = "largest value ranges kept, the rest sampled by attention (VaSE-AttnV)"
    needs_attention = True
    default_sinks = 4
    large_share: float = 0.25
    magnitude: Literal["range", "l2", "var"] = "range"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.large_share <= 1:
            raise ValueError(f"vase large_share={self.large_share} must be a share in [0, 1]")
        if self.magnitude not in ("range", "l2", "var"):
            raise ValueError(f"vase magnitude={self.magnitude!r} must be one of 'range', 'l2', 'var'")

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        positions = context.candidate_positions
        valid = positions >= 0
        values = context.values[..., : context.num_candidates, :].float()
        magnitude = value_magnitude(values, self.magnitude).masked_fill(~valid, float("-inf"))
        protected = (valid.sum(-1, keepdim=True) * self.large_share).floor().long()
        large = top_k_mask(magnitude, protected) & valid
        heads = torch.arange(positions.shape[1], device=positions.device)[None, :, None]
        step = context.newest_position[:, None, None] + 1
        uniform = uniform_hash(self.seed, context.layer_idx, heads, positions, draw=step).clamp(min=SMALLEST_UNIFORM)
        sampled = uniform.log() / sampling_weights(context)
        return torch.where(large, 1.0 + magnitude, sampled)
