"""The attention function of the eviction runtime, registered through transformers' AttentionInterface.

It computes each layer's output over the evicting cache, records the post-RoPE queries for block
attention, and never builds a T x T matrix: block attention is computed later by the engine, at most
L recorded queries at a time. Kernels, best first:
- CUDA, bf16/fp16, `flash-attn` (>= 2.6.3) installed: its kernels, with grouped-query heads and
  bottom-right causal alignment; for a padded batch its KV-cache kernel with a per-row start
  (`cache_leftpad`) that skips left padding and eviction leftovers, so no mask is needed.
- CUDA otherwise: PyTorch SDPA; without padding it gets no mask (one query) or a lower-right causal
  bias, both of which SDPA's fused flash kernel runs; with padding, a boolean mask (SDPA's math kernel).
- CPU: SDPA with the boolean padding-and-causal mask, or none for one query without padding.
- Static decode (`foresight.runtime.static_decode`), any device: SDPA over every slot of the storage under the
  forward's mask of valid slots, made on the device, so the shapes never change.
- A policy that observes in the forward (`ObservedQueries.FORWARD`), any device: the probabilities in float32, from
  which the output comes (a decode forward) and the policy's sums are updated in place (`_observing_attention`).
- The pooled layout (`foresight.runtime.cache`), any device: SDPA over the pool's one key head, each query head
  reading only its own KV head's slots (`_owner_mask`); flash-attn's kernels take no such mask, so they never run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from foresight.cache_argument import cache_argument
from foresight.runtime.cache import EvictionCache, EvictionLayer, ForwardObservation

ATTENTION_NAME = "foresight"
HAS_FLASH_ATTENTION = importlib.util.find_spec("flash_attn") is not None


def eviction_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    eviction_cache: EvictionCache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the evicting cache. query [batch, Hq, q, D]; key/value [batch, Hkv, N, D] hold the
    whole cache including the q new entries (the last q slots). Returns [batch, q, Hq, D]."""
    if eviction_cache is None:
        raise ValueError("the 'foresight' attention runs only inside the eviction engine (no eviction_cache given)")
    layer = eviction_cache.layers[module.layer_idx]
    layer.scaling = scaling
    if eviction_cache.recorder is not None:
        new = [layer.newest_entries(tensor, query.shape[2]) for tensor in (key, value)]
        eviction_cache.recorder.add(module.layer_idx, query, *new, scaling)
    if layer.query_window and eviction_cache.records_queries:
        layer.record_queries(query, layer.pending_positions)
    static = eviction_cache.static
    observation = eviction_cache.forward_observation
    if observation is not None:
        return _observing_attention(query, key, value, layer, scaling, eviction_cache.has_padding, observation), None
    if static is not None:  # every slot, under the forward's mask of valid ones (`EvictionLayer._static_update`)
        output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=static.mask, scale=scaling, enable_gqa=True
        )
        return output.transpose(1, 2).contiguous(), None
    num_queries, has_padding = query.shape[2], eviction_cache.has_padding
    half = query.dtype in (torch.float16, torch.bfloat16)
    if layer.pool_heads:
        mask = _owner_mask(layer, query.shape[1], num_queries, has_padding)
    elif HAS_FLASH_ATTENTION and query.is_cuda and half:
        return _flash_attention(query, key, value, layer, scaling, has_padding), None
    elif query.is_cuda and num_queries > 1 and not has_padding:
        mask = causal_lower_right(num_queries, layer.get_seq_length())  # fused kernels, nothing materialised
    else:
        mask = _padding_causal_mask(layer, num_queries, has_padding)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def _observing_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: EvictionLayer,
    scaling: float,
    has_padding: bool,
    observation: ForwardObservation,
) -> torch.Tensor:
    """Attention that observes as it runs: the float32 probabilities of the latest `observation.count` queries under
    the forward's mask (those of `block_attention` for the same queries and entries, up to rounding), handed to the
    policy with the layer's state, which is written in place; the output [batch, q, Hq, D] from the same
    probabilities where they are every query's (a decode forward), else SDPA's (a prefill or a teacher-forced
    chunk longer than the window, whose earlier queries nothing observes). The policy's update waits for the last
    layer in a decode forward (`ForwardObservation.add`)."""
    num_queries, count = query.shape[2], observation.count
    mask = _padding_causal_mask(layer, num_queries, has_padding)  # [batch or 1, 1, q, N] or None
    batch, query_heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = query_heads // kv_heads
    # [batch·Hkv, G·count, D] @ [batch·Hkv, D, N]: one batched product (a view of the stacked keys, no copy)
    observed = query[:, :, num_queries - count :].reshape(batch * kv_heads, group * count, dim).float()
    logits = torch.bmm(observed, key.float().flatten(0, 1).transpose(-1, -2)).mul_(scaling)
    logits = logits.view(batch, kv_heads, group, count, -1)  # as `attention_logits`, a matmul's rounding
    if mask is not None:
        logits.masked_fill_(~mask[:, :, None, num_queries - count :], float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    observation.add(layer, probabilities)
    if count < num_queries:
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
        return output.transpose(1, 2).contiguous()
    flat = probabilities.to(value.dtype).view(batch * kv_heads, group * num_queries, -1)
    output = torch.bmm(flat, value.flatten(0, 1)).view(batch, kv_heads, group, num_queries, dim)
    return output.permute(0, 3, 1, 2, 4).reshape(batch, num_queries, query_heads, dim)  # a view for one query


def _padding_causal_mask(layer: EvictionLayer, num_queries: int, has_padding: bool) -> torch.Tensor | None:
    """[batch, 1, q, N] boolean mask: causal among the q new tokens (the last q slots, pooled the last q·H) and no
    padding.

    Padding query rows (only in a padded prefill) keep their causal row so they never see an empty
    row (no NaN); nothing valid attends to them. Returns None when nothing needs masking."""
    entries = layer.get_seq_length()
    no_padding = not has_padding
    if num_queries == 1 and no_padding:
        return None
    slots = torch.arange(entries, device=layer.device)
    per_token = layer.slots_per_token
    query_slots = slots[entries - (num_queries - 1) * per_token - 1 :: per_token]  # each new token's last slot
    causal = slots[None, :] <= query_slots[:, None]  # [q, N]
    if no_padding:
        return causal[None, None]
    valid = layer.valid  # [batch, N]
    query_valid = valid[:, query_slots]  # [batch, q]
    mask = causal[None] & (valid[:, None, :] | ~query_valid[:, :, None])
    return mask[:, None]


def _owner_mask(layer: EvictionLayer, query_heads: int, num_queries: int, has_padding: bool) -> torch.Tensor:
    """[batch, Hq, q, N] boolean mask of a pooled layer: query head j reads only the slots of its KV head j // G,
    and the padding-and-causal rule of `_padding_causal_mask`, so each query head attends exactly as it would to its
    own head's cache."""
    readers = torch.arange(query_heads, device=layer.device) // (query_heads // layer.pool_heads)
    owned = layer.owners[:, :, None, :] == readers[None, :, None, None]  # [batch, Hq, 1, N]
    mask = _padding_causal_mask(layer, num_queries, has_padding)
    return owned if mask is None else owned & mask


def _flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: EvictionLayer,
    scaling: float | None,
    has_padding: bool,
) -> torch.Tensor:
    """flash-attn over the cache as it is (no copy), the new queries aligned to the last keys
    (bottom-right causal). With padding, its KV-cache kernel lets row b attend to its valid entries
    only, the last `lengths[b]` slots, from slot `cache_leftpad[b]` on; a padding query that sees no
    entry gets 0."""
    from flash_attn import flash_attn_func, flash_attn_with_kvcache

    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if not has_padding:
        return flash_attn_func(query, key, value, softmax_scale=scaling, causal=True)
    batch, entries = key.shape[:2]
    return flash_attn_with_kvcache(
        query,
        key,
        value,
        cache_seqlens=torch.full((batch,), entries, dtype=torch.int32, device=key.device),
        cache_leftpad=(entries - layer.lengths).to(torch.int32),
        softmax_scale=scaling,
        causal=True,
    )


