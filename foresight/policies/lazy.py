"""LazyEviction (Zhang et al., 2025): keep entries whose attention is likely to recur.

Each entry carries t_last (the last step at which it drew attention >= theta) and its Maximum
Recurrence Interval MRI (the longest gap between two such steps). The formulas follow the authors'
code (the paper's text lost them), docs/algorithms.md section 3:

    per decode query t, in order, for every entry with attention >= theta (max over the G heads):
        MRI <- max(MRI, t - t_last);  t_last <- t
    keep score at step t:  H1 + H2,  H1 = 2 sigmoid(-(1 + (t - t_last) / (MRI + 1e-5))),
                                     H2 = 2 sigmoid(1 - MRI) if MRI > 0 else 0.

Time is measured in sequence positions: "decode step t" is the query of the token at position t,
and the score is taken at the newest token. The runtime hands `observe` every decode query (every
query after the prompt) exactly once, in order and in blocks. A new entry starts with t_last = t - 1
(its own position minus one) and MRI = 0; prompt entries start with t_last = 0 (set in `on_forward`,
which the engine calls after every forward, before observing its queries).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foresight.policies import register
from foresight.policies.raas import NO_HIT, attention_hits, hit_times
from foresight.runtime.cache import StateField
from foresight.runtime.policy import EvictionContext, ObservedQueries, Policy

MRI_EPSILON = 1e-5


def recurrence_update(
    hits: torch.Tensor, query_positions: torch.Tensor, t_last: torch.Tensor, mri: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replay the L queries of a block in order, in closed form: (new t_last, new MRI), [batch, Hkv, N].

    hits [batch, Hkv, L, N] (query l hit the entry), query_positions [batch, L] increasing. The running
    maximum of the hit times up to query l is the t_last that query l+1 sees, so every gap between
    consecutive hits (and from the old t_last to the first hit) comes from one cummax."""
    times = hit_times(hits, query_positions)
    last_hit_so_far = times.cummax(dim=2).values
    shifted = torch.cat([torch.full_like(last_hit_so_far[:, :, :1], NO_HIT), last_hit_so_far[:, :, :-1]], dim=2)
    seen_before = torch.where(shifted > NO_HIT, shifted, t_last[:, :, None, :])
    gaps = (times - seen_before).masked_fill(~hits, NO_HIT)
    new_mri = torch.maximum(mri, gaps.amax(dim=2))
    final_hit = last_hit_so_far[:, :, -1]
    new_t_last = torch.where(final_hit > NO_HIT, final_hit, t_last)
    return new_t_last, new_mri


def recurrence_scores(t_last: torch.Tensor, mri: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """MRI-centric importance H1 + H2 at step `now` [batch] (LazyEviction, authors' code)."""
    elapsed = now.float()[:, None, None] - t_last
    h1 = 2 * torch.sigmoid(-(1 + elapsed / (mri + MRI_EPSILON)))
    h2 = torch.where(mri > 0, 2 * torch.sigmoid(1 - mri), torch.zeros_like(mri))
    return h1 + h2


@register
@dataclass
class LazyEviction(Policy):
    """LazyEviction's MRI-centric eviction (Zhang et al., 2025).

    threshold (theta, default 1e-4): attention, max over the G query heads of a KV head, at or above
    which a decode query counts as a recurrence of an entry."""

    name = "lazy"
    summary = "recurrence interval (MRI) tracking"
    needs_attention = True
    observed_queries = ObservedQueries.DECODE
    state_fields = (StateField("lazy_t_last"), StateField("lazy_mri"))
    threshold: float = 1e-4
    _prompt_seen: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"lazy threshold={self.threshold} must be > 0 (masked attention is exactly 0)")

    def reset(self) -> None:
        self._prompt_seen = False

    def run_state(self) -> dict[str, bool]:
        return {"prompt_seen": self._prompt_seen}

    def load_run_state(self, state: dict[str, bool]) -> None:
        self._prompt_seen = state["prompt_seen"]

    def on_forward(self, hidden_states: dict[int, torch.Tensor], positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """t_last of the new tokens: 0 for the prompt (the first forward of a run), t - 1 afterwards."""
        t_last = positions.float() - 1 if self._prompt_seen else torch.zeros_like(positions, dtype=torch.float32)
        self._prompt_seen = True
        return {"lazy_t_last": t_last}

    def observe(self, context: EvictionContext) -> dict[str, torch.Tensor]:
        hits = attention_hits(context.attention, context.query_positions, self.threshold)
        t_last, mri = recurrence_update(
            hits, context.query_positions, context.state["lazy_t_last"], context.state["lazy_mri"]
        )
        return {"lazy_t_last": t_last, "lazy_mri": mri}

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        scores = recurrence_scores(context.state["lazy_t_last"], context.state["lazy_mri"], context.newest_position)
        return scores[..., : context.num_candidates]
