"""The interface between the runtime and the policies: what a policy sees at an eviction step
(`EvictionContext`) and what the engine calls on it (`Policy`). It lives in the runtime so that the
runtime never imports a policy; `foresight.policies` implements it, one small module per policy.

A policy is a small dataclass (its fields are its options, with the paper's defaults) whose
`keep_scores` maps tensors to a KEEP score per candidate (higher = keep). Cache surgery, the recent
window, sinks, prompt protection and top-k live in the engine, so every score is a pure function of
tensors with a slow loop-based twin in the tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import cached_property
from typing import Any, ClassVar

import torch

from foresight.runtime.cache import StateField
from foresight.runtime.capture import attention_logits, block_attention


class ObservedQueries(str, Enum):
    """Which queries a policy's `observe` sees (docs/algorithms.md sections 2-3).

    WINDOW: at each eviction step, the last L queries (rules that read the latest attention).
    DECODE and ALL: every query after the prompt (DECODE) or from position 0 (ALL), each exactly once
    and in query order, in blocks of at most L, against the keys in the cache when the block is
    observed: after the forward that made it, or at the latest at the row's next eviction step, so
    every entry the query saw is still there and the causal mask hides the later ones. Per-step
    rules (H2O, LazyEviction, RaaS) replay these blocks, which equals observing each query as it runs.
    STREAM: the WINDOW's queries (the L before each eviction step), each observed after the forward that made
    it, against the cache then (the same entries the step would show it), with the position of the query its
    row's next step follows (`EvictionContext.evicts_after`); the step itself then sees no queries. A policy
    whose window statistics are sums keeps them in its per-entry state, so no ring of L queries is held.
    FORWARD: STREAM's sums, added by the attention of the forward that made each query, from the probabilities that
    produce the token's output (`Policy.forward_observe`): no query is held and no block attention is computed."""

    WINDOW = "window"
    DECODE = "decode"
    ALL = "all"
    STREAM = "stream"
    FORWARD = "forward"


