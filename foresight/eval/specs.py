"""What `foresight eval` compares: a policy by name and options, or a learned scorer, with the checks that
tell which budgets each can run at. Shared by the teacher-forced replay and the accuracy evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from foresight.labels import GoldenLabels
from foresight.policies import POLICIES, Policy, make_policy
from foresight.scorer.model import ForesightScorer, load_scorer
from foresight.runtime.engine import EvictionConfig
from foresight.scorer.eviction_sampling import check_temperature

RECOMMENDED_SEEDS = 8
"""Seeds a sampled learned policy is replayed with by default (`foresight eval --sampled-seeds`)."""


# -- which policies ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicySpec:
    """A policy to evaluate and what building it takes. Golden takes the labels of the batch; a
    policy that needs another artifact (a learned scorer's folder) becomes one more kind of spec
    with its own `build`, without touching the replay loop."""

    name: str

    @property
    def policy_class(self) -> type[Policy]:
        return POLICIES[self.name]

    @property
    def needs_labels(self) -> bool:
        return any(f.init and f.name == "labels" for f in fields(self.policy_class))

    @property
    def missing_artifacts(self) -> list[str]:
        """Required constructor arguments that eval cannot give (every one but golden's labels)."""
        return [
            f.name for f in fields(self.policy_class)
            if f.init and f.default is f.default_factory is MISSING and f.name != "labels"
        ]

    @property
    def evicts(self) -> bool:
        return self.policy_class.evicts

    @property
    def protects_prompt(self) -> bool:
        return not self.needs_labels and self.policy_class.default_protect_prompt

    def build(self, labels: Sequence[GoldenLabels] | None, trace_indices: Sequence[int] = ()) -> Policy:
        """The policy for one batch: `labels` of its traces (golden), `trace_indices` (a sampled scorer)."""
        return make_policy(self.name, labels=list(labels)) if self.needs_labels else make_policy(self.name)

    def replays(self) -> list[PolicySpec]:
        """The replays whose per-trace sums average into this spec's row: itself (a sampled learned
        policy: one per seed)."""
        return [self]

    def config(self, budget: int, interval: int) -> EvictionConfig | None:
        """The eviction config: the policy's own defaults; golden's cadence has no sinks and no
        protected prompt (its labels assume neither)."""
        if not self.evicts:
            return None
        if self.needs_labels:
            return EvictionConfig(budget, interval, sinks=0, protect_prompt=False)
        return EvictionConfig(budget, interval)

    def skip_reason(self, budget: int, interval: int) -> str | None:
        """Why the policy cannot run at this budget and interval (a learned scorer runs only at its own)."""
        return None


@dataclass(frozen=True)
class ScorerSpec(PolicySpec):
    """The learned `foresight` policy with one trained scorer, run at the B and L it was trained for,
    with no sinks and no protected prompt (as in training)."""

    scorer: ForesightScorer = field(default=None, compare=False, repr=False)

    @classmethod
    def from_source(cls, source: str, several: bool) -> ScorerSpec:
        """A spec from `SOURCE` or `NAME=SOURCE` (a folder or Hub id): named NAME when given, else
        `foresight`, or `foresight:FOLDER` when several scorers are compared."""
        name, sep, path = source.partition("=")
        if sep and name and "/" not in name:
            return cls(name=name, scorer=load_scorer(path))
        name = f"foresight:{Path(source).name}" if several else "foresight"
        return cls(name=name, scorer=load_scorer(source))

    @property
    def policy_class(self) -> type[Policy]:
        return POLICIES["foresight"]

    @property
    def missing_artifacts(self) -> list[str]:
        return []

    def build(self, labels: Sequence[GoldenLabels] | None, trace_indices: Sequence[int] = ()) -> Policy:
        return make_policy("foresight", scorer=self.scorer)

    def config(self, budget: int, interval: int) -> EvictionConfig | None:
        return EvictionConfig(budget, interval, sinks=0, protect_prompt=False)

    def skip_reason(self, budget: int, interval: int) -> str | None:
        trained = (self.scorer.config.budget, self.scorer.config.interval)
        if (budget, interval) == trained:
            return None
        return f"{self.name} skipped at B={budget}, L={interval}: its scorer was trained for B={trained[0]}, L={trained[1]}"


@dataclass(frozen=True)
class SampledScorerSpec(ScorerSpec):
    """The learned policy in sampled mode (ForesightKV Eq. 2: L evictions drawn from the 2L lowest keep
    scores, softmax of the negated scores / `temperature`), replayed once per seed of `seeds`; its row
    holds the per-trace means over the seeds. Each trace draws from its own generator seeded by (seed,
    trace index), so a trace samples the same evictions whatever traces share its batch. Draws are not
    recorded (`Foresight.record`): only the evictions matter here."""

    seeds: tuple[int, ...] = tuple(range(RECOMMENDED_SEEDS))
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ValueError(f"{self.name}: a sampled policy needs at least one seed, got none")
        check_temperature(self.temperature)

    @classmethod
    def of(cls, spec: ScorerSpec, seeds: int, temperature: float) -> SampledScorerSpec:
        """`spec`'s scorer sampled with seeds 0..seeds-1, its row named NAME-sampled."""
        return cls(name=f"{spec.name}-sampled", scorer=spec.scorer, seeds=tuple(range(seeds)), temperature=temperature)

    def replays(self) -> list[PolicySpec]:
        return [replace(self, seeds=(seed,)) for seed in self.seeds]

    def build(self, labels: Sequence[GoldenLabels] | None, trace_indices: Sequence[int] = ()) -> Policy:
        """One seed's policy for a batch of the traces `trace_indices` (a spec of `replays`)."""
        if len(self.seeds) != 1 or not trace_indices:
            raise ValueError(f"{self.name}: build one seed's replay (`replays`) of a batch of known traces")
        row_seeds = tuple(trace_seed(self.seeds[0], index) for index in trace_indices)
        return make_policy(
            "foresight", scorer=self.scorer, mode="sampled", temperature=self.temperature, row_seeds=row_seeds,
            record=False,
        )


def trace_seed(seed: int, trace_index: int) -> int:
    """The sampling seed of one trace's replay under `seed`: a function of the two only."""
    return int(np.random.SeedSequence([seed, trace_index]).generate_state(1)[0])


REFERENCE = PolicySpec("full")


def resolve_policies(text: str) -> tuple[list[PolicySpec], list[str]]:
    """Specs for `all` or a comma-separated list of names, and notes on what `all` leaves out."""
    if text == "all":
        specs, notes = [], []
        for name in sorted(POLICIES):
            missing = PolicySpec(name).missing_artifacts
            if missing:
                notes.append(f"{name}: skipped, it needs {', '.join(missing)}, which eval does not provide yet")
            else:
                specs.append(PolicySpec(name))
        return specs, notes
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--policies {text!r} names no policy; give 'all' or names such as h2o,snapkv")
    for name in names:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose 'all' or some of: {', '.join(sorted(POLICIES))}")
        missing = PolicySpec(name).missing_artifacts
        if missing:
            raise ValueError(f"policy {name!r} needs {', '.join(missing)}, which eval does not provide yet")
    return [PolicySpec(name) for name in dict.fromkeys(names)], []
