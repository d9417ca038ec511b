"""R-KV (Cai et al., 2025): importance minus redundancy, for long reasoning traces."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foresight.policies import register
from foresight.policies.snapkv import SnapKV, masked_softmax
from foresight.runtime.policy import EvictionContext

NORM_EPSILON = 1e-8  # R-KV Eq. 5


@register
@dataclass
class RKV(SnapKV):
    """Redundancy-aware selection, R-KV Eq. 7: Z = λ·I − (1−λ)·R per KV head.

    I is the `snapkv` score (R-KV Eq. 4). R (Eqs. 5-6, following the official `cal_similarity`):
    S = cosine similarity of the candidate keys, diagonal set to 0; in each row u, the entry of
    the most recent key v with S[u, v] > `threshold` is set to 0 (rows with no such key stay as
    they are; the official code would zero column 0 there instead); S̄[v] = mean over rows u of
    S[u, v] (the official `mean(dim=-2)`, Eq. 6's S̄_i = 1/n Σ_j S_{j,i}), so a key that is the
    most recent near-duplicate of others loses those similarities and is kept over its older
    copies; R = softmax of S̄ over the candidates.

    Our choices where the official code differs: S, its rows and the softmax cover the candidates
    only (the official code also uses the observation window's keys, then slices), invalid slots
    are left out of S, the mean and the softmax, and the mean divides by the number of valid
    candidates. "Most recent" is the latest slot, which is the latest position (the cache keeps
    entries in position order).

    Parameters
    ----------
    window : int, default=8
        α, the number of most recent queries behind the importance score (clamped to L).
    kernel_size : int, default=7
        Max-pooling width of the importance score.
    mix_lambda : float, default=0.1
        λ, the weight of importance against redundancy (R-KV §4.1).
    threshold : float, default=0.5
        Cosine similarity above which two keys count as near-duplicates.
    """

    name = "rkv"
    summary = "λ·snapkv importance − (1−λ)·key redundancy (R-KV)"
    runs_pooled = False  # not SnapKV's: its redundancy over each head's view is not checked against its twin yet
    mix_lambda: float = 0.1
    threshold: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda={self.mix_lambda} must be in [0, 1]")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold={self.threshold} must be a cosine similarity in [-1, 1]")

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        importance = self.importance(context)
        return self.mix_lambda * importance - (1.0 - self.mix_lambda) * self.redundancy(context)

    def redundancy(self, context: EvictionContext) -> torch.Tensor:
        """R-KV's redundancy score R (Eqs. 5-6): [batch, Hkv, C], higher = more redundant."""
        keys = context.keys[..., : context.num_candidates, :].float()
        unit = keys / (keys.norm(dim=-1, keepdim=True) + NORM_EPSILON)
        valid = context.candidate_positions >= 0  # [batch, Hkv, C]
        slots = torch.arange(keys.shape[2], device=keys.device)
        pairs = valid[..., :, None] & valid[..., None, :] & (slots[:, None] != slots[None, :])
        similarity = (unit @ unit.transpose(-1, -2)).masked_fill(~pairs, 0.0)  # [batch, Hkv, C, C]
        similar = pairs & (similarity > self.threshold)
        latest = torch.where(similar, slots, -1).amax(dim=-1, keepdim=True)  # -1: no similar key
        similarity = similarity.masked_fill(slots == latest, 0.0)
        mean = similarity.sum(dim=-2) / valid.sum(dim=-1, keepdim=True).clamp(min=1)
        return masked_softmax(mean, valid)
