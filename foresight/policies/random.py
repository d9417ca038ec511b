"""Random eviction: the floor any informed policy must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foresight.policies import register
from foresight.runtime.policy import EvictionContext, Policy


def uniform_hash(
    seed: int, layer: int, heads: torch.Tensor, positions: torch.Tensor, draw: torch.Tensor | int = 0
) -> torch.Tensor:
    """A uniform pseudo-random number in [0, 1) per (seed, layer, head, position), by integer mixing.
    `draw` (default 0, broadcast like `positions`) names one of several independent draws of an entry,
    e.g. one per eviction step for policies that redraw at every step. Mixed in int64 whatever the positions'
    and draws' dtype (the cache's positions are int32), so a draw depends on their values only."""
    draw = draw.long() if isinstance(draw, torch.Tensor) else draw
    mixed = positions.long() * 0x9E3779B1 + (heads + 131 * layer) * 0x85EBCA77 + seed * 0xC2B2AE3D + draw * 0x27D4EB2F
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, 1)):
        mixed = (mixed ^ (mixed >> shift)) * multiplier & 0x7FFFFFFF
    return mixed.double().div(2**31).float()


@register
@dataclass
class RandomEviction(Policy):
    """Uniform random keep scores. Each entry draws its score once, as a fixed pseudo-random function
    of (seed, layer, KV head, position), so a batch evicts exactly as its rows alone and a run is
    reproducible from `seed` (default 0)."""

    name = "random"
    summary = "uniform random keep scores"
    seed: int = 0

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        positions = context.candidate_positions
        heads = torch.arange(positions.shape[1], device=positions.device)[None, :, None]
        return uniform_hash(self.seed, context.layer_idx, heads, positions)
