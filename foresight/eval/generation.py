"""Accuracy under eviction: sampled completions of problems with checkable answers, under every policy
and budget, compared with the full cache (docs/algorithms.md section 8).

Each problem is sampled k times (T = 0.6, top-k 20, top-p 0.95 by default) with the full cache and
with every policy at every budget. Sample j of problem i draws from its own generator, seeded by
(seed, source, i, j) under every policy (`EvictionEngine.generate(row_seeds=...)`), so a policy's
completion starts from the same random numbers as the full cache's and parts from it only where
eviction moved the model's distribution; agreement counts how often both end in the same answer.

Per policy and budget the report gives, each with a 95% bootstrap interval over problems:

- pass@1 (the mean over the k samples) and pass@k (the unbiased estimator), by the strict and by the
  flexible answer rule of `foresight.data.tasks`;
- agreement: the share of samples whose flexible final answer equals the full cache's on the same seed;
- the mean completion length in tokens;
- loops: the share of completions that end in a repetition loop (`ends_in_loop`).

Every batch of completions is written as soon as it is done, one atomically written JSON file under
OUT/completions/POLICY/B{B}-L{L}/ (the full cache under OUT/completions/full/), so a killed run resumes
from what it wrote. OUT/completions/settings.json records what the completions are made with; a rerun
with other settings is refused rather than mixed in. The policies of a budget run batch by batch
together: each batch of (problem, sample) rows is generated under every policy of the budget before
the next batch starts.

Size: the generation loop, its resumable records and its report share one record format.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from foresight.artifacts import write_text
from foresight.data.tasks import AnswerRule, Problem, chat_prompt_ids, check_answer, extract_answer, stop_token_ids
from foresight.eval.report import Column, markdown_table, set_interval, write_results
from foresight.eval.run_store import RunStore
from foresight.eval.specs import REFERENCE, PolicySpec
from foresight.eval.stats import bootstrap_interval, pass_at_k
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.sampling import REASONING_SAMPLING, SamplingConfig

LOOP_MAX_PERIOD = 256  # longest repeated block looked for, in tokens
LOOP_REPEATS = 3  # times the block must follow itself
LOOP_MIN_SPAN = 64  # fewest tokens the repetition must cover ("\n\n\n" is not a loop)
PLOTTED = ("pass1_flexible", "pass1_strict", "agreement", "loops", "mean_tokens")


@dataclass(frozen=True)
class GenerationSettings:
    """What every completion of a run is made with (stored beside them and checked on resume)."""

    model: str
    sources: tuple[str, ...]
    problems: int  # per source
    problem_seed: int
    samples: int  # k
    max_new_tokens: int
    temperature: float = REASONING_SAMPLING.temperature
    top_k: int = REASONING_SAMPLING.top_k
    top_p: float = REASONING_SAMPLING.top_p
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples per problem k={self.samples} must be at least 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        self.sampling  # validates temperature, top-k and top-p

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "sources": list(self.sources)}


@dataclass(frozen=True)
class Job:
    """One policy at one budget (the full cache has none)."""

    spec: PolicySpec
    eviction: EvictionConfig | None = None

    @property
    def label(self) -> str:
        return self.spec.name if self.eviction is None else f"{self.spec.name} B={self.eviction.budget}"

    def engine(self, model: torch.nn.Module) -> EvictionEngine:
        config = self.spec.config(self.eviction) if self.spec.evicts else None
        return EvictionEngine(model, self.spec.build(None), config)


RowKey = tuple[str, int, int]  # (source, problem index, sample)


def row_seed(seed: int, source: str, index: int, sample: int) -> int:
    """The sampling seed of one (problem, sample): the same under every policy and batch layout."""
    digest = hashlib.blake2b(f"{seed}|{source}|{index}|{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def ends_in_loop(
    tokens: Sequence[int],
    hit_limit: bool,
    max_period: int = LOOP_MAX_PERIOD,
    repeats: int = LOOP_REPEATS,
    min_span: int = LOOP_MIN_SPAN,
) -> bool:
    """Whether a completion ends in a repetition loop: it ran out of tokens (`hit_limit`) and its last
    tokens are one block of at most `max_period` tokens repeated back to back, at least `repeats`
    times and over at least `min_span` tokens (partial copies of the block count towards the span)."""
    if not hit_limit:
        return False
    ids = np.asarray(tokens)
    for period in range(1, min(max_period, len(ids) // repeats) + 1):
        same = ids[period:] == ids[:-period]  # same[i]: token i + period repeats token i
        unequal = np.flatnonzero(~same)
        run = len(same) if unequal.size == 0 else len(same) - 1 - unequal[-1]
        if run + period >= max(repeats * period, min_span):
            return True
    return False


class CompletionStore(RunStore):
    """The completions of a run: per job a folder of batch files, each a JSON list of records
    {source, problem, sample, seed, tokens, text, hit_limit}, written atomically."""

    def __init__(self, folder: str | Path, settings: GenerationSettings):
        super().__init__(folder, settings.as_json())
        self.settings = settings

    def job_folder(self, job: Job) -> Path:
        return self.policy_folder(job.spec, job.eviction)

    def load(self, job: Job) -> dict[RowKey, dict[str, Any]]:
        records = {}
        for path in sorted(self.job_folder(job).glob("batch-*.json")):
            for record in json.loads(path.read_text()):
                records[(record["source"], record["problem"], record["sample"])] = record
        return records

    def save(self, job: Job, records: list[dict[str, Any]]) -> None:
        folder = self.job_folder(job)
        folder.mkdir(parents=True, exist_ok=True)
        number = len(list(folder.glob("batch-*.json")))
        write_text(folder / f"batch-{number:05d}.json", json.dumps(records))


@dataclass(frozen=True)
class BudgetPlan:
    """The jobs of one budget: the full cache first (it runs once, then is found done), then every
    policy that runs at this budget."""

    eviction: EvictionConfig
    jobs: tuple[Job, ...]


def plan_jobs(specs: Sequence[PolicySpec], budgets: Sequence[int], interval: int) -> tuple[list[BudgetPlan], list[str]]:
    """A plan per budget, and notes on the policies left out (those that replay golden labels, a
    learned scorer at a budget it was not trained for)."""
    notes = [
        f"{s.name}: skipped, it replays stored golden labels, which generation has none of"
        for s in specs
        if s.needs_labels
    ]
    evicting = [s for s in specs if s.evicts and not s.needs_labels]
    plans = []
    for budget in sorted(set(budgets)):
        eviction = EvictionConfig(budget, interval)
        notes += [reason for s in evicting if (reason := s.skip_reason(eviction))]
        runnable = [Job(s, eviction) for s in evicting if s.skip_reason(eviction) is None]
        plans.append(BudgetPlan(eviction, (Job(REFERENCE), *runnable)))
    return plans, notes


def generate_completions(
    model: torch.nn.Module,
    tokenizer,
    problems: Sequence[Problem],
    plans: Sequence[BudgetPlan],
    store: CompletionStore,
    batch_size: int = 32,
    progress: bool = True,
) -> int:
    """Generate every missing completion of every job, batch by batch; returns how many were made."""
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    settings = store.settings
    rows = [(problem, sample) for problem in problems for sample in range(settings.samples)]
    batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    done = {job: set(store.load(job)) for plan in plans for job in plan.jobs}
    missing = {job: {_key(p, s) for p, s in rows} - keys for job, keys in done.items()}
    prompts = {(p.source, p.index): chat_prompt_ids(tokenizer, p.prompt) for p in problems}
    stops = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    made = 0
    with tqdm(total=sum(map(len, missing.values())), unit="completion", desc="generate", disable=not progress) as bar:
        for plan in plans:
            for batch in batches:
                for job in plan.jobs:
                    todo = [(p, s) for p, s in batch if _key(p, s) in missing[job]]
                    if not todo:
                        continue
                    bar.set_postfix_str(job.label)
                    seeds = [row_seed(settings.seed, p.source, p.index, s) for p, s in todo]
                    output = job.engine(model).generate(
                        [prompts[(p.source, p.index)] for p, _ in todo],
                        settings.max_new_tokens,
                        settings.sampling,
                        eos_token_id=stops,
                        pad_token_id=pad,
                        row_seeds=seeds,
                    )
                    records = [
                        {
                            "source": p.source,
                            "problem": p.index,
                            "sample": s,
                            "seed": seed,
                            "tokens": tokens,
                            "text": tokenizer.decode(tokens, skip_special_tokens=True),
                            "hit_limit": len(tokens) == settings.max_new_tokens and tokens[-1] not in stops,
                        }
                        for (p, s), seed, tokens in zip(todo, seeds, output.tokens)
                    ]
                    store.save(job, records)
                    missing[job] -= {_key(p, s) for p, s in todo}
                    made += len(todo)
                    bar.update(len(todo))
    return made


def _key(problem: Problem, sample: int) -> RowKey:
    return (problem.source, problem.index, sample)


# -- the report ----------------------------------------------------------------------------------
@dataclass
class _Outcome:
    """What one completion scored."""

    strict: bool
    flexible: bool
    answer: str
    tokens: int
    loop: bool


def _outcome(problem: Problem, record: dict[str, Any]) -> _Outcome:
    text = record["text"]
    return _Outcome(
        strict=bool(check_answer(problem, text, AnswerRule.STRICT)),
        flexible=bool(check_answer(problem, text, AnswerRule.FLEXIBLE)),
        answer=extract_answer(text, AnswerRule.FLEXIBLE),
        tokens=len(record["tokens"]),
        loop=ends_in_loop(record["tokens"], record["hit_limit"]),
    )


def summarize(problems: Sequence[Problem], plans: Sequence[BudgetPlan], store: CompletionStore) -> list[dict[str, Any]]:
    """One row per (policy, budget): the figures of the module docstring with their intervals over
    problems (the full cache's row repeats at every budget). A problem counts when all its k
    completions exist under both the policy and the full cache."""
    k = store.settings.samples
    by_key = {(p.source, p.index): p for p in problems}
    reference = _outcomes(store, Job(REFERENCE), by_key)
    rows = []
    for plan in plans:
        for job in plan.jobs:
            outcomes = reference if job.eviction is None else _outcomes(store, job, by_key)
            per_problem = []
            for problem in problems:
                keys = [_key(problem, sample) for sample in range(k)]
                if all(key in outcomes and key in reference for key in keys):
                    per_problem.append([(outcomes[key], reference[key]) for key in keys])
            rows.append(_row(job.spec.name, plan, per_problem, k))
    return rows


def _outcomes(store: CompletionStore, job: Job, problems: dict[tuple[str, int], Problem]) -> dict[RowKey, _Outcome]:
    return {key: _outcome(problems[key[:2]], record) for key, record in store.load(job).items() if key[:2] in problems}


def _row(policy: str, plan: BudgetPlan, per_problem: list[list[tuple[_Outcome, _Outcome]]], k: int) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": policy, "budget": plan.eviction.budget, "interval": plan.eviction.interval}
    return {**row, **_figures(per_problem, k)}


def _figures(per_problem: list[list[tuple[_Outcome, _Outcome]]], k: int) -> dict[str, Any]:
    """Per-problem values of every figure (each pair is a completion and the full cache's on the same
    seed), their means over problems, and the intervals."""
    values = {
        "pass1_strict": [sum(o.strict for o, _ in rows) / k for rows in per_problem],
        "pass1_flexible": [sum(o.flexible for o, _ in rows) / k for rows in per_problem],
        "passk_strict": [pass_at_k(k, sum(o.strict for o, _ in rows), k) for rows in per_problem],
        "passk_flexible": [pass_at_k(k, sum(o.flexible for o, _ in rows), k) for rows in per_problem],
        "agreement": [sum(o.answer == full.answer for o, full in rows) / k for rows in per_problem],
        "mean_tokens": [sum(o.tokens for o, _ in rows) / k for rows in per_problem],
        "loops": [sum(o.loop for o, _ in rows) / k for rows in per_problem],
    }
    figures: dict[str, Any] = {"problems": len(per_problem), "samples": k}
    for metric, per in values.items():
        figures[metric] = float(np.mean(per)) if per else None
        set_interval(figures, metric, bootstrap_interval(per) if per else None)
    return figures


def summarize_sources(problems: Sequence[Problem], store: CompletionStore) -> list[dict[str, Any]]:
    """The full cache's figures per prompt source: how well the model solves each task family at all."""
    k = store.settings.samples
    reference = _outcomes(store, Job(REFERENCE), {(p.source, p.index): p for p in problems})
    rows = []
    for source in dict.fromkeys(p.source for p in problems):
        per_problem = []
        for problem in (p for p in problems if p.source == source):
            keys = [_key(problem, sample) for sample in range(k)]
            if all(key in reference for key in keys):
                per_problem.append([(reference[key], reference[key]) for key in keys])
        rows.append({"source": source, **_figures(per_problem, k)})
    return rows


def columns(samples: int) -> tuple[Column, ...]:
    return (
        ("policy", "policy", "{}"),
        ("budget", "B", "{}"),
        ("interval", "L", "{}"),
        ("agreement", "agreement with full", "{:.2f}"),
        *_accuracy_columns(samples),
    )


def source_columns(samples: int) -> tuple[Column, ...]:
    return (("source", "source (full cache)", "{}"), *_accuracy_columns(samples))


def _accuracy_columns(samples: int) -> tuple[Column, ...]:
    return (
        ("pass1_flexible", "pass@1 flexible", "{:.2f}"),
        ("pass1_strict", "pass@1 strict", "{:.2f}"),
        ("passk_flexible", f"pass@{samples} flexible", "{:.2f}"),
        ("passk_strict", f"pass@{samples} strict", "{:.2f}"),
        ("mean_tokens", "mean length", "{:.0f}"),
        ("loops", "loops", "{:.2f}"),
        ("problems", "problems", "{}"),
    )


def by_agreement(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """By budget, the full cache first, then by agreement with it (highest first)."""
    return sorted(rows, key=lambda r: (r["budget"], r["policy"] != REFERENCE.name, -(r["agreement"] or 0.0)))


def write_generation_report(
    rows: Sequence[dict[str, Any]],
    source_rows: Sequence[dict[str, Any]],
    out_dir: str | Path,
    settings: dict[str, Any],
    notes: Sequence[str],
    samples: int,
) -> list[Path]:
    """results.json, results.csv, results.md (with the full cache's figures per source after the main
    table) and a plot per figure of PLOTTED (budget on the x axis, intervals as error bars)."""
    by_source = markdown_table(source_rows, source_columns(samples))
    return write_results(
        out_dir,
        "Accuracy under eviction",
        settings,
        notes,
        by_agreement(rows),
        columns(samples),
        PLOTTED,
        after=[by_source],
    )
