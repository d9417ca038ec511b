"""Throughput of every stage of the pipeline on the same traces, and the share of each in the frozen model's forward.

For the traces of a folder that holds their golden labels at (B, L), one model load runs, in order:

- labels: `compute_golden_labels` of every trace (nothing written); the forward is the capture forward;
- examples: `foresight examples` into a scratch example cache (the golden replay in the eviction
  engine, the recorder and the file writes); the forward is the model's inside the engine;
- eval replay: `foresight eval`'s replay of one policy at B (the full-cache reference and the policy);
- rl rollouts: G sampled replays of every trace under a freshly initialised scorer (`roll_out_together`:
  the speed of a rollout does not depend on the scorer's weights), first with every row running the
  forwards before the group's first eviction, then with them run once on one row, then with the groups
  of `batch_size` traces of similar length in one replay; then, for a float32
  model, with a bfloat16 copy of it, its own full-cache replay of each trace included
  (`foresight rl --set model.dtype=bfloat16 --set model.loss_reference=replay`);
- step counts: the device values each eviction step reads back (`HostReads`) and the operations it
  runs (`DeviceOps`), in one replay of the first trace under the eval stage's policy, the learned
  scorer and G sampled rollout rows;
- fit: optimisation steps from that example cache as `foresight fit` runs them (the data module's
  worker processes, batches in the storage dtype cast on the device, pinned memory on CUDA, freed host
  memory kept for reuse as the training CLIs set it: `trainers.process`, which stays set for the
  process, hence last); steady state, after the run's first step.

The forward share is the time inside the model's top-level forward (a pre-hook and a hook timing it,
CUDA synchronised at both edges) over the stage's time: what is left is the stage's own work. The fit
runs no frozen model. Throughput counts the traces' tokens (each rollout's for the rollouts).

The labels have no row of before: the per-block, per-layer loops that the batched block attention and
schedule replaced live on only as the slow twins of tests/test_labels.py.

    foresight bench pipeline --traces runs/default/traces --budget 128 --interval 32 --device cuda

Size: one benchmark whose rows must come from one model load and one run, so their shares compare.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from foresight.bench.common import (
    PlacedSettings,
    budget_field,
    interval_field,
    machine,
    random_scorer,
    threads_note,
    traces_field,
)
from foresight.cadence import TraceTooShort, eviction_steps
from foresight.data.trace_store import Trace, TraceStore, describe_traces
from foresight.eval.replay import Cadence, evaluate
from foresight.eval.specs import PolicySpec, resolve_policies
from foresight.labels import compute_golden_labels
from foresight.models import dtype_name
from foresight.policies import DEFAULT_POLICY, make_policy
from foresight.runtime.device_ops import DeviceOps
from foresight.runtime.engine import EvictionEngine
from foresight.runtime.host_reads import HostReads
from foresight.scorer.model import ForesightScorer
from trainers.data_stage import FrozenModel
from trainers.example_cache import ExampleCache
from trainers.preparation import make_examples
from trainers.process import keep_freed_memory
from trainers.ranking import PairWeight
from trainers.reinforcement.rollouts import full_cache_losses, packs, roll_out, roll_out_together

if TYPE_CHECKING:
    from trainers.data import GoldenDataModule

NAME = "pipeline"


@dataclass(frozen=True, kw_only=True)
class Settings(PlacedSettings):
    """The model is the one that made the traces."""

    traces: Path = traces_field("a traces folder with its golden labels at -B and -L (`foresight labels`)")
    budget: int = budget_field()
    interval: int = interval_field()
    policy: str = field(default=DEFAULT_POLICY, metadata={"help": "the policy the eval stage replays"})
    fit_steps: int = field(default=20, metadata={"help": "optimisation steps of each fit run (at least 2)"})
    batch_size: int = field(
        default=2,
        metadata={"help": "traces per optimisation step of the fit, and per replay in the packed rl rollouts row"},
    )
    group_size: int = field(default=4, metadata={"help": "rollouts of each trace (G)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.eval_policy.evicts:
            raise ValueError(
                f"--policy {self.policy!r} evicts nothing; the eval stage needs one that does, e.g. snapkv"
            )
        for name, value, least in (
            ("--fit-steps", self.fit_steps, 2),
            ("--batch-size", self.batch_size, 1),
            ("--group-size", self.group_size, 1),
        ):
            if value < least:
                raise ValueError(f"{name} {value} must be at least {least}")

    @property
    def eval_policy(self) -> PolicySpec:
        (policy,), _ = resolve_policies(self.policy)
        return policy


@dataclass(frozen=True)
class StageFigures:
    """One stage's row: `work` done in `seconds`, `forward_seconds` of them in the frozen model (None: it runs none)."""

    stage: str
    what: str
    work: float
    unit: str
    seconds: float
    forward_seconds: float | None

    @property
    def rate(self) -> float:
        return self.work / self.seconds

    @property
    def forward_share(self) -> float | None:
        return None if self.forward_seconds is None else self.forward_seconds / self.seconds


