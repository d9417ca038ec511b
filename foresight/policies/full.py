"""Full cache: never evicts; the reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foresight.policies import register
from foresight.runtime.policy import EvictionContext, Policy


@register
@dataclass
class FullCache(Policy):
    """Keeps every entry (no budget)."""

    name = "full"
    summary = "no eviction (reference)"
    evicts = False

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        return torch.zeros_like(context.candidate_positions, dtype=torch.float32)
