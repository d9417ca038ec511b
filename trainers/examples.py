"""Scorer inputs along the golden schedule: the training examples of the supervised stage
(ForesightKV §3.2, App. E.1; docs/algorithms.md §6).

Each trace is teacher-forced through the frozen model (no grad) in the eviction runtime, its cache
following the golden schedule of its labels (the `golden` policy), so later layers see the evicted
cache as they would at inference. At every eviction step t and layer, a recorder wrapped around the
golden policy reads, from the same `EvictionContext` the learned policy sees, the scorer inputs of
the B candidates (keys, values, and attention features computed exactly as the `foresight` policy
computes them) and pairs them with the candidates' future scores α_{·,t}.

One example is one trace, as the paper batches (App. E.1): its M eviction steps, each with keys,
values [M, layers, Hkv, B, D], features [M, layers, Hkv, B, F*G] and alpha [M, layers, Hkv, B],
candidates in ascending position.

The labels' cadence (step t after position B + tL - 1) holds from the first token, whatever the
trace's prompt length, so a replay batch prefills the same `foresight.cadence.golden_prefill` tokens
in every row (as `foresight eval` replays golden): its rows evict together, and a row that ends early
replays padding, which is not recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from foresight.cadence import golden_prefill
from foresight.data.trace_store import Trace
from foresight.labels import GoldenLabels
from foresight.policies import make_policy
from foresight.policies.foresight import feature_state, observe_features
from foresight.runtime.cache import StateField
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.policy import EvictionContext, Policy
from foresight.scorer.attention_features import FeatureSet

TENSORS = ("keys", "values", "features", "alpha")


@dataclass
class GoldenStepRecorder(Policy):
    """Follows `golden` (keep scores and any state) and records the scorer inputs of every step.

    Not registered: it exists only to make training data. `feature_set` picks the attention features;
    keys, values and features are recorded in `storage_dtype`, α in float32.
    """

    name = "golden-steps"
    summary = "golden schedule, recording scorer inputs"
    needs_attention = True

    golden: Policy
    feature_set: str = FeatureSet.PAPER.value
    storage_dtype: torch.dtype = torch.float16
    buffers: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _features: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.golden.state_fields:
            raise ValueError("the recorded golden policy must keep no per-entry state of its own")
        self.labels: Sequence[GoldenLabels] = self.golden.labels
        self.num_steps = self.golden.schedule.num_steps

    @property
    def state_fields(self) -> tuple[StateField, ...]:
        """The per-entry state of the recorded feature set, as the `foresight` policy keeps it."""
        return feature_state(self.feature_set)

    def reset(self) -> None:
        self.golden.reset()
        self.buffers = {}

    def observe(self, context: EvictionContext) -> dict[str, torch.Tensor]:
        self._features, state = observe_features(context, self.feature_set)
        return {**self.golden.observe(context), **state}

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        scores = self.golden.keep_scores(context)  # also checks that the cache holds the golden candidates
        self._record(context)
        return scores

    def _record(self, context: EvictionContext) -> None:
        """Write this step's candidates of the rows still inside their trace into the step buffers."""
        steps = self.golden.schedule.step_of(context.positions.amax(dim=(1, 2)).cpu())
        rows = (steps <= self.num_steps).nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        candidates = slice(0, context.num_candidates)
        inputs = {
            "keys": context.keys[..., candidates, :],
            "values": context.values[..., candidates, :],
            "features": self._features,  # the candidates', as the scorer reads them (`observe_features`)
        }
        if not self.buffers:
            self._allocate(context, inputs)
        index = (rows, steps[rows] - 1, context.layer_idx)
        for name, value in inputs.items():
            self.buffers[name][index] = value[rows.to(value.device)].to("cpu", self.storage_dtype)

    def _allocate(self, context: EvictionContext, inputs: dict[str, torch.Tensor]) -> None:
        """Buffers [rows, M_max, layers, Hkv, B, *] and the α of every row's steps."""
        leading = (len(self.labels), int(self.num_steps.max()), context.num_layers)
        for name, value in inputs.items():
            self.buffers[name] = torch.zeros(*leading, *value.shape[1:], dtype=self.storage_dtype)
        alpha = torch.zeros(*leading, *inputs["keys"].shape[1:3])
        for row, labels in enumerate(self.labels):
            alpha[row, : labels.num_steps] = labels.alpha
        self.buffers["alpha"] = alpha

    def examples(self) -> list[dict[str, torch.Tensor]]:
        """Per replayed trace: {keys, values, features, alpha} with a leading step dim of its M steps."""
        return [
            {name: buffer[row, : int(steps)].clone() for name, buffer in self.buffers.items()}
            for row, steps in enumerate(self.num_steps)
        ]


@torch.no_grad()
def golden_steps(
    model,
    traces: Sequence[Trace],
    labels: Sequence[GoldenLabels],
    feature_set: str = FeatureSet.PAPER.value,
    storage_dtype: torch.dtype = torch.float16,
) -> list[dict[str, torch.Tensor]]:
    """Replay `traces` as one batch along their golden schedules; the training examples of each."""
    recorder = GoldenStepRecorder(make_policy("golden", labels=list(labels)), feature_set, storage_dtype)
    budget, interval = labels[0].budget, labels[0].interval
    engine = EvictionEngine(model, recorder, EvictionConfig(budget, interval, sinks=0, protect_prompt=False))
    prefill = golden_prefill([trace.prompt_length for trace in traces], budget, interval)
    engine.replay([trace.input_ids for trace in traces], [prefill] * len(traces))
    return recorder.examples()
