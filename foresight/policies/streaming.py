"""StreamingLLM (Xiao et al., 2024): attention sinks plus the most recent entries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foresight.policies import register
from foresight.runtime.policy import EvictionContext, Policy


@register
@dataclass
class Streaming(Policy):
    """Keeps the first `sinks` entries (the engine never evicts them; default S = 4) and otherwise
    the most recent candidates: the keep score is the entry's position."""

    name = "streaming"
    summary = "sinks + most recent"
    default_sinks = 4
    runs_pooled = True

    @property
    def scores_compare_across_heads(self) -> bool:
        """Positions: the same scale in every head."""
        return True

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        return context.candidate_positions.float()
