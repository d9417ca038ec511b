"""What one eviction step costs, per policy: its operations, its time and its share of decoding.

For each evicting policy and batch size, two decodes of the benchmark prompt (EOS ignored, every row
evicting together):

- counted: every eviction step run inside `StepCounts`, the operations it runs that are not views
  (`DeviceOps`, counted eagerly, one per aten operation: on a GPU each launches at least one kernel, so
  the count bounds a launch-bound step) and the device values it reads back (`HostReads`);
- timed, with no counter: the milliseconds of one eviction step and the eviction share, the time in
  eviction steps over the time in forwards and eviction steps (`RunStats.eviction_share`, the device's
  seconds: CUDA events on a GPU), the same figure `foresight bench decode` reports.

The last column divides each policy's eviction share by SnapKV's at the same batch size, in the same run:
the ratio a loaded machine leaves intact.

    foresight bench eviction-step --scorer checkpoints/default --batch-sizes 1,4
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from foresight.bench.common import (
    LEARNED,
    RuntimeSettings,
    budget_field,
    interval_field,
    load_benchmark_model,
    machine,
    prompt_ids,
    threads_note,
)
from foresight.bench.pipeline import StepCounts
from foresight.models import describe
from foresight.runtime.engine import EvictionEngine

NAME = "eviction-step"
REFERENCE = "snapkv"  # the shares are divided by this policy's


@dataclass(frozen=True, kw_only=True)
class Settings(RuntimeSettings):
    policies: str = field(
        default=f"{REFERENCE},h2o,tova,{LEARNED}",
        metadata={"help": "comma-separated evicting policies ('all': every one that needs no labels)"},
    )
    budget: int = budget_field()
    interval: int = interval_field()
    max_new_tokens: int = field(
        default=512, metadata={"help": "tokens decoded by each timed run (EOS ignored); its eviction steps are timed"}
    )
    counted_steps: int = field(default=3, metadata={"help": "eviction steps of each counted run"})
    batch_sizes: tuple[int, ...] = field(default=(1, 4), metadata={"help": "comma-separated batch sizes"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.counted_steps < 1:
            raise ValueError(f"--counted-steps {self.counted_steps} must be at least 1")


@dataclass(frozen=True)
class StepCost:
    """One policy at one batch size: per eviction step its operations and host reads (counted run), its
    milliseconds, and the run's eviction share (timed run)."""

    policy: str
    batch: int
    ops: float
    reads: float
    step_ms: float
    steps: int
    share: float


def run(settings: Settings) -> str:
    """Count and time the eviction steps of every evicting policy at every batch size; the report's section."""
    model, tokenizer = load_benchmark_model(settings)
    prompt = prompt_ids(tokenizer, model.config.vocab_size)
    scorer = settings.learned_scorer(model)
    config = settings.eviction
    first = max(config.budget + config.interval - len(prompt), 0)  # tokens fed after the prompt at the first step
    if settings.max_new_tokens < first + 1:
        raise ValueError(f"--max-new-tokens {settings.max_new_tokens} must exceed {first}: the first eviction step")
    counted_tokens = first + (settings.counted_steps - 1) * config.interval + 1
    costs = []
    names = [name for name in settings.policy_names if name != "full"]
    with tqdm(total=2 * len(names) * len(settings.batch_sizes), desc="eviction steps", leave=False) as bar:
        for batch in settings.batch_sizes:
            for name in names:
                counts = StepCounts()
                engine = EvictionEngine(model, settings.policy(name, scorer), config, step_observer=counts)
                counted = engine.generate([prompt] * batch, counted_tokens).stats.evictions
                reads, ops = counts.per_step(counted)
                bar.update()
                stats = (
                    EvictionEngine(model, settings.policy(name, scorer), config)
                    .generate([prompt] * batch, settings.max_new_tokens)
                    .stats
                )
                step_ms = 1000 * stats.eviction_seconds / max(stats.evictions, 1)
                costs.append(StepCost(name, batch, ops, reads, step_ms, stats.evictions, stats.eviction_share))
                bar.update()
    return _report(settings, costs, describe(model), model.dtype)


def _report(settings: Settings, costs: list[StepCost], shape, dtype) -> str:
    reference = {cost.batch: cost.share for cost in costs if cost.policy == REFERENCE}
    lines = [
        f"### Eviction step cost ({settings.run_device})",
        "",
        f"Command: `{settings.command}` {threads_note()}",
        "",
        f"Model {settings.model} ({shape}), {dtype}, on {machine(settings.run_device)}; B = {settings.budget}, "
        f"L = {settings.interval}, every row evicting together. Operations (not views, counted eagerly by "
        "`DeviceOps`) and host reads (`HostReads`) per eviction step over a run of "
        f"{settings.counted_steps} steps; ms per eviction step and the eviction share (eviction steps' time over "
        f"forwards' and eviction steps') from a run of {settings.max_new_tokens} new tokens with no counter; "
        f"the last column: the share over {REFERENCE}'s at the same batch size, this run." + settings.scorer_note(),
        "",
        "| policy | batch | ops per step | host reads per step | ms per step | steps timed | evict share | "
        f"share / {REFERENCE}'s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cost in costs:
        ratio = f"{cost.share / reference[cost.batch]:.2f}" if reference.get(cost.batch) else "–"
        lines.append(
            f"| {cost.policy} | {cost.batch} | {cost.ops:,.0f} | {cost.reads:.1f} | {cost.step_ms:.2f} | {cost.steps} "
            f"| {100 * cost.share:.2f}% | {ratio} |"
        )
    return "\n".join(lines) + "\n"
