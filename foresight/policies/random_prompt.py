"""Random Attention (Wang et al., 2026): keep the prompt, evict uniformly at random within each KV head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foresight.policies import register
from foresight.policies.random import RandomEviction, uniform_hash
from foresight.runtime.policy import EvictionContext


@register
@dataclass
class RandomPrompt(RandomEviction):
    """Random Attention ("Random Attention: Rethinking KV Cache Eviction for Efficient Reasoning", Eq. 3):
    a prompt entry scores +inf, every other candidate a fresh Uniform(0, 1) draw per KV head at every
    eviction step, and the top B - L stay. The prompt is protected by default (the engine's
    `protect_prompt`); the recent window is never scored, as the paper's recent buffer.

    Not `random --protect-prompt`: there an entry draws its score once, so the kept set is a uniform
    sample of the whole history (reservoir sampling). Here the draw is renewed at every step, so each
    candidate leaves with the same probability at every step and an entry's survival decays
    geometrically with its age, the paper's implicit recency. The draw is a fixed hash of (seed, layer,
    KV head, position, the row's newest position), so a batch evicts as its rows alone and a run is
    reproducible from `seed` (default 0).
    """

    name = "random-prompt"
    summary = "Random Attention: prompt kept, a fresh uniform draw per KV head at every step"
    default_protect_prompt = True

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        positions = context.candidate_positions
        heads = torch.arange(positions.shape[1], device=positions.device)[None, :, None]
        step = context.newest_position[:, None, None] + 1
        return uniform_hash(self.seed, context.layer_idx, heads, positions, draw=step)
