"""Bytes each policy holds per cache entry and per sequence, by part, from the runtime's one accounting.

Runs no model: `foresight.runtime.held_memory` counts, from the model's shape and each policy's declarations,
what a sequence holds at budget B and interval L (B + L entries): keys and values, positions, the policy's
per-entry state, its query ring and, for a policy that observes every query, the L queries it may buffer.
The table divides each part by the entries (every layer and KV head summed) and gives the overhead over
K/V; a policy that protects the prompt holds the prompt's entries on top, at the same bytes per entry.

    foresight bench held-memory                                            # default model, float32, B = 128, L = 32
    foresight bench held-memory --model configs/models/qwen3-4b.json --dtype bfloat16 -B 1024 -L 256
    foresight bench held-memory --layout pooled                            # one slot pool per layer
    foresight bench held-memory --scorer checkpoints/default-grouped -o observation=forward   # a policy's options

With `--layout pooled` the evicting rows are counted in the pooled layout (`foresight.runtime.pool`: a one-byte owner
tag per slot, counted as state), and 'all' names the policies it runs; the full cache stays the per-head reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from foresight.bench.common import (
    LEARNED,
    DtypeName,
    OneScorer,
    PolicyOptions,
    ReportSettings,
    bench_policy,
    budget_field,
    dtype_field,
    interval_field,
    model_field,
    policies_field,
    random_scorer,
    scorer_field,
    selected_policies,
)
from foresight.models import architecture_config, describe, float_dtype, is_architecture_config, load_config
from foresight.policies import POLICIES
from foresight.runtime.held_memory import MIB, PARTS, held_bytes
from foresight.runtime.pool import Layout
from foresight.scorer.model import ForesightScorer, load_scorer

NAME = "held-memory"


@dataclass(frozen=True, kw_only=True)
class Settings(OneScorer, PolicyOptions, ReportSettings):
    model: str = model_field()
    dtype: DtypeName = dtype_field()
    budget: int = budget_field()
    interval: int = interval_field()
    policies: str = policies_field("every policy that needs no labels or statistics, and the learned one")
    scorer: tuple[str, ...] = scorer_field(
        "its feature set gives the learned policy's state (default: a scorer of the model's shape with --feature-set)"
    )
    feature_set: str = field(
        default="standardised",
        metadata={"help": "the learned policy's feature set without --scorer (the shipped recipe's by default)"},
    )
    layout: Literal["heads", "pooled"] = field(
        default=Layout.HEADS.value,
        metadata={"help": "the cache layout of the evicting rows: a cache per KV head, or one slot pool per layer"},
    )

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            raise ValueError("--dtype must name the model's dtype (float32, bfloat16, float16), got 'auto'")
        self.learned  # several scorers: refused here
        self.check_options()

    @property
    def policy_names(self) -> list[str]:
        """The rows: the full cache and --policies, of which 'all' in the pooled layout is the policies it runs."""
        names = selected_policies(self.policies, learned=True)
        if Layout.parse(self.layout) is Layout.POOLED and self.policies == "all":
            return [name for name in names if name == "full" or POLICIES[name].runs_pooled]
        return names


def _scorer(settings: Settings, shape) -> ForesightScorer:
    """The learned policy's scorer: --scorer, or one of the model's shape with --feature-set (its weights
    hold nothing of the cache)."""
    if settings.learned is not None:
        return load_scorer(settings.learned[1])
    return random_scorer(
        shape, settings.budget, settings.interval, base_model=settings.model, feature_set=settings.feature_set
    )


def run(settings: Settings) -> str:
    config = (
        architecture_config(settings.model) if is_architecture_config(settings.model) else load_config(settings.model)
    )
    shape = describe(config)
    dtype = float_dtype("--dtype", settings.dtype)
    scorer = _scorer(settings, shape)
    entries = settings.budget + settings.interval
    lines = [
        f"Command: `{settings.command}`",
        "",
        f"Model {settings.model} ({shape}), {settings.dtype}; B = {settings.budget}, L = {settings.interval}: "
        f"{entries} entries per sequence. Bytes per entry: every layer and KV head of one entry; ring and buffered "
        f"queries divided by the {entries} entries. Overhead: bytes held beyond K/V, over K/V. The learned policy: "
        f"{settings.learned[1] if settings.learned else f'the {settings.feature_set} feature set'}. Layout: "
        f"{settings.layout}.",
        "",
        "| policy | K/V B / entry | positions | state | query ring | buffered queries | total B / entry | over K/V | "
        "MiB / sequence |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in settings.policy_names:
        policy = bench_policy(name, scorer if name == LEARNED else None, settings.policy_options(name))
        layout = settings.layout if policy.evicts else Layout.HEADS
        held = held_bytes(shape, policy, settings.budget, settings.interval, dtype, entries=entries, layout=layout)
        parts = " | ".join(f"{held.per_entry(part):.1f}" for part in PARTS)
        lines.append(
            f"| {name} | {parts} | {held.per_entry('total'):.1f} | {held.overhead:+.1%} | {held.total / MIB:.2f} |"
        )
    return "\n".join(lines) + "\n"
