"""The dense reference the cache's schedules are checked against: one eager forward of a whole trace in which
each query of each (layer, KV head) attends only the keys a mask allows, computed without a cache."""

from __future__ import annotations

import torch
from transformers import AttentionInterface

MASKED = "masked-reference"


def masked_forward(
    model, input_ids: torch.Tensor, allowed: torch.Tensor
) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, ...]]]:
    """The logits [T, V] of one forward of `input_ids` [T] in which query q of layer l and KV head h sees key k
    only where allowed[l, h, q, k]; and per layer, its keys [Hkv, T, D], values and attention [Hq, T, T]."""
    captured = {}

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        group = query.shape[1] // key.shape[1]
        keys, values = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        logits = torch.einsum("bhqd,bhkd->bhqk", query, keys) * scaling
        mask = allowed[module.layer_idx].repeat_interleave(group, 0)
        weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
        captured[module.layer_idx] = (key[0], value[0], weights[0])
        return (weights @ values).transpose(1, 2).contiguous(), None

    AttentionInterface.register(MASKED, attend)
    model.set_attn_implementation(MASKED)
    try:
        with torch.no_grad():
            logits = model(input_ids[None]).logits[0]
    finally:
        model.set_attn_implementation("sdpa")
    return logits, captured