def clock(device: torch.device) -> float:
    """time.perf_counter, after the device's queued work on CUDA: the device's time, not that of queueing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class ForwardTimer:
    """Seconds spent in a module's forward, from a pre-hook and a hook on it (`clock` at both edges)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.seconds, self._started = module, 0.0, 0.0
        self.device = next(module.parameters()).device

    def _enter(self, module, args) -> None:
        self._started = clock(self.device)

    def _leave(self, module, args, output) -> None:
        self.seconds += clock(self.device) - self._started

    @contextmanager
    def timing(self) -> Iterator[ForwardTimer]:
        handles = [self.module.register_forward_pre_hook(self._enter), self.module.register_forward_hook(self._leave)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def _timed(model: torch.nn.Module, work: Callable[[], object]) -> tuple[float, float]:
    """(seconds, forward seconds) of `work`."""
    timer = ForwardTimer(model)
    with timer.timing():
        started = clock(timer.device)
        work()
        seconds = clock(timer.device) - started
    return seconds, timer.seconds


def run(settings: Settings) -> str:
    """Time every stage on the folder's traces; the report's markdown section."""
    store = TraceStore(settings.traces)
    traces = [trace for trace in store if _has_steps(trace, settings.budget, settings.interval)]
    if not traces:
        raise ValueError(f"no trace of {settings.traces} reaches B + L = {settings.budget + settings.interval} tokens")
    with tempfile.TemporaryDirectory(prefix="foresight-bench-examples-") as examples_dir:
        data = _data_module(settings, store.settings["model"], examples_dir)
        model = data.frozen.load()[0]
        stages = [
            _labels(model, traces, settings),
            _examples(model, data.frozen, data.examples, traces),
            _eval(model, traces, settings),
        ]
        scorer = random_scorer(
            model, settings.budget, settings.interval
        )  # a rollout's speed does not depend on its weights
        long_enough = [
            t for t in traces if t.input_ids.numel() >= settings.budget + settings.interval + 2
        ]  # roll_out's
        rollouts = _rollouts(
            model, scorer, long_enough, settings
        )  # before the fit, whose row of now changes malloc's settings
        counts = _step_counts(model, scorer, long_enough[0], settings)
        stages += [_fit(data, settings), *rollouts]
    return _report(settings, traces, store.settings["model"], stages, counts)


def _has_steps(trace: Trace, budget: int, interval: int) -> bool:
    try:
        eviction_steps(trace.input_ids.numel(), budget, interval)
    except TraceTooShort:
        return False
    return True


def _tokens(traces: list[Trace]) -> int:
    return sum(trace.input_ids.numel() for trace in traces)


def _labels(model, traces: list[Trace], settings: Settings) -> StageFigures:
    def work() -> None:
        for trace in traces:
            compute_golden_labels(model, trace.input_ids, settings.budget, settings.interval)

    seconds, forward = _timed(model, work)
    return StageFigures(
        "labels", "capture forward, block attention, golden schedule", _tokens(traces), "tokens", seconds, forward
    )


def _examples(model, frozen: FrozenModel, cache: ExampleCache, traces: list[Trace]) -> StageFigures:
    seconds, forward = _timed(model, lambda: make_examples(frozen, cache, progress=False))
    return StageFigures(
        "examples", "golden replay, recorded scorer inputs, cache files", _tokens(traces), "tokens", seconds, forward
    )


def _eval(model, traces: list[Trace], settings: Settings) -> StageFigures:
    def work() -> None:
        evaluate(model, traces, [settings.eval_policy], [settings.budget], settings.interval, progress=False)

    seconds, forward = _timed(model, work)
    what = f"eval replay of {settings.eval_policy.name}: the full-cache reference and the policy"
    return StageFigures("eval replay", what, _tokens(traces), "tokens", seconds, forward)


def _rollouts(model, scorer: ForesightScorer, traces: list[Trace], settings: Settings) -> list[StageFigures]:
    """The rollouts of every trace (each long enough for one) with each group's forwards before its first eviction
    run on every row (before), then once (now), then with the groups of `batch_size` traces in one replay,
    then once with the model in bfloat16 (a float32 model's only)."""
    group = f"G = {settings.group_size} sampled replays of each trace, scored; "
    rows = [
        _rollout_row(
            model,
            scorer,
            traces,
            settings.group_size,
            "rl rollouts before",
            group + "every row runs the group's first B + L tokens",
            share_prefix=False,
        ),
        _rollout_row(
            model,
            scorer,
            traces,
            settings.group_size,
            "rl rollouts now",
            group + "the group's first B + L tokens run on one row",
        ),
        _rollout_row(
            model,
            scorer,
            traces,
            settings.group_size,
            f"rl rollouts now, {settings.batch_size} traces per replay",
            group + f"as now, the groups of {settings.batch_size} traces of similar length in one replay",
            traces_per_replay=settings.batch_size,
        ),
    ]
    if model.dtype == torch.float32:  # a bfloat16 copy, each group scored against its own full-cache losses
        rows.append(
            _rollout_row(
                copy.deepcopy(model).to(torch.bfloat16),
                scorer,
                traces,
                settings.group_size,
                "rl rollouts now, bfloat16",
                "as now with the model in bfloat16, each group scored against the model's own full-cache losses "
                "(one more one-row replay per trace, counted)",
                replayed_reference=True,
            )
        )
    return rows


class StepCounts:
    """Entered around every eviction step of a replay: the device values the step reads back
    (`HostReads`; on a GPU each one is a synchronisation) and the operations it runs (`DeviceOps`; on a
    GPU each one launches at least one kernel)."""

    def __init__(self) -> None:
        self.reads, self.ops = HostReads(), DeviceOps()

    def __enter__(self) -> None:
        self.reads.__enter__()
        self.ops.__enter__()

    def __exit__(self, *exc) -> None:
        self.ops.__exit__(*exc)
        self.reads.__exit__(*exc)

    def per_step(self, steps: int) -> tuple[float, float]:
        """(host reads, device operations) per eviction step over `steps` steps."""
        return self.reads.total / max(steps, 1), self.ops.total / max(steps, 1)


def _step_counts(model, scorer: ForesightScorer, trace: Trace, settings: Settings) -> dict[str, tuple[float, float]]:
    """Host reads and device operations per eviction step (`StepCounts`) in one replay of `trace`: the
    eval stage's policy and the learned scorer (deterministic), each on one row prefilled as `foresight
    eval` prefills it, and G sampled rollout rows of the scorer evicting together."""
    seeds, spec = list(range(settings.group_size)), settings.eval_policy
    counts, cadence = {}, Cadence(settings.budget, settings.interval)
    for name, policy, config in (
        (spec.name, spec.build(None), spec.config(cadence.eviction)),
        ("foresight", make_policy("foresight", scorer=scorer), cadence.eviction),
    ):
        counted = StepCounts()
        engine = EvictionEngine(model, policy, config, step_observer=counted)
        prefill = cadence.prefill_lengths([trace], engine.protect_prompt)
        steps = engine.replay([trace.input_ids], prefill).stats.evictions
        counts[name] = counted.per_step(steps)
    counted = StepCounts()
    group = roll_out(model, scorer, trace, seeds, step_observer=counted)
    counts[f"rl rollouts (G = {settings.group_size})"] = counted.per_step(group.eviction_steps)
    return counts


def _rollout_row(
    model: torch.nn.Module,
    scorer: ForesightScorer,
    traces: list[Trace],
    group_size: int,
    stage: str,
    what: str,
    share_prefix: bool = True,
    replayed_reference: bool = False,
    traces_per_replay: int = 1,
) -> StageFigures:
    """One timed pass of G rollouts of every trace (`roll_out_together`, `traces_per_replay` traces per replay),
    each group scored against the stored losses or, with `replayed_reference`, the model's own (its replay
    counted: a dtype's rounding is not eviction damage)."""
    seeds = list(range(group_size))

    def work() -> None:
        for packed in packs(traces, traces_per_replay):
            references = [full_cache_losses(model, trace) if replayed_reference else None for trace in packed]
            roll_out_together(
                model, scorer, packed, [seeds] * len(packed), share_prefix=share_prefix, reference_nll=references
            )

    seconds, forward = _timed(model, work)
    return StageFigures(stage, what, group_size * _tokens(traces), "tokens", seconds, forward)


def _data_module(settings: Settings, model_name: str, examples_dir: str) -> GoldenDataModule:
    """The supervised stage's data module over every trace (no holdout), its example cache in `examples_dir`."""
    from trainers.data import (
        GoldenDataModule,  # Lightning is imported only when the benchmark runs
    )

    return GoldenDataModule(
        str(settings.traces),
        settings.budget,
        settings.interval,
        model=model_name,
        examples_dir=examples_dir,
        device=settings.run_device,
        dtype=dtype_name(settings.run_dtype),
        holdout=0.0,
        batch_size=settings.batch_size,
    )


def _fit(data: GoldenDataModule, settings: Settings) -> StageFigures:
    """Steps per second of the fit as `foresight fit` runs it: `fit_steps` optimisation steps of a fresh
    scorer (the shipped recipe's gap-weighted pairs), the seconds of the steps after the first, which
    also starts the loader."""
    import lightning as L

    from trainers.supervised import SupervisedScorer

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.times.append(clock(module.device))

    data.setup("fit")
    workers = data.train_dataloader().num_workers
    kept = keep_freed_memory()  # as `foresight fit` runs: for the rest of this process
    times = StepTimes()
    kind, _, index = settings.run_device.partition(":")
    trainer = L.Trainer(
        accelerator="gpu" if kind == "cuda" else kind,
        devices=[int(index)] if index else 1,
        max_steps=settings.fit_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[times],
    )
    trainer.fit(SupervisedScorer(data.scorer_spec, pair_weight=PairWeight.GAP.value), datamodule=data)
    what = (
        f"{workers} worker processes, batches in the storage dtype cast in the scorer's layout copy"
        + (", pinned memory" if kind == "cuda" else "")
        + "; one matmul per (layer, head); pair blocks in cache, the gradient in the same pass"
        + ("; freed host memory kept for the next step" if kept else "")
    )
    return StageFigures("fit", what, len(times.times) - 1, "steps", times.times[-1] - times.times[0], None)


def _report(
    settings: Settings,
    traces: list[Trace],
    model_name: str,
    rows: list[StageFigures],
    counts: dict[str, tuple[float, float]],
) -> str:
    kind = torch.device(settings.run_device).type
    lines = [
        f"### Pipeline stages at the speed of the model forward ({kind})",
        "",
        f"Command: `{settings.command}` {threads_note()}",
        "",
        (
            f"{describe_traces(traces)} of {model_name} ({dtype_name(settings.run_dtype)}) on {machine(settings.run_device)}; "
            f"B = {settings.budget}, L = {settings.interval}. Forward share: the time inside the frozen model's "
            f"forward over the stage's; the fit runs none ({settings.fit_steps} steps of {settings.batch_size} "
            "traces, timed after the first)."
        ),
        "",
        "| stage | what it runs | work | seconds | throughput | forward share |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        share = "–" if row.forward_share is None else f"{row.forward_share:.0%}"
        lines.append(
            f"| {row.stage} | {row.what} | {row.work:,.0f} {row.unit} | {row.seconds:.2f} | "
            f"{row.rate:,.1f} {row.unit}/s | {share} |"
        )
    lines += [
        "",
        (
            "Per eviction step, one replay of the first trace: the device values read back inside the step "
            "(`foresight.runtime.host_reads.HostReads`; on a GPU each one is a synchronisation) and the operations "
            "it runs that are not views (`foresight.runtime.device_ops.DeviceOps`; on a GPU each one launches at "
            "least one kernel)."
        ),
        "",
        "| replay | host reads per step | device operations per step |",
        "|---|---:|---:|",
        *(f"| {name} | {reads:.1f} | {ops:,.0f} |" for name, (reads, ops) in counts.items()),
    ]
    return "\n".join(lines) + "\n"
