"""A transformers Cache whose layers hold a KV budget by per-(batch row, KV head) index gather.

Layout of one layer (N = entries held, the same for every row and head of a layer):
- keys, values   [batch, Hkv, N, D]  post-RoPE keys, so eviction never re-rotates anything;
- positions      [batch, Hkv, N]     true sequence position of each entry (kept entries keep theirs), int32
                                     (`POSITION_DTYPE`: positions of a sequence fit it; half of int64's bytes);
- lengths        [batch]             valid entries per row; the valid entries of a row are always its
                                     last `lengths[b]` slots (left padding and eviction leftovers sit in
                                     front), so validity is derived, never stored per head;
- state          {name: [batch, Hkv, N, *trailing]}  per-entry policy state at its field's declared dtype,
                                     gathered with K and V;
- owners         [batch, 1, N]       the pooled layout only: the KV head each slot holds an entry of (below), uint8;
- the post-RoPE queries the policy observes: a ring buffer of the last L queries and their positions,
  or, for a policy that observes every query, each query until it has been handed out once (for a policy
  that streams its observation, each forward's latest L until handed out right after it); the ring
  at the policy's declared `query_dtype` when narrower than the model's (block attention reads it in float32).

`entry_layouts` and `query_layouts` declare every tensor's shape and dtype once; the cache allocates
from them and `foresight.runtime.held_memory` counts from them.

Entries stay in position order, so the most recent L entries of a row are its last L slots.
Keys, values, positions and state are views of the first N slots of buffers allocated once per run
and stacked across layers (`EntryStorage`: one buffer per field, [layers, batch, Hkv, slots, *trailing];
the query ring likewise, [layers, batch, Hq, L, D]): a layer's tensors are its slices, which the attention
function reads without a copy; a new token is copied into the layer's next slot, and an eviction gathers
the kept entries of every layer to the front at once, one gather per field whatever the depth. A run that
evicts holds the same memory from its first eviction to its end.

The pooled layout (`pool_heads` = H): a layer's H KV heads share one pool, a cache of one KV head whose slots are
tagged with their owner head (`OWNERS`). A token appends its H entries as H consecutive slots, so entries stay in
position order, the recent window is the last H·L slots, and a head may hold more slots than another after a step
(`foresight.runtime.pool`) while every row of every layer holds the same count: the storage and its one gather per
field are the per-head layout's with Hkv = 1. Lengths and slot counts are then in slots (H per token).

Size: the layer, its preallocated storage and the Cache facade change together (every field the
storage holds is one the layer gathers).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from foresight.device_checks import require
from foresight.runtime.prefix import RecordedForward

KEYS, VALUES, POSITIONS, OWNERS = "keys", "values", "positions", "owners"
_ENTRY_TENSORS = (KEYS, VALUES, POSITIONS, OWNERS)
POSITION_DTYPE = torch.int32
"""Sequence positions of entries and buffered queries: exact below 2**31 tokens, 4 bytes per entry and KV head."""
OWNER_DTYPE = torch.uint8
"""The owner head of a pooled slot: one byte per slot, so a pool holds at most `MAX_POOL_HEADS` KV heads."""
MAX_POOL_HEADS = 256
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes a per-entry state field may be stored at."""


@dataclass(frozen=True)
class StateField:
    """A per-entry policy state tensor: its name, the value new entries start with, whether it holds one
    value per query head of the group (trailing dim G) instead of one per KV head, and the dtype the cache
    stores it at (what its bytes are counted at; a policy computes in float32 and writes back at this dtype)."""

    name: str
    fill: float = 0.0
    per_query_head: bool = False
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.name in _ENTRY_TENSORS:
            raise ValueError(f"state field name {self.name!r} is taken; not one of: {', '.join(_ENTRY_TENSORS)}")
        if self.dtype not in STATE_DTYPES:
            raise ValueError(
                f"state field {self.name!r} dtype {self.dtype} is not one of: {', '.join(map(str, STATE_DTYPES))}"
            )


@dataclass(frozen=True)
class EntryLayout:
    """One per-entry tensor of a layer: its trailing shape after [batch, Hkv, entries], its dtype and, for a state
    field, the value a new entry starts with (`fill`; None: a tensor every new entry is copied into)."""

    trailing: tuple[int, ...]
    dtype: torch.dtype
    fill: float | None = None


QUERIES, QUERY_POSITIONS = "queries", "query_positions"


def entry_layouts(
    state_fields: tuple[StateField, ...],
    group_size: int,
    key_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    pooled: bool = False,
) -> dict[str, EntryLayout]:
    """Every per-entry tensor of a layer for a model of `dtype` (what `EntryStorage` allocates and
    `foresight.runtime.held_memory` counts): keys, values, positions, the owner tag of a `pooled` slot and each
    state field."""
    layouts = {
        KEYS: EntryLayout((key_dim,), dtype),
        VALUES: EntryLayout((value_dim,), dtype),
        POSITIONS: EntryLayout((), POSITION_DTYPE),
    }
    if pooled:
        layouts[OWNERS] = EntryLayout((), OWNER_DTYPE)
    for field in state_fields:
        layouts[field.name] = EntryLayout((group_size,) if field.per_query_head else (), field.dtype, float(field.fill))
    return layouts


