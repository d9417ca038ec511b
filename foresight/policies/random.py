"""Random eviction: the floor any informed policy must beat."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foresight.policies import register
from foresight.policies.base import EvictionContext, Policy


@register
@dataclass
class RandomEviction(Policy):
    """Uniform random keep scores, reproducible from `seed` (reset at the start of every run)."""

    name = "random"
    summary = "uniform random keep scores"
    seed: int = 0
    _generator: torch.Generator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._generator = torch.Generator().manual_seed(self.seed)

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        shape = context.candidate_positions.shape
        return torch.rand(shape, generator=self._generator).to(context.keys.device)
