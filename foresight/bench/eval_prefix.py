"""Teacher-forced evaluation with and without the shared prefix (foresight/runtime/prefix.py), same run.

Evaluates the held-out traces of a traces folder under the given policies and budgets twice, first with
every replay running the model on every token, then with the replays of a batch reusing the forwards
before the first eviction, and reports the wall and CPU seconds of each and their ratio. The two result
tables must agree to the last digit; the command fails otherwise.

    foresight bench eval-prefix --traces runs/main/traces --holdout 0.25 --policies all --budgets 128,256
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from foresight.bench.common import (
    PlacedSettings,
    budgets_field,
    interval_field,
    policies_field,
    regime_field,
    threads_note,
    traces_field,
)
from foresight.data.trace_store import TraceStore, describe_traces, select_traces
from foresight.eval.replay import evaluate
from foresight.eval.specs import resolve_policies
from foresight.models import load_model

NAME = "eval-prefix"


@dataclass(frozen=True, kw_only=True)
class Settings(PlacedSettings):
    """The model is the one that made the traces."""

    traces: Path = traces_field("a traces folder with labels at each budget")
    holdout: float = field(default=0.25, metadata={"help": "evaluate this held-out share (as `foresight eval`)"})
    policies: str = policies_field("every registered policy that can run; golden where labels exist")
    budgets: tuple[int, ...] = budgets_field((128, 256))
    interval: int = interval_field()
    regime: Literal["streaming", "decode"] = regime_field()


def run(settings: Settings) -> str:
    """Evaluate plainly, then with the shared prefix; the report's markdown section."""
    specs, _ = resolve_policies(settings.policies)
    store = TraceStore(settings.traces)
    traces = list(select_traces(store, settings.holdout, 0, None))
    model, _ = load_model(store.settings["model"], device=settings.run_device, dtype=settings.run_dtype)
    timings, tables = {}, {}
    for shared in (False, True):
        wall, cpu = time.perf_counter(), time.process_time()
        result = evaluate(
            model,
            traces,
            specs,
            list(settings.budgets),
            settings.interval,
            labels_root=settings.traces,
            progress=False,
            share_prefix=shared,
            regime=settings.regime,
        )
        timings[shared] = (time.perf_counter() - wall, time.process_time() - cpu)
        tables[shared] = [{k: v for k, v in row.items() if k != "seconds"} for row in result.rows]
    if tables[True] != tables[False]:
        raise ValueError("the shared-prefix evaluation differs from the plain one")
    (plain_wall, plain_cpu), (shared_wall, shared_cpu) = timings[False], timings[True]
    return "\n".join(
        [
            f"### Evaluation with the shared prefix ({torch.device(settings.run_device).type})",
            "",
            f"Command: `{settings.command}` {threads_note()}",
            "",
            f"{describe_traces(traces)}; {len(specs)} policies; B = {', '.join(map(str, settings.budgets))}, "
            f"L = {settings.interval}. Both runs gave the same table (every figure and interval).",
            "",
            "| evaluation | wall s | CPU s |",
            "|---|---:|---:|",
            f"| every replay runs the model on every token | {plain_wall:.1f} | {plain_cpu:.1f} |",
            f"| replays share the forwards before the first eviction | {shared_wall:.1f} | {shared_cpu:.1f} |",
            f"| ratio (plain / shared) | {plain_wall / shared_wall:.2f}x | {plain_cpu / shared_cpu:.2f}x |",
        ]
    )
