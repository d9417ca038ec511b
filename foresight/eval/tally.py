"""What one (policy, budget) accumulates over the replayed traces, and its result row.

One entry per scored trace, the unit the confidence intervals resample; a new metric is added here
(its per-trace sums and its row) and named in `foresight.eval.results`'s columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
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
    overlap_hits: list[float] = field(default_factory=list)  # a mean over seeds for a sampled policy
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

    def extend(self, other: TraceTally) -> None:
        """Add the traces of `other` (another batch of the same policy and budget)."""
        for name in _PER_TRACE:
            getattr(self, name).extend(getattr(other, name))
        self.never_evicted += other.never_evicted
        self.seconds += other.seconds

    @staticmethod
    def mean(replays: Sequence[TraceTally]) -> TraceTally:
        """The per-trace means of replays of the same traces (a sampled policy under several seeds): the
        NLL and cosine of every scored token, the damage counts and the overlap hits are averaged; the
        seconds add up. One replay is returned as it is."""
        first = replays[0]
        if len(replays) == 1:
            return first
        if any(replay._scored() != first._scored() for replay in replays):
            raise ValueError("replays to average must score the same tokens of the same traces")

        def mean_tensors(name: str) -> list[torch.Tensor]:
            return [torch.stack(parts).double().mean(0) for parts in zip(*(getattr(r, name) for r in replays))]

        return TraceTally(
            evicted_nll=mean_tensors("evicted_nll"),
            full_nll=first.full_nll,
            cosine=mean_tensors("cosine"),
            damages=[EntropyDamage.mean(parts) for parts in zip(*(r.damages for r in replays))],
            overlap_hits=[sum(parts) / len(replays) for parts in zip(*(r.overlap_hits for r in replays))],
            overlap_kept=first.overlap_kept,
            never_evicted=first.never_evicted,
            seconds=sum(r.seconds for r in replays),
            traces=first.traces,
        )

    def _scored(self) -> list[tuple[int, int]]:
        """(trace index, scored tokens) of every scored trace."""
        return [(trace.index, nll.numel()) for trace, nll in zip(self.traces, self.evicted_nll)]

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


_PER_TRACE = tuple(f.name for f in fields(TraceTally) if f.name not in ("never_evicted", "seconds"))
"""The lists of `TraceTally` that hold one entry per scored trace."""