def block_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """docs/algorithms.md section 2: A = softmax(Q_buf K^T * scaling + causal mask) in float32.

    queries [batch, Hq, L, D] in query order, query_positions [batch, L], keys [batch, Hkv, N, D],
    key_positions [batch, Hkv, N] (-1 marks an invalid entry). Returns [batch, Hkv, G, L, N];
    masked entries and the rows of padding queries (position -1, which see nothing) are exactly 0."""
    logits = attention_logits(queries, keys, scaling)  # a fresh tensor: masked in place
    visible = _visible(query_positions, key_positions)
    weights = torch.softmax(logits.masked_fill_(~visible, float("-inf")), dim=-1)
    return weights.masked_fill_((query_positions < 0)[:, None, None, :, None], 0.0)


OBSERVATION_BLOCK = 32
"""Queries per block-attention product when a policy reads the queries in sub-blocks (`sub_blocks`): the
[batch, Hkv, G, l, N] float32 weights of one product stay those of 32 queries whatever L (at B = 1024,
L = 256 one product of all L held 8x more)."""


def sub_blocks(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    size: int = OBSERVATION_BLOCK,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`block_attention` of the queries [batch, Hq, L, D] in consecutive sub-blocks of at most `size`, oldest
    first: (weights [batch, Hkv, G, l, N], their query_positions [batch, l]) one at a time, each computed when
    the previous is done with (each query's row is the same as in one product of all L)."""
    for start in range(0, queries.shape[2], size):
        block = slice(start, start + size)
        positions = query_positions[:, block]
        yield block_attention(queries[:, :, block], positions, keys, key_positions, scaling), positions


def first_observed_query(query_positions: torch.Tensor) -> torch.Tensor:
    """[batch]: the oldest valid query of a block [batch, l], the first a row observes when the block is its first
    observed one (a row of padding only gets a position past every entry, so no entry counts it)."""
    return query_positions.masked_fill(query_positions < 0, torch.iinfo(query_positions.dtype).max).amin(-1)


def logits_budget(device: torch.device) -> int:
    """Float32 logits of one block-attention product: on the CPU a product is fastest while it stays in
    the cache (1 MiB), on an accelerator while it fills the device (256 MiB). A product holds at least
    one block whatever its size (one block's logits are what is needed anyway)."""
    return 2**18 if device.type == "cpu" else 2**26


STEP_LOGITS = 2**26
"""Float32 logits of one pass of an eviction step's block attention over its layers (256 MiB), on every device:
the layers run as the rows of as few passes as this allows, each pass a fixed number of operations whatever its
rows. On a CPU, passes the size of a core's cache (`logits_budget`) ran no faster for the default model's step
at batch 1 and 4 (docs/notes/eviction-step-cost.md)."""


def attention_logits(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Q K^T * scaling in float32, grouped by KV head: [batch, Hkv, G, L, N]."""
    batch, query_heads, window, dim = queries.shape
    kv_heads = keys.shape[1]
    grouped = queries.reshape(batch, kv_heads, query_heads // kv_heads, window, dim).float()
    return torch.einsum("bhgld,bhnd->bhgln", grouped, keys.float()) * scaling


def _visible(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """[batch, Hkv, 1, L, N]: entry is valid and not after the query."""
    keys = key_positions[:, :, None, None, :]
    return (keys >= 0) & (keys <= query_positions[:, None, None, :, None])


def _no_mask(*args, **kwargs) -> None:
    """The model's own mask is never used: `eviction_attention` builds its mask from the cache."""
    return None


def register_attention(name: str, function, *, full_cache: bool = False) -> None:
    """The one way this project hooks attention: register `function` in transformers' AttentionInterface.

    Default: a function for the engine (`EvictionEngine(attention=name)`), e.g. one that wraps
    `eviction_attention` to record what it sees (the evaluation probe); the model then builds no mask
    of its own. `full_cache=True`: a function that runs on a plain transformers cache with SDPA's mask
    (the golden labels' capture of every query and key).
    """
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask if full_cache else _no_mask)


@contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run `model` with the registered attention function `name` and SDPA's backends less cuDNN's (see
    `sdpa_backends_without_cudnn`), then restore its own."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        with sdpa_kernel(sdpa_backends_without_cudnn()):
            yield
    finally:
        model.set_attn_implementation(previous)


def sdpa_backends_without_cudnn() -> list[SDPBackend]:
    """SDPA's enabled backends less cuDNN's. cuDNN builds an execution graph for every new key length, and a
    decode step's key length is new at every token: on an H200 each call cost about 1 ms of host time, 36 ms
    of an 85 ms Qwen3-4B decode step (docs/notes/gpu-acceptance.md), where flash and memory-efficient
    attention need no graph. With cuDNN alone enabled, the math kernel runs instead."""
    enabled = [
        backend
        for backend, on in (
            (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
            (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
            (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled()),
        )
        if on
    ]
    return enabled or [SDPBackend.MATH]


register_attention(ATTENTION_NAME, eviction_attention)


def full_cache_forward(model, input_ids: torch.Tensor, chunk_size: int, **capture) -> None:
    """One sequence [T] teacher-forced through `model` in chunks of `chunk_size` tokens on a growing full cache,
    the keyword `capture` (name=recorder) handed to every attention call, the logits of the last token only:
    the forward a capturing attention function (the golden labels', TriAttention's calibration) records from,
    inside `attention_implementation` of that function. The chunk size bounds working memory only."""
    cache = DynamicCache(config=model.config)
    for chunk in input_ids.to(model.device).split(chunk_size):
        model(input_ids=chunk[None], **cache_argument(model, cache), use_cache=True, logits_to_keep=1, **capture)
