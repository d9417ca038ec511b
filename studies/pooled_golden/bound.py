"""Golden with one budget across heads: the pooled schedules and the masked replay that scores them.

Per-head golden (docs/algorithms.md §4) keeps B − L entries in every (layer, KV head) cache at every step, the ones
with the largest future score α_{i,t}. A pooled golden keeps the same total over a group of heads: a layer's H KV
heads (`Pool.LAYER`, H·(B − L)) or every head of the model (`Pool.ALL`), each head keeping at least `floor` of its
candidates (its recent window of L entries is kept besides, as in every policy here); the rest go to the group's
largest α, whichever head holds them. Greedy on its own trajectory, as golden: a head's candidates at a step are
what it kept at the step before plus the L entries leaving its window. α reads the full-cache attention only
(`foresight.labels.future_score_table`), so one table scores every trajectory.

The runtime holds the same count in every head, so a pooled schedule is scored by a masked replay instead: the
full-cache forward, each head's attention restricted to the entries its cache would hold (the kept set of the last
eviction step plus the window and the tokens fed since). With per-head golden's kept sets it gives the engine's
golden replay (tests/test_pooled_golden.py), so the difference between schedules is the schedules'.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from foresight.cadence import top_k_mask
from foresight.choices import Choice
from foresight.runtime.capture import attention_implementation, cache_argument, register_attention

MASKED_ATTENTION = "foresight_masked_replay"


class Pool(Choice):
    """Which heads share one budget: each its own (golden), a layer's, or the whole model's."""

    HEAD = "head"
    LAYER = "layer"
    ALL = "all"


Eviction = tuple[int, torch.Tensor]
"""An eviction step: the position of the newest token when it ran and the kept set after it, bool [layers, H, N]."""


def pooled_schedule(
    future: torch.Tensor,
    budget: int,
    interval: int,
    pool: Pool | str,
    floor: int,
    shift: int = 0,
    compression: torch.Tensor | None = None,
) -> list[Eviction]:
    """The greedy schedule of one trace: every eviction step's position and kept set.

    future: α of steps t = 1..M, [M, layers, H, N] (N covers every candidate position). shift and compression: a
    decode regime's compression step after position P − 1 = B − 1 + shift, whose candidates are positions
    0..P − L − 1 and whose α row ([layers, H, N]) is `compression`; without one, step 1's candidates are 0..B − 1.
    Every group keeps its heads' share of B − L entries each, a head at least `floor` (0..L, so that its L leaving
    entries can always meet it) and the rest by α; ties keep the lower head, then the lower position."""
    pool = Pool.parse(pool)
    if not 0 <= floor <= interval:
        raise ValueError(f"floor={floor} must be 0..L={interval}: a head's L leaving entries must be able to meet it")
    num_steps, layers, heads, width = future.shape
    kept = torch.zeros(layers, heads, width, dtype=torch.bool)
    evictions = []
    if compression is not None:
        kept[..., : budget + shift - interval] = True  # every prompt entry but the window is a candidate
        kept = _select(compression, kept, budget - interval, floor, pool)
        evictions.append((budget - 1 + shift, kept))
    else:
        kept[..., : budget - interval] = True
    for step in range(num_steps):
        leaving = budget + (step - 1) * interval + shift
        candidates = kept.clone()
        candidates[..., leaving : leaving + interval] = True
        kept = _select(future[step], candidates, budget - interval, floor, pool)
        evictions.append((budget + (step + 1) * interval - 1 + shift, kept))
    return evictions


def _select(alpha: torch.Tensor, candidates: torch.Tensor, share: int, floor: int, pool: Pool) -> torch.Tensor:
    """The kept set [layers, H, N]: each group's heads keep `share` entries each in all, a head at least `floor` (a
    head keeps exactly `share` when it is its own group). A head's candidates number at least L >= floor and a
    group's at least its heads' shares, so no non-candidate (α = −inf here) is ever kept."""
    layers, heads, width = alpha.shape
    group = {Pool.HEAD: 1, Pool.LAYER: heads, Pool.ALL: layers * heads}[pool]
    scores = alpha.masked_fill(~candidates, float("-inf")).reshape(-1, group, width)
    own = top_k_mask(scores, share if group == 1 else floor)
    rest = scores.masked_fill(own, float("-inf")).flatten(1)
    extra = top_k_mask(rest, 0 if group == 1 else group * (share - floor)).view_as(own)
    return (own | extra).reshape(layers, heads, width)


def golden_evictions(
    kept_positions: torch.Tensor, prefill_kept: torch.Tensor | None, budget: int, interval: int, width: int, shift: int
) -> list[Eviction]:
    """Per-head golden's schedule from its labels (`GoldenLabels.kept_positions()` [M, layers, H, B − L] and its
    decode compression's `prefill_kept`), as the masked replay reads one."""

    def mask(positions: torch.Tensor) -> torch.Tensor:
        held = torch.zeros(*positions.shape[:-1], width, dtype=torch.bool)
        return held.scatter(-1, positions.long(), True)

    evictions = [] if prefill_kept is None else [(budget - 1 + shift, mask(prefill_kept))]
    return evictions + [
        (budget + (step + 1) * interval - 1 + shift, mask(kept)) for step, kept in enumerate(kept_positions)
    ]


