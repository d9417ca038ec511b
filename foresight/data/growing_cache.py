"""A `transformers` KV cache that appends into spare room instead of concatenating.

`DynamicCache` concatenates every layer's whole cache with the new token at every decode step, so a
step copies the batch's entire KV cache: at 16 rows of ~1000 tokens on a CPU that copy was two thirds
of the step time (docs/benchmarks.md, "Trace generation"). Here each layer keeps its keys and values in
a buffer with room to spare; a step writes its token in place and `keys`/`values` are views of the
filled part. The buffer is copied only when it is full (then it grows by a share of its size, so the
copies cost amortised O(1) per token) or when someone replaced `keys`/`values` from outside (a row
joined or left the batch): `update` notices and rebuilds from what it finds.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

MIN_SPARE = 64  # slots of room added at least when a buffer is (re)built
SPARE_SHARE = 0.5  # and at least this share of the filled length


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of a larger buffer filled in place."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        needed = length + key_states.shape[-2]
        if not self._buffers_hold_the_cache(key_states, needed):
            capacity = needed + max(MIN_SPARE, int(SPARE_SHARE * needed))
            self._key_buffer = self._rebuilt(self.keys, key_states, length, capacity)
            self._value_buffer = self._rebuilt(self.values, value_states, length, capacity)
        self._key_buffer[:, :, length:needed] = key_states
        self._value_buffer[:, :, length:needed] = value_states
        self.keys, self.values = self._key_buffer[:, :, :needed], self._value_buffer[:, :, :needed]
        return self.keys, self.values

    def _buffers_hold_the_cache(self, new: torch.Tensor, needed: int) -> bool:
        """Whether `keys`/`values` are still the views this layer made and the buffers have room."""
        buffer = self._key_buffer
        if buffer is None or buffer.shape[-2] < needed or buffer.shape[:2] != new.shape[:2]:
            return False
        return (
            self.keys.data_ptr() == buffer.data_ptr()
            and self.values.data_ptr() == self._value_buffer.data_ptr()
            and self.keys.shape[:2] == buffer.shape[:2]
            and self.keys.stride() == buffer.stride()
        )

    @staticmethod
    def _rebuilt(filled: torch.Tensor, new: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
        """A buffer of `capacity` slots holding the `length` filled slots first."""
        buffer = new.new_empty(*new.shape[:2], capacity, new.shape[-1])
        if length:
            buffer[:, :, :length] = filled
        return buffer


def growing_cache() -> Cache:
    """An empty cache whose layers are `GrowingLayer`s, made as the model's layers first write."""
    return Cache(layer_class_to_replicate=GrowingLayer)
