"""Teacher-forced evaluation of every policy on stored traces, and its report (docs/algorithms.md section 8).

Each trace is replayed through the frozen model under every policy and budget B (one interval L);
the metrics of `foresight.metrics` compare it with the full cache:

- loss ratio and low-entropy damage against the full-cache NLL and entropy stored with the trace;
- attention-output cosine similarity against a full-cache replay of the same batch: an attention
  function registered in AttentionInterface (`PROBE_ATTENTION`, a wrapper of the runtime's
  `eviction_attention`) records every layer's output per token in the full-cache run and compares
  it in the evicted run (same token, same layer and query head; from layer 1 on the queries
  themselves carry the upstream change, so this is the end-to-end change of each head's output);
- overlap with the golden kept set, where labels exist for (B, L). Steps are aligned by position:
  golden step t keeps its set right after position p_t = B + tL - 1, and the policy's kept
  candidates at that moment are the entries it holds with position <= p_t - L (older than the recent
  window), read by the same attention function at the forward that processes position p_t + 1
  (so steps after a trace's last token, whose kept set serves no token, are not counted). For a
  policy on the golden cadence these are exactly the candidates it kept at its own step t; the
  overlap pools hits / kept over every step, layer and KV head.

Cadence. The golden schedule counts steps from the first token (p_t = B + tL - 1, prompt
included), so every policy that does not protect the prompt is replayed on that cadence: a batch
prefills the same min(B + L, shortest prompt) tokens in every row and feeds the rest in chunks that
end at the evictions, so all rows evict together and every row's step t follows position p_t
(golden needs this; for the others it is the same computation as decoding token by token). Policies
that protect the prompt (raas, epikv) are replayed with their true prompt lengths: their budget
applies after the prompt, so their steps fall at P + B + tL - 1 and they hold P more entries.

Shared prefix: the evicting replays of a batch with the same prefill reuse the forwards before the first
eviction, recorded by the first of them (`foresight.runtime.prefix`); every figure is the same as
running the model on every token (`share_prefix=False`), with B + L tokens per row run once.

Scored tokens: predictions made after a row's first eviction (`metrics.scored_tokens`). A policy
that never evicts (full) is the reference itself: loss ratio 1, no damage, cosine 1, scored on the
golden cadence's tokens (j >= B + L). Traces shorter than B + L never evict and are skipped with a
count, per budget.

Size: the replay loop, its attention probe and its tallies; the report's files live in
foresight/report.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from foresight.artifacts import write_text
from foresight.cadence import check_budget, golden_prefill, step_of, step_position
from foresight.headroom import Headroom, TraceScore, headroom, headroom_rows
from foresight.labels import GoldenLabels, LabelStore
from foresight.metrics import (
    EntropyDamage,
    attention_cosine,
    golden_overlap,
    loss_ratio,
    low_entropy_damage,
    scored_tokens,
)
from foresight.policies import POLICIES, Policy, make_policy
from foresight.scorer import ForesightScorer, load_scorer
from foresight.policies.golden import GoldenSchedule
from foresight.report import Column, set_interval, write_results
from foresight.report import markdown_table as format_table
from foresight.runtime.capture import eviction_attention, register_runtime_attention
from foresight.runtime.engine import EvictionConfig, EvictionEngine, ReplayOutput
from foresight.runtime.prefix import ReplayPrefix
from foresight.stats import bootstrap_interval
from foresight.traces import Trace

PROBE_ATTENTION = "foresight_eval_probe"
REFERENCE_CHUNK = 256  # tokens per forward of the full-cache replay (bounds the [batch, chunk, vocab] logits)
METRICS = ("loss_ratio", "low_entropy_damage", "low_entropy_dl2", "attn_cosine", "golden_overlap")


# -- which policies ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicySpec:
    """A policy to evaluate and what building it takes. Golden takes the labels of the batch; a
    policy that needs another artifact (a learned scorer's folder) becomes one more kind of spec
    with its own `build`, without touching the replay loop."""

    name: str

    @property
    def policy_class(self) -> type[Policy]:
        return POLICIES[self.name]

    @property
    def needs_labels(self) -> bool:
        return any(f.init and f.name == "labels" for f in fields(self.policy_class))

    @property
    def missing_artifacts(self) -> list[str]:
        """Required constructor arguments that eval cannot give (every one but golden's labels)."""
        return [
            f.name for f in fields(self.policy_class)
            if f.init and f.default is f.default_factory is MISSING and f.name != "labels"
        ]

    @property
    def evicts(self) -> bool:
        return self.policy_class.evicts

    @property
    def protects_prompt(self) -> bool:
        return not self.needs_labels and self.policy_class.default_protect_prompt

    def build(self, labels: Sequence[GoldenLabels] | None) -> Policy:
        return make_policy(self.name, labels=list(labels)) if self.needs_labels else make_policy(self.name)

    def config(self, budget: int, interval: int) -> EvictionConfig | None:
        """The eviction config: the policy's own defaults; golden's cadence has no sinks and no
        protected prompt (its labels assume neither)."""
        if not self.evicts:
            return None
        if self.needs_labels:
            return EvictionConfig(budget, interval, sinks=0, protect_prompt=False)
        return EvictionConfig(budget, interval)

    def skip_reason(self, budget: int, interval: int) -> str | None:
        """Why the policy cannot run at this budget and interval (a learned scorer runs only at its own)."""
        return None


@dataclass(frozen=True)
class ScorerSpec(PolicySpec):
    """The learned `foresight` policy with one trained scorer, run at the B and L it was trained for,
    with no sinks and no protected prompt (as in training)."""

    scorer: ForesightScorer = field(default=None, compare=False, repr=False)

    @classmethod
    def from_source(cls, source: str, several: bool) -> ScorerSpec:
        """A spec from `SOURCE` or `NAME=SOURCE` (a folder or Hub id): named NAME when given, else
        `foresight`, or `foresight:FOLDER` when several scorers are compared."""
        name, sep, path = source.partition("=")
        if sep and name and "/" not in name:
            return cls(name=name, scorer=load_scorer(path))
        name = f"foresight:{Path(source).name}" if several else "foresight"
        return cls(name=name, scorer=load_scorer(source))

    @property
    def policy_class(self) -> type[Policy]:
        return POLICIES["foresight"]

    @property
    def missing_artifacts(self) -> list[str]:
        return []

    def build(self, labels: Sequence[GoldenLabels] | None) -> Policy:
        return make_policy("foresight", scorer=self.scorer)

    def config(self, budget: int, interval: int) -> EvictionConfig | None:
        return EvictionConfig(budget, interval, sinks=0, protect_prompt=False)

    def skip_reason(self, budget: int, interval: int) -> str | None:
        trained = (self.scorer.config.budget, self.scorer.config.interval)
        if (budget, interval) == trained:
            return None
        return f"{self.name} skipped at B={budget}, L={interval}: its scorer was trained for B={trained[0]}, L={trained[1]}"


REFERENCE = PolicySpec("full")


def resolve_policies(text: str) -> tuple[list[PolicySpec], list[str]]:
    """Specs for `all` or a comma-separated list of names, and notes on what `all` leaves out."""
    if text == "all":
        specs, notes = [], []
        for name in sorted(POLICIES):
            missing = PolicySpec(name).missing_artifacts
            if missing:
                notes.append(f"{name}: skipped, it needs {', '.join(missing)}, which eval does not provide yet")
            else:
                specs.append(PolicySpec(name))
        return specs, notes
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--policies {text!r} names no policy; give 'all' or names such as h2o,snapkv")
    for name in names:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose 'all' or some of: {', '.join(sorted(POLICIES))}")
        missing = PolicySpec(name).missing_artifacts
        if missing:
            raise ValueError(f"policy {name!r} needs {', '.join(missing)}, which eval does not provide yet")
    return [PolicySpec(name) for name in dict.fromkeys(names)], []


# -- recording attention outputs and kept entries ------------------------------------------------
_ACTIVE_PROBE: contextvars.ContextVar[AttentionProbe | None] = contextvars.ContextVar("foresight_probe", default=None)


class AttentionProbe:
    """What the evaluation reads from inside the attention function during one replay of a batch.

    Only the tokens of each row's trace count (`lengths` [rows]; a shorter row replays padding after
    its end). reference=None: record every layer's attention output per (row, position) ->
    `outputs` [rows, T, layers, Hq, D]. With a reference (another probe's `outputs`): add each
    token's cosine similarity to it, averaged over query heads, into `cosine_sum` [rows, T] (one term
    per layer). With a golden schedule: count each row's kept candidates and golden hits at every
    golden step whose kept set serves a later token of the trace (p_t + 1 < T; aligned by position,
    see the module docstring) into `overlap_hits` and `overlap_kept` [rows].
    """

    def __init__(
        self,
        lengths: Sequence[int],
        num_layers: int,
        reference: torch.Tensor | None = None,
        schedule: GoldenSchedule | None = None,
    ) -> None:
        rows, length = len(lengths), max(lengths)
        self.lengths = torch.tensor(list(lengths))
        self.num_layers = num_layers
        self.reference = reference
        self.outputs: torch.Tensor | None = None
        self.cosine_sum = torch.zeros(rows, length, dtype=torch.float64)
        self.layer_count = torch.zeros(rows, length, dtype=torch.long)
        self.schedule = schedule
        self.overlap_hits = torch.zeros(rows, dtype=torch.long)
        self.overlap_kept = torch.zeros(rows, dtype=torch.long)

    @contextlib.contextmanager
    def active(self) -> Iterator[AttentionProbe]:
        token = _ACTIVE_PROBE.set(self)
        try:
            yield self
        finally:
            _ACTIVE_PROBE.reset(token)

    def record(self, layer: int, positions: torch.Tensor, entries: torch.Tensor, output: torch.Tensor) -> None:
        """positions [rows, q] of the tokens just processed (-1: padding), entries [rows, Hkv, N] the
        positions the cache held for them (-1: invalid), output [rows, q, Hq, D]."""
        lengths = self.lengths.to(positions.device)[:, None]
        rows, columns = ((positions >= 0) & (positions < lengths)).nonzero(as_tuple=True)
        at = positions[rows, columns]
        values = output[rows, columns].detach()
        rows, at = rows.cpu(), at.cpu()
        if self.reference is None:
            if self.outputs is None:
                shape = (*self.cosine_sum.shape, self.num_layers, *output.shape[2:])
                self.outputs = torch.zeros(shape, dtype=output.dtype)
            self.outputs[rows, at, layer] = values.cpu()
        else:
            cosine = attention_cosine(values, self.reference[rows, at, layer].to(values.device)).mean(-1)
            self.cosine_sum.index_put_((rows, at), cosine.double().cpu(), accumulate=True)
        self.layer_count.index_put_((rows, at), torch.ones_like(at), accumulate=True)
        if self.schedule is not None:
            self._count_overlap(layer, positions, entries)

    def _count_overlap(self, layer: int, positions: torch.Tensor, entries: torch.Tensor) -> None:
        """Golden step t is read at the forward that processes position p_t + 1 = B + tL."""
        schedule = self.schedule
        budget, interval = schedule.budget, schedule.interval
        steps = step_of(positions - 1, budget, interval)
        for step in steps[steps > 0].unique().tolist():
            start = step_position(step, budget, interval) + 1
            reached = (positions == start).any(dim=1).cpu() & (step <= schedule.num_steps) & (start < self.lengths)
            rows = reached.nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            held = entries[rows.to(entries.device)]
            kept = held.masked_fill(held > start - 1 - interval, -1)  # older than the recent window
            golden = schedule.kept[rows, step - 1, layer].to(held.device)
            hits, count = golden_overlap(kept, golden)
            self.overlap_hits.index_add_(0, rows, hits.sum(-1).cpu())
            self.overlap_kept.index_add_(0, rows, count.sum(-1).cpu())


def _probe_attention(module, query, key, value, attention_mask, eviction_cache=None, **kwargs):
    """The runtime's attention function, plus a report to the active probe (if any)."""
    output, weights = eviction_attention(module, query, key, value, attention_mask, eviction_cache=eviction_cache, **kwargs)
    probe = _ACTIVE_PROBE.get()
    if probe is not None:
        layer = eviction_cache.layers[module.layer_idx]
        probe.record(module.layer_idx, layer.pending_positions, layer.entry_positions(), output)
    return output, weights


register_runtime_attention(PROBE_ATTENTION, _probe_attention)


# -- the replay loop -----------------------------------------------------------------------------
@dataclass
class _Tally:
    """Everything one (policy, budget) accumulates over the batches, one entry per scored trace (the
    unit the confidence intervals resample)."""

    evicted_nll: list[torch.Tensor] = field(default_factory=list)
    full_nll: list[torch.Tensor] = field(default_factory=list)
    cosine: list[torch.Tensor] = field(default_factory=list)
    damages: list[EntropyDamage] = field(default_factory=list)
    overlap_hits: list[int] = field(default_factory=list)
    overlap_kept: list[int] = field(default_factory=list)
    never_evicted: int = 0
    seconds: float = 0.0
    traces: list[Trace] = field(default_factory=list)  # the scored traces, in the order of the lists above

    def add_trace(
        self,
        trace: Trace,
        nll: torch.Tensor,
        first_eviction: int | None,
        cosine: torch.Tensor | None,
        overlap: tuple[int, int] = (0, 0),
    ) -> None:
        """Score one replayed trace: nll [T - 1] with eviction; cosine [T - 1] per token (None: 1);
        overlap (hits, kept) with the golden kept set."""
        scored = scored_tokens(nll.numel(), first_eviction)
        if not bool(scored.any()):
            self.never_evicted += 1
            return
        self.evicted_nll.append(nll[scored])
        self.full_nll.append(trace.token_nll[scored])
        self.damages.append(low_entropy_damage(nll[scored], trace.token_nll[scored], trace.token_entropy[scored]))
        self.traces.append(trace)
        self.cosine.append(torch.ones(int(scored.sum()), dtype=torch.float64) if cosine is None else cosine[scored])
        self.overlap_hits.append(overlap[0])
        self.overlap_kept.append(overlap[1])

    def trace_scores(self, policy: str, budget: int) -> list[TraceScore]:
        """Each scored trace's sums, for intervals over traces (`foresight.headroom`)."""
        return [
            TraceScore(
                policy, budget, trace.index, trace.source, evicted.numel(), float(evicted.double().sum()),
                float(full.double().sum()), damage.low_entropy, damage.damaged,
            )
            for trace, damage, evicted, full in zip(self.traces, self.damages, self.evicted_nll, self.full_nll)
        ]

    def row(self, policy: str, budget: int, interval: int, overlap: bool) -> dict[str, Any]:
        tokens = sum(t.numel() for t in self.evicted_nll)
        evicted = torch.cat(self.evicted_nll) if tokens else torch.zeros(0)
        full = torch.cat(self.full_nll) if tokens else torch.zeros(0)
        damage = sum(self.damages, EntropyDamage())
        overlap = overlap and sum(self.overlap_kept) > 0
        row = {
            "policy": policy,
            "budget": budget,
            "interval": interval,
            "traces": len(self.evicted_nll),
            "tokens": tokens,
            "loss_ratio": loss_ratio(evicted, full) if tokens else None,
            "nll_evicted": float(evicted.double().mean()) if tokens else None,
            "nll_full": float(full.double().mean()) if tokens else None,
            "low_entropy_damage": damage.share if tokens else None,
            "low_entropy_dl2": damage.mean_squared if tokens else None,
            "low_entropy_penalty": damage.penalty if tokens else None,
            "low_entropy_tokens": damage.low_entropy,
            "damaged_tokens": damage.damaged,
            "attn_cosine": float(torch.cat(self.cosine).mean()) if tokens else None,
            "golden_overlap": sum(self.overlap_hits) / sum(self.overlap_kept) if overlap else None,
            "never_evicted": self.never_evicted,
            "seconds": round(self.seconds, 3),
        }
        for metric, parts in self._per_trace().items():
            set_interval(row, metric, None if row[metric] is None else bootstrap_interval(*parts))
        return row

    def _per_trace(self) -> dict[str, tuple[list[float], list[float]]]:
        """(numerator, denominator) per trace of every reported metric: the interval resamples traces."""
        return {
            "loss_ratio": ([float(t.double().sum()) for t in self.evicted_nll], [float(t.double().sum()) for t in self.full_nll]),
            "low_entropy_damage": ([d.damaged for d in self.damages], [d.low_entropy for d in self.damages]),
            "low_entropy_dl2": ([d.squared_sum for d in self.damages], [d.damaged for d in self.damages]),
            "low_entropy_penalty": ([d.squared_sum for d in self.damages], [d.low_entropy for d in self.damages]),
            "attn_cosine": ([float(c.sum()) for c in self.cosine], [c.numel() for c in self.cosine]),
            "golden_overlap": (self.overlap_hits, self.overlap_kept),
        }


@dataclass
class EvaluationResult:
    rows: list[dict[str, Any]]
    notes: list[str]
    trace_scores: list[TraceScore] = field(default_factory=list)
    learned: tuple[str, ...] = ()  # the rows of learned scorers (`ScorerSpec`), whatever they are named


def evaluate(
    model: torch.nn.Module,
    traces: Sequence[Trace],
    specs: Sequence[PolicySpec],
    budgets: Sequence[int],
    interval: int,
    *,
    labels_root: str | os.PathLike | None = None,
    batch_size: int = 4,
    progress: bool = True,
    share_prefix: bool = True,
) -> EvaluationResult:
    """Replay every trace under every policy and budget; one result row per (policy, budget).

    `share_prefix`: the policies of a batch reuse each other's forwards before the first eviction
    (`foresight.runtime.prefix`; the same results, less model work). `labels_root` is the traces
    folder whose labels-B{B}-L{L} folders hold golden labels (None: no
    labels). Golden runs, and the golden overlap is measured, only at budgets whose labels cover
    every evaluated trace; elsewhere a note says so.
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    for budget in budgets:
        check_budget(budget, interval)
    notes: list[str] = []
    plans = []
    for budget in sorted(set(budgets)):
        eligible = sorted((t for t in traces if t.input_ids.numel() >= budget + interval), key=lambda t: -t.input_ids.numel())
        short = len(traces) - len(eligible)
        if short:
            notes.append(f"B={budget}: skipped {short} of {len(traces)} traces shorter than B + L = {budget + interval} tokens")
        store = None if labels_root is None else LabelStore(labels_root, budget, interval)
        batch_labels = _labels_for(store, eligible, budget, interval, notes)
        budget_specs = [s for s in specs if not (s.needs_labels and batch_labels is None)]
        if len(budget_specs) < len(specs):
            notes.append(f"B={budget}: golden skipped (no labels for every trace at B={budget}, L={interval})")
        notes += [reason for s in budget_specs if (reason := s.skip_reason(budget, interval))]
        budget_specs = [s for s in budget_specs if s.skip_reason(budget, interval) is None]
        batches = [eligible[i : i + batch_size] for i in range(0, len(eligible), batch_size)]
        plans.append((budget, budget_specs, batches, batch_labels))
    total = sum(
        _work(batch, budget, interval, spec) for budget, budget_specs, batches, _ in plans
        for batch in batches for spec in _replayed(budget_specs)
    )
    rows, scores = [], []
    with tqdm(total=total, disable=not progress, unit="tok", desc="eval") as bar:
        for budget, budget_specs, batches, batch_labels in plans:
            tallies = {spec.name: _Tally() for spec in budget_specs}
            for batch in batches:
                schedule_labels = None if batch_labels is None else [batch_labels[t.index] for t in batch]
                _evaluate_batch(model, batch, budget_specs, budget, interval, schedule_labels, tallies, bar, share_prefix)
            budget_rows = [
                tallies[spec.name].row(spec.name, budget, interval, overlap=batch_labels is not None and spec.evicts)
                for spec in budget_specs
            ]
            notes += [
                f"B={budget}: {row['policy']} never evicted on {row['never_evicted']} trace(s) (too short for its "
                "cadence, e.g. after a protected prompt); its row leaves them out"
                for spec, row in zip(budget_specs, budget_rows) if spec.evicts and row["never_evicted"]
            ]
            rows += budget_rows
            scores += [score for spec in budget_specs for score in tallies[spec.name].trace_scores(spec.name, budget)]
    learned = tuple(spec.name for spec in specs if isinstance(spec, ScorerSpec))
    return EvaluationResult(rows=rows, notes=notes, trace_scores=scores, learned=learned)


def _labels_for(
    store: LabelStore | None, traces: Sequence[Trace], budget: int, interval: int, notes: list[str]
) -> dict[int, GoldenLabels] | None:
    """Labels of every trace by index, or None (with a note) when some trace has none."""
    if store is None or not traces:
        return None
    missing = [t.index for t in traces if not store.path(t.index).is_file()]  # a damaged file fails in load
    if missing:
        notes.append(
            f"B={budget}: no golden labels for {len(missing)} of {len(traces)} traces in {store.directory} "
            f"(make them with `foresight labels --traces {store.traces_dir} -B {budget} -L {interval}`)"
        )
        return None
    return {t.index: store.load(t.index, num_tokens=t.input_ids.numel()) for t in traces}


def _prefill(batch: Sequence[Trace], budget: int, interval: int, protects_prompt: bool) -> list[int]:
    """Prompt lengths handed to the replay (see the module docstring: the golden cadence, or the
    true prompts for policies that protect them)."""
    if protects_prompt:
        return [t.prompt_length for t in batch]
    return [golden_prefill([t.prompt_length for t in batch], budget, interval)] * len(batch)


def _replayed(specs: Sequence[PolicySpec]) -> list[PolicySpec]:
    """The replays of a batch: the full-cache reference (when anything evicts), then each evicting policy."""
    evicting = [spec for spec in specs if spec.evicts]
    return [REFERENCE, *evicting] if evicting else []


def _work(batch: Sequence[Trace], budget: int, interval: int, spec: PolicySpec) -> int:
    """Token columns x rows a replay of the batch feeds after its prefill (the progress bar's unit)."""
    prefill = _prefill(batch, budget, interval, spec.protects_prompt)
    return len(batch) * max(t.input_ids.numel() - p for t, p in zip(batch, prefill))


def _evaluate_batch(
    model: torch.nn.Module,
    batch: Sequence[Trace],
    specs: Sequence[PolicySpec],
    budget: int,
    interval: int,
    labels: Sequence[GoldenLabels] | None,
    tallies: dict[str, _Tally],
    bar: tqdm,
    share_prefix: bool,
) -> None:
    """One full-cache replay for the reference outputs, then one replay per evicting policy."""
    num_layers = model.config.get_text_config().num_hidden_layers
    lengths = [t.input_ids.numel() for t in batch]
    reference = AttentionProbe(lengths, num_layers)
    if any(spec.evicts for spec in specs):
        _replay(model, REFERENCE, batch, budget, interval, None, reference, bar)
    schedule = None if labels is None else GoldenSchedule.stack(labels)
    prefixes = {} if share_prefix else None  # per prefill: the forwards before the first eviction
    for spec in specs:
        tally = tallies[spec.name]
        if not spec.evicts:
            for trace in batch:
                tally.add_trace(trace, trace.token_nll, budget + interval, None)
            continue
        probe = AttentionProbe(lengths, num_layers, reference=reference.outputs, schedule=schedule)
        output = _replay(model, spec, batch, budget, interval, labels, probe, bar, prefixes)
        tally.seconds += output.stats.forward_seconds + output.stats.eviction_seconds
        for row, trace in enumerate(batch):
            predictions = trace.input_ids.numel() - 1
            _check_all_layers(probe.layer_count[row, :predictions], num_layers, spec.name)
            cosine = probe.cosine_sum[row, :predictions] / num_layers
            overlap = (int(probe.overlap_hits[row]), int(probe.overlap_kept[row]))
            tally.add_trace(trace, output.nll[row], output.first_eviction[row], cosine, overlap)


def _replay(
    model: torch.nn.Module,
    spec: PolicySpec,
    batch: Sequence[Trace],
    budget: int,
    interval: int,
    labels: Sequence[GoldenLabels] | None,
    probe: AttentionProbe,
    bar: tqdm,
    prefixes: dict[tuple[int, ...], ReplayPrefix] | None = None,
) -> ReplayOutput:
    """One replay of the batch; evicting policies with the same prefill share the forwards before their
    first eviction through `prefixes` (`foresight.runtime.prefix`: the same results, the model run once)."""
    engine = EvictionEngine(model, spec.build(labels), spec.config(budget, interval), attention=PROBE_ATTENTION)
    bar.set_postfix_str(f"B={budget} {spec.name}")
    prefill = _prefill(batch, budget, interval, engine.protect_prompt)
    chunk = None if spec.evicts else REFERENCE_CHUNK
    prefix = None if prefixes is None else prefixes.setdefault(tuple(prefill), ReplayPrefix())
    with probe.active():
        return engine.replay(
            [t.input_ids for t in batch], prefill, max_chunk=chunk, on_tokens=lambda n: bar.update(n * len(batch)),
            prefix=prefix,
        )


def _check_all_layers(counts: torch.Tensor, num_layers: int, policy: str) -> None:
    if bool((counts != num_layers).any()):
        raise RuntimeError(f"{policy}: the attention probe missed layers of some tokens (model not routed through AttentionInterface?)")


# -- the report ----------------------------------------------------------------------------------
COLUMNS: tuple[Column, ...] = (
    ("policy", "policy", "{}"),
    ("budget", "B", "{}"),
    ("interval", "L", "{}"),
    ("loss_ratio", "loss ratio", "{:.4f}"),
    ("low_entropy_damage", "low-entropy damage", "{:.2%}"),
    ("low_entropy_dl2", "mean ΔL² (damaged)", "{:.3f}"),
    ("low_entropy_penalty", "−R", "{:.4f}"),
    ("attn_cosine", "attn cosine", "{:.4f}"),
    ("golden_overlap", "golden overlap", "{:.3f}"),
    ("traces", "traces", "{}"),
    ("tokens", "tokens", "{}"),
)


def sorted_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """By budget, then loss ratio (best first; rows without one last)."""
    return sorted(rows, key=lambda r: (r["budget"], math.inf if r["loss_ratio"] is None else r["loss_ratio"]))


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The results as a markdown table, one line per (budget, policy), each metric with its 95%
    bootstrap interval over traces in brackets; '–' where a metric is undefined."""
    return format_table(sorted_rows(rows), COLUMNS)


def write_report(result: EvaluationResult, out_dir: str | os.PathLike, settings: dict[str, Any]) -> list[Path]:
    """Write results.json (the rows), results.csv, results.md (settings, notes, table) and one PNG
    per metric (budget against the metric, one line per policy, intervals as error bars), plus
    traces.json (every scored trace's sums) and, for each learned scorer, its share of the headroom
    over the best heuristic (a results.md section and headroom.json). Returns the paths written."""
    comparisons = learned_headroom(result)
    sections = [f"## The learned scorer against the best heuristic\n\n{c.markdown()}" for c in comparisons]
    paths = write_results(
        out_dir, "Teacher-forced evaluation", settings, result.notes, sorted_rows(result.rows), COLUMNS, METRICS,
        reference=REFERENCE.name, after=sections,
    )
    paths.append(Path(out_dir) / "traces.json")
    write_text(paths[-1], json.dumps([vars(score) for score in result.trace_scores], indent=1))
    if comparisons:
        paths.append(Path(out_dir) / "headroom.json")
        write_text(paths[-1], json.dumps([row for c in comparisons for row in headroom_rows(c)], indent=1))
    return paths


def learned_headroom(result: EvaluationResult) -> list[Headroom]:
    """`foresight.headroom.headroom` of every learned policy at every budget where it can be measured."""
    runs = sorted({(row["budget"], row["policy"]) for row in result.rows if row["policy"] in result.learned})
    comparisons = (headroom(result.trace_scores, budget, policy, result.learned) for budget, policy in runs)
    return [c for c in comparisons if c is not None]
