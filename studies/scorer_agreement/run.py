"""Do two scorers keep the same entries? Kept-set agreement on one trajectory (issue 58, Deliver 2).

The traces are replayed teacher-forced under the `driver` scorer's own evictions (`trainers.examples.scorer_steps`,
the on-policy recorder); at every eviction step and (layer, KV head) each scorer scores the same candidates from
the same inputs (the attention features do not depend on the scorer, only on the trajectory), and two scorers
agree by the share of the B − L kept candidates they both keep (`trainers.ranking.kept_overlap`). Beside each
pair, each scorer's overlap with golden's kept set on the same states (the B − L largest α). Means over the
(step, layer, head) problems of a trace, then over traces, with a 95% bootstrap interval over traces.

What it decides: a scorer distilled from an ensemble (`model.teacher`) stands for it when its agreement with the
ensemble is at least the agreement of two of the ensemble's members with each other.

    python -m studies scorer-agreement --traces data/corpus/gsm-heldout --scorer ensemble=checkpoints/default \\
        --scorer single=checkpoints/default-single --regime decode --max-traces 8
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from foresight.bench.common import ReportSettings, scorer_field, traces_field
from foresight.cadence import Regime
from foresight.data.trace_store import TraceStore, select_traces
from foresight.eval.specs import split_scorer
from foresight.eval.stats import percentile_interval, resample_counts
from foresight.models import load_model
from foresight.scorer.ensemble import split
from foresight.scorer.model import ForesightScorer, load_scorer
from studies import COMMAND as COMMAND  # how its report names it, where it goes
from studies import REPORTS as REPORTS
from trainers.examples import future_tables, scorer_steps
from trainers.ranking import kept_overlap

NAME = "scorer-agreement"
GOLDEN = "golden"
SHARED = ("num_layers", "num_query_heads", "num_kv_heads", "head_dim", "budget", "interval", "feature_set")
"""What the compared scorers must share: they score the same inputs."""


@dataclass(frozen=True, kw_only=True)
class Settings(ReportSettings):
    traces: Path = traces_field("traces folder the scorers never trained on")
    scorer: tuple[str, ...] = scorer_field("the scorers compared, at least two (unnamed: by folder)", required=True)
    driver: str | None = field(default=None, metadata={"help": "whose evictions the replay follows (default: first)"})
    regime: str = field(default=Regime.DECODE.value, metadata={"help": "the eviction regime of the replay"})
    sources: tuple[str, ...] = field(
        default=(), metadata={"help": "only the traces of these prompt sources (a fold's held-out families; repeat)"}
    )
    per_source: int | None = field(default=None, metadata={"help": "the first N traces of each prompt source"})
    max_traces: int | None = field(default=None, metadata={"help": "at most this many traces, in order"})
    split: str | None = field(
        default=None,
        metadata={
            "help": "NAME=K: the first two of the K members that the ensemble scorer NAME averages join the "
            "comparison as NAME.member-0 and NAME.member-1 (a shipped ensemble keeps no member folders)"
        },
    )

    def __post_init__(self) -> None:
        if len(self.folders) < 2:
            raise ValueError(f"--scorer: compare at least two scorers, got {len(self.folders)}")
        if self.driver is not None and self.driver not in self.folders:
            raise ValueError(f"--driver {self.driver!r} is none of the scorers {', '.join(self.folders)}")
        _ = self.split_members  # a malformed --split is refused before any replay
        Regime.parse(self.regime)

    @property
    def folders(self) -> dict[str, Path]:
        """{name: folder} of the compared scorers, in order."""
        found: dict[str, Path] = {}
        for text in self.scorer:
            name, source = split_scorer(text)
            name = name or Path(source).name
            if name in found or name == GOLDEN:
                raise ValueError(f"--scorer {text!r}: each scorer needs a name of its own, not {GOLDEN!r}")
            found[name] = Path(source)
        return found

    @property
    def split_members(self) -> tuple[str, int] | None:
        """(the ensemble's name, its member count) of `split`, or None."""
        if self.split is None:
            return None
        name, sep, count = self.split.partition("=")
        if not sep or not count.isdigit() or name not in self.folders:
            raise ValueError(
                f"--split {self.split!r} must be NAME=K with NAME one of the scorers ({', '.join(self.folders)}) "
                "and K its member count"
            )
        return name, int(count)


def run(settings: Settings) -> str:
    scorers = {name: load_scorer(folder) for name, folder in settings.folders.items()}
    if settings.split_members is not None:
        name, count = settings.split_members
        members = split(scorers[name], count)[:2]
        scorers.update({f"{name}.member-{index}": member for index, member in enumerate(members)})
    _check_alike(scorers)
    driver = scorers[settings.driver or next(iter(scorers))]
    store = TraceStore(settings.traces)
    traces = list(select_traces(store, None, 0, settings.max_traces, settings.sources or None, settings.per_source))
    model, _ = load_model(store.settings["model"])
    regime, config = Regime.parse(settings.regime), driver.config
    per_trace = []
    for trace in traces:
        tables = future_tables(model, [trace], config.budget, config.interval, regime)
        (steps,) = scorer_steps(model, [trace], tables, driver, torch.float32, regime)
        per_trace.append(trace_agreement(scorers, steps, config.budget - config.interval))
    return _report(settings, per_trace, list(scorers))


@torch.no_grad()
def trace_agreement(
    scorers: dict[str, ForesightScorer], steps: dict[str, torch.Tensor], kept: int
) -> dict[tuple[str, str], float]:
    """{(a, b): mean kept-set overlap over the trace's (step, layer, head) problems} for every pair of scorers and
    of each scorer with golden (α's kept set), from one trace's recorded steps (keys, values, features
    [steps, layers, Hkv, B, *], alpha [steps, layers, Hkv, B])."""
    inputs = [steps[name].transpose(0, 1) for name in ("keys", "values", "features")]  # layers first
    scores = {name: scorer(*inputs).transpose(0, 1) for name, scorer in scorers.items()}
    scores[GOLDEN] = steps["alpha"].float()
    names = [*scorers, GOLDEN]
    return {(a, b): float(kept_overlap(scores[a], scores[b], kept).mean()) for a, b in itertools.combinations(names, 2)}


def _check_alike(scorers: dict[str, ForesightScorer]) -> None:
    """A one-line error naming the first scorer that reads other inputs than the first one."""
    (first_name, first), *others = scorers.items()
    for name, scorer in others:
        differing = [key for key in SHARED if getattr(scorer.config, key) != getattr(first.config, key)]
        if differing:
            raise ValueError(
                f"scorer {name} reads other inputs than {first_name} ({', '.join(differing)} differ): "
                "agreement compares scorers of one model, B, L and feature set"
            )


def _report(settings: Settings, per_trace: list[dict[tuple[str, str], float]], names: list[str]) -> str:
    pairs = list(per_trace[0])
    values = np.array([[trace[pair] for pair in pairs] for trace in per_trace])  # [traces, pairs]
    counts = resample_counts(len(per_trace))
    resampled = counts @ values / counts.sum(-1, keepdims=True)
    lines = [
        f"Command: `{settings.command}`",
        "",
        f"{len(per_trace)} traces of {settings.traces}, {settings.regime} regime, the replay following "
        f"{settings.driver or names[0]}'s evictions; kept-set overlap, mean over (step, layer, KV head), then "
        "over traces [95% bootstrap interval over traces].",
        "",
        "| pair | agreement |",
        "|---|---:|",
    ]
    for index, (a, b) in enumerate(pairs):
        low, high = percentile_interval(resampled[:, index])
        lines.append(f"| {a} · {b} | {values[:, index].mean():.3f} [{low:.3f}, {high:.3f}] |")
    return "\n".join(lines)
