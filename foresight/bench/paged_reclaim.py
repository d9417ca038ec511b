"""What a paged KV allocator would reclaim of the entries each policy evicts (docs/serving.md).

A paged engine stores a sequence's cache in fixed-size pages and can return a page to the pool only
when none of its slots is still needed; eviction frees memory only as far as it empties whole pages.
This benchmark replays stored traces under every policy (batch of one, on the cadence of `foresight
eval`: the golden prefill, or the true prompt for policies that protect it) and measures it.

Definition. A time point is the moment right after an eviction step of a replay, for every step of
every trace that evicts at that budget. At a time point the sequence has written positions 0..T-1
(T = newest position + 1) in every layer and KV head; an entry is one position's key and value in one
(layer, KV head); it is kept when that head still holds the position, evicted otherwise. Page k covers
the positions kP..kP+P-1 and exists once all of them are written (k < floor(T / P)); the page that holds
the newest position is never free. Three layouts:

- sequence pages (vLLM's and TensorRT-LLM's today: one block table per sequence, whose block ids index
  every layer's cache): a page holds its P positions of every layer and KV head; it is freed when every
  (layer, KV head) has evicted all of them, freeing P x layers x Hkv entries;
- layer pages (a block table per layer): a page holds its P positions of one layer for all Hkv KV heads;
  it is freed when every head of the layer has evicted all of them, freeing P x Hkv entries;
- (layer, head) pages (a block table per layer and KV head): a page holds its P positions of one
  (layer, KV head); it is freed when that head has evicted all of them, freeing P entries.

Reclaimed share = entries in freed pages / evicted entries, summed over layers and KV heads (the
per-head ideal, every evicted entry freed, is 1). Held / kept = entries in pages not freed / kept entries
(the ideal is 1: memory equals what is kept). Both are computed at every time point and reported as the
mean over time points, each weighing one (so longer traces weigh more). A (layer, head) page is freed
whenever the layer page that contains it is, and a layer page whenever the sequence page that contains it
is, so each layout reclaims at least as much as the one before.

The state right after step t is read at the next moment the cache can be seen: in the policy's
`step_keep_scores` before step t + 1, or from the cache at the end of the replay. Only the positions up to
step t's newest are taken (the newest at step t's own `step_keep_scores`): what a head holds of them then is
exactly what step t kept, since nothing is evicted between steps and the positions written since are newer.

    foresight bench paged-reclaim --traces runs/r21/unseen --policies all --budgets 128,256 \\
        --page-sizes 16,32,64 --scorer checkpoints/default
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from foresight.artifacts import atomic_file
from foresight.bench.common import (
    PlacedSettings,
    budgets_field,
    interval_field,
    option_field,
    policies_field,
    regime_field,
    scorer_field,
    traces_field,
)
from foresight.cadence import Regime, check_budget
from foresight.data.trace_store import Trace, TraceStore, describe_traces, select_traces
from foresight.eval.replay import Cadence
from foresight.eval.specs import PolicySpec, policy_specs
from foresight.labels import GoldenLabels, LabelStore
from foresight.models import dtype_name, load_model
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.policy import EvictionContext, Policy

NAME = "paged-reclaim"
LAYOUTS = ("sequence pages", "layer pages", "(layer, head) pages")


@dataclass(frozen=True, kw_only=True)
class Settings(PlacedSettings):
    """The model is the one that made the traces; the policies that do not evict are skipped."""

    traces: Path = traces_field("traces folder (`foresight traces`), labels where golden runs")
    holdout: float | None = field(
        default=None,
        metadata={"help": "replay only the held-out split of this share, as `foresight eval` (default: every trace)"},
    )
    policies: str = policies_field(
        "every registered policy that evicts; golden where labels exist, foresight with --scorer"
    )
    scorer: tuple[str, ...] = scorer_field("replayed at the B and L it was trained for; repeat for several")
    option: tuple[str, ...] = option_field()
    budgets: tuple[int, ...] = budgets_field((128, 256))
    interval: int = interval_field()
    regime: Literal["streaming", "decode"] = regime_field()
    page_sizes: tuple[int, ...] = field(
        default=(16, 32, 64), metadata={"help": "page sizes P (positions per page), comma-separated"}
    )
    plot: Path | None = field(
        default=None,
        metadata={"help": "PNG of the reclaimed share against page size (default: SECTION.png beside the report)"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for size in self.page_sizes:
            if size < 1:
                raise ValueError(f"page size {size} must be a positive number of positions")
        for budget in self.budgets:
            check_budget(budget, self.interval)

    @property
    def plot_path(self) -> Path:
        return self.plot or self.report.parent / f"{section(self)}.png"


def section(settings: Settings) -> str:
    """--section, or paged-reclaim: the name of the report's section and of its plot."""
    return settings.section or NAME


