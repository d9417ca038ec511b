"""Held-out comparison of a reinforced scorer with the supervised scorer it started from, paired over traces.

Every held-out trace is replayed once per scorer with the learned `foresight` policy in deterministic
mode at the B and L the scorers were trained for, on the cadence of `foresight eval` (batches prefill
the same min(B + L, shortest prompt) tokens); with `--sampled-seeds N`, also N times per scorer in
sampled mode (Eq. 2 at `--sample-temperature`, the policy GRPO trains), each trace's sums the mean
of its N replays, each replay seeded by (seed, trace) as `foresight eval` seeds them. Per trace and scorer, over the predictions after the
first eviction (`foresight.metrics`, the functions `foresight eval` and the reward use): Σ NLL with
eviction, Σ NLL with the full cache (stored with the trace), and the low-entropy damage counts. The
forwards before the first eviction run once per batch of traces, shared by every replay of that batch
(both scorers, both modes, every seed), as `foresight eval` shares them between policies.

Figures pool tokens over traces, as `foresight eval` does: −R = Σ ΔL²·1[ΔL > 1.5] / number of
bottom-80%-entropy tokens (minus the reward of docs/algorithms.md §7), loss ratio, damaged share. 95%
intervals: paired bootstrap over traces (resample the traces with replacement; both scorers on the
same resample), percentile intervals, also for the relative change of −R and the loss-ratio
difference. The report goes to a section of runs/studies/rl-heldout.md; per-trace figures to --results (JSON:
the scorers' SHA-256, B, L, the traces folder and {mode: {scorer: [per-trace figures]}}).

`--pool FILE` adds the per-trace figures of earlier runs' --results to this run's (or stands for it, without
--traces), so one comparison can span trace folders replayed in separate processes or sessions: every file
must compare the same two scorers by content at the same B and L, and no trace may be counted twice.

    python -m studies rl-heldout --traces runs/rl-default/traces --holdout 0.4 \\
        --scorer supervised=checkpoints/default --scorer reinforced=runs/rl-default/rl/scorer
    python -m studies rl-heldout --traces DIR --exclude 0,4,5 ...   # every trace but those trained on
    python -m studies rl-heldout ... --sampled-seeds 8 --sample-temperature 0.005   # and the sampled policy
    python -m studies rl-heldout --scorer ... --pool gsm.json --pool b.json --pool c.json   # pooled
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from foresight.artifacts import write_text
from foresight.bench.common import PlacedSettings, scorer_field
from foresight.data.trace_store import TraceStore, select_traces
from foresight.eval.specs import split_scorer, trace_seed
from foresight.metrics import loss_ratio, low_entropy_damage, scored_tokens
from foresight.models import load_model
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.prefix import ReplayPrefix
from foresight.scorer.model import load_scorer, weights_digest
from studies import COMMAND as COMMAND  # how its report names it, where it goes
from studies import REPORTS as REPORTS

NAME = "rl-heldout"
FIELDS = ("evicted_nll", "full_nll", "low_entropy", "damaged", "squared_sum")


@dataclass(frozen=True, kw_only=True)
class Settings(PlacedSettings):
    """The model is the one that made the traces."""

    traces: Path | None = field(
        default=None, metadata={"help": "traces folder (`foresight traces`) to replay; optional with --pool"}
    )
    holdout: float | None = field(
        default=None,
        metadata={"help": "evaluate the held-out split of this share (the one both training stages left out)"},
    )
    exclude: str | None = field(
        default=None, metadata={"help": "comma-separated trace indices to leave out (traces a stage trained on)"}
    )
    holdout_seed: int = field(default=0, metadata={"help": "seed of the held-out split"})
    scorer: tuple[str, ...] = scorer_field(
        "exactly two, each NAME=: the supervised scorer first, then the reinforced one", required=True
    )
    batch_size: int = field(default=4, metadata={"help": "traces replayed together"})
    resamples: int = field(default=10000, metadata={"help": "bootstrap resamples"})
    sampled_seeds: int = field(
        default=0,
        metadata={
            "help": "also compare the sampled policies (Eq. 2), each trace's figures the mean of N seeded replays",
            "metavar": "N",
        },
    )
    sample_temperature: float = field(
        default=1.0, metadata={"help": "τ of the sampled policies (the rollouts' model.temperature)", "metavar": "T"}
    )
    results: Path | None = field(
        default=None, metadata={"help": "also write the per-trace figures as JSON to this file"}
    )
    pool: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "pool the per-trace figures of an earlier run's --results with this run's (repeatable)",
            "metavar": "RESULTS.json",
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.scorer) != 2 or any(name is None for name, _ in map(split_scorer, self.scorer)):
            raise ValueError(
                "give exactly two --scorer NAME=DIR_OR_HUB_ID: the supervised one, then the reinforced one"
            )
        if self.sampled_seeds < 0 or not 0 < self.sample_temperature < float("inf"):
            raise ValueError(
                f"--sampled-seeds must be at least 0 and --sample-temperature a finite number > 0, got "
                f"{self.sampled_seeds} and {self.sample_temperature}"
            )
        if self.traces is None and not self.pool:
            raise ValueError("give --traces DIR to replay, or --pool RESULTS.json of earlier runs, or both")
        self.excluded  # a bad index list is refused before any model loads

    @property
    def scorers(self) -> tuple[tuple[str, str], ...]:
        """(name, folder or Hub id) of the supervised scorer, then of the reinforced one."""
        return tuple(split_scorer(text) for text in self.scorer)

    @property
    def excluded(self) -> set[int]:
        try:
            return {int(index) for index in (self.exclude or "").split(",") if index.strip()}
        except ValueError:
            raise ValueError(f"--exclude {self.exclude!r} must be comma-separated trace indices, e.g. 0,4,5") from None


def per_trace(
    model,
    scorer,
    traces,
    batch_size: int,
    seed: int | None = None,
    temperature: float = 1.0,
    prefixes: dict[int, ReplayPrefix] | None = None,
) -> list[dict[str, float]]:
    """Σ NLL with eviction and with the full cache, and the damage counts, of every trace: under the
    deterministic policy, or (`seed` given) the sampled one at `temperature`, each trace drawing from its
    own generator seeded by (seed, trace index). `prefixes`: per batch (its first trace's position), the
    forwards before the first eviction, recorded by the first replay of the batch and reused by every
    later one (`foresight.runtime.prefix`: the same figures, the model run once on those tokens)."""
    config = scorer.config
    cadence = EvictionConfig(config.budget, config.interval, sinks=0, protect_prompt=False)
    rows = []
    for start in tqdm(range(0, len(traces), batch_size), desc=f"replays B={config.budget}", unit="batch"):
        batch = traces[start : start + batch_size]
        if seed is None:
            policy = make_policy("foresight", scorer=scorer)
        else:
            seeds = tuple(trace_seed(seed, trace.index) for trace in batch)
            policy = make_policy("foresight", scorer=scorer, mode="sampled", temperature=temperature, row_seeds=seeds)
        prefill = min(config.budget + config.interval, *(t.prompt_length for t in batch))
        prefix = None if prefixes is None else prefixes.setdefault(start, ReplayPrefix())
        output = EvictionEngine(model, policy, cadence).replay(
            [t.input_ids for t in batch], [prefill] * len(batch), prefix=prefix
        )
        for trace, nll, first in zip(batch, output.nll, output.first_eviction):
            scored = scored_tokens(nll.numel(), first)
            damage = low_entropy_damage(nll[scored], trace.token_nll[scored], trace.token_entropy[scored])
            rows.append(
                {
                    "trace": trace.index,
                    "evicted_nll": float(nll[scored].double().sum()),
                    "full_nll": float(trace.token_nll[scored].double().sum()),
                    "low_entropy": damage.low_entropy,
                    "damaged": damage.damaged,
                    "squared_sum": damage.squared_sum,
                    "loss_ratio": loss_ratio(nll[scored], trace.token_nll[scored]),
                }
            )
    return rows


def pooled(sums: np.ndarray) -> dict[str, np.ndarray]:
    """Pooled figures from summed fields [..., 5] (FIELDS order)."""
    evicted, full, low, damaged, squared = np.moveaxis(sums, -1, 0)
    return {"penalty": squared / low, "loss_ratio": evicted / full, "damage": damaged / low}


def run(settings: Settings) -> str:
    """Replay the held-out traces under both scorers (and pool earlier runs' figures); the report's markdown
    section."""
    names = [name for name, _ in settings.scorers]
    scorers = [load_scorer(folder) for _, folder in settings.scorers]
    if len({(s.config.budget, s.config.interval) for s in scorers}) != 1:
        raise ValueError("the two scorers were trained for different B, L")
    config = scorers[0].config
    identity = {
        "scorers": {name: weights_digest(scorer) for name, scorer in zip(names, scorers)},
        "budget": config.budget,
        "interval": config.interval,
    }
    parts = [_pooled_part(Path(path), identity) for path in settings.pool]
    seconds = None
    if settings.traces is not None:
        started = time.perf_counter()
        part = {**identity, **_replayed(settings, names, scorers)}
        seconds = time.perf_counter() - started
        if settings.results is not None:
            write_text(settings.results, json.dumps(part, indent=1))
        parts.insert(0, part)
    modes = _pooled_modes(parts, names)
    low_entropy = int(sum(row["low_entropy"] for row in modes["deterministic"][names[0]]))
    sets = ", ".join(f"{len(part['modes']['deterministic'][names[0]])} of {part['source']}" for part in parts)
    timing = "" if seconds is None else f" Replays took {seconds:.0f} s."
    lines = [
        f"### Reinforced against supervised scorer on held-out traces ({parts[0]['device']})",
        "",
        f"Command: `{settings.command}`",
        "",
        f"{len(modes['deterministic'][names[0]])} held-out traces ({sets}; {low_entropy} "
        f"low-entropy tokens after the first eviction), never used by either stage (held out, or outside what the "
        f"stages read); B = {config.budget}, L = {config.interval}; 95% paired bootstrap intervals over traces "
        f"({settings.resamples} resamples).{timing}",
    ]
    for mode, rows in modes.items():
        lines += ["", *_comparison(mode, names, rows, settings.resamples)]
    return "\n".join(lines)


def _replayed(settings: Settings, names: list[str], scorers: list) -> dict[str, object]:
    """This run's part: its traces folder and source, and the per-trace figures of every mode and scorer."""
    config = scorers[0].config
    store = TraceStore(settings.traces)
    minimum = config.budget + config.interval + 2
    traces = [
        t
        for t in select_traces(store, settings.holdout, settings.holdout_seed, None)
        if t.input_ids.numel() >= minimum and t.index not in settings.excluded
    ]
    model, _ = load_model(store.settings["model"], device=settings.run_device, dtype=settings.run_dtype)
    prefixes: dict[int, ReplayPrefix] = {}  # every replay of a batch shares its forwards before the first eviction
    modes = {
        "deterministic": {
            name: per_trace(model, scorer, traces, settings.batch_size, prefixes=prefixes)
            for name, scorer in zip(names, scorers)
        }
    }
    if settings.sampled_seeds:
        sampled = f"sampled (τ = {settings.sample_temperature}, mean of {settings.sampled_seeds} seeds)"
        modes[sampled] = {
            name: _mean_rows(
                [
                    per_trace(model, scorer, traces, settings.batch_size, seed, settings.sample_temperature, prefixes)
                    for seed in range(settings.sampled_seeds)
                ]
            )
            for name, scorer in zip(names, scorers)
        }
    return {
        "traces": str(settings.traces),
        "source": store.settings["source"],
        "device": model.device.type,
        "modes": modes,
    }


def _pooled_part(path: Path, identity: dict[str, object]) -> dict[str, object]:
    """An earlier run's --results, refused unless it compares the same two scorers (by SHA-256) at the same B, L."""
    try:
        part = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--pool {path}: not a readable JSON file ({error})") from None
    if not isinstance(part, dict) or "modes" not in part:
        raise ValueError(f"--pool {path}: no per-trace figures with scorer digests; rerun it with --results")
    seen = {key: part.get(key) for key in identity}
    if seen != identity:
        raise ValueError(f"--pool {path} compares {seen}, not this run's {identity}")
    return part


def _pooled_modes(parts: list[dict[str, object]], names: list[str]) -> dict[str, dict[str, list[dict[str, float]]]]:
    """The per-trace rows of every part, concatenated per mode and scorer: the modes every part has, each trace
    (its folder and index) once."""
    counted: set[tuple[str, int]] = set()
    for part in parts:
        for row in part["modes"]["deterministic"][names[0]]:
            trace = (part["traces"], int(row["trace"]))
            if trace in counted:
                raise ValueError(f"trace {trace[1]} of {trace[0]} is in two pooled runs; pool each trace once")
            counted.add(trace)
    shared = [mode for mode in parts[0]["modes"] if all(mode in part["modes"] for part in parts)]
    return {
        mode: {name: [row for part in parts for row in part["modes"][mode][name]] for name in names} for mode in shared
    }


def _mean_rows(replays: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per trace, the mean of each figure over several replays of the same traces."""
    return [
        {name: float(np.mean([rows[i][name] for rows in replays])) for name in replays[0][i]}
        for i in range(len(replays[0]))
    ]


def _comparison(mode: str, names: list[str], rows: dict[str, list[dict[str, float]]], resamples: int) -> list[str]:
    """The table and the paired changes of the second scorer against the first under one policy mode."""
    sums = np.array([[[row[field] for field in FIELDS] for row in rows[name]] for name in names])  # [2, traces, 5]
    picks = np.random.default_rng(0).integers(0, sums.shape[1], size=(resamples, sums.shape[1]))
    samples = pooled(sums[:, picks].sum(2))  # each figure [2, resamples]
    point = pooled(sums.sum(1))
    change = samples["penalty"][1] / samples["penalty"][0] - 1
    difference = samples["loss_ratio"][1] - samples["loss_ratio"][0]
    lines = [
        f"**{mode} policy**",
        "",
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
    return lines + [
        "",
        f"Change of −R, {names[1]} against {names[0]}: {point_change:+.1%} [{change_low:+.1%}, "
        f"{change_high:+.1%}] (target: −20% or lower). Loss-ratio difference: {point_difference:+.4f} "
        f"[{difference_low:+.4f}, {difference_high:+.4f}] (target: at most +0.005).",
    ]


def _interval(values: np.ndarray) -> np.ndarray:
    """The 95% percentile interval of bootstrap samples."""
    return np.percentile(values, [2.5, 97.5])