def select_state_rows(state: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """A policy's `run_state` for batch rows `rows` [R] (repeats allowed): tensors indexed along dim 0 (a copy),
    every other value shared."""
    return {
        name: value[rows.to(value.device)] if isinstance(value, torch.Tensor) else value
        for name, value in state.items()
    }


_OBSERVED_IN_WORDS = {
    ObservedQueries.WINDOW: "",
    ObservedQueries.DECODE: " of every decode query",
    ObservedQueries.ALL: " of every query",
    ObservedQueries.STREAM: ", streamed into per-entry sums",
    ObservedQueries.FORWARD: ", summed per entry by the forward's attention",
}


@dataclass
class StepLayers:
    """One eviction step's tensors of every layer on a leading layer dim, for the evicting rows. Each layer's
    `EvictionContext` holds their slices, and when every row evicts they are views of the cache's stacked
    storage: a policy that scores the step's layers at once reads them without a copy (`layers_as_rows`)."""

    keys: torch.Tensor  # [layers, batch, Hkv, N, D]
    values: torch.Tensor  # [layers, batch, Hkv, N, D]
    positions: torch.Tensor  # [layers, batch, Hkv, N], -1 on invalid slots
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # [layers, batch, Hkv, N, *trailing]
    queries: torch.Tensor | None = None  # [layers, batch, Hq, l, D]
    query_positions: torch.Tensor | None = None  # [batch, l], every layer's


@dataclass
class EvictionContext:
    """What a policy sees at one eviction step of one layer, for the batch rows that evict now; or,
    for a policy that observes every query, one block of queries for every row (no candidates then).

    The first `num_candidates` slots are the candidates; the last `interval` slots are the recent
    window, which is always kept. Invalid slots (padding) have position -1 and are dropped first
    whatever their score.

    Keys, values, positions, state and the window's queries may be the cache's own storage (slices of the
    `step`'s stacked tensors), valid for this step only: the compaction and later forwards rewrite them in
    place, so whoever keeps one past the step keeps a copy."""

    layer_idx: int
    num_layers: int
    keys: torch.Tensor  # [batch, Hkv, N, D], post-RoPE
    values: torch.Tensor  # [batch, Hkv, N, D]
    positions: torch.Tensor  # [batch, Hkv, N], -1 on invalid slots
    num_candidates: int
    scaling: float
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # [batch, Hkv, N, *trailing]
    queries: torch.Tensor | None = None  # [batch, Hq, l, D] the observed queries (l <= L), oldest first
    query_positions: torch.Tensor | None = None  # [batch, l], -1 for padding
    candidate_counts: tuple[int, ...] | None = None  # valid candidates per row, known on the host (None: unknown)
    first_observed: torch.Tensor | None = None  # [batch] each row's first observed query position (None: this block)
    evicts_after: torch.Tensor | None = None  # [batch] a streamed block's: the query each row's next step follows
    step: StepLayers | None = None  # every layer's tensors of this step, of which this context's are slices
    rows: torch.Tensor | None = None  # [batch] which rows of the run these are (None: every row, in order)

    @cached_property
    def attention(self) -> torch.Tensor:
        """Block attention [batch, Hkv, G, L, N] (docs/algorithms.md section 2), computed once per step."""
        return block_attention(self.queries, self.query_positions, self.keys, self.positions, self.scaling)

    @cached_property
    def logits(self) -> torch.Tensor:
        """Raw attention logits Q K^T * scaling [batch, Hkv, G, L, N] (float32, unmasked)."""
        return attention_logits(self.queries, self.keys, self.scaling)

    @property
    def candidate_positions(self) -> torch.Tensor:
        return self.positions[..., : self.num_candidates]

    @property
    def newest_position(self) -> torch.Tensor:
        """[batch] position of each row's newest token: its last slot, as entries stay in position order."""
        return self.positions[:, 0, -1]


@dataclass
class Policy:
    """Base of every eviction policy. Subclasses set `name`, declare their needs and implement
    `keep_scores`; policies with per-entry state declare `state_fields` and implement `observe`.
    A policy that needs attention reads the last L queries at each eviction step unless it declares
    `observed_queries` DECODE or ALL; then the runtime keeps every such query for it, and the others
    pay nothing."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    evicts: ClassVar[bool] = True
    needs_attention: ClassVar[bool] = False
    observed_queries: ClassVar[ObservedQueries] = ObservedQueries.WINDOW
    state_fields: ClassVar[tuple[StateField, ...]] = ()
    rows_alone: ClassVar[bool] = False
    """True when `observe` and `keep_scores` treat each batch row on its own and read no layer index: the
    step's layers then run as the rows of one batch (`layers_as_rows`), one pass for every layer."""
    default_sinks: ClassVar[int] = 0
    default_protect_prompt: ClassVar[bool] = False
    runs_pooled: ClassVar[bool] = False
    """True for a policy the pooled layout runs (`foresight.runtime.pool`): one whose step reads each head's
    entries and the window's queries only, and that checks it scores each head's view as its own cache."""

    @property
    def scores_compare_across_heads(self) -> bool:
        """Whether keep scores of a layer's different KV heads are on one scale, so that one top-k over the
        layer's heads (AdaKV's allocation, `foresight.runtime.pool.Allocation.LAYER`) ranks them meaningfully."""
        return False

    @property
    def scores_apart_in_words(self) -> str:
        """Why this policy's keep scores do not compare across heads, for the engine's one-line refusal of AdaKV's
        allocation."""
        return f"policy {self.name!r} with options {self.options()} scores no head apart"

    @property
    def pooled_limit(self) -> str | None:
        """Which of this policy's options the pooled layout does not run yet, in words, for its one-line refusal
        (None: it runs the policy as it is); only for a policy that declares `runs_pooled`."""
        return None

    @property
    def latest_queries(self) -> int | None:
        """How many of the latest queries a WINDOW policy reads at an eviction step (None: all L). The
        runtime keeps only that many per layer: SnapKV's 8-query window would otherwise hold L queries
        of every query head, a quarter of a sequence's cache memory at B = 256, L = 64."""
        return None

    @property
    def buffered_query_dtype(self) -> torch.dtype | None:
        """The dtype the runtime may narrow this policy's buffered queries to (`foresight.runtime.cache.ring_dtype`:
        only where it has fewer bytes than the model's); None keeps the model's."""
        return None

    def reset(self) -> None:
        """Called at the start of every generation or replay (policies with run state override it)."""

    def run_state(self) -> dict[str, Any]:
        """The policy's state of the current run that the cache does not hold (what `reset` clears): a tensor
        whose dim 0 is the batch row, or any other value that every row shares. A paused replay keeps it,
        so another replay may run the policy meanwhile, and a replay copied into other rows selects its
        rows (`select_state_rows`; `foresight.runtime.engine.Replay`). {} for a policy without run state."""
        return {}

    def load_run_state(self, state: dict[str, Any]) -> None:
        """Continue a run from `state`, one that `run_state` returned (possibly with its rows selected)."""

    def tapped_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers whose output hidden states the policy reads after each forward."""
        return ()

    def on_forward(self, hidden_states: dict[int, torch.Tensor], positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token state of the tokens just added ({name: [batch, q]}), from tapped hidden states
        ({layer: [batch, q, hidden]}, empty when nothing is tapped) and their positions [batch, q];
        called after every forward and written to every layer and head."""
        return {}

    def observe(self, context: EvictionContext) -> dict[str, torch.Tensor]:
        """New per-entry state read from the context (e.g. accumulated attention): at each eviction step,
        or for each block of queries when the policy observes every query (`observed_queries`)."""
        return {}

    def step_observe(self, contexts: Sequence[EvictionContext]) -> list[dict[str, torch.Tensor]]:
        """`observe` of one eviction step's layers (`contexts`, in layer order): their new per-entry state.
        The engine calls this once per step unless the policy observes every query (it observed them as
        they ran); `observe` of each layer, or of every layer at once for a policy whose rows are alone
        (`rows_alone`), and a policy whose observation batches across layers otherwise overrides it."""
        merged = layers_as_rows(contexts) if self.rows_alone else None
        if merged is None:
            return [self.observe(context) for context in contexts]
        state = {name: value.unflatten(0, (len(contexts), -1)) for name, value in self.observe(merged).items()}
        return [{name: value[index] for name, value in state.items()} for index in range(len(contexts))]

    @property
    def stream_block(self) -> int:
        """`ObservedQueries.STREAM`: how many queries the runtime hands the policy at once (at the latest at an
        eviction step): the queries it holds meanwhile against the work per query."""
        return 1

    def stream_observe(self, contexts: Sequence[EvictionContext]) -> dict[str, torch.Tensor]:
        """`ObservedQueries.STREAM`: the new per-entry state of every layer after one streamed block of queries
        (`contexts`, every layer in order, each with `evicts_after`), stacked [layers, batch, Hkv, N, *trailing]
        for the engine to write each field at once; the eviction step then calls `step_observe` on contexts
        without queries."""
        raise NotImplementedError(f"policy {self.name!r} does not stream its observation")

    def forward_weights(self, query_positions: torch.Tensor, evicts_after: torch.Tensor) -> Any:
        """`ObservedQueries.FORWARD`: what every layer's `forward_observe` of one forward shares, made once before it
        from the forward's observed queries' positions [batch, l] (-1: outside every row's next eviction window) and
        the query each row's next step follows, evicts_after [batch]."""
        raise NotImplementedError(f"policy {self.name!r} does not observe in the forward")

    def forward_observe(self, attention: torch.Tensor, state: Mapping[str, torch.Tensor], weights: Any) -> None:
        """`ObservedQueries.FORWARD`: update per-entry `state` (the cache's storage, [batch, Hkv, N, *trailing] of one
        layer, or [layers, batch, ...] of every layer at once after a decode forward) in place with the forward's
        attention probabilities `attention` [batch, Hkv, G, l, N] (float32; [layers, batch, ...] with the stacked
        state) of its observed queries and the forward's `weights` (`forward_weights`, for [batch] rows)."""
        raise NotImplementedError(f"policy {self.name!r} does not observe in the forward")

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        """KEEP score of each candidate: [batch, Hkv, num_candidates], higher = keep."""
        raise NotImplementedError

    def step_keep_scores(self, contexts: Sequence[EvictionContext]) -> torch.Tensor:
        """KEEP scores [layers, batch, Hkv, num_candidates] of one eviction step's layers (`contexts`, in
        layer order, each observed already). The engine calls this once per step; `keep_scores` of each
        layer, or of every layer at once for a policy whose rows are alone (`rows_alone`), and a policy that
        scores the layers at once otherwise (the learned scorer's stacked MLPs) overrides it, so a step runs
        its kernels once instead of once per layer."""
        merged = layers_as_rows(contexts) if self.rows_alone else None
        if merged is None:
            return torch.stack([self.keep_scores(context) for context in contexts])
        return self.keep_scores(merged).unflatten(0, (len(contexts), -1))

    @property
    def needs(self) -> str:
        """What the policy reads from the runtime, in words (for `foresight policies`)."""
        parts = []
        if self.needs_attention:
            parts.append(f"block attention{_OBSERVED_IN_WORDS[self.observed_queries]}")
        if self.tapped_layers(32):
            parts.append("hidden states")
        return ", ".join(parts) or "nothing"

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}


