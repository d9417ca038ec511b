"""Is a label kind a different target from α? Spearman's rank correlation of its scores with α's
(docs/notes/loss-aligned-labels.md: above 0.9 it is the same target).

For each trace, eviction step and (layer, KV head): the correlation over the candidates both schedules
hold at that step (at step 1 every kind's candidates are positions 0..B − 1, so there it is over all B),
and the share of the kept set the two schedules agree on. Means over (trace, step, layer, head); steps
where either score is constant over the shared candidates (an empty last block) are left out.

    python -m studies label-agreement --traces runs/a -B 128 -L 32 --kinds value,gradient --max-traces 10
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from foresight.bench.common import ReportSettings, budget_field, interval_field, traces_field
from foresight.data.trace_store import TraceStore
from foresight.labels import GoldenLabels, LabelKind, LabelStore
from studies import COMMAND as COMMAND  # how its report names it, where it goes
from studies import REPORTS as REPORTS

NAME = "label-agreement"


@dataclass(frozen=True, kw_only=True)
class Settings(ReportSettings):
    traces: Path = traces_field("traces folder with labels of α and of every kind at B and L (`foresight labels`)")
    budget: int = budget_field()
    interval: int = interval_field()
    kinds: str = field(default="value,gradient", metadata={"help": "label kinds compared with α, comma-separated"})
    max_traces: int = field(default=10, metadata={"help": "the first this many traces"})


def ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks along the last dim (0 = smallest; ties broken by position, as the schedule breaks them)."""
    return values.argsort(dim=-1, stable=True).argsort(dim=-1).double()


def spearman(first: torch.Tensor, second: torch.Tensor) -> float | None:
    """Spearman's correlation of two 1-D score vectors (None when either is constant)."""
    a, b = ranks(first) - (first.numel() - 1) / 2, ranks(second) - (second.numel() - 1) / 2
    if float(first.max() - first.min()) == 0 or float(second.max() - second.min()) == 0:
        return None
    return float((a * b).sum() / (a.norm() * b.norm()))


def agreement(alpha: GoldenLabels, other: GoldenLabels) -> tuple[list[float], list[float], list[float]]:
    """(Spearman over the shared candidates of every step, those of step 1 alone, kept-set overlap) per
    (step, layer, head)."""
    correlations, first_step, overlaps = [], [], []
    kept_alpha, kept_other = alpha.kept_positions(), other.kept_positions()
    steps, layers, heads, _ = alpha.candidates.shape
    for step in range(steps):
        for layer in range(layers):
            for head in range(heads):
                mine, theirs = alpha.candidates[step, layer, head], other.candidates[step, layer, head]
                shared = torch.isin(mine, theirs)
                order = torch.isin(theirs, mine)  # both ascending: the shared positions line up
                rho = spearman(alpha.alpha[step, layer, head][shared], other.alpha[step, layer, head][order])
                if rho is not None:
                    correlations.append(rho)
                    if step == 0:
                        first_step.append(rho)
                kept = torch.isin(kept_alpha[step, layer, head], kept_other[step, layer, head])
                overlaps.append(float(kept.double().mean()))
    return correlations, first_step, overlaps


def run(settings: Settings) -> str:
    traces = list(TraceStore(settings.traces))[: settings.max_traces]
    alpha_store = LabelStore(settings.traces, settings.budget, settings.interval)
    lines = [
        f"Command: `{settings.command}`",
        "",
        "| kind | traces | Spearman with α (shared candidates) | step 1 (all B) | kept-set overlap with α-golden |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in (LabelKind.parse(k) for k in settings.kinds.split(",")):
        store = LabelStore(settings.traces, settings.budget, settings.interval, kind)
        rhos, first, overlaps = [], [], []
        for trace in traces:
            length = trace.input_ids.numel()
            parts = agreement(
                alpha_store.load(trace.index, num_tokens=length), store.load(trace.index, num_tokens=length)
            )
            rhos += parts[0]
            first += parts[1]
            overlaps += parts[2]
        lines.append(
            f"| {kind.value} | {len(traces)} | {_mean(rhos):.3f} | {_mean(first):.3f} | {_mean(overlaps):.3f} |"
        )
    return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
