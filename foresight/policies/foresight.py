"""ForesightKV's learned scorer as an eviction policy (ForesightKV §3.1 Eqs. 1-2, App. B; docs/algorithms.md §5).

Size: one policy; its features, its batched layers and its sampled mode (Eq. 2, recorded for GRPO) read
the same per-step contexts, so they stay together.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from foresight.choices import Choice
from foresight.models import ModelShape, float_dtype
from foresight.policies import register
from foresight.policies.golden import GoldenEviction
from foresight.runtime.cache import StateField
from foresight.runtime.capture import OBSERVATION_BLOCK, STEP_LOGITS, first_observed_query, sub_blocks
from foresight.runtime.policy import EvictionContext, ObservedQueries, Policy, layers_as_rows
from foresight.scorer import standardised_features as standardised
from foresight.scorer.attention_features import FeatureSet, attention_features
from foresight.scorer.eviction_sampling import (
    EvictionDraw,
    check_temperature,
    draw_eviction,
    guided_eviction,
    plackett_luce_logprob,
)
from foresight.scorer.model import ForesightScorer, ScoreScale, load_scorer

CUMULATIVE = "cumulative"
DECAYED = "decayed"
FEATURE_STATE = (CUMULATIVE, DECAYED)
"""Per-entry state of the older feature sets: raw cumulative and decayed sums per query head."""
STANDARDISED_STATE = standardised.PER_QUERY_HEAD_STATE
"""Per-entry state of the standardised set: raw cumulative, decayed and recent sums per query head (the
observed count is derived from positions, `standardised.observed_queries`)."""


def feature_state(
    feature_set: str | FeatureSet,
    sums: torch.dtype = torch.float32,
    cumulative: torch.dtype = torch.float32,
    streamed: bool = False,
) -> tuple[StateField, ...]:
    """The per-entry state a feature set keeps in the cache (only what it reads, so the older sets'
    caches stay as they were), its cumulative sum stored at `cumulative` and its bounded sums at `sums`; with
    `streamed`, also the window sums of a streamed observation (`standardised.window_state`), bounded too (a
    window of w queries sums to at most w per query head), at `sums`."""
    feature_set = FeatureSet.parse(feature_set)
    names = STANDARDISED_STATE if feature_set.standardised else FEATURE_STATE
    windows = standardised.window_state(feature_set) if streamed else ()
    return tuple(
        StateField(name, per_query_head=feature_set.per_query_head, dtype=cumulative if name == CUMULATIVE else sums)
        for name in (*names, *windows)
    )


def _summed_over_group(attention: torch.Tensor, feature_set: str) -> torch.Tensor:
    """Block attention [batch, Hkv, G, l, N] as the feature functions read it: for the grouped set, the group's
    query heads summed ([batch, Hkv, 1, l, N]); else as it is."""
    return attention if FeatureSet.parse(feature_set).per_query_head else attention.sum(-3, keepdim=True)


def _readable(state: Mapping[str, torch.Tensor], feature_set: str) -> dict[str, torch.Tensor]:
    """The state as the feature functions read it: the grouped set's sums [batch, Hkv, N] with a group dim of 1."""
    if FeatureSet.parse(feature_set).per_query_head:
        return dict(state)
    return {name: value[..., None] for name, value in state.items()}


def _stored(state: Mapping[str, torch.Tensor], feature_set: str) -> dict[str, torch.Tensor]:
    """The state as the cache holds it (`_readable` undone)."""
    if FeatureSet.parse(feature_set).per_query_head:
        return dict(state)
    return {name: value[..., 0] for name, value in state.items()}


class Observation(Choice):
    """How the learned policy reads the attention of each eviction window (docs/algorithms.md section 5)."""

    STREAM = ObservedQueries.STREAM.value
    WINDOW = ObservedQueries.WINDOW.value
    FORWARD = ObservedQueries.FORWARD.value


