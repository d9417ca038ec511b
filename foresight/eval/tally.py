"""What one (policy, budget) accumulates over the replayed traces, and its result row.

One entry per scored trace, the unit the confidence intervals resample; the figures of a row are the
metrics of `foresight.eval.metric_registry`, pooled over those entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from foresight.data.trace_store import Trace
from foresight.eval.equal_bytes import TokenLosses
from foresight.eval.headroom import TraceScore
from foresight.eval.metric_registry import METRICS, SPLIT_SETS, SUM, SUMS, Metric, Part, ScoredTrace, TokenSet
from foresight.eval.report import set_interval
from foresight.eval.stats import bootstrap_interval
from foresight.metrics import scored_tokens
from foresight.runtime.engine import EvictionConfig

_TRACE_SCORE_SUMS = tuple(f.name for f in fields(TraceScore) if f.name in SUM)
"""The sums `TraceScore` keeps per trace (its other fields name the row, the trace and the token set)."""
_COUNTS = ("tokens", "low_entropy")  # sums that count tokens: integers in a TraceScore and a row
SPLIT_METRICS = tuple(m for m in METRICS if m.paired)
"""The figures a row also reports per token set (`row`), each under NAME:SET with its interval."""


# -- the replay loop -----------------------------------------------------------------------------
@dataclass
class TraceTally:
    """Everything one (policy, budget) accumulates over the batches: per scored trace, its part of every
    sum of `SUMS` (for a sampled policy, the mean over its seeds)."""

    parts: list[dict[str, Part]] = field(default_factory=list)
    traces: list[Trace] = field(default_factory=list)  # the scored traces, in the order of `parts`
    token_nll: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # per scored trace: first eviction, NLL
    never_evicted: int = 0
    seconds: float = 0.0

    def add_trace(
        self,
        trace: Trace,
        nll: torch.Tensor,
        first_eviction: int | None,
        cosine: torch.Tensor | None,
        overlap: tuple[int, int] = (0, 0),
        flipped: torch.Tensor | None = None,
    ) -> None:
        """Score one replayed trace: nll [T - 1] with eviction; cosine [T - 1] per token (None: 1);
        overlap (hits, kept) with the golden kept set; flipped [T - 1] whether eviction changed the top-1
        prediction (None: never, the full cache)."""
        scored = scored_tokens(nll.numel(), first_eviction)
        if not bool(scored.any()):
            self.never_evicted += 1
            return
        tokens = ScoredTrace(
            trace,
            nll[scored],
            trace.token_nll[scored],
            trace.token_entropy[scored],
            torch.ones(int(scored.sum()), dtype=torch.float64) if cosine is None else cosine[scored],
            *overlap,
            torch.zeros(int(scored.sum()), dtype=torch.bool) if flipped is None else flipped[scored],
        )
        self.parts.append({s.name: s.part(tokens) for s in SUMS})
        self.traces.append(trace)
        self.token_nll.append((int(first_eviction), nll.float()))

    def extend(self, other: TraceTally) -> None:
        """Add the traces of `other` (another batch of the same policy and budget)."""
        self.parts += other.parts
        self.traces += other.traces
        self.token_nll += other.token_nll
        self.never_evicted += other.never_evicted
        self.seconds += other.seconds

    def state(self) -> dict[str, Any]:
        """What `from_state` rebuilds this tally from: tensors, numbers and trace indices (`torch.load`-safe)."""
        return {
            "traces": [trace.index for trace in self.traces],
            "parts": self.parts,
            "token_nll": self.token_nll,
            "never_evicted": self.never_evicted,
            "seconds": self.seconds,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], traces: Sequence[Trace]) -> TraceTally:
        """The tally `state` describes, its traces looked up by index among `traces`."""
        by_index = {trace.index: trace for trace in traces}
        return cls(
            [dict(parts) for parts in state["parts"]],
            [by_index[index] for index in state["traces"]],
            [(int(first), nll) for first, nll in state["token_nll"]],
            int(state["never_evicted"]),
            float(state["seconds"]),
        )

    @staticmethod
    def mean(replays: Sequence[TraceTally]) -> TraceTally:
        """The per-trace means of replays of the same traces (a sampled policy under several seeds): every
        sum that is not a property of the trace itself is averaged (`Sum.mean`); the seconds add up. One
        replay is returned as it is."""
        first = replays[0]
        if len(replays) == 1:
            return first
        if any(replay._scored() != first._scored() for replay in replays):
            raise ValueError("replays to average must score the same tokens of the same traces")
        parts = [
            {s.name: s.mean([trace[s.name] for trace in seeds]) for s in SUMS}
            for seeds in zip(*(r.parts for r in replays))
        ]
        token_nll = [
            (seeds[0][0], torch.stack([nll for _, nll in seeds]).mean(0))
            for seeds in zip(*(r.token_nll for r in replays))
        ]
        seconds = sum(r.seconds for r in replays)
        return TraceTally(parts, first.traces, token_nll, first.never_evicted, seconds)

    def _scored(self) -> list[tuple[int, float]]:
        """(trace index, scored tokens) of every scored trace."""
        return [(trace.index, SUM["tokens"].of_trace(parts["tokens"])) for trace, parts in zip(self.traces, self.parts)]

    def _parts(self, token_set: TokenSet) -> list[dict[str, Part]]:
        """Each scored trace's parts over the scored tokens of `token_set`."""
        if token_set is TokenSet.ALL:
            return self.parts
        selected = []
        for trace, parts, (first, _) in zip(self.traces, self.parts, self.token_nll):
            if not isinstance(parts["tokens"], torch.Tensor):
                raise ValueError("a tally kept before per-token sums cannot be split by token set; replay it again")
            mask = token_set.mask(first, parts["tokens"].numel(), trace.prompt_length)
            selected.append({s.name: s.select(parts[s.name], mask) for s in SUMS})
        return selected

    def sums(self, name: str, token_set: TokenSet = TokenSet.ALL) -> list[float]:
        """Each scored trace's sum `name` (a `Sum` of `SUMS`) over the scored tokens of `token_set`."""
        return _trace_sums(self._parts(token_set), name)

    def trace_scores(self, policy: str, budget: int) -> list[TraceScore]:
        """Each scored trace's sums, for intervals over traces (`foresight.eval.headroom`): one score per trace
        and token set (all scored predictions, then each set of `SPLIT_SETS`)."""
        scores = []
        for token_set in (TokenSet.ALL, *SPLIT_SETS):
            parts = self._parts(token_set)
            columns = [_trace_sums(parts, name) for name in _TRACE_SCORE_SUMS]
            for trace, values in zip(self.traces, zip(*columns)):
                sums = {n: int(v) if n in _COUNTS else v for n, v in zip(_TRACE_SCORE_SUMS, values)}
                scores.append(TraceScore(policy, budget, trace.index, trace.source, **sums, token_set=token_set.value))
        return scores

    def token_losses(self, policy: str, budget: int) -> list[TokenLosses]:
        """Each scored trace's per-token NLL and first eviction, for scoring budgets on common tokens."""
        return [
            TokenLosses(policy, budget, trace.index, first, nll, trace.prompt_length)
            for trace, (first, nll) in zip(self.traces, self.token_nll)
        ]

    def row(self, policy: str, eviction: EvictionConfig, overlap: bool) -> dict[str, Any]:
        """The result row: every metric of `METRICS` pooled over the scored traces (None where undefined:
        no scored token; the golden overlap without `overlap`, i.e. no labels or a policy that keeps
        everything), then each one's interval over traces."""
        row: dict[str, Any] = {
            "policy": policy,
            "budget": eviction.budget,
            "interval": eviction.interval,
            "traces": len(self.parts),
            "tokens": int(self._pooled(TokenSet.ALL)["tokens"]),
        }
        row |= self._figures(METRICS, TokenSet.ALL, overlap)
        row |= {"never_evicted": self.never_evicted, "seconds": round(self.seconds, 3)}
        for token_set in SPLIT_SETS:
            row[f"tokens:{token_set.value}"] = int(self._pooled(token_set)["tokens"])
            row |= self._figures(SPLIT_METRICS, token_set, overlap)
        return row

    def _pooled(self, token_set: TokenSet) -> dict[str, float]:
        return _pooled(self._parts(token_set))

    def _figures(self, metrics: Sequence[Metric], token_set: TokenSet, overlap: bool) -> dict[str, Any]:
        """`metrics` pooled over the scored tokens of `token_set` (keyed NAME, or NAME:SET for a split set), then
        each one's interval over traces (None where undefined: no scored token; the golden overlap without
        `overlap`)."""
        parts = self._parts(token_set)  # split once, read by every figure
        pooled = _pooled(parts)
        keys = {m.name: m.name if token_set is TokenSet.ALL else f"{m.name}:{token_set.value}" for m in metrics}
        figures: dict[str, Any] = {}
        for metric in metrics:
            undefined = (metric.denominator is not None and not pooled["tokens"]) or (metric.golden and not overlap)
            figures[keys[metric.name]] = None if undefined else metric.value(pooled)
        for metric in metrics:
            if metric.interval:
                key = keys[metric.name]
                sums = (_trace_sums(parts, metric.numerator), _trace_sums(parts, metric.denominator))
                set_interval(figures, key, None if figures[key] is None else bootstrap_interval(*sums))
        return figures


def _trace_sums(parts: Sequence[dict[str, Part]], name: str) -> list[float]:
    """Each trace's sum `name` of its `parts`."""
    return [SUM[name].of_trace(trace[name]) for trace in parts]


def _pooled(parts: Sequence[dict[str, Part]]) -> dict[str, float]:
    """Every sum of `SUMS` pooled over the traces' `parts`."""
    return {s.name: s.pooled([trace[s.name] for trace in parts]) for s in SUMS}