def layers_as_rows(contexts: Sequence[EvictionContext]) -> EvictionContext | None:
    """Consecutive layers of one step (`contexts`, in layer order) as the batch rows of one context,
    [layers * batch, ...], layer-major (row b of the i-th layer is row i * batch + b): views of the step's stacked
    tensors when the engine made the contexts (`EvictionContext.step`), else their tensors concatenated. None
    where the layers have different softmax scales."""
    first, last = contexts[0], contexts[-1]
    if any(context.scaling != first.scaling for context in contexts):
        return None
    step = first.step
    layers = len(contexts)
    if step is not None and all(context.step is step for context in contexts):
        span = slice(first.layer_idx, last.layer_idx + 1)

        def rows(name: str) -> torch.Tensor | None:
            tensor = getattr(step, name)
            return None if tensor is None else tensor[span].flatten(0, 1)

        state = {name: value[span].flatten(0, 1) for name, value in step.state.items()}
    else:

        def rows(name: str) -> torch.Tensor | None:
            return None if getattr(first, name) is None else torch.cat([getattr(c, name) for c in contexts])

        state = {name: torch.cat([context.state[name] for context in contexts]) for name in first.state}
    return EvictionContext(
        layer_idx=first.layer_idx,
        num_layers=first.num_layers,
        keys=rows("keys"),
        values=rows("values"),
        positions=rows("positions"),
        num_candidates=first.num_candidates,
        scaling=first.scaling,
        state=state,
        queries=rows("queries"),
        query_positions=None if first.query_positions is None else first.query_positions.repeat(layers, 1),
        candidate_counts=None if first.candidate_counts is None else first.candidate_counts * layers,
        first_observed=None if first.first_observed is None else first.first_observed.repeat(layers),
        evicts_after=None if first.evicts_after is None else first.evicts_after.repeat(layers),
        rows=None if first.rows is None else first.rows.repeat(layers),
    )