@dataclass(frozen=True)
class Reclaim:
    """Entry counts of one time point, summed over layers and KV heads; `freed` in LAYOUTS order."""

    kept: int
    evicted: int
    freed: tuple[int, int, int]

    @property
    def shares(self) -> tuple[float, ...]:
        """Entries in freed pages / evicted entries, per layout."""
        return tuple(freed / self.evicted for freed in self.freed)

    @property
    def held_per_kept(self) -> tuple[float, ...]:
        """Entries in pages not freed / kept entries, per layout."""
        return tuple((self.kept + self.evicted - freed) / self.kept for freed in self.freed)


def held_mask(positions: torch.Tensor) -> torch.Tensor:
    """[layers, Hkv, T] True where a head holds the position, of the positions [layers, Hkv, N] a cache
    holds (-1: an empty slot); T is the newest position + 1."""
    length = int(positions.max()) + 1
    held = torch.zeros(*positions.shape[:-1], length + 1, dtype=torch.bool, device=positions.device)
    held.scatter_(-1, torch.where(positions < 0, length, positions), True)  # empty slots land in the extra column
    return held[..., :length]


def page_reclaim(held: torch.Tensor, page_size: int) -> Reclaim:
    """What each layout frees at one time point of `held` [layers, Hkv, T] (the module's definition)."""
    layers, heads, pages = held.shape[0], held.shape[1], held.shape[-1] // page_size
    free = (~held[..., : pages * page_size]).unflatten(-1, (pages, page_size)).all(-1)  # [layers, Hkv, pages]
    kept = int(held.sum())
    freed = (int(free.all(1).all(0).sum()) * layers * heads, int(free.all(1).sum()) * heads, int(free.sum()))
    return Reclaim(kept=kept, evicted=held.numel() - kept, freed=tuple(count * page_size for count in freed))


