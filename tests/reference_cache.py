"""The slow, obvious twin of the runtime's cache storage: every forward concatenates the new entries
(`torch.cat`) and every eviction gathers into fresh tensors, so nothing is preallocated or reused.
It keeps the semantics of `EvictionLayer` (same validity, ring buffer, compaction order)."""

from __future__ import annotations

import torch

from foresight.runtime.cache import KEYS, POSITIONS, QUERIES, VALUES, EvictionCache, EvictionLayer, StateField


class ConcatenatingLayer(EvictionLayer):
    """An `EvictionLayer` whose keys, values, positions and state are plain tensors rebuilt per change."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(batch, heads, 0, dim)
        self.values = value_states.new_zeros(batch, heads, 0, value_states.shape[-1])
        self.positions = torch.zeros(batch, heads, 0, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.state = {f.name: self._fresh_state(f, batch, heads, 0) for f in self.state_fields}
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, count, _ = key_states.shape
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        new_positions = self.pending_positions[:, None, :].expand(batch, heads, count)
        self.positions = torch.cat([self.positions, new_positions], dim=2)
        self.lengths = self.lengths + self.pending_valid
        for field in self.state_fields:
            fresh = self._fresh_state(field, batch, heads, count)
            self.state[field.name] = torch.cat([self.state[field.name], fresh], dim=2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def write_state(self, name: str, value: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        if rows is None:
            self.state[name] = value
        else:
            self.state[name][rows] = value

    def compact(self, keep: torch.Tensor, width: int) -> None:
        """Counts what the mask keeps itself: the engine's host cadence must have announced that width."""
        kept_per_row = keep[:, 0].sum(-1)
        assert int(kept_per_row.max()) == width, (int(kept_per_row.max()), width)
        index = torch.sort(keep.to(torch.int8), dim=-1, stable=True).indices[..., -width:]

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            trailing = tensor.shape[3:]
            expanded = index.reshape(*index.shape, *(1,) * len(trailing)).expand(*index.shape, *trailing)
            return tensor.gather(2, expanded)

        self.keys, self.values, self.positions = gather(self.keys), gather(self.values), gather(self.positions)
        self.state = {name: gather(value) for name, value in self.state.items()}
        self.lengths = kept_per_row

    def _fresh_state(self, field: StateField, batch: int, heads: int, count: int) -> torch.Tensor:
        shape = (batch, heads, count, self.group_size) if field.per_query_head else (batch, heads, count)
        return torch.full(shape, field.fill, dtype=field.dtype, device=self.device)


class ConcatenatingCache(EvictionCache):
    """`EvictionCache` with `ConcatenatingLayer`s; takes (and ignores) the capacity of the real one. The per-head
    layout only (`pool_heads` 0)."""

    def __init__(
        self,
        num_layers: int,
        state_fields=(),
        group_size: int = 1,
        query_window: int = 0,
        keep_every_query: bool = False,
        capacity=None,
        query_dtype=None,
        stream_queries: int = 0,
        pool_heads: int = 0,
    ):
        if pool_heads:
            raise ValueError(f"the concatenating cache holds a cache per KV head, not a pool of {pool_heads}")
        super().__init__(
            num_layers,
            state_fields,
            group_size,
            query_window,
            keep_every_query,
            query_dtype=query_dtype,
            stream_queries=stream_queries,
        )
        self.layers = [
            ConcatenatingLayer(state_fields, group_size, query_window, keep_every_query, stream_queries=stream_queries)
            for _ in range(num_layers)
        ]

    def compact(self, keep: torch.Tensor, width: int) -> None:
        """Each layer counts and sorts its own mask [batch, Hkv, N] (the runtime does all layers at once)."""
        for layer, layer_keep in zip(self.layers, keep, strict=True):
            layer.compact(layer_keep, width)

    def stacked(self, name: str) -> torch.Tensor:
        """A stacked copy of every layer's tensor (the runtime's is a view of its one storage)."""
        if name == QUERIES:
            return torch.stack([layer.queries for layer in self.layers])
        named = {KEYS: "keys", VALUES: "values", POSITIONS: "positions"}
        return torch.stack(
            [getattr(layer, named[name]) if name in named else layer.state[name] for layer in self.layers]
        )

    def write_state(self, name: str, value: torch.Tensor, rows: torch.Tensor) -> None:
        for layer, layer_value in zip(self.layers, value, strict=True):
            layer.write_state(name, layer_value, rows)
