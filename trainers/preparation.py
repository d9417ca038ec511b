"""The steps that make the supervised stage's data: traces -> golden labels -> training examples.

`foresight traces`, `foresight labels` and `foresight examples` each run one step; `foresight fit`
runs them in order before it trains, so its data is made by the same functions as the verbs'. Every
step resumes: it skips what is complete (checked, not merely present: a file that does not open or
was made for another trace is made again) and returns a summary whose `describe()` is one line. The
frozen model is loaded on first need, so a step with nothing to do loads nothing and the steps of
one run share one load.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from foresight.artifacts import MISSING, claimed
from foresight.cadence import TraceTooShort, eviction_steps
from foresight.data.tasks import recorded_source
from foresight.data.trace_generation import generate_traces
from foresight.data.trace_store import (
    Trace,
    TraceRunSummary,
    TraceSettings,
    TraceStore,
    finished_run,
)
from foresight.labels import LabelKind, LabelStore, compute_golden_labels, future_score_table, save_labels
from foresight.models import DEFAULT_MODEL, dtype_name, float_dtype, load_model
from foresight.runtime.sampling import REASONING_SAMPLING, Draws
from foresight.scorer.model import ForesightScorer
from trainers.example_cache import ExampleCache
from trainers.examples import golden_steps, scorer_steps


@dataclass
class FrozenModel:
    """The frozen model of a run (a name `load_model` takes, where it runs, its dtype), loaded on first use."""

    name: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    _loaded: tuple | None = field(default=None, init=False, repr=False)

    def load(self) -> tuple:
        """(model, tokenizer), loaded once."""
        if self._loaded is None:
            self._loaded = load_model(self.name, dtype=self.dtype, device=self.device)
        return self._loaded


@dataclass(frozen=True)
class TraceRecipe:
    """How to sample a run's traces: the options of `foresight traces` (see `generate_traces`; the
    defaults are the paper's sampling settings)."""

    prompts: str
    num: int
    max_new_tokens: int
    min_tokens: int = 0
    only_correct: bool = False
    temperature: float = REASONING_SAMPLING.temperature
    top_k: int = REASONING_SAMPLING.top_k
    top_p: float = REASONING_SAMPLING.top_p
    batch_size: int | None = None  # rows decoded together; None sizes it to the machine
    shard_size: int = 64
    seed: int = 0
    draws: str | None = None  # "generator" or "counter" (foresight.runtime.sampling.Draws); None: the device's

    def settings(self, model: str, device: str = "cpu") -> TraceSettings:
        """The settings a traces folder made by `model` on `device` from this recipe records."""
        options = {
            name: value for name, value in asdict(self).items() if name not in ("prompts", "batch_size", "draws")
        }
        draws = Draws.resolve(self.draws, device, self.temperature)
        return TraceSettings(model=model, source=recorded_source(self.prompts), draws=draws.value, **options)


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


@dataclass(frozen=True)
class StepSummary:
    """What a labels or examples step found and did; `action` and `already` word its line."""

    directory: Path
    action: str  # "labelled"
    already: str  # "already labelled"
    made: tuple[int, ...]  # the indices of the traces this call made
    damaged: int  # of the traces to make: files that were there but could not be used
    done: int
    too_short: int
    min_tokens: int  # B + L
    seconds: float
    by_others: int = 0  # of the traces to make: made by another process meanwhile

    def describe(self) -> str:
        replaced = f" ({self.damaged} replacing damaged files)" if self.damaged else ""
        others = f", {self.by_others} by other processes" if self.by_others else ""
        return (
            f"{self.directory}: {self.action} {len(self.made)} traces{replaced}{others}, skipped {self.too_short} "
            f"too short (< B + L = {self.min_tokens} tokens), {self.done} {self.already}; {self.seconds:.1f} s"
        )


def make_traces(
    frozen: FrozenModel,
    recipe: TraceRecipe,
    out_dir: str | os.PathLike,
    *,
    shard: tuple[int, int] = (0, 1),
    progress: bool = True,
) -> TraceRunSummary:
    """`foresight traces`: sample the recipe's traces into `out_dir`, resuming; a complete folder loads no model."""
    finished = finished_run(out_dir, recipe.settings(frozen.name, frozen.device), shard)
    if finished is not None:
        return finished
    model, tokenizer = frozen.load()
    options = asdict(recipe)
    return generate_traces(
        model,
        tokenizer,
        options.pop("prompts"),
        out_dir=out_dir,
        shard=shard,
        progress=progress,
        model_name=frozen.name,
        **options,
    )