def query_layouts(
    query_heads: int, head_dim: int, dtype: torch.dtype, query_dtype: torch.dtype | None = None
) -> dict[str, EntryLayout]:
    """One recorded query of a row of a model of `dtype`: its post-RoPE vector per query head [Hq, D] and its
    position []. `query_dtype`: the policy's narrower dtype for its ring buffer (`ring_dtype`); the queries
    not yet handed out (a policy that observes every query) stay at the model's."""
    return {
        QUERIES: EntryLayout((query_heads, head_dim), ring_dtype(dtype, query_dtype)),
        QUERY_POSITIONS: EntryLayout((), POSITION_DTYPE),
    }


class EntryStorage:
    """Per-entry tensors of every layer of a cache that share the entry dim (dim 3), stacked across layers in
    buffers of fixed size: one buffer per copied field, [layers, batch, Hkv, slots, *trailing], and the state fields
    of one trailing shape and dtype packed in one, [layers, batch, Hkv, slots, *trailing, fields], so that a
    compaction gathers every state field at once (the learned policy's six in one gather).

    Slots [0, filled[l]) of layer l hold its entries; `view` returns that region of one layer, or of every layer
    once they hold the same count (between forwards). `append` copies a layer's new entries into its next slots
    and `compact` gathers the kept entries of every layer to the front, one gather per buffer, in place. The
    buffers start with `capacity` slots (the most a run can hold: B + L + protected prompt) and grow, by
    doubling, only when a forward brings more than fits (a prefill longer than the budget, a full cache); a
    compaction that leaves at most `capacity` entries brings grown buffers back to it.

    A state field's slots past a layer's filled ones hold its fill value (written when a buffer is made and after
    each compaction), so `append` copies only keys, values and positions: a stateful policy's token costs the
    storage what a stateless one's does, and a compaction one fill per state field.
    """

    def __init__(
        self,
        layouts: dict[str, EntryLayout],
        layers: int,
        batch: int,
        heads: int,
        slots: int,
        device: torch.device,
        capacity: int | None = None,
    ):
        self.layouts = layouts
        # the fields a new entry is copied into: not the state fields, whose unwritten slots hold their fill value
        self.copied = tuple(name for name, layout in layouts.items() if layout.fill is None)
        self.packs = _state_packs(layouts)
        # each field's buffer and, for a state field, its index in the buffer's last dim
        self._places: dict[str, tuple[str, int | None]] = {name: (name, None) for name in self.copied}
        for pack, names in self.packs.items():
            self._places.update({name: (pack, index) for index, name in enumerate(names)})
        self.batch, self.heads, self.device = batch, heads, device
        self.capacity = capacity
        self.filled = [0] * layers  # entries held per layer
        self.allocations = 0  # buffer sets allocated so far (1 for a run that never grows)
        self.buffers: dict[str, torch.Tensor] = {}
        self._allocate(slots)

    @property
    def slots(self) -> int:
        return next(iter(self.buffers.values())).shape[3]

    @property
    def entries(self) -> int:
        """Entries every layer holds (they hold the same count between forwards)."""
        if len(set(self.filled)) > 1:
            raise RuntimeError(f"the layers hold different entry counts {sorted(set(self.filled))} (mid-forward)")
        return self.filled[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (filled or not), every layer's."""
        return sum(buffer.nbytes for buffer in self.buffers.values())

    def view(self, name: str, layer: int | None = None) -> torch.Tensor:
        """The entries held, a view into the buffer: [batch, Hkv, filled, *trailing] of `layer`, or
        [layers, batch, Hkv, entries, *trailing] of every layer (None)."""
        buffer, component = self._places[name]
        if layer is None:
            held = self.buffers[buffer][:, :, :, : self.entries]
        else:
            held = self.buffers[buffer][layer, :, :, : self.filled[layer]]
        return held if component is None else held[..., component]

    def append(self, layer: int, count: int, entries: Mapping[str, torch.Tensor]) -> None:
        """Copy `count` new entries of `layer` into its next slots: for every buffer but the state fields (whose
        next slots hold their fill value already), a tensor broadcast to [batch, Hkv, count, *trailing]."""
        start = self.filled[layer]
        if start + count > self.slots:
            self._allocate(max(start + count, 2 * self.slots), keep=max(self.filled))
        for name in self.copied:
            self.buffers[name][layer, :, :, start : start + count].copy_(entries[name])
        self.filled[layer] = start + count

    def fill_unwritten(self, start: int) -> None:
        """Write each state field's fill value into slots [start, slots) of every layer: one fill a pack whose fields
        start alike (the learned policy's sums all start at 0)."""
        for pack, names in self.packs.items():
            self._fill(self.buffers[pack][:, :, :, start:], names)

    def _fill(self, unwritten: torch.Tensor, names: tuple[str, ...]) -> None:
        fills = [self.layouts[name].fill for name in names]
        if len(set(fills)) == 1:
            unwritten.fill_(fills[0])
            return
        for component, fill in enumerate(fills):
            unwritten[..., component].fill_(fill)

    def compact(self, index: torch.Tensor) -> None:
        """Keep the entries at slots `index` [layers, batch, Hkv, W], in that order, in slots [0, W) of every layer."""
        width = index.shape[-1]
        shrink = self.capacity is not None and width <= self.capacity < self.slots
        entries = self.entries
        for name in self.buffers:
            kept = gather_entries(self.buffers[name][:, :, :, :entries], index)  # a temporary: slots may overlap
            if shrink:
                self.buffers[name] = self._new_buffer(name, self.capacity)
            self.buffers[name][:, :, :, :width].copy_(kept)
        if shrink:
            self.allocations += 1
        else:
            self.fill_unwritten(width)
        self.filled = [width] * len(self.filled)

    def select_rows(self, rows: torch.Tensor) -> EntryStorage:
        """A copy holding batch rows `rows` [R] (indices, repeats allowed) of every buffer, filled as this one."""
        selected = copy.copy(self)
        selected.buffers = {name: buffer[:, rows] for name, buffer in self.buffers.items()}
        selected.filled = list(self.filled)
        selected.batch = rows.numel()
        return selected

    def _allocate(self, slots: int, keep: int = 0) -> None:
        """New buffers of `slots` entries holding the first `keep` entries of the old ones."""
        old = self.buffers
        self.buffers = {name: self._new_buffer(name, slots) for name in (*self.copied, *self.packs)}
        for name, buffer in old.items():
            self.buffers[name][:, :, :, :keep].copy_(buffer[:, :, :, :keep])
        self.allocations += 1

    def _new_buffer(self, name: str, slots: int) -> torch.Tensor:
        """An unwritten buffer (a copied field's, or a pack of state fields holding their fill values)."""
        fields = self.packs.get(name, (name,))
        layout = self.layouts[fields[0]]
        packed = (len(fields),) if name in self.packs else ()
        shape = (len(self.filled), self.batch, self.heads, slots, *layout.trailing, *packed)
        buffer = torch.empty(shape, dtype=layout.dtype, device=self.device)
        if name in self.packs:
            self._fill(buffer, fields)
        return buffer


def _state_packs(layouts: Mapping[str, EntryLayout]) -> dict[str, tuple[str, ...]]:
    """The state fields grouped by trailing shape and dtype, in their order: each group one buffer, named for its
    fields ("state:cumulative+decayed+recent")."""
    groups: dict[tuple[tuple[int, ...], torch.dtype], list[str]] = {}
    for name, layout in layouts.items():
        if layout.fill is not None:
            groups.setdefault((layout.trailing, layout.dtype), []).append(name)
    return {"state:" + "+".join(names): tuple(names) for names in groups.values()}


@dataclass
class StaticDecodeState:
    """The counters a decode forward advances, on the device (`EvictionCache.start_static_decode`): with them a
    decode forward runs the same operations on the same tensors at every token (what a CUDA graph replays), and
    the host mirrors each counter between forwards (`EvictionCache.advance_static`) for the eager eviction step.

    The queries of a streaming policy wait in `stream_queries` [layers, batch, Hq, S, D] and `stream_positions`
    [batch, S] instead of a list of each forward's; a window policy's ring is the stack's, indexed here."""

    cursor: torch.Tensor  # [1] long: the slot the next token's entry is written to, every layer's
    query_slot: torch.Tensor  # [1] long: the next slot of the query ring or of the stream buffer
    query_slots: int  # the ring's or the stream buffer's length: query_slot wraps at it
    slot_index: torch.Tensor  # [slots] 0..slots-1, for the mask
    stream_queries: torch.Tensor | None = None
    stream_positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [batch, 1, 1, slots] the valid slots of this forward, made by layer 0

    def after_forward(self) -> None:
        """Advance the counters past one decode token (inside the captured step)."""
        self.cursor.add_(1)
        self.query_slot.add_(1).remainder_(self.query_slots)


class LayerStack:
    """What the layers of one cache share, each layer reading its slice: the entry storage and the query ring
    ([layers, batch, Hq, L, D] and its positions [layers, batch, L]), allocated when the first layer needs them."""

    def __init__(self, depth: int):
        self.depth = depth
        self.storage: EntryStorage | None = None
        self.queries: torch.Tensor | None = None
        self.query_positions: torch.Tensor | None = None
        self.static: StaticDecodeState | None = None  # set by `EvictionCache.start_static_decode`

    def select_rows(self, rows: torch.Tensor) -> LayerStack:
        """A copy holding batch rows `rows` [R] of everything allocated."""
        selected = LayerStack(self.depth)
        if self.storage is not None:
            selected.storage = self.storage.select_rows(rows)
        if self.queries is not None:
            selected.queries, selected.query_positions = self.queries[:, rows], self.query_positions[:, rows]
        return selected


class LayerState(Mapping[str, torch.Tensor]):
    """A layer's state fields, each a view of its filled region of the storage made when read: a decode forward
    refreshes every layer's views and reads none of its state, so it makes none (six fields a layer and token for
    the learned policy)."""

    def __init__(self, storage: EntryStorage, layer: int, names: tuple[str, ...]):
        self._storage, self._layer, self._names = storage, layer, names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._storage.view(name, self._layer)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class EvictionLayer(CacheLayerMixin):
    """One decoder layer's cache: its slice `index` of the storage and query ring its cache's layers share
    (`stack`; a layer made on its own has a stack of one). It appends by copy into preallocated slots; the
    cache evicts every layer at once (`EvictionCache.compact`).

    `capacity` is the most entries a run can hold (its storage is sized for it up front); None grows
    the storage as entries arrive. `pool_heads`: the KV heads of the pooled layout's one pool (module docstring;
    `capacity` then counts slots), 0 for a cache per KV head."""

    is_compileable = False
    is_sliding = False

    def __init__(
        self,
        state_fields: tuple[StateField, ...] = (),
        group_size: int = 1,
        query_window: int = 0,
        keep_every_query: bool = False,
        capacity: int | None = None,
        query_dtype: torch.dtype | None = None,
        stack: LayerStack | None = None,
        index: int = 0,
        stream_queries: int = 0,
        pool_heads: int = 0,
    ):
        super().__init__()
        self.stack = LayerStack(1) if stack is None else stack
        self.index = index
        self.state_fields = state_fields
        self.state_names = tuple(field.name for field in state_fields)  # made once, read every token
        self.group_size = group_size
        self.query_window = query_window
        self.keep_every_query = keep_every_query
        self.stream_queries = stream_queries
        self.pool_heads = pool_heads
        self.capacity = capacity
        self.query_dtype = query_dtype
        self.storage: EntryStorage | None = None
        self.positions: torch.Tensor | None = None
        self.owners: torch.Tensor | None = None  # [batch, 1, N] the pooled layout's owner head of each slot
        self.lengths: torch.Tensor | None = None
        self.state: Mapping[str, torch.Tensor] = MappingProxyType({})  # write with `write_state`
        self.queries: torch.Tensor | None = None  # [batch, Hq, window, D] ring buffer, a slice of the stack's
        self.query_positions: torch.Tensor | None = None  # [batch, window], a slice of the stack's
        self.query_cursor = 0  # next slot of the ring buffer
        self.unobserved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (queries, positions) not yet handed out
        self.unobserved_count = 0  # queries in `unobserved`
        self.scaling: float | None = None  # softmax scale of the layer's attention, set on first use
        self.pending_positions: torch.Tensor | None = None  # [batch, q] positions of the tokens being added
        self.pending_valid: torch.Tensor | None = None  # [batch] valid (non-padding) tokens among them

    # -- CacheLayerMixin -------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, count, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        layouts = entry_layouts(
            self.state_fields, self.group_size, dim, value_states.shape[-1], key_states.dtype, bool(self.pool_heads)
        )
        if self.pool_heads:
            heads, count = 1, count * heads
        stack = self.stack
        if stack.storage is None:
            slots = max(self.capacity or 0, count)
            stack.storage = EntryStorage(layouts, stack.depth, batch, heads, slots, self.device, self.capacity)
        elif (stack.storage.layouts, stack.storage.batch, stack.storage.heads) != (layouts, batch, heads):
            raise ValueError(
                f"layer {self.index}'s keys {tuple(key_states.shape)} ({key_states.dtype}) differ from the first "
                "layer's: the cache stacks every layer's entries in one storage, so they must share one shape"
            )
        self.storage = stack.storage
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens' K/V with the positions announced by `EvictionCache.begin_forward`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.stack.static is not None:
            return self._static_update(key_states, value_states)
        entries = self._new_entries(key_states, value_states)
        self.storage.append(self.index, entries[KEYS].shape[2], entries)
        self.lengths = self.lengths + self.pending_valid * self.slots_per_token
        self._refresh_views()
        return self.keys, self.values

    @property
    def slots_per_token(self) -> int:
        """Slots a token's entries take: one per KV head in the pooled layout, one in each head's cache otherwise."""
        return self.pool_heads or 1

    def _new_entries(self, key_states: torch.Tensor, value_states: torch.Tensor) -> dict[str, torch.Tensor]:
        """A forward's new keys, values and positions as this layer's slots: [batch, Hkv, q] as they come, or pooled,
        each token's H entries as H consecutive slots of the one pool, [batch, 1, q·H], tagged with their head."""
        positions = self.pending_positions[:, None, :]
        if not self.pool_heads:
            return {KEYS: key_states, VALUES: value_states, POSITIONS: positions}
        heads, count = key_states.shape[1], key_states.shape[2]
        owners = torch.arange(heads, dtype=OWNER_DTYPE, device=key_states.device).repeat(count)
        return {
            KEYS: key_states.transpose(1, 2).flatten(1, 2)[:, None],
            VALUES: value_states.transpose(1, 2).flatten(1, 2)[:, None],
            POSITIONS: positions.repeat_interleave(heads, dim=2),
            OWNERS: owners,
        }

    def newest_entries(self, tensor: torch.Tensor, tokens: int) -> torch.Tensor:
        """The entries of the newest `tokens` tokens in this layer's `tensor` (its keys or values), per KV head:
        [batch, Hkv, tokens, D] (what a recorded forward appends again, `foresight.runtime.prefix`)."""
        if not self.pool_heads:
            return tensor[:, :, -tokens:]
        return tensor[:, 0, -tokens * self.pool_heads :].unflatten(1, (tokens, self.pool_heads)).transpose(1, 2)

    def _static_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """`update` of a static decode forward (one token per row): write its entry at the device cursor (its state
        slots hold their fill value already), count it in place, and return every slot's keys and values; layer 0
        makes the forward's mask of valid slots, which every layer's attention reads (`StaticDecodeState.mask`)."""
        static, buffers = self.stack.static, self.storage.buffers
        batch, heads = key_states.shape[:2]
        new = {
            KEYS: key_states,
            VALUES: value_states,
            POSITIONS: self.pending_positions.to(POSITION_DTYPE)[:, None, :].expand(batch, heads, 1),
        }
        for name in self.storage.copied:
            target = buffers[name][self.index]
            target.index_copy_(2, static.cursor, new[name].to(target.dtype))
        self.lengths.add_(self.pending_valid)
        if self.index == 0:
            filled = static.cursor + 1
            valid = (static.slot_index < filled) & (static.slot_index >= filled - self.lengths[:, None])
            static.mask = valid[:, None, None, :]
        return buffers[KEYS][self.index], buffers[VALUES][self.index]

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers < 5.3 passes cache_position
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.storage is None else self.storage.filled[self.index]

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # the name of this abstract method in transformers < 5.3

    def reset(self) -> None:
        """Empty this layer and the stack it shares (every layer of the cache resets with it)."""
        self.stack.__init__(self.stack.depth)
        self.__init__(
            self.state_fields,
            self.group_size,
            self.query_window,
            self.keep_every_query,
            self.capacity,
            self.query_dtype,
            self.stack,
            self.index,
            self.stream_queries,
            self.pool_heads,
        )

    # -- eviction runtime --------------------------------------------------------------------------
    def _refresh_views(self) -> None:
        """Point keys, values, positions and state at this layer's filled region of the storage."""
        storage, index = self.storage, self.index
        self.keys, self.values = storage.view(KEYS, index), storage.view(VALUES, index)
        self.positions = storage.view(POSITIONS, index)
        if self.pool_heads:
            self.owners = storage.view(OWNERS, index)
        self.state = LayerState(storage, index, self.state_names)

    def write_state(self, name: str, value: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Overwrite state field `name` with `value` [batch or len(rows), Hkv, N, *trailing], in place."""
        if rows is None:
            self.state[name].copy_(value)
        else:
            self.state[name][rows] = value

    @property
    def valid(self) -> torch.Tensor:
        """[batch, N] True for real entries (the last `lengths[b]` slots of each row)."""
        slots = torch.arange(self.get_seq_length(), device=self.device)
        return slots[None, :] >= (self.get_seq_length() - self.lengths)[:, None]

    def entry_positions(self) -> torch.Tensor:
        """[batch, Hkv, N] positions with -1 on invalid slots (padding, eviction leftovers)."""
        return self.positions.masked_fill(~self.valid[:, None, :], -1)

    def positions_by_head(self) -> torch.Tensor:
        """[batch, Hkv, N] the positions each KV head holds, -1 elsewhere: `entry_positions`, or in the pooled layout
        the pool's positions seen once per head with every other head's slots at -1 (what a per-head reader such as
        the evaluation's golden overlap reads)."""
        held = self.entry_positions()
        if not self.pool_heads:
            return held
        heads = torch.arange(self.pool_heads, device=held.device)[None, :, None]
        return held.expand(-1, self.pool_heads, -1).masked_fill(self.owners != heads, -1)

    def record_queries(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Record a forward's post-RoPE queries [batch, Hq, q, D] and their positions [batch, q]: every one
        until `take_unobserved` hands it out (`keep_every_query`), else the last `query_window` in the ring buffer
        (at `ring_dtype`); in a static decode forward, at the device's query slot."""
        if self.stack.static is not None:
            self._record_static(queries, positions)
            return
        if self.keep_every_query:
            if self.stream_queries:  # only a forward's latest L can be in an eviction window
                queries, positions = queries[:, :, -self.stream_queries :], positions[:, -self.stream_queries :]
            self.unobserved.append((queries, positions.to(POSITION_DTYPE)))
            self.unobserved_count += queries.shape[2]
            return
        window, stack = self.query_window, self.stack
        if self.queries is None:
            if stack.queries is None:
                batch, heads, _, dim = queries.shape
                layouts = query_layouts(heads, dim, queries.dtype, self.query_dtype)
                stack.queries = queries.new_zeros(stack.depth, batch, heads, window, dim, dtype=layouts[QUERIES].dtype)
                stack.query_positions = torch.full(
                    (stack.depth, batch, window), -1, dtype=layouts[QUERY_POSITIONS].dtype, device=queries.device
                )
            self.queries, self.query_positions = stack.queries[self.index], stack.query_positions[self.index]
        queries, positions = queries[:, :, -window:].to(self.queries.dtype), positions[:, -window:].to(POSITION_DTYPE)
        slots = (self.query_cursor + torch.arange(queries.shape[2], device=queries.device)) % window
        self.queries.index_copy_(2, slots, queries)
        self.query_positions.index_copy_(1, slots, positions)
        self.query_cursor = (self.query_cursor + queries.shape[2]) % window

    def _record_static(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """A static decode forward's one query [batch, Hq, 1, D] into the stream buffer or the ring, at the device's
        query slot (the stream buffer's positions are every layer's: layer 0 writes them)."""
        static = self.stack.static
        if self.keep_every_query:
            buffer, position_buffer = static.stream_queries[self.index], static.stream_positions
        else:
            buffer, position_buffer = self.queries, self.query_positions
        buffer.index_copy_(2, static.query_slot, queries.to(buffer.dtype))
        if self.index == 0 or not self.keep_every_query:
            position_buffer.index_copy_(1, static.query_slot, positions.to(POSITION_DTYPE))

    def buffered_queries(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring buffer in query order (oldest first): ([batch, Hq, L, D], [batch, L])."""
        order = (self.query_cursor + torch.arange(self.query_window, device=self.queries.device)) % self.query_window
        queries, positions = self.queries[:, :, order], self.query_positions[:, order]
        if rows is not None:
            queries, positions = queries[rows], positions[rows]
        return queries, positions

    def kept(self, lengths: torch.Tensor) -> None:
        """After the stack's compaction: the last `lengths` [batch] entries of each row are valid (in place in static
        decode, whose forwards read this tensor)."""
        if self.stack.static is not None:
            self.lengths.copy_(lengths)
        else:
            self.lengths = lengths
        self._refresh_views()

    def select_rows(self, rows: torch.Tensor, stack: LayerStack) -> EvictionLayer:
        """A copy of this layer holding batch rows `rows` [R] (indices on its device, repeats allowed), a slice of
        `stack` (this layer's stack with those rows selected): the entries and their state, the valid lengths, the
        query ring buffer (and its cursor) or the queries not yet handed out, and the announced positions of a
        forward whose eviction step is pending."""
        selected = copy.copy(self)
        selected.stack = stack
        if self.storage is None:
            return selected
        selected.storage = stack.storage
        selected.lengths = self.lengths[rows]
        if self.queries is not None:
            selected.queries, selected.query_positions = stack.queries[self.index], stack.query_positions[self.index]
        selected.unobserved = [(queries[rows], positions[rows]) for queries, positions in self.unobserved]
        if self.pending_positions is not None:
            selected.pending_positions, selected.pending_valid = self.pending_positions[rows], self.pending_valid[rows]
        selected._refresh_views()
        return selected

    def storage_bytes(self) -> int:
        """Bytes held by this layer's share of the entry storage, its query ring buffer and its queries not yet
        handed out."""
        held = 0 if self.storage is None else self.storage.nbytes // self.stack.depth
        buffered = [t for pair in self.unobserved for t in pair]
        return held + sum(t.nbytes for t in (self.queries, self.query_positions, *buffered) if t is not None)


def ring_dtype(model_dtype: torch.dtype, query_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the ring buffer holds queries at: the policy's `query_dtype` where it has fewer bytes than the
    model's (fp16 for a float32 model), else the model's (a bf16 model's queries are not rounded again)."""
    if query_dtype is None or query_dtype.itemsize >= model_dtype.itemsize:
        return model_dtype
    return query_dtype


def gather_entries(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather [..., N, *trailing] along the entry dim with index [..., W] (leading dims: [layers,] batch, Hkv)."""
    trailing = tensor.shape[index.dim() :]
    expanded = index.reshape(*index.shape, *(1,) * len(trailing)).expand(*index.shape, *trailing)
    return tensor.gather(index.dim() - 1, expanded)


@dataclass
class ForwardObservation:
    """One forward observed by its own attention (`ObservedQueries.FORWARD`): `observe` (the policy's
    `forward_observe`) gets the attention probabilities of the forward's latest `count` queries (at most L, the most
    an eviction window holds) with the state they update and the `weights` every layer shares (the policy's
    `forward_weights`)."""

    observe: Callable[[torch.Tensor, Mapping[str, torch.Tensor], Any], None]
    weights: Any
    count: int
    pending: list[torch.Tensor] = dataclasses.field(
        default_factory=list
    )  # a decode forward's probabilities of the layers so far

    def add(self, layer: EvictionLayer, probabilities: torch.Tensor) -> None:
        """Layer `layer`'s probabilities [batch, Hkv, G, count, N]. A longer forward's update the layer's sums at
        once; a decode forward's one query per layer waits for the last layer's, then one update of every layer's
        sums (their stacked storage) follows: a few operations a token instead of a few a layer and token."""
        if probabilities.shape[-2] > 1:
            self.observe(probabilities, layer.state, self.weights)
            return
        self.pending.append(probabilities)
        if layer.index == layer.stack.depth - 1:
            stacked = torch.stack(self.pending)
            self.pending.clear()
            self.observe(stacked, {name: layer.storage.view(name) for name in layer.state}, self.weights)


class EvictionCache(Cache):
    """The Cache facade the model calls; the engine announces each forward's positions first.

    `capacity`: the most entries a layer can hold in this run, for which every layer's storage is
    allocated at its first forward (None: grow as entries arrive). `query_dtype`: the dtype the query ring may
    narrow to (`ring_dtype`; None: the model's). `stream_queries` (with `keep_every_query`): record only each
    forward's latest `stream_queries` queries (L), which a streaming policy observes in blocks of `query_window`
    (0: every query). `pool_heads`: the pooled layout's KV heads per layer (module docstring; `capacity` in slots),
    0 for a cache per KV head."""

    def __init__(
        self,
        num_layers: int,
        state_fields: tuple[StateField, ...] = (),
        group_size: int = 1,
        query_window: int = 0,
        keep_every_query: bool = False,
        capacity: int | None = None,
        query_dtype: torch.dtype | None = None,
        stream_queries: int = 0,
        pool_heads: int = 0,
    ):
        stack = LayerStack(num_layers)
        layers = [
            EvictionLayer(
                state_fields,
                group_size,
                query_window,
                keep_every_query,
                capacity,
                query_dtype,
                stack,
                index,
                stream_queries,
                pool_heads,
            )
            for index in range(num_layers)
        ]
        super().__init__(layers=layers)
        self.slots_per_token = pool_heads or 1  # the layers' `slots_per_token`
        self.has_padding = False
        self.records_queries = True
        self.recorder: RecordedForward | None = None  # set while a forward is recorded for reuse (runtime/prefix.py)
        self.forward_observation: ForwardObservation | None = None  # set while a forward observes (runtime/capture.py)

    def begin_forward(
        self,
        positions: torch.Tensor,
        valid: torch.Tensor,
        lengths: Sequence[int],
        record_queries: bool = True,
        observation: ForwardObservation | None = None,
    ) -> None:
        """Announce the tokens of the next forward: positions [batch, q] and valid counts [batch], each
        row's valid entries after it (`lengths`, on the host), whether their queries are recorded
        (where the layers record queries at all), and how its attention observes them (`ForwardObservation`, None:
        it does not).

        Also decides once per forward, from the host's lengths, whether any row will hold invalid slots,
        which every layer's attention needs to know."""
        per_token = self.slots_per_token
        entries = self.layers[0].get_seq_length() + positions.shape[1] * per_token
        self.has_padding = min(lengths) * per_token < entries
        self.records_queries = record_queries
        self.forward_observation = observation if record_queries else None
        for layer in self.layers:
            layer.pending_positions = positions
            layer.pending_valid = valid

    def compact(self, keep: torch.Tensor, width: int) -> None:
        """Keep, in every layer, the entries where `keep` [layers, batch, Hkv, N] is True, in position order,
        right-aligned.

        Every row keeps the same count on each of its heads; rows may differ (padding, protected
        prompts), so the layers narrow to `width`, the largest count, which the caller knows from its
        cadence (reading it here would synchronise with the device), and shorter rows get invalid slots
        in front. One count, one device-side check, one sort and one gather per stacked field serve all the
        layers."""
        kept_per_row = keep[:, :, 0].sum(-1)  # [layers, batch]
        require(
            (kept_per_row.amax(-1) == width).all(), f"an eviction step kept another count than its cadence's {width}"
        )
        # A stable sort of the 0/1 mask puts dropped slots first and kept ones last, in position order.
        index = torch.sort(keep.to(torch.int8), dim=-1, stable=True).indices[..., -width:]
        self.layers[0].storage.compact(index)
        for layer, lengths in zip(self.layers, kept_per_row, strict=True):
            layer.kept(lengths)
        if self.static is not None:
            self.static.cursor.fill_(width)

    def stacked(self, name: str) -> torch.Tensor:
        """Every layer's entry field `name` (keys, values, positions or a state field), [layers, batch, Hkv, N,
        *trailing], or their query rings (`QUERIES`, [layers, batch, Hq, L, D] in slot order): a view of the
        stacked storage (entries between forwards, when every layer holds the same count)."""
        if name == QUERIES:
            return self.layers[0].stack.queries
        return self.layers[0].storage.view(name)

    def write_state(self, name: str, value: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Overwrite state field `name` of batch rows `rows` [R] (None: every row) in every layer with `value`
        [layers, R, Hkv, N, *trailing], in place."""
        if rows is None:
            self.stacked(name).copy_(value)
        else:
            self.stacked(name)[:, rows] = value

    def take_unobserved(self, complete_blocks_only: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Hand out every layer's recorded queries, oldest first, in blocks of `query_window`: [(queries [layers,
        batch, Hq, l, D], positions [batch, l])] with l <= L (the layers record the same positions). With
        `complete_blocks_only`, a last block shorter than L stays for later. One concatenation of every layer's
        queries, whatever the depth."""
        first = self.layers[0]
        if self.static is not None:
            return self._take_static(complete_blocks_only)
        if not first.unobserved:
            return []
        queries = torch.cat([chunk for layer in self.layers for chunk, _ in layer.unobserved], dim=2)
        queries = queries.unflatten(2, (len(self.layers), -1)).movedim(2, 0)  # [layers, batch, Hq, count, D]
        positions = torch.cat([chunk for _, chunk in first.unobserved], dim=1)
        window, count = first.query_window, first.unobserved_count
        end = count - count % window if complete_blocks_only else count
        blocks = [(queries[..., s : s + window, :], positions[:, s : s + window]) for s in range(0, end, window)]
        for layer, layer_queries in zip(self.layers, queries, strict=True):
            layer.unobserved = [(layer_queries[:, :, end:], positions[:, end:])] if end < count else []
            layer.unobserved_count = count - end
        return blocks

    def _take_static(self, complete_blocks_only: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`take_unobserved` in static decode: the stream buffer holds at most one block (the engine takes each block
        as it completes), handed out as views, and its slot goes back to 0."""
        static, count = self.static, self.layers[0].unobserved_count
        if count == 0 or (complete_blocks_only and count < static.query_slots):
            return []
        for layer in self.layers:
            layer.unobserved_count = 0
        static.query_slot.zero_()
        return [(static.stream_queries[..., :count, :], static.stream_positions[:, :count])]

    @property
    def static(self) -> StaticDecodeState | None:
        """The device counters of static decode, or None (eager forwards)."""
        return self.layers[0].stack.static

    def start_static_decode(self, query_heads: int, head_dim: int) -> None:
        """From now on decode forwards run at fixed shapes (`foresight.runtime.static_decode`): each writes its
        token's entry at a device cursor into storage that holds every slot the run can use, attends over all
        slots under a mask of the valid ones, and records its query at a device slot (`StaticDecodeState`).
        Between forwards the host advances its mirrors (`advance_static`) and the eager eviction step runs as
        before, compacting in place. A streaming policy's queries not yet handed out move into the stream buffer.
        Slots the run has not written are zeroed (the state's hold its fill): masked out, they must still be finite
        for the attention."""
        first, storage = self.layers[0], self.layers[0].storage
        if storage.capacity is None or storage.slots != storage.capacity:
            raise ValueError(
                f"static decode needs storage of the run's capacity ({storage.capacity} entries), got {storage.slots}"
            )
        for name in storage.copied:
            storage.buffers[name][:, :, :, storage.entries :].zero_()
        device, window = storage.device, first.query_window
        static = StaticDecodeState(
            cursor=torch.tensor([storage.entries], device=device),
            query_slot=torch.tensor([first.query_cursor if not first.keep_every_query else 0], device=device),
            query_slots=max(window, 1),
            slot_index=torch.arange(storage.slots, device=device),
        )
        if first.keep_every_query:
            dtype = first.dtype
            static.stream_queries = torch.zeros(
                len(self.layers), storage.batch, query_heads, window, head_dim, dtype=dtype, device=device
            )
            static.stream_positions = torch.full((storage.batch, window), -1, dtype=POSITION_DTYPE, device=device)
            blocks = self.take_unobserved(complete_blocks_only=False)  # fewer than one block: the prefill's rest
            for queries, positions in blocks:
                static.stream_queries[..., : queries.shape[3], :].copy_(queries)
                static.stream_positions[:, : positions.shape[1]].copy_(positions)
                static.query_slot.fill_(positions.shape[1])
                for layer in self.layers:
                    layer.unobserved_count = positions.shape[1]
        first.stack.static = static

    def advance_static(self) -> None:
        """The host's mirrors after a static decode forward of one token per row: every layer holds one more
        entry (its views follow), the ring's cursor or the stream buffer's count moves on."""
        storage = self.layers[0].storage
        storage.filled = [filled + 1 for filled in storage.filled]
        for layer in self.layers:
            layer._refresh_views()
            if layer.keep_every_query:
                layer.unobserved_count += 1
            elif layer.query_window:
                layer.query_cursor = (layer.query_cursor + 1) % layer.query_window

    def select_rows(self, rows: torch.Tensor) -> EvictionCache:
        """A copy of the cache holding batch rows `rows` [R] of every layer (indices on the cache's device,
        repeats allowed: `rows = [0] * K` copies a one-row cache into K rows). The copy shares nothing
        with this cache, so both go on independently (`foresight.runtime.engine.Replay.select_rows`)."""
        selected = copy.copy(self)
        stack = self.layers[0].stack.select_rows(rows)
        selected.layers = [layer.select_rows(rows, stack) for layer in self.layers]
        selected.recorder = None
        return selected

    @property
    def lengths(self) -> torch.Tensor:
        """[batch] valid entries per row (equal across layers; slots in the pooled layout)."""
        return self.layers[0].lengths

    def max_entries(self) -> int:
        """Largest number of entries any layer holds (pooled: its slots over its heads, the per-head count)."""
        return max(layer.get_seq_length() for layer in self.layers) // self.slots_per_token

    def storage_bytes(self) -> int:
        """Bytes held by every layer's entry storage and query ring buffer, and static decode's stream buffer."""
        static = self.static
        buffered = [] if static is None else [static.stream_queries, static.stream_positions]
        return sum(layer.storage_bytes() for layer in self.layers) + sum(t.nbytes for t in buffered if t is not None)
