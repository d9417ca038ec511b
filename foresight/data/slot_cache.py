"""A `transformers` KV cache of fixed row slots, for continuous batching without cache copies.

Each layer holds keys and values in one buffer [slots, heads, capacity, head_dim]. A request takes a free
slot and keeps it until it ends: its prefilled prompt is written at the slot's start (`admit`, a copy of
that row only), each decode step writes every slot's new token at that slot's own length, and a row that
ends just frees its slot. Nothing is copied when rows join or leave, unlike a batch whose cache is
concatenated and re-indexed (the whole cache copied each time), and nothing is read back to the host:
the lengths live on the device and the host keeps its own copy of the widest (`SlotStep`).

The model sees the first `active` slots' first `width` positions (a view: slots fill lowest first, so the
idle ones above the highest busy slot cost nothing) with an additive 4D attention mask, built by the
sampler, that shows each row its own `length + 1` entries; `transformers` uses such a mask as it is.
A model with sliding-window layers is refused: one mask serves every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from foresight.models import describe

CAPACITY_ROUNDING = 64
"""Buffers grow to a multiple of this many positions (growth copies every slot, so it should be rare)."""


@dataclass
class SlotStep:
    """What the next forward writes: `write_index` [slots] on the device (each slot's length, where its new
    token goes), `width`, the positions the model attends over (the longest row's length + 1), and
    `active`, the slots it runs (the highest busy one + 1)."""

    write_index: torch.Tensor
    width: int = 1
    active: int = 1


class SlotLayer(CacheLayerMixin):
    """One layer's fixed-slot buffers; `keys`/`values` are views of their first `step.width` positions."""

    def __init__(self, step: SlotStep, slots: int, heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.step = step
        self.key_buffer = torch.zeros(slots, heads, 0, head_dim, dtype=dtype, device=device)
        self.value_buffer = torch.zeros_like(self.key_buffer)
        self.rows = torch.arange(slots, device=device)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a slot layer is made with its buffers")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each active slot's one new token [active, heads, 1, head_dim] at its own length."""
        active = self.step.active
        if key_states.shape[-2] != 1 or key_states.shape[0] != active:
            raise ValueError(
                f"a slot cache decodes one token per active slot ({active}), got key states {tuple(key_states.shape)}"
            )
        rows, index = self.rows[:active], self.step.write_index[:active]
        self.key_buffer[rows, :, index] = key_states[:, :, 0]
        self.value_buffer[rows, :, index] = value_states[:, :, 0]
        self.keys = self.key_buffer[:active, :, : self.step.width]
        self.values = self.value_buffer[:active, :, : self.step.width]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.step.width, 0

    def get_seq_length(self) -> int:
        return self.step.width - 1

    def get_max_length(self) -> int:
        return self.key_buffer.shape[2]

    def admit(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write prefilled rows' keys and values [rows, heads, n, head_dim] at the start of `slots` [rows]
        (positions past a row's prompt hold its padding, which the mask hides until its own tokens overwrite it)."""
        length = keys.shape[2]
        self.key_buffer[slots, :, :length] = keys
        self.value_buffer[slots, :, :length] = values

    def grow(self, capacity: int) -> None:
        """Room for `capacity` positions per slot (copies every slot once)."""
        if capacity <= self.key_buffer.shape[2]:
            return
        held = self.key_buffer.shape[2]
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, :held] = old
            setattr(self, name, new)


class SlotCache(Cache):
    """The fixed-slot cache of a model: one `SlotLayer` per layer sharing one `SlotStep`."""

    def __init__(self, model: torch.nn.Module, slots: int) -> None:
        layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
        if "sliding_attention" in layer_types:
            raise ValueError(
                f"{model.config.name_or_path} has sliding-window layers; the slot cache's one mask serves full attention only"
            )
        shape = describe(model)
        self.step = SlotStep(write_index=torch.zeros(slots, dtype=torch.long, device=model.device))
        layers = [
            SlotLayer(self.step, slots, shape.num_kv_heads, shape.head_dim, model.dtype, model.device)
            for _ in range(shape.num_layers)
        ]
        super().__init__(layers=layers)

    @property
    def capacity(self) -> int:
        return self.layers[0].get_max_length()

    def reserve(self, positions: int) -> None:
        """Make every slot able to hold `positions` tokens (a request's prompt and its new tokens)."""
        if positions > self.capacity:
            capacity = -(-positions // CAPACITY_ROUNDING) * CAPACITY_ROUNDING
            for layer in self.layers:
                layer.grow(capacity)

    def admit(self, slots: torch.Tensor, prefilled: Cache) -> None:
        """Copy a prefilled cache's rows into `slots` [rows] (the caller `reserve`d their room)."""
        for mine, theirs in zip(self.layers, prefilled.layers, strict=True):
            mine.admit(slots, theirs.keys, theirs.values)