def observe_features(context: EvictionContext, feature_set: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Attention features a_n of this step's candidates [batch, Hkv, C, F*G], exactly as the scorer reads
    them, and the updated feature state of every entry.

    Shared by the learned policy and the supervised data maker, so that training and inference
    compute features from the same block attention and state in the same way, the standardised set's
    standardisation over the valid candidates included. A context without queries is a streamed step's
    (`ObservedQueries.STREAM`): its window's sums are in the state already."""
    if context.queries is None:
        return _streamed_features(context, feature_set)
    blocks = _attention_blocks(
        context.queries, context.query_positions, context.keys, context.positions, context.scaling, feature_set
    )
    if blocks is None:
        blocks = [(context.attention, context.query_positions)]
    moments = None
    if FeatureSet.parse(feature_set).reads_window_logits:
        moments = standardised.window_logit_moments(
            context.queries, context.query_positions, context.keys, context.scaling
        )
    return _features(
        blocks,
        context.state,
        context.positions,
        context.query_positions,
        context.num_candidates,
        feature_set,
        context.first_observed,
        moments,
    )


def _streamed_features(context: EvictionContext, feature_set: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`observe_features` at a streamed eviction step: the features from the state, the window sums reset."""
    if context.first_observed is None:
        raise ValueError("a streamed eviction step needs each row's first observed query position")
    features, state = standardised.streamed_features(
        _readable(context.state, feature_set),
        context.positions,
        context.newest_position,
        context.first_observed,
        feature_set,
        context.num_candidates,
    )
    valid = context.positions[..., : context.num_candidates] >= 0
    return standardised.standardise_candidates(features, valid), _stored(state, feature_set)


def _attention_blocks(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    feature_set: str,
) -> Iterable[tuple[torch.Tensor, torch.Tensor]] | None:
    """The standardised sets' block attention in sub-blocks of `OBSERVATION_BLOCK` queries when L is longer
    (their features are block-size invariant: sums decay per token and the windows are at most 32 queries, so
    sub-blocks change them only by rounding); None for one block of all L (the older sets' "last L" window,
    block max and min span the block)."""
    if not FeatureSet.parse(feature_set).standardised or queries.shape[2] <= OBSERVATION_BLOCK:
        return None
    return sub_blocks(queries, query_positions, keys, positions, scaling)


def _features(
    blocks: Iterable[tuple[torch.Tensor, torch.Tensor]],
    state: Mapping[str, torch.Tensor],
    positions: torch.Tensor,
    query_positions: torch.Tensor,
    num_candidates: int,
    feature_set: str,
    first_observed: torch.Tensor | None = None,
    logit_moments: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`observe_features` of block attention in `blocks` [(weights [batch, Hkv, G, l, N], their query positions)],
    oldest first (one block for the older sets); every batch row on its own. The state runs in float32 from
    block to block and is stored back at its fields' dtypes once. logit_moments: the whole window's
    (`standardised.window_logit_moments`), for a set that reads them."""
    candidates = slice(0, num_candidates)
    if FeatureSet.parse(feature_set).standardised:
        if first_observed is None:
            first_observed = first_observed_query(query_positions)
        running = {name: value.float() for name, value in _readable(state, feature_set).items()}
        for attention, block_positions in blocks:
            features, running = standardised.standardised_features(
                _summed_over_group(attention, feature_set),
                running,
                positions,
                block_positions,
                feature_set,
                first_observed,
                logit_moments,
            )
        valid = positions[..., candidates] >= 0
        new_state = {name: value.to(state[name].dtype) for name, value in _stored(running, feature_set).items()}
        return standardised.standardise_candidates(features[..., candidates, :], valid), new_state
    ((attention, _),) = blocks
    features, cumulative, decayed = attention_features(attention, state[CUMULATIVE], state[DECAYED], feature_set)
    return features[..., candidates, :], {CUMULATIVE: cumulative, DECAYED: decayed}


class EvictionMode(Choice):
    """How keep scores become evictions: the L lowest, or sampled by Eq. 2."""

    DETERMINISTIC = "deterministic"
    SAMPLED = "sampled"


@dataclass(frozen=True)
class SampledEviction:
    """One layer's sampled eviction at one step (Eq. 2), as the GRPO stage needs it.

    The batch dim holds the rows that evicted at this step (all rows when they evict together, as
    the rollouts of one trace do); `query_positions` [batch, L] names the step. The scorer inputs of
    the pool P = min(2L, candidates) are kept (the Plackett-Luce probability depends on the pool's
    scores only): keys, values [batch, Hkv, P, D], features [batch, Hkv, P, F*G], their sequence
    positions [batch, Hkv, P] and eligible [batch, Hkv, P] (False: an invalid slot, probability 0).
    `order` [batch, Hkv, L] indexes the pool in sampled order; `logprob` [batch, Hkv] is its
    log-probability under the sampling scorer at the sampling `temperature`.
    """

    layer: int
    query_positions: torch.Tensor
    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    features: torch.Tensor
    eligible: torch.Tensor
    order: torch.Tensor
    logprob: torch.Tensor
    temperature: float = 1.0

    def logprob_under(self, scorer: ForesightScorer) -> torch.Tensor:
        """Log-probability [batch, Hkv] of the recorded eviction under `scorer` (differentiable; the
        ratio of GRPO, ForesightKV Eq. 10)."""
        scores = scorer.score_layer(self.layer, self.keys, self.values, self.features)
        pool = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
        return plackett_luce_logprob(scores, pool, self.order, eligible=self.eligible, temperature=self.temperature)


@register
@dataclass
class Foresight(Policy):
    """The learned scorer of ForesightKV (§3.1, App. B): one MLP per (layer, KV head) maps
    x_n = [k_n || v_n || a_n] to a keep score, a_n being attention features of the block attention
    (`foresight.scorer.attention_features`, `foresight.scorer.standardised_features`) whose running sums
    live in the per-entry state (`feature_state`).

    scorer: a `ForesightScorer`, or a folder / Hub repo id to load one from (required).
    mode: "deterministic" (default) evicts the L lowest-scoring candidates; "sampled" draws the
      L evictions from the 2L lowest by Eq. 2 (softmax over the negated scores, without
      replacement), using a generator seeded with `seed` at the start of every run, and records
      each layer's draw in `records` (a list of `SampledEviction`) for the reinforcement stage. A step with
      more than B candidates (the decode regime's compression after a long prompt) is taken
      deterministically in either mode and not recorded.
    temperature: τ of the sampled mode: Eq. 2's softmax reads the negated scores divided by τ (default 1,
      the paper's). A smaller τ sharpens the draw towards the deterministic policy (τ -> 0 evicts the
      L lowest); the pool, the 2L lowest, does not depend on it.
    seed: seed of the sampled mode (default 0).
    row_seeds: one seed per batch row instead (sampled mode, every row evicting at every step, as the
      rollouts of one trace do): each row draws from its own generator, so a row's evictions do not
      depend on which rows share its batch (rollouts split across processes sample as on one).
    sampled_layers: the layers that sample in sampled mode (None: all); the others evict their L lowest as
      the deterministic mode does, and only the sampled layers' draws are recorded (a branch group of the
      reinforcement stage may sample a few layers of a step, `trainers.reinforcement.branches`).
    guide, guided_rows: sampled mode with `row_seeds`: the batch rows in `guided_rows` do not sample; in the sampled
      layers they evict what golden (`guide`, a `GoldenEviction` over the same rows' labels) proposes among the same
      pool (`foresight.scorer.eviction_sampling.guided_eviction`), recorded with its log-probability under the
      scorer like any draw (the reinforcement stage's golden-swap rows, `trainers.reinforcement.branches`).
    record: keep each sampled draw in `records` (default true, what the reinforcement stage learns from);
      false when only the evictions matter (`foresight eval`, `foresight generate`), as the records of
      a long run hold the pool's keys, values and features of every step and layer.
    sums_dtype: the dtype the cache stores the bounded sums at (decayed, recent and a streamed observation's window
      sums; default: the scorer's `ScorerConfig.sums_dtype`, "float32" unless its folder names another).
      "float16" passes the one-sided state gate for the serving scorer (docs/notes/lean-state.md), which holds it.
    cumulative_dtype: the dtype of the cumulative sum (default "float32": it grows with the trace, so a 16-bit
      copy rounds each block's share relative to the whole sum, and overflows fp16 past 65504 queries).
    query_dtype: the dtype the buffered queries of block attention are held at where narrower than the model's
      (default "float32": the model's for a float32 or 16-bit model; block attention reads them in float32).
      "float16" halves a float32 model's ring (30% of its K/V bytes at B = 128, L = 32 to 15%) but failed the
      kept-set identity gate: 95.97% of kept sets identical on gsm-heldout, Δ loss ratio −0.0003
      [−0.0014, +0.0013] (docs/notes/lean-state.md).
    observation: "stream" (default) observes each query of an eviction window right after the forward that made
      it and keeps the window's sums per entry (`ObservedQueries.STREAM`), so no ring of L queries is held (30%
      of the default model's K/V bytes at B = 128, L = 32); "window" reads a ring of the window's L queries at
      the step, as kvpress's press must; "forward" adds the same sums inside the attention of the forward that made
      each query, from the probabilities that give its output (`ObservedQueries.FORWARD`): no query is held or
      computed against the keys again (the per-head layout and eager decode only). The standardised sets only: the
      older sets' block max and min need the whole block, and the transfer set's logit moments the window's
      queries, so they always read the window.
    stream_block: the queries a streaming policy is handed at once (default 4): each decode forward's query waits
      until 4 have come (or until an eviction step), so the runtime holds up to 4 queries of every query head
      (3.75% of the default model's K/V bytes) and the per-query work runs once per 4 tokens (1: none held
      between forwards, the work at every forward; docs/notes/lean-state.md measures both).

    The scorer fits one model shape and one (B, L); both are checked against the cache at every
    eviction step. B is read from the valid candidates per row, which number exactly B at every
    step but the run's first (a prefill of a prompt longer than B + L brings more), so the policy
    refuses a protected prompt (the scorer never saw one in training). In sampled mode the engine
    must add no sinks (the default), so that it evicts exactly the sampled entries.

    The pooled layout (`EvictionConfig(layout="pooled")`) runs it deterministically (`pooled_limit`), in either
    observation: each head's state is gathered into its view at a step or a streamed block and written back to the
    pool. Its allocation "layer" needs a calibrated scorer (`scores_compare_across_heads`).
    """

    name = "foresight"
    summary = "learned per-(layer, KV head) MLP keep scores (ForesightKV)"
    needs_attention = True
    runs_pooled = True  # deterministic (`pooled_limit`)

    scorer: ForesightScorer | str | os.PathLike
    mode: str = EvictionMode.DETERMINISTIC.value
    temperature: float = 1.0
    seed: int = 0
    row_seeds: tuple[int, ...] | None = None
    sampled_layers: tuple[int, ...] | None = None
    guide: GoldenEviction | None = field(default=None, repr=False)
    guided_rows: tuple[int, ...] = ()
    record: bool = True
    sums_dtype: str | None = None
    cumulative_dtype: str = "float32"
    query_dtype: str = "float32"
    observation: str = Observation.STREAM.value
    stream_block: int = 4
    records: list[SampledEviction] = field(default_factory=list, init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)
    _pending: dict[int, tuple[EvictionContext, torch.Tensor, int]] = field(
        default_factory=dict, init=False, repr=False
    )  # layer -> its context, the features of its pass [layers, ...] and its index there
    _generator: torch.Generator | list[torch.Generator] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.scorer, (str, os.PathLike)):
            self.scorer = load_scorer(self.scorer)
        if not isinstance(self.scorer, ForesightScorer):
            raise ValueError(
                f"scorer must be a ForesightScorer or a folder to load one from, got {type(self.scorer).__name__}"
            )
        if self.scorer.needs_output_factors:
            raise ValueError(
                "the scorer reads log‖W_o v‖ (the transfer set) but holds no output factors: a fit sets them from "
                "its model; for a scorer made by hand call ForesightScorer.set_output_factors(model)"
            )
        if self.sums_dtype is None:
            self.sums_dtype = self.scorer.config.sums_dtype
        self.mode = EvictionMode.parse(self.mode).value
        self.observation = Observation.parse(self.observation).value
        if not isinstance(self.stream_block, int) or self.stream_block < 1:
            raise ValueError(f"stream_block must be a positive number of queries, got {self.stream_block!r}")
        check_temperature(self.temperature)
        for name in ("sums_dtype", "cumulative_dtype", "query_dtype"):
            float_dtype(name, getattr(self, name))
        if self.row_seeds is not None:
            self.row_seeds = tuple(int(seed) for seed in self.row_seeds)
        self.guided_rows = tuple(sorted({int(row) for row in self.guided_rows}))
        if self.guided_rows and (
            self.guide is None or self.row_seeds is None or self.mode != EvictionMode.SAMPLED.value
        ):
            raise ValueError(
                f"guided_rows={self.guided_rows} need a guide (golden over the rows' labels), row_seeds and mode "
                f"'sampled', got guide={type(self.guide).__name__}, row_seeds={self.row_seeds}, mode={self.mode!r}"
            )
        if self.guided_rows and not all(0 <= row < len(self.row_seeds) for row in self.guided_rows):
            raise ValueError(f"guided_rows must name rows 0..{len(self.row_seeds) - 1}, got {self.guided_rows}")
        if self.sampled_layers is not None:
            self.sampled_layers = tuple(sorted({int(layer) for layer in self.sampled_layers}))
            layers = self.scorer.config.num_layers
            if not self.sampled_layers or not all(0 <= layer < layers for layer in self.sampled_layers):
                raise ValueError(
                    f"sampled_layers must name some of the layers 0..{layers - 1}, got {self.sampled_layers}"
                )

    @property
    def observed_queries(self) -> ObservedQueries:
        """STREAM or FORWARD where `observation` asks for it and the feature set allows it (its statistics are sums;
        the transfer set's logit moments are not), else WINDOW."""
        feature_set = FeatureSet.parse(self.scorer.config.feature_set)
        if not self._standardised or feature_set.reads_window_logits:
            return ObservedQueries.WINDOW
        return ObservedQueries(self.observation)

    @property
    def scores_compare_across_heads(self) -> bool:
        """A calibrated scorer's scores estimate log α on one scale for every head (`ScoreScale.LOG_TARGET`); an
        ordinal scorer's rank the candidates of one head only."""
        return self.scorer.config.scale is ScoreScale.LOG_TARGET

    @property
    def scores_apart_in_words(self) -> str:
        return f"the scorer's scale is {self.scorer.config.scale.value!r}, which ranks within a head only"

    @property
    def pooled_limit(self) -> str | None:
        """A sampled draw evicts L of each head's 2L lowest keep scores, which the heads' different counts at
        allocation 'layer' do not follow: the pool runs the deterministic mode only."""
        if self.mode != EvictionMode.DETERMINISTIC.value:
            return f"in mode {self.mode!r} yet; give mode='deterministic'"
        if self.observed_queries is ObservedQueries.FORWARD:
            return "in observation 'forward' (the pool's attention is masked SDPA); give observation='stream'"
        return None

    @property
    def _standardised(self) -> bool:
        return FeatureSet.parse(self.scorer.config.feature_set).standardised

    @property
    def state_fields(self) -> tuple[StateField, ...]:
        """The per-entry state of the scorer's feature set, at `sums_dtype` and `cumulative_dtype`, and the window
        sums of a streamed observation."""
        return feature_state(
            self.scorer.config.feature_set,
            float_dtype("sums_dtype", self.sums_dtype),
            float_dtype("cumulative_dtype", self.cumulative_dtype),
            streamed=self.observed_queries in (ObservedQueries.STREAM, ObservedQueries.FORWARD),
        )

    @property
    def buffered_query_dtype(self) -> torch.dtype:
        return float_dtype("query_dtype", self.query_dtype)

    def reset(self) -> None:
        self.records = []
        self._steps = 0
        self._pending = {}
        self._generator = None

    def run_state(self) -> dict[str, object]:
        """Steps run so far and, once the sampled mode has drawn, its generators' states: [rows, S] with
        `row_seeds` (each row's own, selected with its row when a replay is copied), else the one shared."""
        generator, device = self._generator, None
        if isinstance(generator, list):
            device, generator = generator[0].device, torch.stack([row.get_state() for row in generator])
        elif generator is not None:
            device, generator = generator.device, (generator.get_state(),)
        return {"steps": self._steps, "generators": generator, "generator_device": device}

    def load_run_state(self, state: dict[str, object]) -> None:
        self._steps = state["steps"]
        generators, device = state["generators"], state["generator_device"]
        if isinstance(generators, torch.Tensor):
            self._generator = [
                torch.Generator(device=device).set_state(row.clone()) for row in generators
            ]  # not a view: set_state reads its storage from 0
        elif generators is not None:
            self._generator = torch.Generator(device=device).set_state(generators[0])
        else:
            self._generator = None

    def observe(self, context: EvictionContext) -> dict[str, torch.Tensor]:
        return self.step_observe([context])[0]

    def step_observe(self, contexts: Sequence[EvictionContext]) -> list[dict[str, torch.Tensor]]:
        """The layers' features in few passes: block attention and the feature sums treat each batch row on
        its own, so consecutive layers of one softmax scale run as the rows of one batch, as many as keep
        a pass's attention logits within `STEP_LOGITS` (usually all of them)."""
        if contexts[0].layer_idx == 0:
            self._check(contexts[0])
        states = []
        for layers in _attention_batches(contexts):
            features, state = self._layer_features(layers)
            for index, context in enumerate(layers):
                self._pending[context.layer_idx] = (context, features, index)
                states.append({name: value[index] for name, value in state.items()})
        if contexts[-1].layer_idx == contexts[-1].num_layers - 1:
            self._steps += 1
        return states

    def stream_observe(self, contexts: Sequence[EvictionContext]) -> dict[str, torch.Tensor]:
        """`standardised.stream_observe` of one forward's queries in every layer, in as few passes as
        `step_observe`'s (usually one), stacked over the layers."""
        if contexts[0].layer_idx == 0 and self._steps == 0:  # a run's first blocks: its steps check the rest
            self._check_shape(contexts[0])
        feature_set, passes = self.scorer.config.feature_set, []
        for layers in _attention_batches(contexts):
            merged = layers[0] if len(layers) == 1 else layers_as_rows(layers)
            state = standardised.stream_observe(
                _summed_over_group(merged.attention, feature_set),
                _readable(merged.state, feature_set),
                merged.query_positions,
                merged.evicts_after,
                feature_set,
            )
            state = _stored(state, feature_set)
            passes.append({name: value.unflatten(0, (len(layers), -1)) for name, value in state.items()})
        if len(passes) == 1:
            return passes[0]
        return {name: torch.cat([state[name] for state in passes]) for name in passes[0]}

    def forward_weights(self, query_positions: torch.Tensor, evicts_after: torch.Tensor) -> standardised.StreamWeights:
        """`standardised.stream_weights` of one forward's observed queries, shared by its layers."""
        return standardised.stream_weights(query_positions, evicts_after, self.scorer.config.feature_set)

    def forward_observe(
        self, attention: torch.Tensor, state: Mapping[str, torch.Tensor], weights: standardised.StreamWeights
    ) -> None:
        """`stream_observe` of attention in its forward, written into `state`: one layer's ([batch, ...]) or every
        layer's at once ([layers, batch, ...]); in place where every sum is float32 (`standardised.stream_update_`),
        else computed in float32 and stored at its dtype."""
        config = self.scorer.config
        group = config.num_query_heads // config.num_kv_heads
        if self._steps == 0 and attention.shape[-3] != group:
            raise ValueError(
                f"scorer trained for {config.base_model} with {group} query heads per KV head does not fit this "
                f"model's {attention.shape[-3]}"
            )
        feature_set = config.feature_set
        summed, readable = _summed_over_group(attention, feature_set), _readable(state, feature_set)
        if all(readable[name].dtype == torch.float32 for name in weights.names):
            standardised.stream_update_(summed, readable, weights)
            return
        new = _stored(standardised.stream_update(summed, readable, weights), feature_set)
        torch._foreach_copy_([state[name] for name in new], list(new.values()))

    def _layer_features(self, contexts: Sequence[EvictionContext]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`observe_features` of the layers [layers, batch, ...], as the rows of one batch (`layers_as_rows`: views
        of the step's stacked tensors); a lone layer's from its context's own block attention
        (`EvictionContext.attention`, computed once)."""
        merged = contexts[0] if len(contexts) == 1 else layers_as_rows(contexts)
        features, state = observe_features(merged, self.scorer.config.feature_set)
        return features.unflatten(0, (len(contexts), -1)), {
            name: value.unflatten(0, (len(contexts), -1)) for name, value in state.items()
        }

    def observed_features(self, context: EvictionContext) -> torch.Tensor:
        """The candidates' features [batch, Hkv, C, F*G] that `observe` computed for this context (what
        `keep_scores` will read; the supervised data maker records them instead of computing them again)."""
        _, features, index = self._observed(context)
        return features[index]

    def _observed(self, context: EvictionContext) -> tuple[EvictionContext, torch.Tensor, int]:
        pending = self._pending.get(context.layer_idx)
        if pending is None or pending[0] is not context:
            raise RuntimeError("keep_scores and observed_features must follow observe on the same eviction context")
        return pending

    def _step_features(self, contexts: Sequence[EvictionContext]) -> torch.Tensor:
        """The candidates' features of the step's layers [layers, batch, Hkv, C, F*G]: the features of their one
        pass as they are (no copy), else stacked head-major (`_stacked`)."""
        observed = [self._observed(context) for context in contexts]
        for context in contexts:
            del self._pending[context.layer_idx]
        features = observed[0][1]
        whole = len(features) == len(observed) and all(
            passed is features and index == at for at, (_, passed, index) in enumerate(observed)
        )
        return features if whole else _stacked([passed[index] for _, passed, index in observed])

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        return self.step_keep_scores([context])[0]

    def step_keep_scores(self, contexts: Sequence[EvictionContext]) -> torch.Tensor:
        """Every layer of the step through the stacked MLPs in one pass and, in sampled mode, one draw
        for all of them (a row's generator draws its noise layer after layer, as one draw per layer would)."""
        first = contexts[0].layer_idx
        if [context.layer_idx for context in contexts] != list(range(first, first + len(contexts))):
            raise ValueError(f"a step's contexts must be consecutive layers, got {[c.layer_idx for c in contexts]}")
        features = self._step_features(contexts)
        candidates = slice(0, contexts[0].num_candidates)
        step = contexts[0].step
        if step is not None and step.keys.shape[0] == len(contexts) and first == 0:  # every layer: the step's views
            keys, values = step.keys[..., candidates, :], step.values[..., candidates, :]
        else:
            keys = _stacked([context.keys[..., candidates, :] for context in contexts])
            values = _stacked([context.values[..., candidates, :] for context in contexts])
        scores = self.scorer.score_layers(first, keys, values, features)
        if self.mode == EvictionMode.DETERMINISTIC.value or contexts[0].num_candidates != self.scorer.config.budget:
            return scores  # a decode compression (more than B candidates) is taken deterministically, unrecorded
        return self._sample(contexts, scores, keys, values, features)

    def _sample(self, contexts, scores, keys, values, features) -> torch.Tensor:
        """Eq. 2: draw L evictions among the 2L lowest; keep scores 1, sampled entries 0 ([layers, ...] all).
        Layers outside `sampled_layers` keep their scores, so the engine evicts their L lowest."""
        layers = [context.layer_idx for context in contexts]
        picked = [
            index for index, layer in enumerate(layers) if self.sampled_layers is None or layer in self.sampled_layers
        ]
        if not picked:
            return scores
        positions = torch.stack([context.candidate_positions for context in contexts])
        eligible = positions >= 0
        if self._generator is None:
            self._generator = self._generators(scores.device)
        every_layer = scores
        if len(picked) < len(layers):
            index = torch.tensor(picked, device=scores.device)
            scores, keys, values, features, positions, eligible = (
                tensor.index_select(0, index) for tensor in (scores, keys, values, features, positions, eligible)
            )
        draw = self._draw(scores, eligible)
        if self.guided_rows:
            draw = self._guided(draw, [contexts[at] for at in picked], scores, eligible)
        if self.record:
            inputs = [_pooled(tensor, draw.pool) for tensor in (positions, keys, values, features, eligible)]
            # Every layer's ring holds the same positions; a copy, as the ring itself is overwritten later.
            query_positions = contexts[0].query_positions.clone()
            self.records.extend(
                SampledEviction(
                    contexts[at].layer_idx,
                    query_positions,
                    *(tensor[index] for tensor in inputs),
                    order=draw.picks[index],
                    logprob=draw.logprob[index],
                    temperature=self.temperature,
                )
                for index, at in enumerate(picked)
            )
        sampled = (~torch.zeros_like(eligible).scatter(-1, draw.order, True)).to(scores.dtype)
        if len(picked) == len(layers):
            return sampled  # the engine keeps the B - L entries scored 1
        return every_layer.index_copy(0, index, sampled)

    def _guided(
        self, draw: EvictionDraw, contexts: Sequence[EvictionContext], scores: torch.Tensor, eligible: torch.Tensor
    ) -> EvictionDraw:
        """`draw` ([layers, batch, ...]) with the `guided_rows` replaced by the guide's proposal."""
        keeps = torch.stack([self.guide.golden_keeps(context) for context in contexts])
        proposal = guided_eviction(scores, self.scorer.config.interval, keeps, eligible, self.temperature)
        guided = torch.zeros(scores.shape[1], dtype=torch.bool, device=scores.device)
        guided[list(self.guided_rows)] = True

        def chosen(drawn: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
            return torch.where(guided.view(1, -1, *[1] * (drawn.dim() - 2)), proposed, drawn)

        return EvictionDraw(
            chosen(draw.pool, proposal.pool),
            chosen(draw.picks, proposal.picks),
            chosen(draw.order, proposal.order),
            chosen(draw.logprob, proposal.logprob),
        )

    def _draw(self, scores: torch.Tensor, eligible: torch.Tensor) -> EvictionDraw:
        """`draw_eviction` over [layers, batch, ...]; per-row generators index the batch dim."""
        interval = self.scorer.config.interval
        if isinstance(self._generator, list):
            draw = draw_eviction(
                scores.transpose(0, 1), interval, self._generator, eligible.transpose(0, 1), self.temperature
            )
            return draw.transpose(0, 1)
        return draw_eviction(scores, interval, self._generator, eligible, self.temperature)

    def _generators(self, device: torch.device) -> torch.Generator | list[torch.Generator]:
        if self.row_seeds is None:
            return torch.Generator(device=device).manual_seed(self.seed)
        return [torch.Generator(device=device).manual_seed(seed) for seed in self.row_seeds]

    def _check(self, context: EvictionContext) -> None:
        """One-line errors when the cache is not the model shape or the (B, L) the scorer was trained for."""
        scorer = self.scorer
        if context.queries is None and self.observed_queries is ObservedQueries.WINDOW:
            raise ValueError("the foresight policy needs the buffered queries of block attention")
        self._check_shape(context)
        scorer.to(context.keys.device)
        config = scorer.config
        interval = context.keys.shape[2] - context.num_candidates
        counts = context.candidate_counts
        if counts is None:  # a pooled step's, or a context built outside the engine: count on the device
            counts = _candidates_per_head(context.candidate_positions).tolist()
        fewest, most = min(counts), max(counts)
        # A prefill of a long prompt may bring more candidates, only at the run's first step.
        budget_fits = fewest >= config.budget and (self._steps == 0 or most == config.budget)
        if interval != config.interval or not budget_fits:
            seen = fewest if fewest < config.budget else most
            raise ValueError(
                f"scorer trained for {config.base_model} with B={config.budget}, L={config.interval} does not fit "
                f"this cache (B={seen}, L={interval})"
            )

    def _check_shape(self, context: EvictionContext) -> None:
        """A one-line error unless the cache is the model shape the scorer was trained for. Its query heads come
        from the context's queries, else from a per-query-head state's group dim; a grouped set's streamed step
        holds neither, and its query heads were checked when its queries were streamed (`stream_observe`)."""
        kv_heads = context.keys.shape[1]
        if context.queries is not None:
            query_heads = context.queries.shape[1]
        elif FeatureSet.parse(self.scorer.config.feature_set).per_query_head:
            query_heads = kv_heads * context.state[CUMULATIVE].shape[-1]
        else:
            query_heads = kv_heads * self.scorer.config.group_size
        shape = ModelShape(context.num_layers, query_heads, kv_heads, context.keys.shape[-1])
        self.scorer.check_compatible(shape)


def _candidates_per_head(positions: torch.Tensor) -> torch.Tensor:
    """[batch] valid candidates per KV head of each row, of candidate positions [batch, Hkv, C]: a pooled layer's
    heads hold different counts at allocation 'layer', B on average at every step but the run's first."""
    return (positions >= 0).sum((-2, -1)) // positions.shape[1]


def _stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-layer [batch, Hkv, ...] tensors as one [layers, batch, Hkv, ...] laid out head-major in memory
    ([layers, Hkv, batch, ...]), the layout the scorer's per-(layer, head) matmuls read without another
    copy (when the scorer's dtype is theirs; else its one casting copy)."""
    return torch.stack([tensor.transpose(0, 1) for tensor in tensors]).transpose(1, 2)


def _pooled(tensor: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """The pool's entries [..., P, *] of a [..., C, *] tensor of the candidates (`pool` [..., P])."""
    if tensor.dim() == pool.dim():
        return tensor.gather(-1, pool)
    return tensor.gather(-2, pool[..., None].expand(*pool.shape, tensor.shape[-1]))


def _attention_batches(contexts: Sequence[EvictionContext]) -> list[list[EvictionContext]]:
    """Runs of consecutive layers of one softmax scale whose block attention logits [batch, Hq, l, N] stay
    within `STEP_LOGITS` together (at least one layer each)."""
    first = contexts[0]
    queries = first.queries
    per_layer = (
        0 if queries is None else first.keys.shape[0] * queries.shape[1] * queries.shape[2] * first.keys.shape[2]
    )
    size = max(1, STEP_LOGITS // per_layer) if per_layer else len(contexts)
    batches: list[list[EvictionContext]] = []
    for context in contexts:
        if batches and len(batches[-1]) < size and batches[-1][0].scaling == context.scaling:
            batches[-1].append(context)
        else:
            batches.append([context])
    return batches
