"""Forwards that one replay records and another replay of the same batch reuses: those before any eviction.

Until a row evicts, its cache holds every token it was fed, whatever the policy, so the model's queries,
keys, values and token losses in those forwards depend only on the tokens. `foresight eval` replays each
batch under many policies on one cadence, and before the first eviction step (B + L tokens per row) they
all run the same forwards. The first replay given an empty `ReplayPrefix` records its forwards up to and
including the one after which it first evicts; a later replay injects them instead of running the model:
the engine appends the recorded keys and values to its own cache and runs its attention function on the
recorded queries, so what the attention function keeps (the policy's queries, the evaluation's probe)
is what a real forward would give, and it takes the recorded token losses. Policy hooks run as usual.

A forward is injected only while the replay has not evicted, when its tokens, positions and valid counts
equal the recorded forward's with each recorded row repeated over an equal run of the batch's rows (one
to one, or a single recorded row for every row), and when the policy reads no hidden states (those come
from the model); anything else runs the model. A recording of one row per trace serves a batch of G
rows per trace: the G rollouts of each trace of the reinforcement stage run the model once on the tokens
before their first eviction (`trainers.reinforcement.rollouts.roll_out_together`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RecordedForward:
    """One forward's inputs, every layer's post-RoPE queries and new keys and values, its token NLL and top-1
    predictions."""

    input_ids: torch.Tensor  # [batch, q]
    positions: torch.Tensor  # [batch, q]
    valid: torch.Tensor  # [batch]
    queries: list[torch.Tensor] = field(default_factory=list)  # per layer [batch, Hq, q, D]
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [batch, Hkv, q, D]
    values: list[torch.Tensor] = field(default_factory=list)
    scaling: list[float | None] = field(default_factory=list)
    nll: torch.Tensor | None = None  # [batch, q]
    greedy: torch.Tensor | None = None  # [batch, q]

    def add(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
    ) -> None:
        """Called by the attention function with the forward's queries and new keys and values [batch, Hkv, q, D]
        (`EvictionLayer.newest_entries`)."""
        if layer_idx != len(self.queries):
            raise RuntimeError(
                f"layers must be recorded in order: got layer {layer_idx} after {len(self.queries)} layers"
            )
        self.queries.append(query.clone())
        self.keys.append(key.clone())
        self.values.append(value.clone())
        self.scaling.append(scaling)

    def matches(self, input_ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> bool:
        """Whether a forward of these inputs is the recorded one with each recorded row repeated over an
        equal run of rows (`for_rows`): the same rows, or the G rollouts of each recorded trace."""
        recorded, rows = self.input_ids.shape[0], input_ids.shape[0]
        if rows % recorded or self.input_ids.shape[1:] != input_ids.shape[1:]:
            return False
        pairs = ((self.input_ids, input_ids), (self.positions, positions), (self.valid, valid))
        return all(torch.equal(_repeat_rows(mine, rows), theirs) for mine, theirs in pairs)

    def for_rows(self, rows: int) -> RecordedForward:
        """This forward for a batch of `rows`, recorded row i serving rows [i·m, (i + 1)·m) with m = rows /
        recorded rows (views when a single row is recorded)."""
        if self.input_ids.shape[0] == rows:
            return self

        def repeat(tensor: torch.Tensor) -> torch.Tensor:
            return _repeat_rows(tensor, rows)

        return RecordedForward(
            repeat(self.input_ids),
            repeat(self.positions),
            repeat(self.valid),
            [repeat(q) for q in self.queries],
            [repeat(k) for k in self.keys],
            [repeat(v) for v in self.values],
            self.scaling,
            None if self.nll is None else repeat(self.nll),
            None if self.greedy is None else repeat(self.greedy),
        )


@dataclass
class ReplayPrefix:
    """The forwards shared by the replays of one batch (empty until the first replay records them)."""

    forwards: list[RecordedForward] = field(default_factory=list)


def _repeat_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` [r, ...] with each row repeated rows / r times in place, [rows, ...] (a view when r = 1)."""
    if tensor.shape[0] in (1, rows):
        return tensor.expand(rows, *tensor.shape[1:])
    return tensor.repeat_interleave(rows // tensor.shape[0], dim=0)
