"""Held-out comparison of a reinforced scorer with the supervised scorer it started from, paired over traces.

Every held-out trace is replayed once per scorer with the learned `foresight` policy in deterministic
mode at the B and L the scorers were trained for, on the cadence of `foresight eval` (batches prefill
the same min(B + L, shortest prompt) tokens). Per trace and scorer, over the predictions after the
first eviction (`foresight.metrics`, the functions `foresight eval` and the reward use): Σ NLL with
eviction, Σ NLL with the full cache (stored with the trace), and the low-entropy damage counts.

Figures pool tokens over traces, as `foresight eval` does: −R = Σ ΔL²·1[ΔL > 1.5] / number of
bottom-80%-entropy tokens (minus the reward of docs/algorithms.md §7), loss ratio, damaged share. 95%
intervals: paired bootstrap over traces (resample the traces with replacement; both scorers on the
same resample), percentile intervals, also for the relative change of −R and the loss-ratio
difference. The report goes to a section of docs/benchmarks.md; per-trace figures to --results.

    foresight bench rl-heldout --traces runs/rl-default/traces --holdout 0.4 \\
        --scorer supervised=checkpoints/default --scorer reinforced=runs/rl-default/rl/scorer
    foresight bench rl-heldout --traces DIR --exclude 0,4,5 ...   # every trace but those trained on
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from foresight.artifacts import write_text
from foresight.data.trace_store import TraceStore, select_traces
from foresight.metrics import loss_ratio, low_entropy_damage, scored_tokens
from foresight.models import load_model
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.scorer.model import load_scorer

NAME = "rl-heldout"
FIELDS = ("evicted_nll", "full_nll", "low_entropy", "damaged", "squared_sum")


@dataclass(frozen=True, kw_only=True)
class RlHeldoutSettings:
    """`scorers`: (name, folder or Hub id) of the supervised scorer, then of the reinforced one;
    `holdout`/`holdout_seed`: the held-out split both stages left out (None: every trace);
    `exclude`: trace indices a stage trained on; `results`: also write per-trace figures (JSON) there."""

    traces: Path
    scorers: tuple[tuple[str, str], tuple[str, str]]
    holdout: float | None
    holdout_seed: int
    exclude: set[int]
    batch_size: int
    resamples: int
    device: str
    dtype: torch.dtype
    results: Path | None
    command: str


def per_trace(model, scorer, traces, batch_size: int) -> list[dict[str, float]]:
    """Σ NLL with eviction and with the full cache, and the damage counts, of every trace."""
    config = scorer.config
    engine = EvictionEngine(model, make_policy("foresight", scorer=scorer),
                            EvictionConfig(config.budget, config.interval, sinks=0, protect_prompt=False))
    rows = []
    for start in tqdm(range(0, len(traces), batch_size), desc=f"replays B={config.budget}", unit="batch"):
        batch = traces[start : start + batch_size]
        prefill = min(config.budget + config.interval, *(t.prompt_length for t in batch))
        output = engine.replay([t.input_ids for t in batch], [prefill] * len(batch))
        for trace, nll, first in zip(batch, output.nll, output.first_eviction):
            scored = scored_tokens(nll.numel(), first)
            damage = low_entropy_damage(nll[scored], trace.token_nll[scored], trace.token_entropy[scored])
            rows.append({
                "trace": trace.index, "evicted_nll": float(nll[scored].double().sum()),
                "full_nll": float(trace.token_nll[scored].double().sum()), "low_entropy": damage.low_entropy,
                "damaged": damage.damaged, "squared_sum": damage.squared_sum,
                "loss_ratio": loss_ratio(nll[scored], trace.token_nll[scored]),
            })
    return rows


def pooled(sums: np.ndarray) -> dict[str, np.ndarray]:
    """Pooled figures from summed fields [..., 5] (FIELDS order)."""
    evicted, full, low, damaged, squared = np.moveaxis(sums, -1, 0)
    return {"penalty": squared / low, "loss_ratio": evicted / full, "damage": damaged / low}


def run(settings: RlHeldoutSettings) -> str:
    """Replay the held-out traces under both scorers and compare them; the report's markdown section."""
    names = [name for name, _ in settings.scorers]
    scorers = [load_scorer(folder) for _, folder in settings.scorers]
    if len({(s.config.budget, s.config.interval) for s in scorers}) != 1:
        raise ValueError("the two scorers were trained for different B, L")
    config = scorers[0].config
    store = TraceStore(settings.traces)
    minimum = config.budget + config.interval + 2
    traces = [
        t for t in select_traces(store, settings.holdout, settings.holdout_seed, None)
        if t.input_ids.numel() >= minimum and t.index not in settings.exclude
    ]
    model, _ = load_model(store.settings["model"], device=settings.device, dtype=settings.dtype)
    started = time.perf_counter()
    rows = {name: per_trace(model, scorer, traces, settings.batch_size) for name, scorer in zip(names, scorers)}
    seconds = time.perf_counter() - started
    sums = np.array([[[row[field] for field in FIELDS] for row in rows[name]] for name in names])  # [2, traces, 5]
    picks = np.random.default_rng(0).integers(0, len(traces), size=(settings.resamples, len(traces)))
    samples = pooled(sums[:, picks].sum(2))  # each figure [2, resamples]
    point = pooled(sums.sum(1))
    change = samples["penalty"][1] / samples["penalty"][0] - 1
    difference = samples["loss_ratio"][1] - samples["loss_ratio"][0]
    lines = [
        f"### Reinforced against supervised scorer on held-out traces ({model.device.type})", "",
        f"Command: `{settings.command}`", "",
        f"{len(traces)} held-out traces of {store.settings['source']} ({int(sums[0, :, 2].sum())} "
        f"low-entropy tokens after the first eviction), never used by either stage (held out, or outside what the stages read); B = {config.budget}, "
        f"L = {config.interval}, deterministic policy; 95% paired bootstrap intervals over traces "
        f"({settings.resamples} resamples). Replays took {seconds:.0f} s.", "",
        "| scorer | −R (ΔL²·1[ΔL > 1.5], mean over low-entropy tokens) | loss ratio | damaged share |",
        "|---|---:|---:|---:|",
    ]
    for index, name in enumerate(names):
        cells = []
        for figure, fmt in (("penalty", "{:.4f}"), ("loss_ratio", "{:.4f}"), ("damage", "{:.2%}")):
            low, high = _interval(samples[figure][index])
            cells.append(f"{fmt.format(point[figure][index])} [{fmt.format(low)}, {fmt.format(high)}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    point_change = point["penalty"][1] / point["penalty"][0] - 1
    point_difference = point["loss_ratio"][1] - point["loss_ratio"][0]
    (change_low, change_high), (difference_low, difference_high) = _interval(change), _interval(difference)
    lines += [
        "",
        f"Change of −R, {names[1]} against {names[0]}: {point_change:+.1%} [{change_low:+.1%}, "
        f"{change_high:+.1%}] (target: −20% or lower). Loss-ratio difference: {point_difference:+.4f} "
        f"[{difference_low:+.4f}, {difference_high:+.4f}] (target: at most +0.005).",
    ]
    if settings.results is not None:
        write_text(settings.results, json.dumps(rows, indent=1))
    return "\n".join(lines)


def _interval(values: np.ndarray) -> np.ndarray:
    """The 95% percentile interval of bootstrap samples."""
    return np.percentile(values, [2.5, 97.5])
