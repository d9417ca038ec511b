"""Teacher-forced evaluation of every policy on stored traces (docs/algorithms.md section 8).

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

Cadence (`foresight.cadence.Regime`). In the streaming regime (the paper's) the golden schedule counts
steps from the first token (p_t = B + tL - 1, prompt included), so every policy that does not protect the
prompt is replayed on that cadence: a batch prefills the same min(B + L, shortest prompt) tokens in every
row and feeds the rest in chunks that end at the evictions, so all rows evict together and every row's
step t follows position p_t (golden needs this; for the others it is the same computation as decoding
token by token). In the decode regime every row prefills its whole prompt, as `foresight generate` does:
a prompt longer than B + L ends with a compression step, and the row's steps follow every L tokens after
it, so rows evict on their own schedules; its labels are the decode regime's (`labels-B*-L*-decode`).
Policies that protect the prompt (raas, epikv) are replayed with their true prompt lengths in both: their
budget applies after the prompt, so their steps fall at P + B + tL - 1 and they hold P more entries.

Shared prefix: the evicting replays of a batch with the same prefill reuse the forwards before the first
eviction, recorded by the first of them (`foresight.runtime.prefix`); every figure is the same as
running the model on every token (`share_prefix=False`), with B + L tokens per row run once.

Sampled learned policy (`SampledScorerSpec`): the batch is replayed once per seed and each trace's
figures are the means over the seeds (`TraceTally.mean`): the same tokens are scored under every
seed, so its row pools per-trace means, with intervals over traces as for any other row.

Scored tokens: predictions made after a row's first eviction (`metrics.scored_tokens`), reported over all
of them and apart for prompt and generated tokens (`TokenSet`). A policy that never evicts (full) is the
reference itself: loss ratio 1, no damage, cosine 1, scored on the golden cadence's tokens (j >= B + L,
or j >= P after a decode compression). Traces shorter than B + L never evict and are skipped with a
count, per budget.

The probe lives in `foresight.eval.probe`, the metrics in `foresight.eval.metric_registry`, the per-trace
sums in `foresight.eval.tally` and the report in `foresight.eval.results`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from foresight.artifacts import claimed
from foresight.cadence import Regime, check_budget, golden_prefill, regime_shift
from foresight.data.trace_store import Trace
from foresight.eval.probe import PROBE_ATTENTION, AttentionProbe
from foresight.eval.replay_store import ReplayStore
from foresight.eval.results import EvaluationResult
from foresight.eval.specs import REFERENCE, PolicySpec, ScorerSpec
from foresight.eval.tally import TraceTally
from foresight.labels import GoldenLabels, LabelKind, LabelStore
from foresight.models import describe
from foresight.policies.golden import GoldenSchedule
from foresight.runtime.engine import EvictionConfig, EvictionEngine, ReplayOutput
from foresight.runtime.held_memory import MIB, Shape, held_bytes
from foresight.runtime.pool import Layout
from foresight.runtime.prefix import ReplayPrefix

REFERENCE_CHUNK = 256  # tokens per forward of the full-cache replay (bounds the [batch, chunk, vocab] logits)


def evaluate(
    model: torch.nn.Module,
    traces: Sequence[Trace],
    specs: Sequence[PolicySpec],
    budgets: Sequence[int],
    interval: int,
    *,
    labels_root: str | os.PathLike | None = None,
    label_kind: LabelKind | str = LabelKind.ALPHA,
    batch_size: int = 4,
    progress: bool = True,
    share_prefix: bool = True,
    replays: ReplayStore | None = None,
    regime: Regime | str = Regime.STREAMING,
) -> EvaluationResult:
    """Replay every trace under every policy and budget, on the steps of `regime`; one result row per
    (policy, budget).

    `share_prefix`: the policies of a batch reuse each other's forwards before the first eviction
    (`foresight.runtime.prefix`; the same results, less model work). `labels_root` is the traces
    folder whose labels-B{B}-L{L} folders hold golden labels (None: no
    labels), of kind `label_kind` (golden then replays that kind's schedule). Golden runs, and the golden overlap is measured, only at budgets whose labels cover
    every evaluated trace; elsewhere a note says so. `replays`: where each evicting policy's replay of a batch is
    kept as soon as it ends, and read instead of replayed when a rerun finds it (None: nothing kept).
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    regime = Regime.parse(regime)
    for budget in budgets:
        check_budget(budget, interval)
    notes: list[str] = []
    plans = []
    for budget in sorted(set(budgets)):
        cadence = Cadence(budget, interval, regime)
        eligible = sorted(
            (t for t in traces if t.input_ids.numel() >= budget + interval), key=lambda t: -t.input_ids.numel()
        )
        short = len(traces) - len(eligible)
        if short:
            notes.append(
                f"B={budget}: skipped {short} of {len(traces)} traces shorter than B + L = {budget + interval} tokens"
            )
        store = None if labels_root is None else LabelStore(labels_root, budget, interval, label_kind, regime)
        batch_labels = _labels_for(store, eligible, cadence.eviction, notes)
        budget_specs = [s for s in specs if not (s.needs_labels and batch_labels is None)]
        if len(budget_specs) < len(specs):
            notes.append(f"B={budget}: golden skipped (no labels for every trace at B={budget}, L={interval})")
        notes += [reason for s in budget_specs if (reason := s.skip_reason(cadence.eviction))]
        budget_specs = [s for s in budget_specs if s.skip_reason(cadence.eviction) is None]
        batches = [eligible[i : i + batch_size] for i in range(0, len(eligible), batch_size)]
        plans.append((cadence, budget_specs, batches, batch_labels))
    total = sum(
        _work(batch, cadence, spec)
        for cadence, budget_specs, batches, _ in plans
        for batch in batches
        for spec in _replayed(budget_specs)
    )
    rows, scores, losses = [], [], []
    shape, dtype = describe(model), next(model.parameters()).dtype
    with tqdm(total=total, disable=not progress, unit="tok", desc="eval") as bar:
        for cadence, budget_specs, batches, batch_labels in plans:
            budget = cadence.budget

            def run_batch(batch: Sequence[Trace], tallies: dict[str, TraceTally], bar: tqdm) -> None:
                schedule_labels = None if batch_labels is None else [batch_labels[t.index] for t in batch]
                _evaluate_batch(
                    model, batch, budget_specs, cadence, schedule_labels, tallies, bar, share_prefix, replays
                )

            replayed_here = set()
            if replays is not None:  # claim and replay first; every batch is then in the store, read in order below
                for batch in _claimed_batches(replays, batches, budget_specs, cadence.eviction):
                    run_batch(batch, {spec.name: TraceTally() for spec in budget_specs}, bar)
                    replayed_here.add(id(batch))
            tallies = {spec.name: TraceTally() for spec in budget_specs}
            for batch in batches:  # a batch replayed above is read back here: its work was counted then
                run_batch(batch, tallies, tqdm(disable=True) if id(batch) in replayed_here else bar)
            budget_rows = [
                tallies[spec.name].row(spec.name, cadence.eviction, overlap=batch_labels is not None and spec.evicts)
                | kv_memory(spec, cadence.eviction, tallies[spec.name].traces, shape, dtype, batch_labels)
                for spec in budget_specs
            ]
            notes += [
                f"B={budget}: {row['policy']} never evicted on {row['never_evicted']} trace(s) (too short for its "
                "cadence, e.g. after a protected prompt); its row leaves them out"
                for spec, row in zip(budget_specs, budget_rows)
                if spec.evicts and row["never_evicted"]
            ]
            rows += budget_rows
            scores += [score for spec in budget_specs for score in tallies[spec.name].trace_scores(spec.name, budget)]
            losses += [loss for spec in budget_specs for loss in tallies[spec.name].token_losses(spec.name, budget)]
    learned = tuple(spec.name for spec in specs if isinstance(spec, ScorerSpec))
    reference_nll = {t.index: t.token_nll.float() for t in traces}
    return EvaluationResult(
        rows=rows, notes=notes, trace_scores=scores, learned=learned, token_losses=losses, reference_nll=reference_nll
    )


def kv_memory(
    spec: PolicySpec,
    eviction: EvictionConfig,
    traces: Sequence[Trace],
    shape: Shape,
    dtype: torch.dtype,
    labels: dict[int, GoldenLabels] | None = None,
) -> dict[str, float | None]:
    """The row's peak KV memory per sequence (the x axis of the field's accuracy-against-memory curves), the mean
    over the traces its figures come from: entries min(T, B + L), plus the prompt for a policy that protects it
    (the full cache holds every token of a trace; a decode regime's prefill holds a long prompt for a moment,
    alike under every policy, and is not counted), and MiB of everything the policy holds with them
    (`foresight.runtime.held_memory`: K/V, positions, per-entry state, query ring, buffered queries). `labels`:
    golden's, by trace index. None without traces."""
    if not traces:
        return {"kv_entries": None, "kv_mib": None}
    policy = spec.replays()[0].build(
        [labels[traces[0].index]] if spec.needs_labels else None, [t.index for t in traces]
    )
    budget, interval = eviction.budget, eviction.interval
    peaks = [
        t.input_ids.numel()
        if not spec.evicts
        else min(t.input_ids.numel(), budget + interval + (t.prompt_length if spec.protects_prompt else 0))
        for t in traces
    ]
    config = spec.config(eviction)
    layout = config.layout if config is not None else Layout.HEADS
    held = [held_bytes(shape, policy, budget, interval, dtype, entries=peak, layout=layout).total for peak in peaks]
    return {"kv_entries": sum(peaks) / len(peaks), "kv_mib": sum(held) / len(held) / MIB}


def _labels_for(
    store: LabelStore | None, traces: Sequence[Trace], eviction: EvictionConfig, notes: list[str]
) -> dict[int, GoldenLabels] | None:
    """Labels of every trace by index, or None (with a note) when some trace has none."""
    if store is None or not traces:
        return None
    missing = [t.index for t in traces if not store.path(t.index).is_file()]  # a damaged file fails in load
    if missing:
        notes.append(
            f"B={eviction.budget}: no golden labels for {len(missing)} of {len(traces)} traces in {store.directory} "
            f"(make them with `foresight labels --traces {store.traces_dir} -B {eviction.budget} -L {eviction.interval}`)"
        )
        return None
    return {t.index: store.load(t.index, num_tokens=t.input_ids.numel()) for t in traces}


@dataclass(frozen=True)
class Cadence:
    """B, L and the regime one budget's replays run on."""

    budget: int
    interval: int
    regime: Regime = Regime.STREAMING

    def prefill_lengths(self, batch: Sequence[Trace], protects_prompt: bool) -> list[int]:
        """Prompt lengths handed to the replay (see the module docstring: the streaming regime's golden cadence,
        or the true prompts in the decode regime and for policies that protect them)."""
        if protects_prompt or self.regime is Regime.DECODE:
            return [t.prompt_length for t in batch]
        return [golden_prefill([t.prompt_length for t in batch], self.budget, self.interval)] * len(batch)

    def first_scored(self, trace: Trace) -> int:
        """The first prediction made after golden's first eviction: B + L, or P after a decode compression."""
        shift = regime_shift(trace.prompt_length, self.budget, self.interval, self.regime)
        return trace.prompt_length if shift else self.budget + self.interval

    @property
    def eviction(self) -> EvictionConfig:
        """B and L as the engine takes them; each policy's spec adds its sinks and prompt rule (`PolicySpec.config`)."""
        return EvictionConfig(self.budget, self.interval)


def _claimed_batches(
    replays: ReplayStore, batches: Sequence[Sequence[Trace]], specs: Sequence[PolicySpec], eviction: EvictionConfig
) -> Iterator[Sequence[Trace]]:
    """The batches this process replays: those it claims and finds not yet kept; with several processes on one
    folder, each batch goes to one of them, and each returns once every batch is kept."""
    return claimed(
        batches,
        lambda batch: replays.claim_path(eviction, batch),
        lambda batch: replays.holds(specs, eviction, batch),
    )


def _replayed(specs: Sequence[PolicySpec]) -> list[PolicySpec]:
    """The replays of a batch: the full-cache reference (when anything evicts), then each evicting
    policy's (one per seed of a sampled one)."""
    evicting = [replay for spec in specs if spec.evicts for replay in spec.replays()]
    return [REFERENCE, *evicting] if evicting else []


def _work(batch: Sequence[Trace], cadence: Cadence, spec: PolicySpec) -> int:
    """Token columns x rows a replay of the batch feeds after its prefill (the progress bar's unit)."""
    prefill = cadence.prefill_lengths(batch, spec.protects_prompt)
    return len(batch) * max(t.input_ids.numel() - p for t, p in zip(batch, prefill))


def _evaluate_batch(
    model: torch.nn.Module,
    batch: Sequence[Trace],
    specs: Sequence[PolicySpec],
    cadence: Cadence,
    labels: Sequence[GoldenLabels] | None,
    tallies: dict[str, TraceTally],
    bar: tqdm,
    share_prefix: bool,
    store: ReplayStore | None = None,
) -> None:
    """One full-cache replay for the reference outputs, then the replays of every evicting policy, each kept in
    `store` as soon as it ends; a policy whose replay of this batch `store` holds already is read from it (and
    the progress bar skips its work; the reference runs only when some evicting policy is replayed)."""
    kept: dict[str, TraceTally] = {}
    for spec in specs if store is not None else ():
        if spec.evicts and (tally := store.load(spec, cadence.eviction, batch)) is not None:
            kept[spec.name] = tally
    missing = [spec for spec in specs if spec.name not in kept]

    def work(replays: Sequence[PolicySpec]) -> int:
        return sum(_work(batch, cadence, replay) for replay in replays)

    bar.update(work(_replayed(specs)) - work(_replayed(missing)))
    reference, greedy = None, None  # the full cache's probe and top-1 predictions per trace
    if any(spec.evicts for spec in missing):
        num_layers = model.config.get_text_config().num_hidden_layers
        reference = AttentionProbe([t.input_ids.numel() for t in batch], num_layers)
        greedy = _replay(model, REFERENCE, batch, cadence, None, reference, bar).greedy
    schedule = None if labels is None else GoldenSchedule.stack(labels)
    prefixes = {} if share_prefix else None  # per prefill: the forwards before the first eviction
    for spec in specs:
        tally = tallies[spec.name]
        if spec.name in kept:
            tally.extend(kept[spec.name])
        elif not spec.evicts:
            for trace in batch:
                tally.add_trace(trace, trace.token_nll, cadence.first_scored(trace), None)
        else:
            replays = [
                _tally_replay(model, replay, batch, cadence, labels, (reference, greedy), schedule, bar, prefixes)
                for replay in spec.replays()
            ]
            replayed = TraceTally.mean(replays)
            tally.extend(replayed)
            if store is not None:
                store.save(spec, replayed, cadence.eviction, batch)


def _tally_replay(
    model: torch.nn.Module,
    spec: PolicySpec,
    batch: Sequence[Trace],
    cadence: Cadence,
    labels: Sequence[GoldenLabels] | None,
    full: tuple[AttentionProbe, list[torch.Tensor]],
    schedule: GoldenSchedule | None,
    bar: tqdm,
    prefixes: dict[tuple[int, ...], ReplayPrefix] | None,
) -> TraceTally:
    """One replay of the batch under an evicting policy, scored against the full cache's replay (`full`: its
    attention probe and its top-1 predictions per trace)."""
    reference, greedy = full
    num_layers = model.config.get_text_config().num_hidden_layers
    probe = AttentionProbe(
        [t.input_ids.numel() for t in batch], num_layers, reference=reference.outputs, schedule=schedule
    )
    output = _replay(model, spec, batch, cadence, labels, probe, bar, prefixes)
    tally = TraceTally(seconds=output.stats.forward_seconds + output.stats.eviction_seconds)
    for row, trace in enumerate(batch):
        predictions = trace.input_ids.numel() - 1
        _check_all_layers(probe.layer_count[row, :predictions], num_layers, spec.name)
        cosine = probe.cosine_sum[row, :predictions] / num_layers
        overlap = (int(probe.overlap_hits[row]), int(probe.overlap_kept[row]))
        flipped = output.greedy[row] != greedy[row]
        tally.add_trace(trace, output.nll[row], output.first_eviction[row], cosine, overlap, flipped)
    return tally


def _replay(
    model: torch.nn.Module,
    spec: PolicySpec,
    batch: Sequence[Trace],
    cadence: Cadence,
    labels: Sequence[GoldenLabels] | None,
    probe: AttentionProbe,
    bar: tqdm,
    prefixes: dict[tuple[int, ...], ReplayPrefix] | None = None,
) -> ReplayOutput:
    """One replay of the batch; evicting policies with the same prefill share the forwards before their
    first eviction through `prefixes` (`foresight.runtime.prefix`: the same results, the model run once)."""
    policy = spec.build(labels, [t.index for t in batch])
    engine = EvictionEngine(model, policy, spec.config(cadence.eviction), attention=PROBE_ATTENTION)
    bar.set_postfix_str(f"B={cadence.budget} {spec.name}")
    prefill = cadence.prefill_lengths(batch, engine.protect_prompt)
    chunk = None if spec.evicts else REFERENCE_CHUNK
    prefix = None if prefixes is None else prefixes.setdefault(tuple(prefill), ReplayPrefix())
    with probe.active():
        return engine.replay(
            [t.input_ids for t in batch],
            prefill,
            max_chunk=chunk,
            on_tokens=lambda n: bar.update(n * len(batch)),
            prefix=prefix,
        )


def _check_all_layers(counts: torch.Tensor, num_layers: int, policy: str) -> None:
    if bool((counts != num_layers).any()):
        raise RuntimeError(
            f"{policy}: the attention probe missed layers of some tokens (model not routed through AttentionInterface?)"
        )
