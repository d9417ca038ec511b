"""The supervised stage's own data: training examples from labelled traces, and the fit's recipe options.

Traces and golden labels are the data stage's (`trainers.data_stage`); `foresight examples` runs the examples
step, and `foresight fit` runs all three in order before it trains, so its data is made by the same functions
as the verbs'. Like the data stage's steps, every step here resumes and returns a `StepSummary`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from foresight.artifacts import claimed
from foresight.cadence import Regime
from foresight.data.trace_store import Trace, TraceStore
from foresight.labels import LabelStore
from foresight.models import dtype_name, float_dtype
from foresight.scorer.model import ForesightScorer
from trainers.data_stage import FrozenModel, StepPlan, StepSummary
from trainers.example_cache import ExampleCache
from trainers.examples import future_tables, golden_steps, scorer_steps

MAX_ROUNDS = 10
"""The most on-policy rounds a fit runs (each replays every training trace and refits)."""


@dataclass(frozen=True)
class OnPolicyRounds:
    """On-policy rounds after the golden fit (`foresight fit`, docs/algorithms.md §6): how many, and the
    optimisation steps of each (None: the trainer's max_steps)."""

    rounds: int = 2
    steps: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rounds <= MAX_ROUNDS:
            raise ValueError(f"on-policy rounds must be between 0 and {MAX_ROUNDS}, got {self.rounds}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"on-policy round steps must be a positive integer, got {self.steps}")


MAX_MEMBERS = 16
"""The most fits a seed ensemble averages."""


@dataclass(frozen=True)
class SeedEnsemble:
    """Fits of one recipe under `members` seeds (seed_everything, + 1, ...) whose keep scores `foresight fit`
    averages into one scorer (`foresight.scorer.ensemble`); 1: a single fit."""

    members: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.members <= MAX_MEMBERS:
            raise ValueError(f"ensemble members must be between 1 and {MAX_MEMBERS}, got {self.members}")


def make_examples(
    frozen: FrozenModel,
    cache: ExampleCache,
    *,
    replay_batch_size: int = 4,
    progress: bool = True,
    per_source: int | None = None,
) -> StepSummary:
    """`foresight examples`: the training examples of every labelled trace of the cache's traces folder (of the
    first `per_source` of each prompt source when given), replayed `replay_batch_size` traces at a time (similar
    lengths together). Processes started on one cache (a fold study's, one per fold) share its replay batches by
    claims (`foresight.artifacts.claimed`), each returning when the cache is complete."""
    started = time.perf_counter()
    key = cache.key
    folder = _opened_traces(frozen, cache, replay_batch_size)
    traces = folder if per_source is None else folder.first_of_each(per_source)
    labels = LabelStore(cache.traces_dir, key.budget, key.interval, key.label_kind, key.regime)
    plan = StepPlan.of(traces, key.budget, key.interval, cache.problem, labels.regime)
    for trace in plan.todo:  # all labels first: a missing one fails now, not after hours of replay
        labels.require(trace.index, num_tokens=trace.input_ids.numel())
    storage_dtype = float_dtype("storage_dtype", key.storage_dtype)

    def undone(group: list[Trace]) -> list[Trace]:
        return [trace for trace in group if cache.problem(trace) is not None]

    todo = {trace.index for trace in plan.todo}
    groups = [  # the same groups in every process sharing the cache, so a group's claim means one thing
        group
        for group in _length_groups(plan.long_enough, replay_batch_size)
        if any(trace.index in todo for trace in group)
    ]
    mine = claimed(groups, lambda group: cache.claim_path(group[0].index), lambda group: not undone(group))
    for whole in tqdm(mine, total=len(groups), desc="examples", unit="batch", disable=not progress):
        group = undone(whole)
        group_labels = [labels.load(trace.index, num_tokens=trace.input_ids.numel()) for trace in group]
        examples = golden_steps(frozen.load()[0], group, group_labels, key.feature_set, storage_dtype)
        for trace, tensors in zip(group, examples):
            cache.write(trace, tensors)
    return plan.summary(cache.directory, "made the examples of", "already made", time.perf_counter() - started)


def make_on_policy_examples(
    frozen: FrozenModel,
    cache: ExampleCache,
    scorer: ForesightScorer,
    trace_indices: Sequence[int],
    *,
    replay_batch_size: int = 4,
    chunk_size: int = 256,
    progress: bool = True,
) -> StepSummary:
    """One on-policy round's data: the traces `trace_indices` replayed under `scorer`'s own evictions,
    each step's candidates labelled with their future scores (`trainers.examples.scorer_steps`).

    The cache's key must name this scorer's trajectory (`scorer_trajectory`), so that the examples of
    another scorer are never mixed in; a rerun skips finished traces."""
    started = time.perf_counter()
    key = cache.key
    if key.trajectory != scorer_trajectory(scorer) or key.feature_set != scorer.config.feature_set:
        raise ValueError(
            f"the cache {cache.directory} is keyed to trajectory {key.trajectory!r} with {key.feature_set} features, "
            f"not to this scorer's ({scorer_trajectory(scorer)!r}, {scorer.config.feature_set})"
        )
    wanted = set(trace_indices)
    traces = [trace for trace in _opened_traces(frozen, cache, replay_batch_size) if trace.index in wanted]
    regime = Regime.parse(key.regime)
    plan = StepPlan.of(traces, key.budget, key.interval, cache.problem, regime)
    storage_dtype = float_dtype("storage_dtype", key.storage_dtype)
    for group in tqdm(
        _length_groups(plan.todo, replay_batch_size), desc="on-policy", unit="batch", disable=not progress
    ):
        model = frozen.load()[0]
        tables = future_tables(model, group, key.budget, key.interval, regime, key.label_kind, chunk_size)
        for trace, tensors in zip(group, scorer_steps(model, group, tables, scorer, storage_dtype, regime)):
            cache.write(trace, tensors)
    action = "made the on-policy examples of"
    return plan.summary(cache.directory, action, "already made", time.perf_counter() - started)


def scorer_trajectory(scorer: ForesightScorer) -> str:
    """The trajectory name of a scorer's own evictions in an example cache's key: a digest of its weights
    and config, so a retrained scorer gets a new cache."""
    digest = hashlib.sha256(json.dumps(asdict(scorer.config), sort_keys=True, default=str).encode())
    for name, tensor in sorted(scorer.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return f"scorer:{digest.hexdigest()[:16]}"


def _opened_traces(frozen: FrozenModel, cache: ExampleCache, replay_batch_size: int) -> TraceStore:
    """The traces of a cache, after checking the model and claiming the folder for the cache's key."""
    key = cache.key
    if (frozen.name, dtype_name(frozen.dtype)) != (key.model, key.model_dtype):
        raise ValueError(
            f"the examples of {cache.directory} are keyed to model {key.model!r} in {key.model_dtype}, "
            f"not {frozen.name!r} in {dtype_name(frozen.dtype)}"
        )
    if replay_batch_size < 1:
        raise ValueError(f"replay_batch_size must be at least 1, got {replay_batch_size}")
    traces = TraceStore(cache.traces_dir)
    traces.require_model(frozen.name)
    cache.claim()
    return traces


def _length_groups(traces: Sequence[Trace], size: int) -> list[list[Trace]]:
    """Replay batches of `size` traces of similar lengths (little padding)."""
    ordered = sorted(traces, key=lambda trace: trace.input_ids.numel())
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]
