"""Window check of the reinforcement stage's branch groups: does d_k over W chunks rank branches as the whole rest does?

A branch group's reward d_k = R_k − R_backbone is measured over the W·L predictions after its step
(`trainers.reinforcement.branches`); damage its decision causes later (a long-range copy of an evicted entry) falls
outside the window. On the first COUNT traces of a folder (whole traces), the branch groups of one round
(`model.branch_steps` per trace, K rows, the run's τ) are continued to each trace's end, and each group's
d_k over W chunks (each W of --chunks) is compared with d_k over the whole rest of the trace: Spearman
across the K rows, per group, then the mean and the lowest of the traces' means, by each reward rule. The
rule of docs/rl.md: widen W where the mean is below 0.5. Nothing is trained.

    python -m studies rl-window --traces data/corpus/train52 --count 4 --out runs/bench.md
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from foresight.bench.common import OneScorer, PlacedSettings, machine, scorer_field, threads_note
from foresight.data.trace_store import TraceStore
from studies import COMMAND as COMMAND  # how its report names it, where it goes
from studies import REPORTS as REPORTS
from studies.rl_signal.run import model_and_scorer
from trainers.reinforcement.branches import BranchSettings, RewardSettings, WindowAgreement, window_agreement
from trainers.reinforcement.estimators import GATE_WIDTH, REWARD_RULES, Estimator

NAME = "rl-window"
AGREEMENT = 0.5
"""The mean Spearman below which W is too narrow (issue 42)."""


@dataclass(frozen=True, kw_only=True)
class Settings(OneScorer, PlacedSettings):
    """The options of `python -m studies rl-window`, each with its help text."""

    traces: Path = field(
        default=Path("data/corpus/train52"),
        metadata={"help": "traces folder of the scorer's model (`foresight traces`)"},
    )
    count: int = field(default=4, metadata={"help": "traces measured: the first COUNT of the folder, whole"})
    scorer: tuple[str, ...] = scorer_field("the one whose branch groups are measured", ("checkpoints/default",))
    chunks: tuple[int, ...] = field(
        default=(4, 8, 16),
        metadata={"help": "a window W in chunks of L to compare with the rest (repeat)", "flags": ("--chunks",)},
    )
    branch_steps: int = field(default=2, metadata={"help": "branch groups per trace"})
    branch_rows: int = field(default=8, metadata={"help": "rows per branch group, K"})
    branch_layers: int | None = field(
        default=None, metadata={"help": "layers that sample a group's step (all when unset)"}
    )
    sample_temperature: float = field(default=0.005, metadata={"help": "τ of Eq. 2 at the branch step"})
    damage_threshold: float = field(default=1.5, metadata={"help": "η of the thresholded and gated rewards"})
    damage_exponent: float = field(default=2.0, metadata={"help": "p of the damage term"})
    damage_offset: float = field(default=0.0, metadata={"help": "δ of the dense reward (ΔL − δ)₊^p"})
    damage_gate_width: float = field(default=GATE_WIDTH, metadata={"help": "w of the gated reward's σ((ΔL − η) / w)"})
    seed: int = field(default=0, metadata={"help": "seeds the branch points and draws (round 0 of a run of this seed)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.count < 1 or not self.chunks or min(self.chunks) < 1:
            raise ValueError(f"need count >= 1 and every --chunks >= 1, got count={self.count}, chunks={self.chunks}")


def run(settings: Settings) -> str:
    """Continue every branch to its trace's end, compare the windows; the report's markdown section."""
    started = time.perf_counter()
    store = TraceStore(settings.traces)
    model, scorer = model_and_scorer(store, settings, settings.learned[1])
    branches = BranchSettings(settings.branch_rows, max(settings.chunks), settings.branch_steps, settings.branch_layers)
    rules = {
        name: Estimator(name, offset=settings.damage_offset, gate_width=settings.damage_gate_width).damage_terms
        for name in REWARD_RULES
    }
    traces = list(itertools.islice(store, settings.count))
    agreements = [
        agreement
        for trace in tqdm(traces, desc="traces", leave=False)
        for agreement in window_agreement(
            model,
            scorer,
            trace,
            branches,
            settings.chunks,
            rules,
            seed=settings.seed,
            temperature=settings.sample_temperature,
            reward=RewardSettings(threshold=settings.damage_threshold, exponent=settings.damage_exponent),
        )
    ]
    tokens = sum(trace.input_ids.numel() for trace in traces)
    seconds = time.perf_counter() - started
    return report(settings, agreements, len(traces), tokens, scorer.config.interval, seconds)


def report(
    settings: Settings, agreements: list[WindowAgreement], traces: int, tokens: int, interval: int, seconds: float
) -> str:
    """The table: per reward rule and W, the mean over groups of the Spearman (groups where it is defined), the
    lowest trace mean, and the share of groups where it is undefined (d_k constant in the window or the rest)."""
    lines = [
        f"Command: `{settings.command}`",
        "",
        f"{traces} traces of {settings.traces} ({tokens} tokens), {settings.branch_steps} branch groups per trace "
        f"of K = {settings.branch_rows} rows at τ = {settings.sample_temperature}, from {settings.learned[1]}; L = {interval}. "
        f"Spearman across a group's rows of d_k over W chunks against d_k over the whole rest of the trace. "
        f"{machine(settings.run_device)}; {threads_note()}; {seconds:.0f} s.",
        "",
        "| reward rule | W (chunks) | window tokens | mean Spearman | lowest trace mean | groups undefined | W enough |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for rule in dict.fromkeys(agreement.rule for agreement in agreements):
        for width in settings.chunks:
            chosen = [a for a in agreements if a.rule == rule and a.chunks == width]
            values = np.array([a.spearman for a in chosen])
            defined = values[~np.isnan(values)]
            by_trace = [
                float(np.nanmean(values[[a.trace_index == index for a in chosen]]))
                for index in dict.fromkeys(a.trace_index for a in chosen)
                if not np.isnan(values[[a.trace_index == index for a in chosen]]).all()
            ]
            mean = float(defined.mean()) if defined.size else math.nan
            lines.append(
                f"| {rule} | {width} | {width * interval} | {mean:.3f} | {min(by_trace, default=math.nan):.3f} | "
                f"{1 - defined.size / len(values):.0%} | {'yes' if mean >= AGREEMENT else 'no: widen W'} |"
            )
    return "\n".join(lines) + "\n"
