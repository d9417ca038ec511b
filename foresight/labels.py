"""Golden Eviction labels (ForesightKV §3.2, Eqs. 3-5; docs/algorithms.md §4).

A trace is teacher-forced once through the frozen model with the full cache. Eviction step
t = 1..M runs after position p_t = B + tL - 1, when the cache first holds B + L entries; block j is
the L queries at positions (p_j, p_j + L]. Per (layer, KV head):

- block score ã_{i,j} (Eqs. 3-4): mean over the block's queries and the G query heads of the group of
  the full-cache attention weight on entry i (each row a float32 softmax over all its causal keys);
- future score α_{i,t} = max_{j >= t} ã_{i,j} (Eq. 5);
- golden schedule, greedy: the candidates of step t are the entries kept at step t - 1 plus the L
  that just left the recent window (step 1: positions 0..B-1), and the B - L candidates with the
  largest α_{·,t} are kept (Eq. 5, Top_{B-L}). Ties keep the lower position.

M = floor((T - B) / L), the number of steps with p_t <= T - 1. The last block is masked where the
trace ends inside it. If L divides T - B, step M falls on the last token and its block holds no
query: its ã is 0, so every α of that step is 0 and the tie rule decides (the paper's
M = ceil((T - B) / L) - 1 drops that step; we keep it so that every eviction the runtime would run
has a label).

Memory: the T x T attention is never formed. The forward runs in chunks with a DynamicCache; an
attention function registered through transformers' AttentionInterface records post-RoPE queries
and keeps a reference to the cached keys (no copy), and computes the layer output with SDPA. Then
one layer at a time: block scores several blocks to a product (the logits of a product bounded by
`logits_budget`, at least one block, O(L*T)), future scores [M, Hkv, N <= T] for that layer, and the
layer's queries and keys are freed. The future scores of all layers (layers * M * Hkv * N floats,
O(T^2 / L)) are kept for one greedy schedule batched over every layer and head: they grow as the
captured queries and keys shrink, and stacking them takes twice their size once the capture is gone,
which stays below the capture while T <= L * (Hq + Hkv) * D * itemsize / (8 Hkv) (40K tokens for
Qwen3-4B in bfloat16 at L = 256; the paper's traces are at most 16K + prompt). Peak memory is then the
captured queries (model dtype, all layers) plus the cache's keys and values: linear in T.

The block means (over a block's queries and heads) of a product of several blocks may differ from
those of one block at a time in their last bits (float32 summation order, within 1e-6 relative); one
block at a time they are bit-identical to a per-block softmax and mean.

Label kinds (docs/algorithms.md §4, "Label kinds"): α is the paper's target; the others weight each
attention weight a_{q,h,i} by what the entry does to the output, and those that read the loss (`gradient`,
`gradient-magnitude`, `removal`) need one backward pass of the low-entropy NLL through the same capture
(`_gradient_forward`). The kind is in the file's metadata and the folder's name.

Regimes (`foresight.cadence.Regime`): in the decode regime a trace whose prompt of P tokens is longer than
B + L starts with a compression step after position P - 1: its candidates are positions 0..P-L-1 and it keeps
the B - L of them with the largest α of that step (block: the L queries after P - 1); that kept set is stored
as `prefill_kept`, and steps t = 1..M follow at p_t = P - 1 + tL, B candidates each, exactly as in the
streaming cadence moved by shift = P - B. The future scores are those of the streaming cadence with budget
P - L, whose step 1 is the compression. The regime and the shift are in the file's metadata, the regime in
the folder's name.

Size: one algorithm (§4) end to end: the capture forward, block and future scores, the greedy
schedule and the label file; splitting it would spread one equation over several files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from foresight.artifacts import check_metadata, file_problem, read_tensors, save_tensors
from foresight.cadence import Regime, check_budget, eviction_steps, keep_top, regime_shift
from foresight.choices import Choice
from foresight.metrics import low_entropy_tokens
from foresight.models import ModelShape, describe
from foresight.runtime.capture import (
    attention_implementation,
    attention_logits,
    full_cache_forward,
    logits_budget,
    register_attention,
)

CAPTURE_ATTENTION = "foresight_golden_capture"
FORMAT = "foresight-golden-labels/1"


class LabelKind(Choice):
    """What a label ranks the candidates by (docs/algorithms.md §4, "Label kinds")."""

    ALPHA = "alpha"  # α_{i,t} = max_{j>=t} ã_{i,j} (Eq. 5)
    VALUE = "value"  # max_{j>=t} mean_{q in j, h in group} a_{q,h,i} ‖v_i − o_{q,h}‖
    GRADIENT = "gradient"  # Σ_{j>=t} mean_{q in j, h in group} −∂NLL_low / ∂s_{q,h,i}
    GRADIENT_MAGNITUDE = "gradient-magnitude"  # Σ_{j>=t} |mean_{q in j, h in group} −∂NLL_low / ∂s_{q,h,i}|
    REMOVAL = "removal"  # Σ_{j>=t} mean_{q in j, h in group} −∂NLL_low / ∂s_{q,h,i} / (1 − a_{q,h,i})

    @property
    def reads_loss(self) -> bool:
        """Whether the kind needs ∂NLL_low/∂output (one backward pass); those kinds also sum over the future
        blocks (first-order loss changes add) where α and value take the max."""
        return self in (LabelKind.GRADIENT, LabelKind.GRADIENT_MAGNITUDE, LabelKind.REMOVAL)


@dataclass(frozen=True)
class BlockTerms:
    """What `value` and `gradient` labels weight each attention weight by, for the queries of a product.

    values: [Hkv, keys, D] the layer's values; outputs: [Hq, rows, D] each query head's attention output;
    grads: [Hq, rows, D] ∂NLL_low/∂output (the kinds that read the loss) or None (value labels);
    removal: divide each derivative by 1 − a_{q,i} (removal labels)."""

    values: torch.Tensor
    outputs: torch.Tensor
    grads: torch.Tensor | None = None
    removal: bool = False

    def rows(self, start: int, end: int, keys: int) -> BlockTerms:
        """The terms of queries start..end-1 and keys 0..keys-1 (positions of the trace)."""
        grads = None if self.grads is None else self.grads[:, start:end]
        return BlockTerms(self.values[:, :keys], self.outputs[:, start:end], grads, self.removal)

    def weigh(self, weights: torch.Tensor) -> torch.Tensor:
        """weights [Hkv, G, rows, keys] times ‖v_i − o_q‖ (value) or −⟨∂NLL/∂o_q, v_i − o_q⟩ (gradient: the
        derivative of the loss with respect to the attention logit s_{q,i} is a_{q,i}⟨∂NLL/∂o_q, v_i − o_q⟩).
        With `removal`, also divided by 1 − a_{q,i}: removing entry i from the softmax moves o_q by
        a_{q,i}(o_q − v_i)/(1 − a_{q,i}) exactly, so this is the loss change of that removal to first order in
        the output, not in the logit (large for an entry that holds most of the row's weight)."""
        heads, group, rows, _ = weights.shape
        values = self.values.float()
        outputs = self.outputs.float().view(heads, group, rows, -1)
        if self.grads is None:
            cross = torch.einsum("hgrd,hkd->hgrk", outputs, values)
            squared = outputs.square().sum(-1, keepdim=True) + values.square().sum(-1)[:, None, None] - 2 * cross
            return weights * squared.clamp_min(0.0).sqrt()
        grads = self.grads.float().view(heads, group, rows, -1)
        along_value = torch.einsum("hgrd,hkd->hgrk", grads, values)
        along_output = (grads * outputs).sum(-1, keepdim=True)
        derivative = weights * (along_output - along_value)
        if not self.removal:
            return derivative
        return derivative / (1.0 - weights).clamp_min(torch.finfo(weights.dtype).eps)


@dataclass(frozen=True)
class GoldenLabels:
    """Golden Eviction labels of one trace: per step t and (layer, KV head), the B candidates and their α.

    candidates: [M, layers, Hkv, B] int32 positions, ascending along the last dim.
    alpha: [M, layers, Hkv, B] float32 future scores α_{i,t} of those candidates (Eq. 5).
    trace_index is -1 when the ids do not come from a trace store; model_shape is the labelling
    model's (None only for labels built by hand, which cannot be saved).
    """

    candidates: torch.Tensor
    alpha: torch.Tensor
    budget: int
    interval: int
    num_tokens: int
    trace_index: int = -1
    model_name: str = ""
    model_shape: ModelShape | None = None
    kind: LabelKind = LabelKind.ALPHA  # what `alpha` holds: α or another kind's score (`LabelKind`)
    regime: Regime = Regime.STREAMING
    shift: int = 0  # step t follows p_t = B + tL - 1 + shift (`foresight.cadence.regime_shift`)
    prefill_kept: torch.Tensor | None = None  # [layers, Hkv, B - L] int32: a decode compression's kept set

    @property
    def num_steps(self) -> int:
        return self.candidates.shape[0]

    def kept(self, step: int) -> torch.Tensor:
        """Kept positions [layers, Hkv, B - L] of eviction step `step` (1..M, as in the paper)."""
        if not 1 <= step <= self.num_steps:
            raise ValueError(f"step {step} is out of range: this trace has steps 1..{self.num_steps}")
        return keep_top(self.candidates[step - 1], self.alpha[step - 1], self.budget - self.interval)

    def kept_positions(self) -> torch.Tensor:
        """Kept positions [M, layers, Hkv, B - L] of every step."""
        return keep_top(self.candidates, self.alpha, self.budget - self.interval)


def golden_schedule(
    future: torch.Tensor, budget: int, interval: int, kept: torch.Tensor | None = None, shift: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the greedy golden schedule for a batch of heads.

    future: [M, heads, N] future scores α_{i,t} of positions 0..N-1, N >= B + (M - 1)L + shift.
    Returns candidates [M, heads, B] int64 (ascending) and their α [M, heads, B].
    kept_0 is taken as 0..B-L-1 and the window leaving at step 1 as B-L..B-1, so step 1's
    candidates are 0..B-1 like every later step's are kept_{t-1} plus the L that left the window. After a
    decode regime's compression step, `kept` [heads, B - L] is its kept set and the window leaving at step 1
    is B-L+shift..B-1+shift.
    """
    num_steps, heads, _ = future.shape
    device = future.device
    candidates = torch.empty(num_steps, heads, budget, dtype=torch.long, device=device)
    if kept is None:
        kept = torch.arange(budget - interval, device=device).expand(heads, -1)
    for step in range(num_steps):
        left_window = budget + (step - 1) * interval + shift
        leaving = torch.arange(left_window, left_window + interval, device=device).expand(heads, -1)
        candidates[step] = torch.cat([kept, leaving], dim=-1)
        kept = keep_top(candidates[step], future[step].gather(-1, candidates[step]), budget - interval)
    return candidates, future.gather(-1, candidates)


def block_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    start: int,
    scaling: float,
    blocks: int = 1,
    terms: BlockTerms | None = None,
) -> torch.Tensor:
    """ã of `blocks` consecutive blocks of equal size (Eqs. 3-4) in one product: for each block, the mean
    over its queries and each group's G heads (of each weight times `terms`' factor, when given).

    queries: [Hq, blocks * n, D] of positions start..; keys: [Hkv, start + blocks * n, D] (all causal keys).
    Returns [blocks, Hkv, start + blocks * n] in float32; row i's softmax runs over keys 0..start+i only,
    so a block's columns after its last query are 0. Only the last blocks * n keys need the causal mask.
    """
    rows = queries.shape[1]
    if rows % blocks or keys.shape[1] != start + rows:
        raise ValueError(
            f"{rows} queries from position {start} must split into {blocks} equal blocks and see "
            f"{start + rows} keys, got {keys.shape[1]}"
        )
    logits = attention_logits(queries[None], keys[None], scaling)[0]  # [Hkv, G, rows, start + rows]
    future_key = torch.ones(rows, rows, dtype=torch.bool, device=keys.device).triu(diagonal=1)
    logits[..., start:].masked_fill_(future_key, float("-inf"))
    weights = logits.softmax(dim=-1)
    if terms is not None:
        weights = terms.rows(start, start + rows, keys.shape[1]).weigh(weights)
    heads, group = weights.shape[:2]
    return weights.view(heads, group, blocks, rows // blocks, -1).mean(dim=(1, 3)).transpose(0, 1)


def _products(
    num_steps: int, budget: int, interval: int, query_heads: int, max_elements: int
) -> Iterator[tuple[int, int]]:
    """(first block, blocks) of each product over the whole blocks 1..M-1. A product computes each of its
    blocks against the last one's keys, so its queries span at most a quarter of the keys before them
    (at most 1/8 of its logits wasted on masked keys) and its logits at most `max_elements`."""
    first = 1
    while first < num_steps:
        start = budget + first * interval
        span = start // 4
        fitting = min(span // interval, max_elements // (query_heads * interval * (start + span)))
        count = min(num_steps - first, max(1, fitting))
        yield first, count
        first += count


def future_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    budget: int,
    interval: int,
    scaling: float,
    max_elements: int | None = None,
    terms: BlockTerms | None = None,
    kind: LabelKind = LabelKind.ALPHA,
) -> torch.Tensor:
    """α_{i,t} = max_{j >= t} ã_{i,j} (Eq. 5) for one layer: [M, Hkv, N], N = B + (M - 1)L; for another
    `kind`, its score from the block scores of `terms` (`LabelKind`).

    N covers every position that can be a candidate. Blocks 1..M-1 are whole and go several to a product
    (`_products`, at most `max_elements` logits each, default `logits_budget`); block M holds the
    (T - B) mod L queries left, and scores 0 when it holds none. The suffix max is a cumulative max over
    the reversed steps (a cumulative sum for the kinds that read the loss: first-order loss changes add up;
    of the block scores' magnitudes for gradient-magnitude).
    """
    keys = keys.float()  # once per layer, not once per product (exact: every float dtype widens to float32)
    max_elements = logits_budget(keys.device) if max_elements is None else max_elements
    num_tokens = keys.shape[1]
    num_steps = eviction_steps(num_tokens, budget, interval)
    width = budget + (num_steps - 1) * interval
    scores = torch.zeros(num_steps, keys.shape[0], width, device=keys.device)
    for first, count in _products(num_steps, budget, interval, queries.shape[0], max_elements):
        start, end = budget + first * interval, budget + (first + count) * interval
        columns = min(end, width)
        chunk = block_scores(queries[:, start:end], keys[:, :end], start, scaling, blocks=count, terms=terms)
        scores[first - 1 : first - 1 + count, :, :columns] = chunk[..., :columns]
    start = budget + num_steps * interval
    if start < num_tokens:
        scores[-1] = block_scores(queries[:, start:], keys, start, scaling, terms=terms)[0, :, :width]
    if kind == LabelKind.GRADIENT_MAGNITUDE:
        scores = scores.abs()
    if kind.reads_loss:
        return scores.flip(0).cumsum(dim=0).flip(0)
    return scores.flip(0).cummax(dim=0).values.flip(0)


class _Capture:
    """Post-RoPE queries of every layer (preallocated, model dtype) and references to the cached keys; for a
    label kind other than α also the values and each query head's attention output (`outputs[layer]`
    [1, T, Hq, D], in the autograd graph for gradient labels)."""

    def __init__(self, num_tokens: int, kind: LabelKind = LabelKind.ALPHA):
        self.num_tokens = num_tokens
        self.kind = kind
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.scaling: dict[int, float] = {}

    def record(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        scaling: float,
    ) -> None:
        if layer not in self.queries:
            heads, _, dim = query.shape[1:]
            self.queries[layer] = query.new_empty(heads, self.num_tokens, dim)
        end = key.shape[-2]
        self.queries[layer][:, end - query.shape[-2] : end] = query[0].detach()
        self.keys[layer] = key[0].detach()  # the DynamicCache's own tensor: grows each chunk, never copied
        self.scaling[layer] = scaling
        if self.kind != LabelKind.ALPHA:
            self.values[layer] = value[0].detach()
            if self.kind.reads_loss:
                output.retain_grad()
            self.outputs.setdefault(layer, []).append(output)

    def terms(self, layer: int) -> BlockTerms | None:
        """The layer's `BlockTerms` (None for α), its outputs and values freed from the capture."""
        if self.kind == LabelKind.ALPHA:
            return None
        outputs = self.outputs.pop(layer)
        grads = None
        if self.kind.reads_loss:
            grads = torch.cat([output.grad for output in outputs], dim=1)[0].transpose(0, 1)
        heads_first = torch.cat([output.detach() for output in outputs], dim=1)[0].transpose(0, 1)
        return BlockTerms(self.values.pop(layer), heads_first, grads, removal=self.kind == LabelKind.REMOVAL)


def _capture_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    golden_capture: _Capture,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function for AttentionInterface: record Q/K for the labels, compute the output with SDPA."""
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"layer {module.layer_idx} uses a sliding window of {kwargs['sliding_window']}; "
            "golden labels need full causal attention"
        )
    output, weights = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    golden_capture.record(
        module.layer_idx, query, key, value, output, query.shape[-1] ** -0.5 if scaling is None else scaling
    )
    return output, weights


register_attention(CAPTURE_ATTENTION, _capture_attention, full_cache=True)


def _capture_forward(
    model: PreTrainedModel, input_ids: torch.Tensor, chunk_size: int, kind: LabelKind = LabelKind.ALPHA
) -> _Capture:
    """One teacher-forced, chunked forward of the trace with the full cache (one chunk and a backward pass
    for gradient labels: `_gradient_forward`); returns the capture."""
    capture = _Capture(input_ids.numel(), kind)
    with attention_implementation(model, CAPTURE_ATTENTION):
        if kind.reads_loss:
            _gradient_forward(model, input_ids.to(model.device), capture)
        else:
            full_cache_forward(model, input_ids, chunk_size, golden_capture=capture)
    num_layers = model.config.num_hidden_layers
    if sorted(capture.queries) != list(range(num_layers)):
        raise ValueError(
            f"{type(model).__name__} did not route attention through transformers' AttentionInterface "
            f"(captured layers {sorted(capture.queries)} of {num_layers})"
        )
    return capture


def _gradient_forward(model: PreTrainedModel, input_ids: torch.Tensor, capture: _Capture) -> None:
    """The whole trace in one forward with autograd on (the frozen weights stay frozen: the graph starts at
    the input embeddings), then the backward of the summed NLL of its low-entropy predictions (the bottom
    share by the forward's own entropy, `low_entropy_tokens`), which leaves ∂NLL_low/∂output on every
    layer's captured attention outputs."""
    with torch.enable_grad():
        embeds = model.get_input_embeddings()(input_ids[None]).detach().requires_grad_()
        logits = model(inputs_embeds=embeds, use_cache=False, golden_capture=capture).logits[0, :-1].float()
        log_probs = logits.log_softmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1).detach()
        nll = -log_probs.gather(-1, input_ids[1:, None])[:, 0]
        nll[low_entropy_tokens(entropy)].sum().backward()


@torch.no_grad()
def compute_golden_labels(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    budget: int,
    interval: int,
    *,
    trace_index: int = -1,
    model_name: str | None = None,
    chunk_size: int = 256,
    kind: LabelKind | str = LabelKind.ALPHA,
    regime: Regime | str = Regime.STREAMING,
    prompt_length: int | None = None,
) -> GoldenLabels:
    """Golden Eviction labels of one trace (1-D token ids, prompt + completion), of label kind `kind`, on the
    steps of `regime` (the decode regime reads the trace's `prompt_length`).

    Raises TraceTooShort when T < B + L (decode, after a compression: T < P + L). chunk_size only bounds the
    forward's working memory. model_name defaults to the model config's name_or_path.
    """
    kind, regime = LabelKind.parse(kind), Regime.parse(regime)
    if regime is Regime.DECODE and prompt_length is None:
        raise ValueError("decode-regime labels need the trace's prompt length (prompt_length)")
    shift = 0 if prompt_length is None else regime_shift(prompt_length, budget, interval, regime)
    eviction_steps(input_ids.numel(), budget, interval, shift)
    start = (
        budget + shift - interval if shift else budget
    )  # the step-1 positions of the table: P - L after a compression
    table = _future_table(model, input_ids, start, interval, chunk_size, model.device, kind)
    num_steps, layers, heads, width = table.shape
    flat = table.view(num_steps, layers * heads, width)
    prefill_kept = None
    if shift:  # the compression step: keep the B - L of positions 0..P-L-1 with the largest α
        older = torch.arange(start, device=flat.device).expand(layers * heads, -1)
        prefill_kept = keep_top(older, flat[0, :, :start], budget - interval)
        flat, num_steps = flat[1:], num_steps - 1
    candidates, alpha = golden_schedule(flat, budget, interval, prefill_kept, shift)
    return GoldenLabels(
        candidates=candidates.view(num_steps, layers, heads, budget).to("cpu", torch.int32),
        alpha=alpha.view(num_steps, layers, heads, budget).cpu(),
        budget=budget,
        interval=interval,
        num_tokens=input_ids.numel(),
        trace_index=trace_index,
        model_name=model.config.name_or_path if model_name is None else model_name,
        model_shape=describe(model),
        kind=kind,
        regime=regime,
        shift=shift,
        prefill_kept=None if prefill_kept is None else prefill_kept.view(layers, heads, -1).to("cpu", torch.int32),
    )


@torch.no_grad()
def future_score_table(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    budget: int,
    interval: int,
    *,
    chunk_size: int = 256,
    kind: LabelKind | str = LabelKind.ALPHA,
    regime: Regime | str = Regime.STREAMING,
    prompt_length: int | None = None,
) -> torch.Tensor:
    """α_{i,t} (or another kind's score) of every position that can be a candidate, [M, layers, Hkv, N]
    float32 on the CPU, for steps t = 1..M of `regime` (a decode compression's row left out).

    What an entry's target is does not depend on which entries a policy kept before (α reads the
    full-cache attention only), so this table labels the states of any trajectory on the cadence, the
    learned scorer's own included (on-policy examples, `trainers.examples`)."""
    shift = 0 if prompt_length is None else regime_shift(prompt_length, budget, interval, regime)
    if Regime.parse(regime) is Regime.DECODE and prompt_length is None:
        raise ValueError("a decode-regime table needs the trace's prompt length (prompt_length)")
    start = budget + shift - interval if shift else budget
    table = _future_table(model, input_ids, start, interval, chunk_size, torch.device("cpu"), LabelKind.parse(kind))
    return table[1:] if shift else table


def _future_table(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    budget: int,
    interval: int,
    chunk_size: int,
    device: torch.device,
    kind: LabelKind = LabelKind.ALPHA,
) -> torch.Tensor:
    """One capture forward, then the future scores of one layer at a time, stacked into [M, layers, Hkv, N] on
    `device`; each layer's queries and keys are freed once read, so the layers' scores grow as they shrink.
    `budget` places the steps only (p_t = budget + tL - 1): a decode regime's table is that of budget P - L."""
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D (one trace), got shape {tuple(input_ids.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be at least 1")
    eviction_steps(input_ids.numel(), budget, interval)
    capture = _capture_forward(model, input_ids, chunk_size, kind)
    layers = []
    for layer in range(len(capture.queries)):
        queries, keys, terms = capture.queries.pop(layer), capture.keys.pop(layer), capture.terms(layer)
        scores = future_scores(queries, keys, budget, interval, capture.scaling[layer], terms=terms, kind=kind)
        layers.append(scores.to(device))
    return torch.stack(layers, dim=1)


def labels_dir(
    traces_dir: str | os.PathLike,
    budget: int,
    interval: int,
    kind: LabelKind | str = LabelKind.ALPHA,
    regime: Regime | str = Regime.STREAMING,
) -> Path:
    """Where the labels of a traces folder live for one (B, L), kind and regime: TRACES_DIR/labels-B{B}-L{L} for
    α in the streaming regime, with -{kind} for another kind and -decode for the decode regime."""
    check_budget(budget, interval)
    kind, regime = LabelKind.parse(kind), Regime.parse(regime)
    suffix = "" if kind == LabelKind.ALPHA else f"-{kind.value}"
    suffix += "" if regime is Regime.STREAMING else f"-{regime.value}"
    return Path(traces_dir) / f"labels-B{budget}-L{interval}{suffix}"


def save_labels(labels: GoldenLabels, path: str | os.PathLike) -> None:
    """Write labels as safetensors with their metadata, atomically (temporary file, then rename)."""
    if labels.model_shape is None:
        raise ValueError("labels without a model shape cannot be saved; make them with compute_golden_labels")
    metadata = {
        "format": FORMAT,
        "budget": str(labels.budget),
        "interval": str(labels.interval),
        "num_tokens": str(labels.num_tokens),
        "trace_index": str(labels.trace_index),
        "model": labels.model_name,
        "kind": labels.kind.value,
        "regime": labels.regime.value,
        "shift": str(labels.shift),
        **{key: str(value) for key, value in asdict(labels.model_shape).items()},
    }
    tensors = {"candidates": labels.candidates, "alpha": labels.alpha}
    if labels.prefill_kept is not None:
        tensors["prefill_kept"] = labels.prefill_kept
    save_tensors(path, tensors, metadata)


def labels_command(
    traces_dir: str | os.PathLike,
    budget: int,
    interval: int,
    kind: LabelKind | str = LabelKind.ALPHA,
    regime: Regime | str = Regime.STREAMING,
) -> str:
    """The command that makes (or remakes) the labels of a traces folder for one (B, L), kind and regime."""
    kind, regime = LabelKind.parse(kind), Regime.parse(regime)
    option = "" if kind == LabelKind.ALPHA else f" --label-kind {kind.value}"
    option += "" if regime is Regime.STREAMING else f" --regime {regime.value}"
    return f"`foresight labels --traces {traces_dir} --budget {budget} --interval {interval}{option}`"


def load_labels(
    path: str | os.PathLike,
    *,
    expect_budget: int,
    expect_interval: int,
    expect_num_tokens: int,
    expect_trace_index: int,
    expect_kind: LabelKind | str = LabelKind.ALPHA,
    expect_regime: Regime | str = Regime.STREAMING,
) -> GoldenLabels:
    """Read labels and check they were made for this trace, this (B, L), this kind and this regime (a file
    without a kind holds α and one without a regime the streaming cadence: they predate them); a missing,
    damaged or mismatched file is a one-line `ArtifactError` naming the command that remakes it."""
    path, kind, regime = Path(path), LabelKind.parse(expect_kind), Regime.parse(expect_regime)
    remake = labels_command(path.parent.parent, expect_budget, expect_interval, kind, regime)
    metadata, tensors = read_tensors(path, remake)
    expected = {
        "format": FORMAT,
        "budget": expect_budget,
        "interval": expect_interval,
        "num_tokens": expect_num_tokens,
        "trace_index": expect_trace_index,
        "kind": kind.value,
        "regime": regime.value,
    }
    defaults = {"kind": LabelKind.ALPHA.value, "regime": Regime.STREAMING.value, "shift": "0"}
    metadata = defaults | metadata
    check_metadata(path, metadata, expected, remake)
    return GoldenLabels(
        candidates=tensors["candidates"],
        alpha=tensors["alpha"],
        budget=expect_budget,
        interval=expect_interval,
        num_tokens=expect_num_tokens,
        trace_index=expect_trace_index,
        model_name=metadata["model"],
        model_shape=ModelShape(**{f.name: int(metadata[f.name]) for f in fields(ModelShape)}),
        kind=kind,
        regime=regime,
        shift=int(metadata["shift"]),
        prefill_kept=tensors.get("prefill_kept"),
    )


class LabelStore:
    """The golden labels of a traces folder for one (B, L) and label kind, read by trace index."""

    def __init__(
        self,
        traces_dir: str | os.PathLike,
        budget: int,
        interval: int,
        kind: LabelKind | str = LabelKind.ALPHA,
        regime: Regime | str = Regime.STREAMING,
    ):
        self.traces_dir = Path(traces_dir)
        self.budget = budget
        self.interval = interval
        self.kind = LabelKind.parse(kind)
        self.regime = Regime.parse(regime)
        self.directory = labels_dir(traces_dir, budget, interval, self.kind, self.regime)

    def path(self, trace_index: int) -> Path:
        return self.directory / f"trace-{trace_index:06d}.safetensors"

    def claim_path(self, trace_index: int) -> Path:
        """The file a labelling process locks while it labels the trace (`foresight.artifacts.claimed`)."""
        return self.directory / f".trace-{trace_index:06d}.claim"

    def __contains__(self, trace_index: int) -> bool:
        """True when the trace's labels file is complete (a damaged one counts as missing)."""
        return file_problem(self.path(trace_index), {"format": FORMAT}) is None

    def problem(self, trace_index: int, *, num_tokens: int) -> str | None:
        """Why the labels file of a trace is not usable (missing, damaged, made with other settings), or None;
        reads only its header."""
        expected = {
            "format": FORMAT,
            "budget": str(self.budget),
            "interval": str(self.interval),
            "num_tokens": str(num_tokens),
            "trace_index": str(trace_index),
        }
        if self.kind != LabelKind.ALPHA:  # α files made before the kinds carry none
            expected["kind"] = self.kind.value
        if self.regime is not Regime.STREAMING:  # streaming files made before the regimes carry none
            expected["regime"] = self.regime.value
        return file_problem(self.path(trace_index), expected)

    def require(self, trace_index: int, *, num_tokens: int) -> None:
        """A one-line ValueError naming the command that makes the labels, unless they are usable."""
        problem = self.problem(trace_index, num_tokens=num_tokens)
        if problem is not None:
            command = labels_command(self.traces_dir, self.budget, self.interval, self.kind, self.regime)
            path = self.path(trace_index)
            raise ValueError(
                f"the golden labels of trace {trace_index} ({path}) are {problem}; make them with {command}"
            )

    def load(self, trace_index: int, *, num_tokens: int) -> GoldenLabels:
        """Labels of one trace, checked against its length and this store's (B, L)."""
        return load_labels(
            self.path(trace_index),
            expect_budget=self.budget,
            expect_interval=self.interval,
            expect_num_tokens=num_tokens,
            expect_trace_index=trace_index,
            expect_kind=self.kind,
            expect_regime=self.regime,
        )
