"""A transformers Cache whose layers hold a KV budget by per-(batch row, KV head) index gather.

Layout of one layer (N = entries held, the same for every row and head of a layer):
- keys, values   [batch, Hkv, N, D]  post-RoPE keys, so eviction never re-rotates anything;
- positions      [batch, Hkv, N]     true sequence position of each entry (kept entries keep theirs);
- lengths        [batch]             valid entries per row; the valid entries of a row are always its
                                     last `lengths[b]` slots (left padding and eviction leftovers sit in
                                     front), so validity is derived, never stored per head;
- state          {name: [batch, Hkv, N, *trailing]}  per-entry policy state, gathered with K and V;
- the post-RoPE queries the policy observes: a ring buffer of the last L queries and their positions,
  or, for a policy that observes every query, each query until it has been handed out once.

Entries stay in position order, so the most recent L entries of a row are its last L slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass(frozen=True)
class StateField:
    """A per-entry policy state tensor: its name, the value new entries start with, and whether it
    holds one value per query head of the group (trailing dim G) instead of one per KV head."""

    name: str
    fill: float = 0.0
    per_query_head: bool = False


class EvictionLayer(CacheLayerMixin):
    """One decoder layer's cache: appends like a dynamic layer, evicts by gather (`compact`)."""

    is_compileable = False
    is_sliding = False

    def __init__(
        self,
        state_fields: tuple[StateField, ...] = (),
        group_size: int = 1,
        query_window: int = 0,
        keep_every_query: bool = False,
    ):
        super().__init__()
        self.state_fields = state_fields
        self.group_size = group_size
        self.query_window = query_window
        self.keep_every_query = keep_every_query
        self.positions: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.queries: torch.Tensor | None = None  # [batch, Hq, window, D] ring buffer
        self.query_positions: torch.Tensor | None = None  # [batch, window]
        self.query_cursor = 0  # next slot of the ring buffer
        self.unobserved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (queries, positions) not yet handed out
        self.unobserved_count = 0  # queries in `unobserved`
        self.scaling: float | None = None  # softmax scale of the layer's attention, set on first use
        self.pending_positions: torch.Tensor | None = None  # [batch, q] positions of the tokens being added
        self.pending_valid: torch.Tensor | None = None  # [batch] valid (non-padding) tokens among them

    # -- CacheLayerMixin -------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(batch, heads, 0, dim)
        self.values = value_states.new_zeros(batch, heads, 0, value_states.shape[-1])
        self.positions = torch.zeros(batch, heads, 0, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.state = {f.name: self._new_state(f, batch, heads, 0) for f in self.state_fields}
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens' K/V with the positions announced by `EvictionCache.begin_forward`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, count, _ = key_states.shape
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        new_positions = self.pending_positions[:, None, :].expand(batch, heads, count)
        self.positions = torch.cat([self.positions, new_positions], dim=2)
        self.lengths = self.lengths + self.pending_valid
        for field in self.state_fields:
            fresh = self._new_state(field, batch, heads, count)
            self.state[field.name] = torch.cat([self.state[field.name], fresh], dim=2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers < 5.3 passes cache_position
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # the name of this abstract method in transformers < 5.3

    def reset(self) -> None:
        self.__init__(self.state_fields, self.group_size, self.query_window, self.keep_every_query)

    # -- eviction runtime --------------------------------------------------------------------------
    def _new_state(self, field: StateField, batch: int, heads: int, count: int) -> torch.Tensor:
        shape = (batch, heads, count, self.group_size) if field.per_query_head else (batch, heads, count)
        return torch.full(shape, field.fill, dtype=torch.float32, device=self.device)

    @property
    def valid(self) -> torch.Tensor:
        """[batch, N] True for real entries (the last `lengths[b]` slots of each row)."""
        slots = torch.arange(self.get_seq_length(), device=self.device)
        return slots[None, :] >= (self.get_seq_length() - self.lengths)[:, None]

    def entry_positions(self) -> torch.Tensor:
        """[batch, Hkv, N] positions with -1 on invalid slots (padding, eviction leftovers)."""
        return self.positions.masked_fill(~self.valid[:, None, :], -1)

    def record_queries(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Record a forward's post-RoPE queries [batch, Hq, q, D] and their positions [batch, q]: every one
        until `take_unobserved` hands it out (`keep_every_query`), else the last `query_window` in the ring buffer."""
        if self.keep_every_query:
            self.unobserved.append((queries, positions))
            self.unobserved_count += queries.shape[2]
            return
        window = self.query_window
        if self.queries is None:
            batch, heads, _, dim = queries.shape
            self.queries = queries.new_zeros(batch, heads, window, dim)
            self.query_positions = torch.full((batch, window), -1, dtype=torch.long, device=queries.device)
        queries, positions = queries[:, :, -window:], positions[:, -window:]
        slots = (self.query_cursor + torch.arange(queries.shape[2], device=queries.device)) % window
        self.queries.index_copy_(2, slots, queries)
        self.query_positions.index_copy_(1, slots, positions)
        self.query_cursor = (self.query_cursor + queries.shape[2]) % window

    def buffered_queries(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring buffer in query order (oldest first): ([batch, Hq, L, D], [batch, L])."""
        order = (self.query_cursor + torch.arange(self.query_window, device=self.queries.device)) % self.query_window
        queries, positions = self.queries[:, :, order], self.query_positions[:, order]
        if rows is not None:
            queries, positions = queries[rows], positions[rows]
        return queries, positions

    def take_unobserved(self, complete_blocks_only: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Hand out the recorded queries, oldest first, in blocks of `query_window`: [(queries [batch, Hq, l, D],
        positions [batch, l])] with l <= L. With `complete_blocks_only`, a last block shorter than L stays for later."""
        if not self.unobserved:
            return []
        queries = torch.cat([q for q, _ in self.unobserved], dim=2)
        positions = torch.cat([p for _, p in self.unobserved], dim=1)
        window, count = self.query_window, self.unobserved_count
        end = count - count % window if complete_blocks_only else count
        blocks = [(queries[:, :, s : s + window], positions[:, s : s + window]) for s in range(0, end, window)]
        self.unobserved = [(queries[:, :, end:], positions[:, end:])] if end < count else []
        self.unobserved_count = count - end
        return blocks

    def compact(self, keep: torch.Tensor) -> None:
        """Keep the entries where `keep` [batch, Hkv, N] is True, in position order, right-aligned.

        Every row keeps the same count on each of its heads; rows may differ (padding, protected
        prompts), so the layer narrows to the largest count and shorter rows get invalid slots in front.
        """
        kept_per_row = keep[:, 0].sum(-1)
        width = int(kept_per_row.max())
        # A stable sort of the 0/1 mask puts dropped slots first and kept ones last, in position order.
        index = torch.sort(keep.to(torch.int8), dim=-1, stable=True).indices[..., -width:]
        self.keys = _gather_entries(self.keys, index)
        self.values = _gather_entries(self.values, index)
        self.positions = self.positions.gather(2, index)
        self.state = {name: _gather_entries(value, index) for name, value in self.state.items()}
        self.lengths = kept_per_row


def _gather_entries(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather [batch, Hkv, N, *trailing] along the entry dim with index [batch, Hkv, W]."""
    trailing = tensor.shape[3:]
    expanded = index.reshape(*index.shape, *(1,) * len(trailing)).expand(*index.shape, *trailing)
    return tensor.gather(2, expanded)


class EvictionCache(Cache):
    """The Cache facade the model calls; the engine announces each forward's positions first."""

    def __init__(
        self,
        num_layers: int,
        state_fields: tuple[StateField, ...] = (),
        group_size: int = 1,
        query_window: int = 0,
        keep_every_query: bool = False,
    ):
        layers = [EvictionLayer(state_fields, group_size, query_window, keep_every_query) for _ in range(num_layers)]
        super().__init__(layers=layers)
        self.has_padding = False
        self.records_queries = True

    def begin_forward(self, positions: torch.Tensor, valid: torch.Tensor, record_queries: bool = True) -> None:
        """Announce the tokens of the next forward: positions [batch, q] and valid counts [batch], and
        whether their queries are recorded (where the layers record queries at all).

        Also decides once per forward (one host sync, not one per layer) whether any row will hold
        invalid slots, which every layer's attention needs to know."""
        first = self.layers[0]
        entries = first.get_seq_length() + positions.shape[1]
        lengths = valid if first.lengths is None else first.lengths + valid
        self.has_padding = bool((lengths < entries).any())
        self.records_queries = record_queries
        for layer in self.layers:
            layer.pending_positions = positions
            layer.pending_valid = valid

    @property
    def lengths(self) -> torch.Tensor:
        """[batch] valid entries per row (equal across layers)."""
        return self.layers[0].lengths

    def max_entries(self) -> int:
        """Largest number of entries any layer holds."""
        return max(layer.get_seq_length() for layer in self.layers)
