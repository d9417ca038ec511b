"""Scorer inputs along the golden schedule: the training examples of the supervised stage
(ForesightKV §3.2, App. E.1; docs/algorithms.md §6).

Each trace is teacher-forced through the frozen model (no grad) in the eviction runtime, its cache
following the golden schedule of its labels (the `golden` policy), so later layers see the evicted
cache as they would at inference. At every eviction step t and layer, a recorder wrapped around the
golden policy reads, from the same `EvictionContext` the learned policy sees, the scorer inputs of
the B candidates (keys, values, and attention features computed exactly as the `foresight` policy
computes them) and pairs them with the candidates' future scores α_{·,t}.

On-policy examples (`scorer_steps`) are recorded the same way along the learned scorer's own
trajectory: the replay follows the scorer's evictions instead of the golden schedule, and each
candidate's α is read from the trace's table of future scores (`foresight.labels.future_score_table`),
which does not depend on the trajectory. They teach the scorer the states its own evictions lead to,
which the golden trajectory never visits (ForesightKV §3.3 names this shift; DAgger's remedy).

One example is one trace, as the paper batches (App. E.1): its M eviction steps, each with keys,
values [M, layers, Hkv, B, D], features [M, layers, Hkv, B, F*G] and alpha [M, layers, Hkv, B],
candidates in ascending position.

In the streaming regime the labels' cadence (step t after position B + tL - 1) holds from the first
token, whatever the trace's prompt length, so a replay batch prefills the same
`foresight.cadence.golden_prefill` tokens in every row (as `foresight eval` replays golden): its rows evict
together, and a row that ends early replays padding, which is not recorded. In the decode regime each row
prefills its whole prompt and its steps follow its own shift (`foresight.cadence.regime_shift`), so rows
evict apart; a compression step (step 0) is driven but not recorded: its labels hold only its kept set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from foresight.cadence import Regime, eviction_steps, golden_prefill, regime_shift, step_of
from foresight.data.trace_store import Trace
from foresight.labels import GoldenLabels, LabelKind, future_score_table
from foresight.policies import make_policy
from foresight.policies.foresight import Foresight, feature_state, observe_features
from foresight.runtime.cache import StateField
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.policy import EvictionContext, ObservedQueries, Policy
from foresight.scorer.attention_features import FeatureSet
from foresight.scorer.model import ForesightScorer

TENSORS = ("keys", "values", "features", "alpha")


class StepTargets(Protocol):
    """The α of a replayed batch: how many steps each row has and its candidates' future scores."""

    budget: int
    interval: int
    num_steps: torch.Tensor  # [rows]
    shift: torch.Tensor  # [rows] each row's `regime_shift`
    regime: Regime

    def alpha(self, rows: torch.Tensor, steps: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """α [len(rows), Hkv, B] of the candidates at `positions` [len(rows), Hkv, B] (steps are 1-based)."""


class LabelTargets:
    """α from golden labels: only for the golden trajectory, whose candidates are the labels' own
    (the golden policy checks this at every step)."""

    def __init__(self, labels: Sequence[GoldenLabels]) -> None:
        self.budget, self.interval = labels[0].budget, labels[0].interval
        regimes = {item.regime for item in labels}
        if len(regimes) > 1:
            raise ValueError(f"the labels of one batch must share one regime, got {sorted(r.value for r in regimes)}")
        self.regime = regimes.pop()
        self.num_steps = torch.tensor([item.num_steps for item in labels])
        self.shift = torch.tensor([item.shift for item in labels])
        self._alpha = torch.zeros(len(labels), int(self.num_steps.max()), *labels[0].alpha.shape[1:])
        for row, item in enumerate(labels):
            self._alpha[row, : item.num_steps] = item.alpha

    def alpha(self, rows: torch.Tensor, steps: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
        return self._alpha[rows, steps - 1, layer]


class FutureTargets:
    """α from each row's table of future scores [M, layers, Hkv, N]: any trajectory on the cadence."""

    def __init__(
        self,
        tables: Sequence[torch.Tensor],
        budget: int,
        interval: int,
        shifts: Sequence[int] = (),
        regime: Regime = Regime.STREAMING,
    ) -> None:
        self.tables, self.budget, self.interval, self.regime = list(tables), budget, interval, regime
        self.num_steps = torch.tensor([table.shape[0] for table in self.tables])
        self.shift = torch.tensor(list(shifts) or [0] * len(self.tables))

    def alpha(self, rows: torch.Tensor, steps: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.cpu().long()
        pairs = zip(rows.tolist(), steps.tolist())
        return torch.stack(
            [self.tables[row][step - 1, layer].gather(-1, positions[i]) for i, (row, step) in enumerate(pairs)]
        )


@dataclass
class StepRecorder(Policy):
    """Follows a driving policy (its keep scores and state) and records the scorer inputs of every step.

    Not registered: it exists only to make training data. The driver is `golden` (no state of its
    own; the recorder computes the features) or the learned `foresight` policy of the same feature set
    (whose features and state are read, not computed again); `feature_set` picks the attention
    features; keys, values and features are recorded in `storage_dtype`, α in float32.
    """

    name = "recorded-steps"
    summary = "a driving policy, recording scorer inputs and future scores"
    needs_attention = True

    driver: Policy
    targets: StepTargets
    feature_set: str = FeatureSet.PAPER.value
    storage_dtype: torch.dtype = torch.float16
    buffers: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _features: dict[int, torch.Tensor] = field(
        default_factory=dict, init=False, repr=False
    )  # by layer, observe to score

    def __post_init__(self) -> None:
        learned = isinstance(self.driver, Foresight)
        scored = FeatureSet.parse(self.driver.scorer.config.feature_set) if learned else None
        if learned and scored is not FeatureSet.parse(self.feature_set):
            raise ValueError(
                f"the scorer reads {scored.value} features; it cannot drive a recording of {self.feature_set} features"
            )
        if not learned and self.driver.state_fields:
            raise ValueError(
                f"the {self.driver.name} policy keeps per-entry state of its own and cannot drive this recording"
            )
        self.num_steps = self.targets.num_steps

    @property
    def state_fields(self) -> tuple[StateField, ...]:
        """The per-entry state of the recorded feature set, as the `foresight` policy keeps it: the learned driver's
        own (its dtypes), so the features recorded are the ones it scored."""
        return self.driver.state_fields if isinstance(self.driver, Foresight) else feature_state(self.feature_set)

    @property
    def observed_queries(self) -> ObservedQueries:
        """The learned driver's (it may stream its window, `ObservedQueries.STREAM`); the ring's for a golden one."""
        return self.driver.observed_queries if isinstance(self.driver, Foresight) else ObservedQueries.WINDOW

    @property
    def stream_block(self) -> int:
        return self.driver.stream_block

    def stream_observe(self, contexts: Sequence[EvictionContext]) -> dict[str, torch.Tensor]:
        return self.driver.stream_observe(contexts)

    @property
    def buffered_query_dtype(self) -> torch.dtype | None:
        """The learned driver's query ring dtype (see `state_fields`); the model's for a golden driver."""
        return self.driver.buffered_query_dtype if isinstance(self.driver, Foresight) else None

    def reset(self) -> None:
        self.driver.reset()
        self.buffers = {}
        self._features = {}

    def observe(self, context: EvictionContext) -> dict[str, torch.Tensor]:
        return self.step_observe([context])[0]

    def step_observe(self, contexts: Sequence[EvictionContext]) -> list[dict[str, torch.Tensor]]:
        if isinstance(self.driver, Foresight):  # it computes the same features for its own scores
            states = self.driver.step_observe(contexts)
            self._features.update((context.layer_idx, self.driver.observed_features(context)) for context in contexts)
            return states
        states = []
        for context, driver_state in zip(contexts, self.driver.step_observe(contexts), strict=True):
            self._features[context.layer_idx], state = observe_features(context, self.feature_set)
            states.append({**driver_state, **state})
        return states

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        return self.step_keep_scores([context])[0]

    def step_keep_scores(self, contexts: Sequence[EvictionContext]) -> torch.Tensor:
        """The driver's scores of the step's layers (at once where it batches them), then each layer recorded."""
        scores = self.driver.step_keep_scores(contexts)
        for context in contexts:
            self._record(context)
        return scores

    def _record(self, context: EvictionContext) -> None:
        """Write this step's candidates of the rows still inside their trace into the step buffers."""
        targets = self.targets
        batch_rows = torch.arange(context.positions.shape[0]) if context.rows is None else context.rows.cpu()
        newest = context.positions.amax(dim=(1, 2)).cpu()
        steps = step_of(newest, targets.budget, targets.interval, targets.shift[batch_rows])
        local = ((steps >= 1) & (steps <= self.num_steps[batch_rows])).nonzero().squeeze(1)
        features = self._features.pop(context.layer_idx)  # the candidates', as the scorer reads them
        if local.numel() == 0:
            return
        # A compression step (more candidates) is never recorded; a row stepping beside another row's compression
        # has its B candidates last among the widened candidate slots, its invalid ones first.
        candidates = slice(context.num_candidates - targets.budget, context.num_candidates)
        keys, values = context.keys[..., candidates, :], context.values[..., candidates, :]
        inputs = {"keys": keys, "values": values, "features": features[..., candidates, :]}
        if not self.buffers:
            self._allocate(context, inputs)
        rows = batch_rows[local]
        index = (rows, steps[local] - 1, context.layer_idx)
        for name, value in inputs.items():
            self.buffers[name][index] = value[local.to(value.device)].to("cpu", self.storage_dtype)
        positions = context.candidate_positions[local.to(context.keys.device), :, candidates]
        self.buffers["alpha"][index] = targets.alpha(rows, steps[local], context.layer_idx, positions)

    def _allocate(self, context: EvictionContext, inputs: dict[str, torch.Tensor]) -> None:
        """Buffers [rows, M_max, layers, Hkv, B, *] and the α [rows, M_max, layers, Hkv, B]."""
        leading = (len(self.num_steps), int(self.num_steps.max()), context.num_layers)
        for name, value in inputs.items():
            self.buffers[name] = torch.zeros(*leading, *value.shape[1:], dtype=self.storage_dtype)
        self.buffers["alpha"] = torch.zeros(*leading, *inputs["keys"].shape[1:3])

    def examples(self) -> list[dict[str, torch.Tensor]]:
        """Per replayed trace: {keys, values, features, alpha} with a leading step dim of its M steps."""
        return [
            {name: buffer[row, : int(steps)].clone() for name, buffer in self.buffers.items()}
            for row, steps in enumerate(self.num_steps)
        ]


def _replay(model, traces: Sequence[Trace], recorder: StepRecorder) -> list[dict[str, torch.Tensor]]:
    """Replay `traces` as one batch on the labels' cadence (no sinks, no protected prompt; one prefill in the
    streaming regime, each whole prompt in the decode regime)."""
    targets = recorder.targets
    budget, interval = targets.budget, targets.interval
    engine = EvictionEngine(model, recorder, EvictionConfig(budget, interval, sinks=0, protect_prompt=False))
    prompts = [trace.prompt_length for trace in traces]
    prefill = prompts if targets.regime is Regime.DECODE else [golden_prefill(prompts, budget, interval)] * len(traces)
    engine.replay([trace.input_ids for trace in traces], prefill)
    return recorder.examples()


@torch.no_grad()
def golden_steps(
    model,
    traces: Sequence[Trace],
    labels: Sequence[GoldenLabels],
    feature_set: str = FeatureSet.PAPER.value,
    storage_dtype: torch.dtype = torch.float16,
) -> list[dict[str, torch.Tensor]]:
    """Replay `traces` as one batch along their golden schedules; the training examples of each."""
    golden = make_policy("golden", labels=list(labels))
    return _replay(model, traces, StepRecorder(golden, LabelTargets(labels), feature_set, storage_dtype))


def future_tables(
    model,
    traces: Sequence[Trace],
    budget: int,
    interval: int,
    regime: Regime,
    kind: LabelKind | str = LabelKind.ALPHA,
    chunk_size: int = 256,
) -> list[torch.Tensor]:
    """Each trace's table of future scores at B and L in `regime` (`foresight.labels.future_score_table`): what an
    on-policy replay (`scorer_steps`) labels the scorer's own candidates with."""
    return [
        future_score_table(
            model,
            trace.input_ids,
            budget,
            interval,
            chunk_size=chunk_size,
            kind=kind,
            regime=regime,
            prompt_length=trace.prompt_length,
        )
        for trace in traces
    ]


@torch.no_grad()
def scorer_steps(
    model,
    traces: Sequence[Trace],
    tables: Sequence[torch.Tensor],
    scorer: ForesightScorer,
    storage_dtype: torch.dtype = torch.float16,
    regime: Regime = Regime.STREAMING,
) -> list[dict[str, torch.Tensor]]:
    """Replay `traces` as one batch under `scorer`'s own (deterministic) evictions on the steps of `regime`; the
    on-policy training examples of each, α read from its table of future scores (`future_score_table`)."""
    config = scorer.config
    shifts = [regime_shift(trace.prompt_length, config.budget, config.interval, regime) for trace in traces]
    for trace, table, shift in zip(traces, tables, shifts, strict=True):
        steps = eviction_steps(trace.input_ids.numel(), config.budget, config.interval, shift)
        if table.shape[0] != steps:
            raise ValueError(
                f"the future scores of trace {trace.index} hold {table.shape[0]} steps, but the scorer's "
                f"B={config.budget}, L={config.interval} give its {trace.input_ids.numel()} tokens {steps} steps "
                f"in the {regime.value} regime"
            )
    targets = FutureTargets(list(tables), config.budget, config.interval, shifts, regime)
    recorder = StepRecorder(make_policy("foresight", scorer=scorer), targets, config.feature_set, storage_dtype)
    return _replay(model, traces, recorder)