def make_labels(
    frozen: FrozenModel,
    traces_dir: str | os.PathLike,
    budget: int,
    interval: int,
    *,
    chunk_size: int = 256,
    progress: bool = True,
    kind: LabelKind | str = LabelKind.ALPHA,
) -> StepSummary:
    """`foresight labels`: the golden labels (of label kind `kind`) of every trace of `traces_dir` long enough
    to have an eviction step.

    Processes started on one folder (or the ranks of a `torchrun` launch) share its traces by per-trace claims
    (`foresight.artifacts.claimed`): each trace is labelled by one of them, a trace claimed by a killed process
    is taken over, and each returns when the folder is complete, with the files one process would write."""
    started = time.perf_counter()
    traces = TraceStore(traces_dir)
    traces.require_model(frozen.name)
    store = LabelStore(traces_dir, budget, interval, kind)

    def problem(trace: Trace) -> str | None:
        return store.problem(trace.index, num_tokens=trace.input_ids.numel())

    plan = _Plan.of(traces, budget, interval, problem)
    made = []
    mine = claimed(plan.todo, lambda trace: store.claim_path(trace.index), lambda trace: problem(trace) is None)
    for trace in tqdm(mine, total=len(plan.todo), desc="labels", unit="trace", disable=not progress):
        labels = compute_golden_labels(
            frozen.load()[0],
            trace.input_ids,
            budget,
            interval,
            trace_index=trace.index,
            model_name=frozen.name,
            chunk_size=chunk_size,
            kind=store.kind,
        )
        save_labels(labels, store.path(trace.index))
        made.append(trace.index)
    return plan.summary(store.directory, "labelled", "already labelled", time.perf_counter() - started, made)


def make_examples(
    frozen: FrozenModel, cache: ExampleCache, *, replay_batch_size: int = 4, progress: bool = True
) -> StepSummary:
    """`foresight examples`: the training examples of every labelled trace of the cache's traces folder,
    replayed `replay_batch_size` traces at a time (similar lengths together)."""
    started = time.perf_counter()
    key = cache.key
    traces = _opened_traces(frozen, cache, replay_batch_size)
    labels = LabelStore(cache.traces_dir, key.budget, key.interval, key.label_kind)
    plan = _Plan.of(traces, key.budget, key.interval, cache.problem)
    for trace in plan.todo:  # all labels first: a missing one fails now, not after hours of replay
        labels.require(trace.index, num_tokens=trace.input_ids.numel())
    storage_dtype = float_dtype("storage_dtype", key.storage_dtype)
    for group in tqdm(
        _length_groups(plan.todo, replay_batch_size), desc="examples", unit="batch", disable=not progress
    ):
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
    plan = _Plan.of(traces, key.budget, key.interval, cache.problem)
    storage_dtype = float_dtype("storage_dtype", key.storage_dtype)
    for group in tqdm(
        _length_groups(plan.todo, replay_batch_size), desc="on-policy", unit="batch", disable=not progress
    ):
        model = frozen.load()[0]
        tables = [
            future_score_table(
                model, trace.input_ids, key.budget, key.interval, chunk_size=chunk_size, kind=key.label_kind
            )
            for trace in group
        ]
        for trace, tensors in zip(group, scorer_steps(model, group, tables, scorer, storage_dtype)):
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


@dataclass
class _Plan:
    """A step's traces sorted into to-do (missing or damaged files), done and too short."""

    todo: list[Trace]
    damaged: int
    done: int
    too_short: int
    min_tokens: int

    @classmethod
    def of(cls, traces: Sequence[Trace], budget: int, interval: int, problem: Callable[[Trace], str | None]) -> _Plan:
        plan = cls([], 0, 0, 0, budget + interval)
        for trace in traces:
            try:
                eviction_steps(trace.input_ids.numel(), budget, interval)
            except TraceTooShort:
                plan.too_short += 1
                continue
            found = problem(trace)
            if found is None:
                plan.done += 1
            else:
                plan.todo.append(trace)
                plan.damaged += found != MISSING
        return plan

    def summary(
        self, directory: Path, action: str, already: str, seconds: float, made: Sequence[int] | None = None
    ) -> StepSummary:
        """The step's summary; `made`: the traces this process made, when processes shared the to-do list."""
        made = tuple(trace.index for trace in self.todo) if made is None else tuple(made)
        return StepSummary(
            directory,
            action,
            already,
            made,
            self.damaged,
            self.done,
            self.too_short,
            self.min_tokens,
            seconds,
            len(self.todo) - len(made),
        )
