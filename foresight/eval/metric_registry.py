"""The teacher-forced evaluation's metrics, each declared once (docs/algorithms.md section 8).

Every reported figure is a ratio of two sums over a policy's scored traces (or one sum, a count): the
tally (`foresight.eval.tally`) records each trace's sums, the result row pools them over the traces,
the confidence interval resamples the traces, the results table and plots take their labels from here,
and the paired comparisons (`foresight.eval.headroom`) read the sums of the metrics marked `paired`.
A new metric is one `Metric` in `METRICS` (plus a `Sum` in `SUMS` if it pools a new quantity);
docs/extending.md walks through one.

Token sets: every sum of a trace is kept per scored token (a count is a 0/1 tensor), so a figure can be read
over all scored predictions or over one `TokenSet`: the predictions of prompt tokens (what a streaming replay
scores while it reads a long prompt through the window) or of generated tokens (what a user's generation
sees). The two partition the scored predictions, so their sums add up to the all-token ones; a token's
low-entropy status is that of the trace's scored tokens as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from foresight.choices import Choice
from foresight.data.trace_store import Trace
from foresight.metrics import TokenDamage, low_entropy_tokens, token_damage

Part = torch.Tensor | float
"""What one trace contributes to a sum: its per-token terms (a tensor) or a count (a per-trace quantity)."""


class TokenSet(Choice):
    """Which scored predictions a figure sums over (module docstring)."""

    ALL = "all"
    PROMPT = "prompt"  # predictions of prompt tokens
    GENERATED = "generated"  # predictions of generated tokens

    def mask(self, first_scored: int, scored: int, prompt_length: int) -> torch.Tensor:
        """[scored] bool over a trace's scored predictions j = first_scored, first_scored + 1, ...: those of
        this set (prediction j is of token j + 1, a prompt token when j + 1 < prompt_length)."""
        predicted = torch.arange(first_scored, first_scored + scored) + 1
        if self is TokenSet.ALL:
            return torch.ones(scored, dtype=torch.bool)
        return (predicted < prompt_length) if self is TokenSet.PROMPT else (predicted >= prompt_length)


SPLIT_SETS = (TokenSet.GENERATED, TokenSet.PROMPT)
"""The token sets reported beside all scored predictions, in the order the tables show them."""


@dataclass(frozen=True)
class ScoredTrace:
    """One replayed trace's scored tokens (`foresight.metrics.scored_tokens`), what every sum reads:
    the NLL with eviction and with the full cache, the full cache's entropy, the attention-output cosine
    per token (ones without the probe), the golden overlap's (hits, kept) counts, and whether each token's
    top-1 prediction under eviction differs from the full cache's (`flipped`)."""

    trace: Trace
    evicted_nll: torch.Tensor
    full_nll: torch.Tensor
    full_entropy: torch.Tensor
    cosine: torch.Tensor
    overlap_hits: float
    overlap_kept: int
    flipped: torch.Tensor

    @cached_property
    def damage(self) -> TokenDamage:
        """Per token: low-entropy, damaged (ΔL > η) and ΔL² where damaged."""
        return token_damage(self.evicted_nll, self.full_nll, self.full_entropy)

    @property
    def low_entropy_flips(self) -> torch.Tensor:
        """Per token, whether it is a bottom-80%-entropy token whose top-1 prediction eviction changed: the error
        the paper's reward targets, counted without a loss threshold."""
        return self.flipped & low_entropy_tokens(self.full_entropy)


@dataclass(frozen=True)
class Sum:
    """A quantity summed over a trace's scored tokens and pooled over traces.

    `part` reads one trace's contribution. `shared`: a property of the trace itself (the same under
    every seed of a sampled policy, which keeps the first seed's); the others are averaged over seeds."""

    name: str
    part: Callable[[ScoredTrace], Part]
    shared: bool = False

    def select(self, part: Part, mask: torch.Tensor) -> Part:
        """One trace's part over the scored tokens of `mask`; a per-trace count is kept whole."""
        return part[mask] if isinstance(part, torch.Tensor) else part

    def of_trace(self, part: Part) -> float:
        """One trace's sum."""
        return float(part.double().sum()) if isinstance(part, torch.Tensor) else part

    def pooled(self, parts: Sequence[Part]) -> float:
        """The sum over traces; per-token terms are concatenated first, so every token weighs the same."""
        if parts and isinstance(parts[0], torch.Tensor):
            return float(torch.cat(list(parts)).double().sum())
        return sum(parts)

    def mean(self, parts: Sequence[Part]) -> Part:
        """One trace's part over the seeds of a sampled policy."""
        if self.shared:
            if not isinstance(parts[0], torch.Tensor) and len(set(parts)) != 1:
                raise ValueError(f"replays to average must score the same tokens, got {self.name} {sorted(set(parts))}")
            return parts[0]
        if isinstance(parts[0], torch.Tensor):
            return torch.stack(list(parts)).double().mean(0)
        return sum(parts) / len(parts)


