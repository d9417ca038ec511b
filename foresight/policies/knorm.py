"""Key-norm eviction (kvpress KnormPress; Devoto et al., 2024): low-norm keys draw attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foresight.policies import register
from foresight.runtime.policy import EvictionContext, Policy


@register
@dataclass
class KeyNorm(Policy):
    """Keep score -||k||_2 of the post-RoPE key (RoPE is a rotation, so the norm is the pre-RoPE one)."""

    name = "knorm"
    summary = "-||k||2"

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        return -context.keys[..., : context.num_candidates, :].float().norm(dim=-1)
