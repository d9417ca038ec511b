"""The evaluation's attention probe: what a replay reads from inside the runtime's attention function.

Registered as an attention function that wraps the runtime's own (`foresight.runtime.capture`), so a
replay under the probe runs the same attention as any other, and only adds a record of each layer's
output and of the entries it attended to (attention-output cosine, golden overlap; docs/algorithms.md §8).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import torch

from foresight.cadence import step_of, step_position
from foresight.metrics import (
    attention_cosine,
    golden_overlap,
)
from foresight.policies.golden import GoldenSchedule
from foresight.runtime.capture import eviction_attention, register_attention

PROBE_ATTENTION = "foresight_eval_probe"


# -- recording attention outputs and kept entries ------------------------------------------------
_ACTIVE_PROBE: contextvars.ContextVar[AttentionProbe | None] = contextvars.ContextVar("foresight_probe", default=None)


class AttentionProbe:
    """What the evaluation reads from inside the attention function during one replay of a batch.

    Only the tokens of each row's trace count (`lengths` [rows]; a shorter row replays padding after
    its end). reference=None: record every layer's attention output per (row, position) ->
    `outputs` [rows, T, layers, Hq, D]. With a reference (another probe's `outputs`): add each
    token's cosine similarity to it, averaged over query heads, into `cosine_sum` [rows, T] (one term
    per layer). With a golden schedule: count each row's kept candidates and golden hits at every
    golden step whose kept set serves a later token of the trace (p_t + 1 < T; aligned by position,
    see the module docstring) into `overlap_hits` and `overlap_kept` [rows].
    """

    def __init__(
        self,
        lengths: Sequence[int],
        num_layers: int,
        reference: torch.Tensor | None = None,
        schedule: GoldenSchedule | None = None,
    ) -> None:
        rows, length = len(lengths), max(lengths)
        self.lengths = torch.tensor(list(lengths))
        self.num_layers = num_layers
        self.reference = reference
        self.outputs: torch.Tensor | None = None
        self.cosine_sum = torch.zeros(rows, length, dtype=torch.float64)
        self.layer_count = torch.zeros(rows, length, dtype=torch.long)
        self.schedule = schedule
        self.overlap_hits = torch.zeros(rows, dtype=torch.long)
        self.overlap_kept = torch.zeros(rows, dtype=torch.long)

    @contextlib.contextmanager
    def active(self) -> Iterator[AttentionProbe]:
        token = _ACTIVE_PROBE.set(self)
        try:
            yield self
        finally:
            _ACTIVE_PROBE.reset(token)

    def record(self, layer: int, positions: torch.Tensor, entries: torch.Tensor, output: torch.Tensor) -> None:
        """positions [rows, q] of the tokens just processed (-1: padding), entries [rows, Hkv, N] the
        positions the cache held for them (-1: invalid), output [rows, q, Hq, D]."""
        lengths = self.lengths.to(positions.device)[:, None]
        rows, columns = ((positions >= 0) & (positions < lengths)).nonzero(as_tuple=True)
        at = positions[rows, columns]
        values = output[rows, columns].detach()
        rows, at = rows.cpu(), at.cpu()
        if self.reference is None:
            if self.outputs is None:
                shape = (*self.cosine_sum.shape, self.num_layers, *output.shape[2:])
                self.outputs = torch.zeros(shape, dtype=output.dtype)
            self.outputs[rows, at, layer] = values.cpu()
        else:
            cosine = attention_cosine(values, self.reference[rows, at, layer].to(values.device)).mean(-1)
            self.cosine_sum.index_put_((rows, at), cosine.double().cpu(), accumulate=True)
        self.layer_count.index_put_((rows, at), torch.ones_like(at), accumulate=True)
        if self.schedule is not None:
            self._count_overlap(layer, positions, entries)

    def _count_overlap(self, layer: int, positions: torch.Tensor, entries: torch.Tensor) -> None:
        """Golden step t is read at the forward that processes position p_t + 1 = B + tL + shift (each row's
        shift: 0 but after a decode compression)."""
        schedule = self.schedule
        budget, interval = schedule.budget, schedule.interval
        shift = schedule.shift.to(positions.device)[:, None]
        steps = step_of(positions - 1, budget, interval, shift)
        for step in steps[steps > 0].unique().tolist():
            starts = step_position(step, budget, interval) + 1 + schedule.shift  # [rows]
            reached = (positions == starts.to(positions.device)[:, None]).any(dim=1).cpu()
            reached &= (step <= schedule.num_steps) & (starts < self.lengths)
            rows = reached.nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            held = entries[rows.to(entries.device)]
            newest_old = (starts[rows] - 1 - interval).to(held.device)[:, None, None]
            kept = held.masked_fill(held > newest_old, -1)  # older than the recent window
            golden = schedule.kept[rows, step - 1, layer].to(held.device)
            hits, count = golden_overlap(kept, golden)
            self.overlap_hits.index_add_(0, rows, hits.sum(-1).cpu())
            self.overlap_kept.index_add_(0, rows, count.sum(-1).cpu())


def _probe_attention(module, query, key, value, attention_mask, eviction_cache=None, **kwargs):
    """The runtime's attention function, plus a report to the active probe (if any)."""
    output, weights = eviction_attention(
        module, query, key, value, attention_mask, eviction_cache=eviction_cache, **kwargs
    )
    probe = _ACTIVE_PROBE.get()
    if probe is not None:
        layer = eviction_cache.layers[module.layer_idx]
        probe.record(module.layer_idx, layer.pending_positions, layer.positions_by_head(), output)
    return output, weights


register_attention(PROBE_ATTENTION, _probe_attention)