def _counted(mask: torch.Tensor) -> torch.Tensor:
    """A per-token 0/1 count (float64, so a mean over seeds stays exact to the last bit of a count)."""
    return mask.to(torch.float64)


SUMS: tuple[Sum, ...] = (
    Sum("tokens", lambda s: _counted(torch.ones_like(s.evicted_nll, dtype=torch.bool)), shared=True),
    Sum("nll_evicted", lambda s: s.evicted_nll),
    Sum("nll_full", lambda s: s.full_nll, shared=True),
    Sum("low_entropy", lambda s: _counted(s.damage.low_entropy), shared=True),  # bottom-80%-entropy tokens
    Sum("damaged", lambda s: _counted(s.damage.damaged)),  # of those, ΔL > η
    Sum("squared_sum", lambda s: s.damage.terms),  # ΔL² on the damaged tokens
    Sum("flipped", lambda s: _counted(s.low_entropy_flips)),  # low-entropy tokens whose top-1 prediction changed
    Sum("cosine", lambda s: s.cosine),
    Sum("overlap_hits", lambda s: s.overlap_hits),
    Sum("overlap_kept", lambda s: s.overlap_kept, shared=True),
)
SUM = {s.name: s for s in SUMS}


@dataclass(frozen=True)
class Metric:
    """One figure of the result rows: Σ numerator / Σ denominator over the scored traces (the sums' names
    in `SUMS`), or the numerator's sum alone when `denominator` is None (a count).

    label, fmt: its column in the results table (no label: in results.json and the CSV only);
    interval: a 95% bootstrap interval over traces (row keys NAME_low, NAME_high);
    probe: read from the attention probe (`foresight.eval.probe`);
    golden: measured only at budgets with golden labels (None elsewhere);
    empty: its value when the denominator sums to 0;
    plotted / by_memory: drawn by budget / against the KV memory per sequence;
    paired: compared paired over traces (`foresight.eval.headroom`; its sums are fields of `TraceScore`);
    higher_is_better: the plots rank policies by it that way (most figures are damage: lower is better)."""

    name: str
    numerator: str
    denominator: str | None = None
    label: str | None = None
    fmt: str = "{}"
    interval: bool = False
    probe: bool = False
    golden: bool = False
    empty: float | None = 0.0
    plotted: bool = False
    by_memory: bool = False
    paired: bool = False
    higher_is_better: bool = False

    def value(self, pooled: dict[str, float]) -> float | None:
        """The figure from the pooled sums."""
        if self.denominator is None:
            return pooled[self.numerator]
        bottom = pooled[self.denominator]
        return pooled[self.numerator] / bottom if bottom else self.empty


METRICS: tuple[Metric, ...] = (
    Metric(
        "loss_ratio",
        "nll_evicted",
        "nll_full",
        "loss ratio",
        "{:.4f}",
        interval=True,
        plotted=True,
        by_memory=True,
        paired=True,
    ),
    Metric("nll_evicted", "nll_evicted", "tokens"),
    Metric("nll_full", "nll_full", "tokens"),
    Metric(
        "low_entropy_damage",
        "damaged",
        "low_entropy",
        "low-entropy damage",
        "{:.2%}",
        interval=True,
        plotted=True,
        by_memory=True,
        paired=True,
    ),
    Metric("low_entropy_dl2", "squared_sum", "damaged", "mean ΔL² (damaged)", "{:.3f}", interval=True, plotted=True),
    Metric("low_entropy_penalty", "squared_sum", "low_entropy", "−R", "{:.4f}", interval=True, paired=True),
    Metric(
        "low_entropy_flip_rate", "flipped", "low_entropy", "low-entropy flip rate", "{:.2%}", interval=True, paired=True
    ),
    Metric("low_entropy_tokens", "low_entropy"),
    Metric("damaged_tokens", "damaged"),
    Metric(
        "attn_cosine",
        "cosine",
        "tokens",
        "attn cosine",
        "{:.4f}",
        interval=True,
        probe=True,
        plotted=True,
        higher_is_better=True,
    ),
    Metric(
        "golden_overlap",
        "overlap_hits",
        "overlap_kept",
        "golden overlap",
        "{:.3f}",
        interval=True,
        probe=True,
        golden=True,
        empty=None,
        plotted=True,
        higher_is_better=True,
    ),
)
"""In the order of the result rows' keys and the table's columns."""
