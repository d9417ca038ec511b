"""foresight.data.growing_cache against transformers' DynamicCache: same keys, values and logits through
prefill, decode steps past the buffer's room, rows leaving, and slots dropped from outside."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from foresight.data.growing_cache import MIN_SPARE, GrowingLayer, growing_cache
from foresight.models import tiny_model


def test_growing_cache_decodes_as_the_dynamic_cache_and_copies_only_when_needed(monkeypatch):
    builds = []
    rebuilt = GrowingLayer._rebuilt
    monkeypatch.setattr(GrowingLayer, "_rebuilt", staticmethod(lambda *args: builds.append(args[-1]) or rebuilt(*args)))
    model = tiny_model("llama", seed=0).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=generator)
    caches = [DynamicCache(), growing_cache()]
    with torch.no_grad():
        outputs = [model(input_ids=ids, past_key_values=c, use_cache=True).logits for c in caches]
        torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
        for step in range(100):
            if step == 10:  # a row leaves
                for cache in caches:
                    cache.batch_select_indices(torch.tensor([0, 2]))
            if step == 20:  # the oldest slot is dropped from outside, as the sampler narrows its batch
                for cache in caches:
                    for layer in cache.layers:
                        layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
            token = torch.randint(0, model.config.vocab_size, (ids.shape[0] if step < 10 else 2, 1), generator=generator)
            outputs = [model(input_ids=token, past_key_values=c, use_cache=True).logits for c in caches]
            torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
        for dynamic, growing in zip(caches[0].layers, caches[1].layers):
            assert isinstance(growing, GrowingLayer)
            torch.testing.assert_close(growing.keys, dynamic.keys, rtol=0, atol=0)
            torch.testing.assert_close(growing.values, dynamic.values, rtol=0, atol=0)
            assert growing.keys.data_ptr() == growing._key_buffer.data_ptr()  # a view of its buffer
    # per layer, keys and values: built at the prefill (5 tokens + room), rebuilt when the row left (16
    # tokens), when the slot was dropped (25) and once when the room ran out (90), never at other steps
    layers = model.config.num_hidden_layers
    assert builds == [5 + MIN_SPARE] * 2 * layers + [16 + MIN_SPARE] * 2 * layers + [25 + MIN_SPARE] * 2 * layers + [
        90 + MIN_SPARE
    ] * 2 * layers
