"""How much of the headroom above the best heuristic a learned scorer captures, with bootstrap
confidence intervals over traces (docs/algorithms.md section 8).

At one budget, the headroom is the gap between the best heuristic's loss ratio and the golden
oracle's; the learned scorer captures the share (best heuristic − learned) / (best heuristic −
golden): 0 is no better than the heuristic, 1 is as good as the oracle. The best heuristic is the
policy of one fixed list (`REFERENCE_HEURISTICS`, docs/algorithms.md §8, the same for every set) with the
lowest pooled loss ratio among those scored on exactly golden's tokens; a heuristic off the list never
enters, whatever its figure, so no set picks its reference from its own rows after the fact.

Intervals: traces are resampled with replacement (`RESAMPLES` times, a fixed seed); every policy is
pooled over the same resampled traces (paired), the best heuristic is chosen again inside every resample
(so the interval includes the choice), and an interval is the 2.5th to 97.5th percentile of the statistic
over the resamples.

Token sets: every function reads one `TokenSet` of the scores (all scored predictions unless told), the
predictions of prompt tokens or of generated tokens (`foresight.eval.metric_registry`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from foresight.eval.metric_registry import METRICS, TokenSet
from foresight.eval.stats import CONFIDENCE, RESAMPLES, percentile_interval, resample_counts

REFERENCE, ORACLE = "full", "golden"
REFERENCE_HEURISTICS = ("snapkv", "tova", "h2o", "rkv", "vase", "streaming", "lagkv")
"""The heuristics the headroom's best is chosen from, on every set (docs/algorithms.md §8)."""


@dataclass(frozen=True)
class TraceScore:
    """One trace replayed under one policy at one budget: its scored tokens' summed NLL with
    eviction and with the full cache, its low-entropy token counts (all, damaged, and top-1 flipped) and the
    damaged tokens' Σ ΔL² (−R's numerator); for a sampled policy, the NLL sum, the damaged and flipped counts
    and Σ ΔL² are means over its seeds."""

    policy: str
    budget: int
    index: int
    source: str
    tokens: int
    nll_evicted: float
    nll_full: float
    low_entropy: int
    damaged: float
    flipped: float = math.nan  # nan: a traces.json written before the flip rate existed
    squared_sum: float = math.nan  # nan: a traces.json written before −R was kept per trace
    token_set: str = TokenSet.ALL.value  # the scored predictions these sums run over


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.value:.4f} [{self.low:.4f}, {self.high:.4f}]"


@dataclass(frozen=True)
class Headroom:
    """The learned policy against the best heuristic and golden at one budget, over one token set."""

    budget: int
    learned: str
    best_heuristic: str  # the best of the full sample (each resample chooses its own)
    traces: int
    least_damaging_heuristic: str
    loss_ratio: dict[str, Estimate]  # every compared policy, pooled over the traces
    damage: dict[str, Estimate]  # low-entropy damage share
    share: Estimate  # of the headroom captured by the learned policy
    ratio_gain: Estimate  # best heuristic − learned, loss ratio (paired)
    damage_gain: Estimate  # least damaging heuristic − learned, low-entropy damage (paired)
    token_set: TokenSet = TokenSet.ALL
    missing_reference: tuple[str, ...] = ()  # heuristics of REFERENCE_HEURISTICS with no row on golden's tokens

    def markdown(self) -> str:
        """The comparison as a markdown table with a line stating the share of headroom captured."""
        missing = f" (not run: {', '.join(self.missing_reference)})" if self.missing_reference else ""
        lines = [
            f"B = {self.budget}, {self.traces} traces, {self.token_set.value} scored predictions; best heuristic: "
            f"{self.best_heuristic}, of the fixed reference list{missing}, chosen again in every resample; "
            f"{CONFIDENCE:.0%} bootstrap intervals over traces ({RESAMPLES} resamples, paired).",
            "",
            "| policy | loss ratio | low-entropy damage |",
            "|---|---:|---:|",
        ]
        for policy in sorted(self.loss_ratio, key=lambda p: self.loss_ratio[p].value):
            ratio, damage = self.loss_ratio[policy], self.damage[policy]
            lines.append(f"| {policy} | {ratio} | {percent(damage)} |")
        lines += [
            "",
            f"- share of the headroom (best heuristic − golden) captured by {self.learned}: {percent(self.share, 1)}",
            f"- loss ratio, {self.best_heuristic} − {self.learned}: {self.ratio_gain}",
            f"- low-entropy damage, {self.least_damaging_heuristic} (the least damaging heuristic) − {self.learned}: "
            f"{percent(self.damage_gain)}",
        ]
        return "\n".join(lines)