class HeldPositions:
    """`policy` with every call passed through, noting at each eviction step the positions every
    (layer, KV head) holds before the step ([layers, Hkv, N] on the CPU); `reset`, at the start of a run,
    forgets them. Replays run one trace at a time, so the context's batch row is the trace."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.steps: list[list[torch.Tensor]] = []

    def __getattr__(self, name: str) -> Any:
        if name == "policy":  # not set yet (copying): no delegation
            raise AttributeError(name)
        return getattr(self.policy, name)

    def reset(self) -> None:
        self.steps = []
        self.policy.reset()

    def step_keep_scores(self, contexts: Sequence[EvictionContext]) -> torch.Tensor:
        self.steps.append(
            [context.positions[0].to("cpu", copy=True) for context in contexts]
        )  # a copy: the context holds the cache's own storage
        return self.policy.step_keep_scores(contexts)


def held_after_steps(
    model: torch.nn.Module,
    spec: PolicySpec,
    trace: Trace,
    budget: int,
    interval: int,
    labels: GoldenLabels | None,
    regime: Regime | str = Regime.STREAMING,
) -> list[torch.Tensor]:
    """The held masks [layers, Hkv, T] right after every eviction step of one replay in `regime` (none if it never
    evicts)."""
    recorder = HeldPositions(spec.build(None if labels is None else [labels]))
    cadence = Cadence(budget, interval, Regime.parse(regime))
    engine = EvictionEngine(model, recorder, spec.config(cadence.eviction))  # type: ignore[arg-type]  # a Policy by delegation
    prefill = cadence.prefill_lengths([trace], engine.protect_prompt)
    engine.replay([trace.input_ids], prefill)
    if not recorder.steps:
        return []
    final = torch.stack([layer.entry_positions()[0].cpu() for layer in engine.last_cache.layers])
    readings = [*map(torch.stack, recorder.steps), final]  # before every step, then at the end
    return [held_mask(after)[..., : int(before.max()) + 1] for before, after in pairwise(readings)]


def run(settings: Settings) -> str:
    """Replay every trace under every policy and budget; the report's markdown section (and the plot)."""
    chosen, notes = policy_specs(settings.policies, list(settings.scorer), settings.option)
    store = TraceStore(settings.traces)
    traces = list(select_traces(store, settings.holdout, 0, None))
    model, _ = load_model(store.settings["model"], device=settings.run_device, dtype=settings.run_dtype)
    notes += [f"{spec.name}: never evicts, nothing to reclaim" for spec in chosen if not spec.evicts]
    specs = [spec for spec in chosen if spec.evicts]
    figures: dict[tuple[str, int, int], list[Reclaim]] = defaultdict(list)
    for budget in settings.budgets:
        eligible = [t for t in traces if t.input_ids.numel() >= budget + settings.interval]
        if len(eligible) < len(traces):
            notes.append(f"B={budget}: skipped {len(traces) - len(eligible)} traces shorter than B + L")
        labels = _labels(settings.traces, eligible, budget, settings.interval, settings.regime)
        for spec in specs:
            reason = _skip_reason(spec, budget, settings.interval, labels is not None)
            if reason:
                notes.append(reason)
                continue
            never = 0
            for trace in tqdm(eligible, desc=f"B={budget} {spec.name}", unit="trace"):
                golden = labels[trace.index] if spec.needs_labels else None
                states = held_after_steps(model, spec, trace, budget, settings.interval, golden, settings.regime)
                never += not states
                for held in states:
                    for size in settings.page_sizes:
                        figures[spec.name, budget, size].append(page_reclaim(held, size))
            if never:
                notes.append(
                    f"B={budget}: {spec.name} never evicted on {never} trace(s) (too short for its cadence, "
                    "e.g. after a protected prompt); left out"
                )
    order = {spec.name: index for index, spec in enumerate(specs)}
    rows = [_row(key, figures[key]) for key in sorted(figures, key=lambda key: (order[key[0]], *key[1:]))]
    if not rows:
        raise ValueError(f"nothing evicted in {settings.traces} at B={list(settings.budgets)}: " + "; ".join(notes))
    plot_reclaim(rows, settings.plot_path, settings.interval)
    described = (
        f"{describe_traces(traces)}; L = {settings.interval}. Mean over the time points right after every eviction "
        "step of every trace (foresight/bench/paged_reclaim.py states the definition): the share of the evicted "
        "entries' memory a paged allocator frees when a page holds P consecutive positions of every layer and KV head "
        "(sequence pages: vLLM's and TensorRT-LLM's block tables today), of one layer for all its KV heads (layer "
        "pages) or of one (layer, KV head); and the memory it still holds per kept entry (1 = the budget's memory)."
    )
    return "\n".join(
        [
            f"### Paged-allocator reclaim of evicted entries ({torch.device(settings.run_device).type}, "
            f"{dtype_name(settings.run_dtype)})",
            "",
            f"Command: `{settings.command}`",
            "",
            described,
            "",
            *_table(rows),
            "",
            *(f"- {note}" for note in notes),
            *([""] if notes else []),
            f"Plot: `{settings.plot_path}`.",
        ]
    )


