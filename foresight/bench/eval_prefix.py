"""Teacher-forced evaluation with and without the shared prefix (foresight/runtime/prefix.py), same run.

Evaluates the held-out traces of a traces folder under the given policies and budgets twice, first with
every replay running the model on every token, then with the replays of a batch reusing the forwards
before the first eviction, and reports the wall and CPU seconds of each and their ratio. The two result
tables must agree to the last digit; the command fails otherwise.

    foresight bench eval-prefix --traces runs/main/traces --holdout 0.25 --policies all --budgets 128,256
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from foresight.bench.common import threads_note
from foresight.data.trace_store import TraceStore, describe_traces, select_traces
from foresight.eval.replay import evaluate
from foresight.eval.specs import PolicySpec
from foresight.models import load_model

NAME = "eval-prefix"


@dataclass(frozen=True, kw_only=True)
class EvalPrefixSettings:
    """`traces`: a folder with labels at each budget; `holdout`: the held-out share evaluated (as
    `foresight eval`); the model is the one that made the traces, on `device` in `dtype`."""

    traces: Path
    holdout: float
    specs: list[PolicySpec]
    budgets: list[int]
    interval: int
    device: str
    dtype: torch.dtype
    command: str


def run(settings: EvalPrefixSettings) -> str:
    """Evaluate plainly, then with the shared prefix; the report's markdown section."""
    store = TraceStore(settings.traces)
    traces = list(select_traces(store, settings.holdout, 0, None))
    model, _ = load_model(store.settings["model"], device=settings.device, dtype=settings.dtype)
    timings, tables = {}, {}
    for shared in (False, True):
        wall, cpu = time.perf_counter(), time.process_time()
        result = evaluate(model, traces, settings.specs, settings.budgets, settings.interval, labels_root=settings.traces,
                          progress=False, share_prefix=shared)
        timings[shared] = (time.perf_counter() - wall, time.process_time() - cpu)
        tables[shared] = [{k: v for k, v in row.items() if k != "seconds"} for row in result.rows]
    if tables[True] != tables[False]:
        raise ValueError("the shared-prefix evaluation differs from the plain one")
    (plain_wall, plain_cpu), (shared_wall, shared_cpu) = timings[False], timings[True]
    return "\n".join([
        f"### Evaluation with the shared prefix ({torch.device(settings.device).type})", "",
        f"Command: `{settings.command}` {threads_note()}", "",
        f"{describe_traces(traces)}; {len(settings.specs)} policies; B = {', '.join(map(str, settings.budgets))}, "
        f"L = {settings.interval}. Both runs gave the same table (every figure and interval).", "",
        "| evaluation | wall s | CPU s |", "|---|---:|---:|",
        f"| every replay runs the model on every token | {plain_wall:.1f} | {plain_cpu:.1f} |",
        f"| replays share the forwards before the first eviction | {shared_wall:.1f} | {shared_cpu:.1f} |",
        f"| ratio (plain / shared) | {plain_wall / shared_wall:.2f}x | {plain_cpu / shared_cpu:.2f}x |",
    ])
