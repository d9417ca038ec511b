"""The Python front door of training: the four steps of `foresight traces`, `labels`, `fit` and `rl` as
functions with the verbs' names and defaults, so a script trains an evictor as the command line does
(docs/training.md; evaluation is `foresight.evaluate`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from foresight.cadence import Regime
from foresight.data.trace_store import TraceRunSummary, TraceStore
from foresight.labels import LabelKind
from foresight.models import DEFAULT_MODEL, float_dtype
from trainers import data_stage
from trainers.data_stage import FrozenModel, StepSummary, TraceRecipe
from trainers.fitting import FitRequest, fit_scorer
from trainers.reinforcement.stage import RLRequest, refine_scorer


def make_traces(
    out: str | os.PathLike,
    recipe: TraceRecipe,
    *,
    model: str = DEFAULT_MODEL,
    device: str = "cpu",
    dtype: str = "float32",
    shard: tuple[int, int] = (0, 1),
    progress: bool = True,
) -> TraceRunSummary:
    """Sample `recipe`'s reasoning traces with the frozen `model` into `out` (`foresight traces`), resuming."""
    frozen = FrozenModel(model, device, float_dtype("dtype", dtype))
    return data_stage.make_traces(frozen, recipe, out, shard=shard, progress=progress)


def make_labels(
    traces: str | os.PathLike,
    budget: int,
    interval: int,
    *,
    kind: LabelKind | str = LabelKind.ALPHA,
    regime: Regime | str = Regime.STREAMING,
    device: str = "cpu",
    dtype: str = "float32",
    progress: bool = True,
) -> StepSummary:
    """The golden labels of every trace in `traces` at B = `budget`, L = `interval` (`foresight labels`),
    made by the model that made the traces; several processes on one folder share its traces."""
    model = TraceStore(traces).settings["model"]
    frozen = FrozenModel(model, device, float_dtype("dtype", dtype))
    return data_stage.make_labels(frozen, traces, budget, interval, kind=kind, regime=regime, progress=progress)


def fit(
    config: str | os.PathLike,
    out: str | os.PathLike,
    *,
    traces: str | os.PathLike | None = None,
    model: str | None = None,
    budget: int | None = None,
    interval: int | None = None,
    regime: Regime | str | None = None,
    label_kind: LabelKind | str | None = None,
    on_policy_rounds: int | None = None,
    round_steps: int | None = None,
    ensemble: int | None = None,
    ckpt_path: str | None = None,
    overrides: Sequence[str] = (),
) -> Path:
    """Fit a scorer with the supervised stage (`foresight fit`): traces (from the config's recipe unless
    `traces` names a folder), labels and examples made or found, then training; returns out/scorer.
    Every None keeps the config's value; `overrides` are `KEY=VALUE` pairs of dotted config keys."""
    request = FitRequest(
        config=config,
        out=out,
        traces=traces,
        model=model,
        budget=budget,
        interval=interval,
        regime=regime,
        label_kind=label_kind,
        on_policy_rounds=on_policy_rounds,
        round_steps=round_steps,
        ensemble=ensemble,
        ckpt_path=ckpt_path,
        overrides=overrides,
    )
    return fit_scorer(request)


def rl(
    config: str | os.PathLike,
    scorer: str | os.PathLike,
    out: str | os.PathLike,
    *,
    traces: str | os.PathLike | None = None,
    model: str | None = None,
    budget: int | None = None,
    interval: int | None = None,
    regime: Regime | str | None = None,
    ckpt_path: str | None = None,
    overrides: Sequence[str] = (),
) -> Path:
    """Refine `scorer` (a fitted scorer folder or Hub id) with the reinforcement stage (`foresight rl`);
    returns out/scorer. Every None keeps the config's value (`regime`: the scorer's own)."""
    request = RLRequest(
        config=config,
        scorer=str(scorer),
        out=out,
        traces=traces,
        model=model,
        budget=budget,
        interval=interval,
        regime=regime,
        ckpt_path=ckpt_path,
        overrides=overrides,
    )
    return refine_scorer(request)