def _table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The markdown table: per row its reclaimed shares, then its held / kept, in LAYOUTS order."""
    header = [
        "policy",
        "B",
        "page size P",
        "time points",
        *(f"reclaimed, {layout}" for layout in LAYOUTS),
        *(f"held / kept, {layout}" for layout in LAYOUTS),
    ]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for row in rows:
        cells = [
            row["policy"],
            row["budget"],
            row["page_size"],
            row["time_points"],
            *(f"{share:.1%}" for share in row["shares"]),
            *(f"{held:.2f}" for held in row["held"]),
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def _labels(
    traces_dir: Path, traces: Sequence[Trace], budget: int, interval: int, regime: str
) -> dict[int, GoldenLabels] | None:
    """The golden labels of every trace by index in `regime`, or None when some trace has none at (B, L)."""
    store = LabelStore(traces_dir, budget, interval, regime=regime)
    if not traces or not all(t.index in store for t in traces):
        return None
    return {t.index: store.load(t.index, num_tokens=t.input_ids.numel()) for t in traces}


def _skip_reason(spec: PolicySpec, budget: int, interval: int, has_labels: bool) -> str | None:
    """Why a policy is not replayed at this budget: golden has no labels for every trace, or a learned
    scorer was trained for another (B, L)."""
    if spec.needs_labels and not has_labels:
        return f"B={budget}: {spec.name} skipped (no labels for every trace at B={budget}, L={interval})"
    return spec.skip_reason(EvictionConfig(budget, interval))


def _row(key: tuple[str, int, int], points: Sequence[Reclaim]) -> dict[str, Any]:
    """One table row: the means over time points of both figures in every layout."""
    policy, budget, size = key
    return {
        "policy": policy,
        "budget": budget,
        "page_size": size,
        "time_points": len(points),
        "shares": [sum(values) / len(points) for values in zip(*(p.shares for p in points))],
        "held": [sum(values) / len(points) for values in zip(*(p.held_per_kept for p in points))],
    }


def plot_reclaim(rows: Sequence[dict[str, Any]], path: Path, interval: int) -> None:
    """Reclaimed share against page size, one line per policy; a panel per budget (rows) and layout (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    budgets = sorted({row["budget"] for row in rows})
    policies = list(dict.fromkeys(row["policy"] for row in rows))
    figure, axes = plt.subplots(
        len(budgets), len(LAYOUTS), figsize=(15, 3.5 * len(budgets)), squeeze=False, sharey=True
    )
    tab20 = plt.get_cmap("tab20").colors
    colours, markers = tab20[0::2] + tab20[1::2], "osD^v<>pPhX*"  # the ten strong colours first, as eval's plots
    sizes = sorted({row["page_size"] for row in rows})
    for (b, budget), (i, layout) in ((b, i) for b in enumerate(budgets) for i in enumerate(LAYOUTS)):
        panel = axes[b][i]
        for index, policy in enumerate(policies):
            points = sorted(
                (r["page_size"], r["shares"][i]) for r in rows if r["policy"] == policy and r["budget"] == budget
            )
            panel.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker=markers[index % len(markers)],
                color=colours[index % len(colours)],
                label=policy,
            )
        panel.set_xscale("log", base=2)
        panel.set_xticks(sizes, labels=[str(size) for size in sizes])
        panel.set_ylim(-0.02, 1.02)
        panel.set_title(f"{layout}, B={budget}, L={interval}")
        panel.set_xlabel("page size P (positions)")
        panel.set_ylabel("reclaimed share of evicted entries")
        panel.grid(alpha=0.3)
    axes[0][-1].legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.tight_layout()
    with atomic_file(path) as temporary:
        figure.savefig(temporary, dpi=120, format="png")
    plt.close(figure)
