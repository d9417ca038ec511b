"""LagKV (Liang et al., 2025): score each chunk of the cache against the chunk that follows it.

LagKV Eqs. 7-10, per KV head, for keys and values alike: over the L entries of the reference chunk
take each channel's min and max, normalise the chunk x_bar = (x - min) / (max - min), take the std
over channels, softmax over the chunk; the token score is key score + value score. Attention-free.

Adapted to our cadence (docs/algorithms.md section 3):
- Chunks of `lag_size` entries are cut from the newest candidate backwards, so every chunk's
  reference is exactly the `lag_size` entries after it (the newest chunk's is the recent window);
  only the oldest chunk can be short. In steady state this is the paper's oldest-first partition:
  each step scores exactly the L entries that just left the recent window.
- A score is frozen once computed (per-entry state), as in the paper's recursive compression.
- The score is converted to the within-chunk rank / chunk size (as kvpress does), so a global
  top-k keeps about the same share of every chunk (the paper keeps a ratio per partition).
- A channel whose reference range is below eps (a constant channel) divides by eps instead of 0;
  elsewhere the normalisation is exactly Eq. 9. The std is torch's default (unbiased), as kvpress.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from foresight.policies import register
from foresight.runtime.cache import StateField
from foresight.runtime.policy import EvictionContext, Policy

RANGE_EPSILON = 1e-6
UNSCORED = float("nan")


def lag_relative_scores(states: torch.Tensor, references: torch.Tensor) -> torch.Tensor:
    """LagKV Eqs. 7-10 before the softmax: std over channels of each entry normalised by its
    reference chunk's per-channel range. states and references [..., chunk, D] -> [..., chunk]."""
    low = references.amin(dim=-2, keepdim=True)
    span = (references.amax(dim=-2, keepdim=True) - low).clamp(min=RANGE_EPSILON)
    return ((states - low) / span).std(dim=-1)


def within_chunk_ranks(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rank of each valid entry among the valid entries of its chunk, divided by their count, in
    [0, 1) (0 = lowest). scores and valid [..., chunk]; invalid entries get -1."""
    order = scores.masked_fill(~valid, float("-inf")).argsort(dim=-1, stable=True)
    ranks = order.argsort(dim=-1, stable=True)
    invalid = (~valid).sum(-1, keepdim=True)
    ranks = (ranks - invalid).float() / valid.sum(-1, keepdim=True).clamp(min=1)
    return ranks.masked_fill(~valid, -1.0)


def lagkv_chunk_ranks(
    keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, num_candidates: int, lag: int
) -> torch.Tensor:
    """Within-chunk ranks [batch, Hkv, num_candidates] of every candidate against its lag reference.

    keys, values [batch, Hkv, N, D]; valid [batch, Hkv, N]; the candidates are the first
    `num_candidates` entries and the entries after them hold at least `lag` more."""
    pad = -num_candidates % lag
    chunks = (num_candidates + pad) // lag

    def chunked(tensor: torch.Tensor, fill: float | bool) -> torch.Tensor:
        """[batch, Hkv, chunks + 1, lag, ...]: the candidates front-padded to whole chunks, then
        the last chunk's reference."""
        tensor = tensor[:, :, : num_candidates + lag]
        trailing = (0, 0) * (tensor.dim() - 3)
        padded = F.pad(tensor, (*trailing, pad, 0), value=fill)
        return padded.reshape(*tensor.shape[:2], chunks + 1, lag, *tensor.shape[3:])

    keys, values = chunked(keys.float(), 0.0), chunked(values.float(), 0.0)
    valid = chunked(valid, False)
    chunk_valid = valid[:, :, :-1]
    score = sum(
        lag_relative_scores(states[:, :, :-1], states[:, :, 1:]).masked_fill(~chunk_valid, float("-inf")).softmax(-1)
        for states in (keys, values)
    )
    ranks = within_chunk_ranks(score.nan_to_num(0.0), chunk_valid)
    return ranks.reshape(*ranks.shape[:2], chunks * lag)[:, :, pad : pad + num_candidates]


@register
@dataclass
class LagKV(Policy):
    """LagKV: attention-free lag-relative scores of keys and values (Liang et al., 2025).

    lag_size (default None = the interval L): entries per chunk and per reference chunk; at most L.
    Sinks default to S = 16 (the paper's setting)."""

    name = "lagkv"
    summary = "lag-relative key/value std, ranked within chunks"
    default_sinks = 16
    state_fields = (StateField("lagkv_rank", fill=UNSCORED),)
    lag_size: int | None = None

    def __post_init__(self) -> None:
        if self.lag_size is not None and self.lag_size < 1:
            raise ValueError(f"lagkv lag_size={self.lag_size} must be >= 1 (or None for the interval L)")

    def observe(self, context: EvictionContext) -> dict[str, torch.Tensor]:
        interval = context.keys.shape[2] - context.num_candidates
        lag = interval if self.lag_size is None else self.lag_size
        if lag > interval:
            raise ValueError(f"lagkv lag_size={lag} must be at most the interval L={interval}")
        ranks = lagkv_chunk_ranks(context.keys, context.values, context.positions >= 0, context.num_candidates, lag)
        frozen = context.state["lagkv_rank"]
        candidates = frozen[..., : context.num_candidates]
        scored = torch.where(candidates.isnan(), ranks, candidates)
        return {"lagkv_rank": torch.cat([scored, frozen[..., context.num_candidates :]], dim=-1)}

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        return context.state["lagkv_rank"][..., : context.num_candidates]
