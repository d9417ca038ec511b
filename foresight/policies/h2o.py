"""H2O (Zhang et al., 2023): heavy hitters, the entries that received the most attention so far."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foresight.policies import register
from foresight.runtime.cache import StateField
from foresight.runtime.policy import EvictionContext, ObservedQueries, Policy

CUMULATIVE = "cumulative"


@register
@dataclass
class H2O(Policy):
    """Heavy-Hitter Oracle, as run by ForesightKV's baselines (App. E.2): keep the candidates with
    the largest cumulative attention received, summed over every query seen so far and averaged
    over the G query heads of each KV head's group (docs/algorithms.md section 3).

    The sum lives in the per-entry state `cumulative` and travels with the entry when others are
    evicted. The runtime hands `observe` every query exactly once, the prompt's included, in blocks
    of at most L; each block adds its attention, so the state equals H2O's per-query accumulation
    from position 0. No options.
    """

    name = "h2o"
    summary = "cumulative attention received (mean over the G heads)"
    needs_attention = True
    rows_alone = True
    observed_queries = ObservedQueries.ALL
    state_fields = (StateField(CUMULATIVE),)

    def observe(self, context: EvictionContext) -> dict[str, torch.Tensor]:
        received = context.attention.sum(dim=3).mean(dim=2)  # [batch, Hkv, N]
        return {CUMULATIVE: context.state[CUMULATIVE] + received}

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        return context.state[CUMULATIVE][..., : context.num_candidates]