def percent(estimate: Estimate, digits: int = 2) -> str:
    return f"{estimate.value:.{digits}%} [{estimate.low:.{digits}%}, {estimate.high:.{digits}%}]"


def headroom(
    scores: Sequence[TraceScore],
    budget: int,
    learned: str,
    other_learned: Collection[str] = (),
    seed: int = 0,
    resamples: int = RESAMPLES,
    token_set: TokenSet | str = TokenSet.ALL,
    reference: Collection[str] = REFERENCE_HEURISTICS,
) -> Headroom | None:
    """The learned policy's headroom at `budget` over `token_set`, or None when golden, the learned policy or
    every heuristic of `reference` on golden's tokens is missing there. `other_learned` names the other learned
    scorers' rows, never heuristics (a row's name says nothing: `--scorer NAME=DIR` picks it)."""
    token_set = TokenSet.parse(token_set)
    tables = _by_policy(_selected(scores, budget, token_set))
    if ORACLE not in tables or learned not in tables:
        return None
    traces = sorted(tables[ORACLE])
    tokens = [tables[ORACLE][i].tokens for i in traces]
    comparable = {  # every evicting policy scored on golden's tokens
        policy: table
        for policy, table in tables.items()
        if policy != REFERENCE and sorted(table) == traces and [table[i].tokens for i in traces] == tokens
    }
    heuristics = [p for p in reference if p in comparable and p not in (ORACLE, learned, *other_learned)]
    if learned not in comparable or not heuristics:
        return None
    weights = resample_weights(len(traces), resamples, seed)  # [1 + resamples, traces]; row 0: the sample itself
    pooled = {
        figure: {p: pooled_ratio(*_figure_sums(table, traces, figure), weights) for p, table in comparable.items()}
        for figure in ("loss_ratio", "low_entropy_damage")
    }
    ratios, damages = pooled["loss_ratio"], pooled["low_entropy_damage"]
    best = min(heuristics, key=lambda p: ratios[p][0])
    least_damaging = min(heuristics, key=lambda p: damages[p][0])
    best_ratio = np.min([ratios[p] for p in heuristics], axis=0)  # chosen again in every resample
    least_damage = np.min([damages[p] for p in heuristics], axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = (best_ratio - ratios[learned]) / (best_ratio - ratios[ORACLE])
    return Headroom(
        budget=budget,
        learned=learned,
        best_heuristic=best,
        traces=len(traces),
        least_damaging_heuristic=least_damaging,
        loss_ratio={p: estimate(v) for p, v in ratios.items()},
        damage={p: estimate(v) for p, v in damages.items()},
        share=estimate(share),
        ratio_gain=estimate(best_ratio - ratios[learned]),
        damage_gain=estimate(least_damage - damages[learned]),
        token_set=token_set,
        missing_reference=tuple(p for p in reference if p not in comparable),
    )


FIGURES = {m.name: (m.numerator, m.denominator) for m in METRICS if m.paired}
"""The pooled figures a paired comparison reads (the metrics marked `paired`): numerator and denominator
sums of `TraceScore`."""


def paired_gain(
    scores: Sequence[TraceScore],
    budget: int,
    reference: str,
    other: str,
    figure: str = "loss_ratio",
    seed: int = 0,
    resamples: int = RESAMPLES,
    relative: bool = False,
    token_set: TokenSet | str = TokenSet.ALL,
) -> Estimate | None:
    """`figure` (a key of FIGURES) of `reference` − `other` at `budget`, pooled and paired over the traces
    both scored on the same tokens (positive: `other` is better), or None when they share no such trace; with
    `relative`, the relative change other / reference − 1 instead (negative: `other` is lower, as −R's change
    is quoted). `token_set`: the scored predictions compared (module docstring)."""
    tables = _by_policy(_selected(scores, budget, TokenSet.parse(token_set)))
    first, second = tables.get(reference, {}), tables.get(other, {})
    traces = sorted(i for i in first.keys() & second.keys() if first[i].tokens == second[i].tokens)
    if not traces:
        return None
    weights = resample_weights(len(traces), resamples, seed)
    ours, theirs = (pooled_ratio(*_figure_sums(table, traces, figure), weights) for table in (first, second))
    if not relative:
        return estimate(ours - theirs)
    with np.errstate(divide="ignore", invalid="ignore"):
        return estimate(theirs / ours - 1)


def pooled_figure(
    scores: Sequence[TraceScore],
    budget: int,
    policy: str,
    figure: str = "loss_ratio",
    seed: int = 0,
    resamples: int = RESAMPLES,
    token_set: TokenSet | str = TokenSet.ALL,
) -> Estimate | None:
    """`figure` of one policy at `budget` over `token_set`, pooled over its traces with a bootstrap interval
    (None: not scored)."""
    table = _by_policy(_selected(scores, budget, TokenSet.parse(token_set))).get(policy, {})
    if not table:
        return None
    traces = sorted(table)
    return estimate(pooled_ratio(*_figure_sums(table, traces, figure), resample_weights(len(traces), resamples, seed)))


def _figure_sums(table: dict[int, TraceScore], traces: Sequence[int], figure: str) -> list[np.ndarray]:
    """The per-trace numerator and denominator sums of `figure` (a key of FIGURES), in the order of `traces`."""
    if figure not in FIGURES:
        raise ValueError(f"figure {figure!r} is not one of: {', '.join(FIGURES)}")
    return [np.array([getattr(table[i], name) for i in traces], dtype=np.float64) for name in FIGURES[figure]]


def _selected(scores: Sequence[TraceScore], budget: int, token_set: TokenSet) -> list[TraceScore]:
    """The scores at `budget` over `token_set` (a trace with none of that set's predictions left out)."""
    return [s for s in scores if s.budget == budget and s.token_set == token_set.value and s.tokens]


def _by_policy(scores: Sequence[TraceScore]) -> dict[str, dict[int, TraceScore]]:
    tables: dict[str, dict[int, TraceScore]] = {}
    for score in scores:
        tables.setdefault(score.policy, {})[score.index] = score
    return tables


def resample_weights(traces: int, resamples: int, seed: int) -> np.ndarray:
    """How often each trace is drawn: row 0 once each (the sample), then one row per resample."""
    return np.vstack([np.ones(traces), resample_counts(traces, resamples, seed)])


def pooled_ratio(numerator: np.ndarray, denominator: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ w·numerator / Σ w·denominator for every weight row (0 where the denominator is 0)."""
    top, bottom = weights @ numerator, weights @ denominator
    return np.divide(top, bottom, out=np.zeros_like(top), where=bottom != 0)


def estimate(values: np.ndarray) -> Estimate:
    """Row 0 is the estimate; the others give the percentile interval (NaN resamples left out)."""
    spread = values[1:][np.isfinite(values[1:])]
    low, high = percentile_interval(spread, CONFIDENCE) if spread.size else (np.nan, np.nan)
    return Estimate(float(values[0]), float(low), float(high))


def headroom_rows(result: Headroom) -> list[dict[str, Any]]:
    """The estimates as plain rows (for JSON)."""
    rows = [
        {"budget": result.budget, "token_set": result.token_set.value, "policy": p, "statistic": statistic}
        | vars(estimate)
        for statistic, table in (("loss_ratio", result.loss_ratio), ("low_entropy_damage", result.damage))
        for p, estimate in table.items()
    ]
    rows += [
        {
            "budget": result.budget,
            "token_set": result.token_set.value,
            "policy": result.learned,
            "statistic": statistic,
            "against": against,
            **vars(estimate),
        }
        for statistic, against, estimate in (
            ("headroom_share", result.best_heuristic, result.share),
            ("loss_ratio_gain", result.best_heuristic, result.ratio_gain),
            ("damage_gain", result.least_damaging_heuristic, result.damage_gain),
        )
    ]
    return rows
