"""What a policy holds per sequence, in bytes, counted from the declarations the cache allocates from
(docs/algorithms.md section 8, "KV memory").

Per layer and batch row, a policy that evicts every L tokens at budget B holds:

- B + L entries (plus its protected prompt), each with a key and a value per KV head at the model's
  dtype, its position, and the policy's per-entry state fields (`entry_layouts`);
- a WINDOW policy that reads attention: a ring of its latest queries (`query_window`: L, or fewer for
  SnapKV and TOVA), each one vector per query head and its position (`query_layouts`);
- a policy that observes every query (H2O, LazyEviction, RaaS): the queries recorded but not yet
  observed, at most L between two observations (`query_layouts`; the figure published is that peak);
- a policy that streams its observation (the learned scorer's standardised sets): the queries recorded since
  its last observation, at most its `stream_block` between two decode forwards (the figure published; a
  teacher-forced chunk of up to L is observed right after its forward); one that observes in the forward's own
  attention (`ObservedQueries.FORWARD`) holds no query at all.

In the pooled layout (`foresight.runtime.pool`) a layer's H KV heads share one pool of H·(B + L) slots per row
(plus H per protected prompt token), each a key, a value and a position of one head and a one-byte owner tag:
the per-head layout's bytes plus the tag, counted with the per-entry state.

`held_bytes` counts this from a model shape and a policy without running anything; the live cache's
`EvictionCache.storage_bytes()` reads the same tensors after a run, and the tests check the two agree.
Every published figure of KV memory (eval's column and plots, the baselines tables, the benchmarks)
reads `held_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch

from foresight.runtime.cache import KEYS, POSITIONS, VALUES, EntryLayout, entry_layouts, query_layouts
from foresight.runtime.policy import ObservedQueries, Policy
from foresight.runtime.pool import Layout, check_runs_pooled

MIB = 2**20


class Shape(Protocol):
    """A model's attention shape (`foresight.models.ModelShape`)."""

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int


def query_window(policy: Policy, interval: int) -> int:
    """Queries each layer keeps for a WINDOW policy: the latest it reads (`Policy.latest_queries`), at most L
    (the block size in which a policy that observes every query sees them); none for a policy that reads no
    attention."""
    if not (policy.evicts and policy.needs_attention) or policy.observed_queries is ObservedQueries.FORWARD:
        return 0
    return min(interval, policy.latest_queries or interval)


def keeps_every_query(policy: Policy) -> bool:
    """Whether the runtime records queries until the policy has observed them (DECODE, ALL and STREAM policies)
    instead of holding a ring of the latest (WINDOW) or none (FORWARD: its attention observes them)."""
    observed = policy.observed_queries
    return policy.evicts and observed is not ObservedQueries.WINDOW and observed is not ObservedQueries.FORWARD


def buffered_queries(policy: Policy, interval: int) -> int:
    """Queries recorded and not yet observed at the most, per layer: L for a policy that observes every query
    (observed a block of L at a time), a streaming policy's block (`Policy.stream_block`), none for a ring."""
    if not keeps_every_query(policy):
        return 0
    return policy.stream_block if policy.observed_queries is ObservedQueries.STREAM else interval


@dataclass(frozen=True)
class HeldBytes:
    """Bytes one sequence holds in every layer, by part: keys and values, positions, per-entry policy state,
    the query ring (queries and their positions) and the buffered queries of an every-query policy."""

    entries: int
    kv: int
    positions: int
    state: int
    ring: int
    buffered: int

    @property
    def total(self) -> int:
        return self.kv + self.positions + self.state + self.ring + self.buffered

    @property
    def overhead(self) -> float:
        """Bytes held beyond K/V, as a share of K/V."""
        return (self.total - self.kv) / self.kv

    def per_entry(self, part: str) -> float:
        """`part` (a field of bytes, or "total") per entry held, summed over the layers."""
        return getattr(self, part) / self.entries


PARTS = tuple(f.name for f in fields(HeldBytes) if f.name != "entries")


def held_bytes(
    shape: Shape,
    policy: Policy,
    budget: int,
    interval: int,
    dtype: torch.dtype,
    *,
    protected: int = 0,
    entries: int | None = None,
    buffered: int | None = None,
    layout: Layout | str = Layout.HEADS,
) -> HeldBytes:
    """What `policy` holds per sequence at budget B and interval L, for a model of `shape` in `dtype`.

    `entries`: entries held (default B + L + `protected`, the most an evicting run holds; every token for
    a policy that does not evict, which then needs it). `buffered`: queries recorded and not yet observed
    (default `buffered_queries`: L for a policy that observes every query, its block for a streaming one, else 0).
    `layout`: the cache's (`EvictionConfig.layout`); pooled, each entry of a head is a slot with its owner tag."""
    pooled = Layout.parse(layout) is Layout.POOLED
    if pooled:
        check_runs_pooled(policy)
    if entries is None:
        if not policy.evicts:
            raise ValueError(f"policy {policy.name!r} keeps every token: give the entries it holds")
        entries = budget + interval + protected
    if entries < 0:
        raise ValueError(f"entries held must be >= 0, got {entries}")
    group = shape.num_query_heads // shape.num_kv_heads
    layouts = entry_layouts(policy.state_fields, group, shape.head_dim, shape.head_dim, dtype, pooled)
    per_entry = {name: shape.num_kv_heads * _bytes(entry) for name, entry in layouts.items()}
    state = sum(size for name, size in per_entry.items() if name not in (KEYS, VALUES, POSITIONS))
    every_query = keeps_every_query(policy)
    if buffered is None:
        buffered = buffered_queries(policy, interval)
    if buffered and not every_query:
        raise ValueError(f"policy {policy.name!r} buffers no queries, got buffered={buffered}")
    per_query = sum(_bytes(layout) for layout in query_layouts(shape.num_query_heads, shape.head_dim, dtype).values())
    ring_layouts = query_layouts(shape.num_query_heads, shape.head_dim, dtype, policy.buffered_query_dtype)
    per_ring_query = sum(_bytes(layout) for layout in ring_layouts.values())
    layers = shape.num_layers
    return HeldBytes(
        entries=entries,
        kv=layers * entries * (per_entry[KEYS] + per_entry[VALUES]),
        positions=layers * entries * per_entry[POSITIONS],
        state=layers * entries * state,
        ring=0 if every_query else layers * query_window(policy, interval) * per_ring_query,
        buffered=layers * buffered * per_query,
    )


def _bytes(layout: EntryLayout) -> int:
    """Bytes of one entry of `layout` (its trailing shape at its dtype)."""
    return int(torch.Size(layout.trailing).numel()) * layout.dtype.itemsize
