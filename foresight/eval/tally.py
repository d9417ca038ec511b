"""What one (policy, budget) accumulates over the replayed traces, and its result row.

One entry per scored trace, the unit the confidence intervals resample; a new metric is added here
(its per-trace sums and its row) and named in `foresight.eval.results`'s columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from foresight.eval.headroom import TraceScore
from foresight.metrics import (
    EntropyDamage,
    loss_ratio,
    low_entropy_damage,
    scored_tokens,
)
from foresight.eval.report import set_interval
from foresight.eval.stats import bootstrap_interval
from foresight.data.trace_store import Trace


# -- the replay loop -----------------------------------------------------------------------------
@dataclass
class TraceTally:
    """Everything one (policy, budget) accumulates over the batches, one entry per scored trace (the
    unit the confidence intervals resample)."""

    evicted_nll: list[torch.Tensor] = field(default_factory=list)
    full_nll: list[torch.Tensor] = field(default_factory=list)
    cosine: list[torch.Tensor] = field(default_factory=list)
    damages: list[EntropyDamage] = field(default_factory=list)
    overlap_hits: list[int] = field(default_factory=list)
    overlap_kept: list[int] = field(default_factory=list)
    never_evicted: int = 0
    seconds: float = 0.0
    traces: list[Trace] = field(default_factory=list)  # the scored traces, in the order of the lists above

    def add_trace(
        self,
        trace: Trace,
        nll: torch.Tensor,
        first_eviction: int | None,
        cosine: torch.Tensor | None,
        overlap: tuple[int, int] = (0, 0),
    ) -> None:
        """Score one replayed trace: nll [T - 1] with eviction; cosine [T - 1] per token (None: 1);
        overlap (hits, kept) with the golden kept set."""
        scored = scored_tokens(nll.numel(), first_eviction)
        if not bool(scored.any()):
            self.never_evicted += 1
            return
        self.evicted_nll.append(nll[scored])
        self.full_nll.append(trace.token_nll[scored])
        self.damages.append(low_entropy_damage(nll[scored], trace.token_nll[scored], trace.token_entropy[scored]))
        self.traces.append(trace)
        self.cosine.append(torch.ones(int(scored.sum()), dtype=torch.float64) if cosine is None else cosine[scored])
        self.overlap_hits.append(overlap[0])
        self.overlap_kept.append(overlap[1])

    def trace_scores(self, policy: str, budget: int) -> list[TraceScore]:
        """Each scored trace's sums, for intervals over traces (`foresight.eval.headroom`)."""
        return [
            TraceScore(
                policy, budget, trace.index, trace.source, evicted.numel(), float(evicted.double().sum()),
                float(full.double().sum()), damage.low_entropy, damage.damaged,
            )
            for trace, damage, evicted, full in zip(self.traces, self.damages, self.evicted_nll, self.full_nll)
        ]

    def row(self, policy: str, budget: int, interval: int, overlap: bool) -> dict[str, Any]:
        tokens = sum(t.numel() for t in self.evicted_nll)
        evicted = torch.cat(self.evicted_nll) if tokens else torch.zeros(0)
        full = torch.cat(self.full_nll) if tokens else torch.zeros(0)
        damage = sum(self.damages, EntropyDamage())
        overlap = overlap and sum(self.overlap_kept) > 0
        row = {
            "policy": policy,
            "budget": budget,
            "interval": interval,
            "traces": len(self.evicted_nll),
            "tokens": tokens,
            "loss_ratio": loss_ratio(evicted, full) if tokens else None,
            "nll_evicted": float(evicted.double().mean()) if tokens else None,
            "nll_full": float(full.double().mean()) if tokens else None,
            "low_entropy_damage": damage.share if tokens else None,
            "low_entropy_dl2": damage.mean_squared if tokens else None,
            "low_entropy_penalty": damage.penalty if tokens else None,
            "low_entropy_tokens": damage.low_entropy,
            "damaged_tokens": damage.damaged,
            "attn_cosine": float(torch.cat(self.cosine).mean()) if tokens else None,
            "golden_overlap": sum(self.overlap_hits) / sum(self.overlap_kept) if overlap else None,
            "never_evicted": self.never_evicted,
            "seconds": round(self.seconds, 3),
        }
        for metric, parts in self._per_trace().items():
            set_interval(row, metric, None if row[metric] is None else bootstrap_interval(*parts))
        return row

    def _per_trace(self) -> dict[str, tuple[list[float], list[float]]]:
        """(numerator, denominator) per trace of every reported metric: the interval resamples traces."""
        return {
            "loss_ratio": ([float(t.double().sum()) for t in self.evicted_nll], [float(t.double().sum()) for t in self.full_nll]),
            "low_entropy_damage": ([d.damaged for d in self.damages], [d.low_entropy for d in self.damages]),
            "low_entropy_dl2": ([d.squared_sum for d in self.damages], [d.damaged for d in self.damages]),
            "low_entropy_penalty": ([d.squared_sum for d in self.damages], [d.low_entropy for d in self.damages]),
            "attn_cosine": ([float(c.sum()) for c in self.cosine], [c.numel() for c in self.cosine]),
            "golden_overlap": (self.overlap_hits, self.overlap_kept),
        }