def _masked_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    visible: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with each KV head's own key mask (`visible` [layers, Hkv, queries, keys]), its query heads sharing it."""
    groups = query.shape[1] // key.shape[1]
    mask = visible[module.layer_idx].repeat_interleave(groups, dim=0)[None]
    key, value = (tensor.repeat_interleave(groups, dim=1) for tensor in (key, value))
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


register_attention(MASKED_ATTENTION, _masked_attention, full_cache=True)


@torch.no_grad()
def masked_replay(
    model: torch.nn.Module, input_ids: torch.Tensor, evictions: Sequence[Eviction], interval: int, chunk: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token NLL [T − 1] and top-1 predictions [T − 1] of the trace, each head attending only to what its cache
    holds: before the first eviction every earlier token, after an eviction at position e its kept set, the
    window (e − L, e] and the tokens fed since (no evictions: the full cache). `chunk` bounds the forwards before
    the first eviction."""
    length = input_ids.numel()
    config = model.config.get_text_config()
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    cache = DynamicCache(config=model.config)
    unevicted = evictions[0][0] + 1 if evictions else length  # no schedule: the full cache throughout
    spans = [(start, min(start + chunk, unevicted), None) for start in range(0, unevicted, chunk)]
    bounds = [position + 1 for position, _ in evictions] + [length]
    spans += [(start, end, state) for start, end, state in zip(bounds, bounds[1:], evictions) if start < end]
    nll, greedy = torch.empty(length - 1), torch.empty(length - 1, dtype=torch.long)
    device = model.device
    ids = input_ids.to(device)
    with attention_implementation(model, MASKED_ATTENTION):
        for start, end, state in spans:
            positions = torch.arange(end, device=device)
            queries = torch.arange(start, end, device=device)
            visible = (positions[None, :] <= queries[:, None]).expand(layers, heads, -1, -1)
            if state is not None:
                newest, kept = state
                held = torch.zeros(layers, heads, end, dtype=torch.bool, device=device)
                held[..., : min(kept.shape[-1], end)] = kept[..., :end].to(device)
                held[..., max(newest - interval + 1, 0) :] = True
                visible = visible & held[:, :, None, :]
            logits = (
                model(input_ids=ids[start:end][None], **cache_argument(model, cache), use_cache=True, visible=visible)
                .logits[0]
                .float()
            )
            targets = slice(start, min(end, length - 1))
            log_probs = logits[: targets.stop - start].log_softmax(-1)
            nll[targets] = -log_probs.gather(-1, ids[start + 1 : targets.stop + 1, None])[:, 0].cpu()
            greedy[targets] = log_probs.argmax(-1).cpu()
    return nll, greedy
