"""How much could one budget across heads gain? Golden pooled over each layer's heads and over the whole model
against per-head golden and the best heuristic, no training (issue 57, Deliver 1; studies/pooled_golden/bound.py).

    python -m studies pooled-golden --traces data/corpus/unseen-a --eval runs/restate/unseen-a-streaming \\
        --regime streaming --floor 19

`--eval` is a `foresight eval --traces` folder of the same traces, B, L and regime holding golden and the reference
heuristics (its traces.json): their rows are read from it, and the pooled schedules are replayed here on the traces
it scored. Each pooled oracle's share of the headroom is (best heuristic − it) / (best heuristic − golden), the best
chosen again in every resample (docs/algorithms.md §8): above 100% by what pooling adds to today's headroom. The
same for SnapKV and TOVA with the same freedom (`snapkv-layer`, `tova-all`, ...: AdaKV's allocation over their
scores, the same floor; TOVA's per KV head), beside their per-head twins. Rows per token set (generated, prompt,
all); the -head rows are golden, SnapKV and TOVA as the engine runs them, replayed here by the masked replay, whose
match with the evaluation's golden, snapkv and tova rows checks the replay.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from foresight.artifacts import check_settings, write_text
from foresight.bench.common import ReportSettings, budget_field, interval_field, regime_field
from foresight.cadence import Regime, eviction_steps, regime_shift
from foresight.data.trace_store import Trace, TraceStore
from foresight.eval.headroom import ORACLE, TraceScore, headroom, paired_gain, percent
from foresight.eval.metric_registry import TokenSet
from foresight.eval.tally import TraceTally
from foresight.labels import future_score_table
from foresight.models import load_model
from studies import COMMAND as COMMAND  # how its report names it, where it goes
from studies import REPORTS as REPORTS
from studies.pooled_golden.bound import FixedSchedule, HeuristicSchedule, Pool, masked_replay, pooled_schedule

NAME = "pooled-golden"


@dataclass(frozen=True, kw_only=True)
class Settings(ReportSettings):
    traces: Path = field(metadata={"help": "the traces folder the evaluation replayed"})
    eval: Path = field(metadata={"help": "a `foresight eval --traces` folder of those traces with golden's rows"})
    budget: int = budget_field()
    interval: int = interval_field()
    regime: str = regime_field()
    floor: int = field(default=19, metadata={"help": "entries every head keeps at least besides its window (0..L)"})
    model: str = field(default="default", metadata={"help": "the frozen model that made the traces"})
    max_traces: int | None = field(
        default=None, metadata={"help": "the first N of the evaluated traces (default: all)"}
    )
    work: Path | None = field(
        default=None,
        metadata={"help": "a folder keeping each trace's scores as it ends, so a stopped run resumes (default: none)"},
    )

    def __post_init__(self) -> None:
        Regime.parse(self.regime)
        if not 0 <= self.floor <= self.interval:
            raise ValueError(
                f"--floor {self.floor} must be 0..L={self.interval}: a head's L leaving entries must meet it"
            )


def pooled_scores(model, trace: Trace, settings: Settings) -> list[TraceScore]:
    """Every pool's trace scores for one trace (the golden-, snapkv- and tova-POOL rows), on golden's scored tokens."""
    budget, interval = settings.budget, settings.interval
    shift = regime_shift(trace.prompt_length, budget, interval, settings.regime)
    if shift:  # the compression's α is row 0 of the streaming table of budget P − L
        table = future_score_table(model, trace.input_ids, budget + shift - interval, interval)
        future, compression = table[1:], table[0]
    else:
        future, compression = future_score_table(model, trace.input_ids, budget, interval), None
    _, full_greedy = masked_replay(model, trace.input_ids, [], interval)
    scores = []
    steps = eviction_steps(trace.input_ids.numel(), budget, interval, shift)
    for pool in Pool:
        floor = settings.floor if pool is not Pool.HEAD else 0
        schedules = {
            "golden": FixedSchedule(pooled_schedule(future, budget, interval, pool, floor, shift, compression)),
            **{
                name: HeuristicSchedule(budget, interval, steps, pool, floor, shift, heuristic=name)
                for name in ("snapkv", "tova")
            },
        }
        for name, schedule in schedules.items():
            nll, greedy = masked_replay(model, trace.input_ids, schedule, interval)
            tally = TraceTally()
            tally.add_trace(trace, nll, schedule.positions[0] + 1, None, flipped=greedy != full_greedy)
            scores += tally.trace_scores(f"{name}-{pool.value}", budget)
    return scores


def kept_scores(settings: Settings, index: int, compute) -> list[TraceScore]:
    """One trace's scores: read from --work where a run of the same settings kept them, else computed and kept
    (a --work folder of other settings is refused in one line)."""
    if settings.work is None:
        return compute()
    made_with = {name: getattr(settings, name) for name in ("budget", "interval", "regime", "floor", "model")}
    made_with |= {"traces": str(settings.traces), "eval": str(settings.eval)}
    record = settings.work / "settings.json"
    if record.is_file():
        check_settings(
            f"the scores in {settings.work}", json.loads(record.read_text()), made_with, "give another --work"
        )
    else:
        write_text(record, json.dumps(made_with, indent=1))
    path = settings.work / f"trace-{index}.json"
    if path.is_file():
        return [TraceScore(**entry) for entry in json.loads(path.read_text())]
    scores = compute()
    write_text(path, json.dumps([dataclasses.asdict(score) for score in scores]))
    return scores


def run(settings: Settings) -> str:
    if not (settings.eval / "traces.json").is_file():
        raise ValueError(f"--eval {settings.eval} holds no traces.json: give a `foresight eval --traces` folder")
    evaluated = [TraceScore(**entry) for entry in json.loads((settings.eval / "traces.json").read_text())]
    evaluated = [score for score in evaluated if score.budget == settings.budget]
    indices = sorted({score.index for score in evaluated if score.policy == ORACLE})[: settings.max_traces]
    if not indices:
        raise ValueError(f"{settings.eval} holds no golden row at B={settings.budget}")
    store = TraceStore(settings.traces)
    by_index = {trace.index: trace for trace in store if trace.index in indices}
    missing = sorted(set(indices) - set(by_index))
    if missing:
        raise ValueError(
            f"{settings.traces} lacks trace(s) {missing[:5]} that {settings.eval} evaluated: give its traces"
        )
    model, _ = load_model(settings.model)
    scores = [score for score in evaluated if score.index in indices]
    for index in tqdm(indices, desc=NAME, unit="trace"):
        scores += kept_scores(settings, index, lambda index=index: pooled_scores(model, by_index[index], settings))
    pooled = tuple(f"{name}-{pool.value}" for name in ("golden", "snapkv", "tova") for pool in Pool)
    lines = [
        f"Command: `{settings.command}`",
        "",
        f"B = {settings.budget}, L = {settings.interval}, {settings.regime} regime, {len(indices)} traces; pooled heads "
        f"keep at least {settings.floor} entries besides their window. Share: of the headroom between the best "
        "heuristic and per-head golden (100% = per-head golden); Δ: the pool's loss ratio − its per-head twin's "
        "(golden-head, snapkv-head), paired.",
        "",
        "| tokens | policy | loss ratio | best heuristic | share of the headroom | Δ loss ratio vs its per-head twin |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for token_set in (TokenSet.GENERATED, TokenSet.PROMPT, TokenSet.ALL):
        for name in (ORACLE, *pooled):
            result = headroom(scores, settings.budget, name, other_learned=pooled, token_set=token_set)
            if result is None:
                continue
            twin = f"{name.split('-')[0]}-head"
            gain = paired_gain(scores, settings.budget, twin, name, token_set=token_set)
            delta = "–" if name == twin or gain is None else f"{-gain.value:+.4f} [{-gain.high:+.4f}, {-gain.low:+.4f}]"
            best = f"{result.loss_ratio[result.best_heuristic].value:.4f} ({result.best_heuristic})"
            lines.append(
                f"| {token_set.value} | {name} | {result.loss_ratio[name]} | {best} | {percent(result.share, 1)} | {delta} |"
            )
    return "\n".join(lines)
