"""The data stage: a frozen model's traces and their golden labels (`foresight traces`, `foresight labels`).

`foresight fit` runs the same functions before it trains (with `trainers.preparation`'s examples step), so
its data is made as the verbs make it. Every step resumes: it skips what is complete (checked, not merely
present: a file that does not open or was made for another trace is made again) and returns a summary
whose `describe()` is one line. The frozen model is loaded on first need, so a step with nothing to do loads
nothing and the steps of one run share one load.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from foresight.artifacts import MISSING, claimed
from foresight.cadence import Regime, TraceTooShort, eviction_steps, regime_shift
from foresight.data.tasks import recorded_source
from foresight.data.trace_generation import generate_traces
from foresight.data.trace_store import Trace, TraceRunSummary, TraceSettings, TraceStore, finished_run
from foresight.labels import LabelKind, LabelStore, compute_golden_labels, save_labels
from foresight.models import DEFAULT_MODEL, load_model
from foresight.runtime.sampling import REASONING_SAMPLING, Draws


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
    regime: Regime | str = Regime.STREAMING,
    per_source: int | None = None,
) -> StepSummary:
    """`foresight labels`: the golden labels (of label kind `kind`, on the steps of `regime`) of every trace of
    `traces_dir` long enough to have an eviction step (of the first `per_source` of each prompt source when given:
    a fit's sample of every family).

    Processes started on one folder (or the ranks of a `torchrun` launch) share its traces by per-trace claims
    (`foresight.artifacts.claimed`): each trace is labelled by one of them, a trace claimed by a killed process
    is taken over, and each returns when the folder is complete, with the files one process would write."""
    started = time.perf_counter()
    folder = TraceStore(traces_dir)
    folder.require_model(frozen.name)
    traces = folder if per_source is None else folder.first_of_each(per_source)
    store = LabelStore(traces_dir, budget, interval, kind, regime)

    def problem(trace: Trace) -> str | None:
        return store.problem(trace.index, num_tokens=trace.input_ids.numel())

    plan = StepPlan.of(traces, budget, interval, problem, store.regime)
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
            regime=store.regime,
            prompt_length=trace.prompt_length,
        )
        save_labels(labels, store.path(trace.index))
        made.append(trace.index)
    return plan.summary(store.directory, "labelled", "already labelled", time.perf_counter() - started, made)


@dataclass
class StepPlan:
    """A step's traces sorted into to-do (missing or damaged files), done and too short."""

    todo: list[Trace]
    damaged: int
    done: int
    too_short: int
    min_tokens: int
    long_enough: list[Trace] = field(default_factory=list)  # every trace with a step: the to-do and the done

    @classmethod
    def of(
        cls,
        traces: Sequence[Trace],
        budget: int,
        interval: int,
        problem: Callable[[Trace], str | None],
        regime: Regime = Regime.STREAMING,
    ) -> StepPlan:
        plan = cls([], 0, 0, 0, budget + interval)
        for trace in traces:
            try:
                shift = regime_shift(trace.prompt_length, budget, interval, regime)
                eviction_steps(trace.input_ids.numel(), budget, interval, shift)
            except TraceTooShort:
                plan.too_short += 1
                continue
            plan.long_enough.append(trace)
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
