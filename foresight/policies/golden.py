"""Golden Eviction (ForesightKV §3.2, Eq. 5): replay the stored golden schedule of a trace.

The oracle of docs/algorithms.md section 4, for teacher-forced replay of the very traces its labels were
made from: at eviction step t it keeps the B - L candidates with the largest future score α_{·,t},
read from the labels (`GoldenLabels.kept_positions`). It is what every learned or heuristic policy
is measured against (ForesightKV Table 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from foresight.cadence import step_of
from foresight.labels import GoldenLabels
from foresight.policies import register
from foresight.runtime.policy import EvictionContext, Policy


@dataclass(frozen=True)
class GoldenSchedule:
    """The golden schedules of a batch of traces, stacked by row and padded to the longest.

    candidates [rows, M_max, layers, Hkv, B] and kept [rows, M_max, layers, Hkv, B - L] hold
    positions (ascending, -1 past a row's last step); num_steps [rows] is each row's M.
    """

    candidates: torch.Tensor
    kept: torch.Tensor
    num_steps: torch.Tensor
    budget: int
    interval: int

    @classmethod
    def stack(cls, labels: Sequence[GoldenLabels]) -> GoldenSchedule:
        """Stack the labels of a batch; they must share one (B, L) and one model shape."""
        if not labels:
            raise ValueError("golden needs the labels of at least one trace")
        settings = sorted({(item.budget, item.interval) for item in labels})
        if len(settings) > 1:
            raise ValueError(f"golden labels of one batch must share one (B, L), got {settings}")
        shapes = sorted({tuple(item.candidates.shape[1:3]) for item in labels})
        if len(shapes) > 1:
            raise ValueError(f"golden labels of one batch come from models of different shapes (layers, Hkv): {shapes}")
        steps = max(item.num_steps for item in labels)
        return cls(
            candidates=torch.stack([_pad_steps(item.candidates.long(), steps) for item in labels]),
            kept=torch.stack([_pad_steps(item.kept_positions().long(), steps) for item in labels]),
            num_steps=torch.tensor([item.num_steps for item in labels]),
            budget=settings[0][0],
            interval=settings[0][1],
        )

    def step_of(self, newest: torch.Tensor) -> torch.Tensor:
        """Step t of an eviction whose newest position is p_t = B + tL - 1 (0 where none is)."""
        return step_of(newest, self.budget, self.interval)


@register
@dataclass
class GoldenEviction(Policy):
    """Keeps the golden kept set of each step: keep score 1 for a candidate the golden schedule keeps
    at this step, 0 otherwise.

    labels: the golden labels of the trace replayed in each batch row, in row order (required, so
    the policy is built by `foresight eval`, not by name alone). All must share one (B, L).

    Which step: step t evicts right after position p_t = B + tL - 1, so the newest position in a
    row's cache gives t. Steps past a row's last label (the row is replaying padding after its trace
    ended) score 0. The labels assume the cadence of section 4 from the first token: no sinks, no
    protected prompt, a prefill of at most B + L tokens, and every row of a batch evicting at once
    (equal prompt lengths). Each step checks that the cache holds exactly the golden candidates of
    that step, so any other setting (sinks, a protected prompt, labels for another B or L) stops with
    a one-line error instead of replaying a wrong schedule. Which labels belong to which trace is the
    caller's to get right (`LabelStore.load` checks the trace index and length).
    """

    name = "golden"
    summary = "oracle: the golden schedule of stored labels (needs labels)"
    labels: Sequence[GoldenLabels] = field(repr=False)
    schedule: GoldenSchedule = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.schedule = GoldenSchedule.stack(self.labels)

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        schedule = self.schedule
        self._check_shape(context)
        positions = context.candidate_positions
        device = positions.device
        steps = self._steps(context)
        active = steps <= schedule.num_steps
        rows = torch.arange(positions.shape[0])
        index = (torch.minimum(steps, schedule.num_steps) - 1).clamp(min=0)
        expected = schedule.candidates[rows, index, context.layer_idx].to(device)
        differs = active.to(device) & (positions != expected).flatten(1).any(dim=1)
        if bool(differs.any()):
            row = int(differs.nonzero()[0])
            raise ValueError(
                f"golden: at step {int(steps[row])} of layer {context.layer_idx} the cache of row {row} holds other "
                "candidates than the golden schedule; replay its own trace from the first token with sinks=0 "
                "and protect_prompt=False"
            )
        kept = schedule.kept[rows, index, context.layer_idx].to(device)  # ascending positions
        slot = torch.searchsorted(kept, positions.contiguous()).clamp(max=kept.shape[-1] - 1)
        keep = kept.gather(-1, slot) == positions
        return (keep & active.to(device)[:, None, None]).float()

    def _check_shape(self, context: EvictionContext) -> None:
        """One-line errors for a batch, a model or a (B, L) the labels were not made for."""
        schedule = self.schedule
        rows, kv_heads, entries = context.positions.shape
        if rows != len(self.labels):
            raise ValueError(
                f"golden holds labels for {len(self.labels)} trace(s) but {rows} row(s) evict at this step; "
                "replay exactly the labelled traces, with equal prompt lengths so that every row evicts at once"
            )
        layers, heads = schedule.candidates.shape[2:4]
        if (context.num_layers, kv_heads) != (layers, heads):
            raise ValueError(
                f"golden labels were made for a model with {layers} layers and {heads} KV heads, "
                f"not {context.num_layers} and {kv_heads}"
            )
        interval = entries - context.num_candidates
        if (context.num_candidates, interval) != (schedule.budget, schedule.interval):
            raise ValueError(
                f"golden labels were made for B={schedule.budget}, L={schedule.interval}, but this eviction step "
                f"has {context.num_candidates} candidates and a recent window of {interval} (another B or L, a "
                "protected prompt, a prefill longer than B + L or a padded batch)"
            )

    def _steps(self, context: EvictionContext) -> torch.Tensor:
        """Step t of each row, from its newest position p_t = B + tL - 1 (docs/algorithms.md §4)."""
        newest = context.positions.amax(dim=(1, 2)).cpu()
        steps = self.schedule.step_of(newest)
        if bool((steps == 0).any()):
            raise ValueError(
                f"golden: an eviction after position(s) {newest.tolist()} is off the golden cadence "
                f"p_t = B + tL - 1 with B={self.schedule.budget}, L={self.schedule.interval}; replay from the first "
                "token with protect_prompt=False and a prefill of at most B + L tokens"
            )
        return steps


def _pad_steps(tensor: torch.Tensor, steps: int) -> torch.Tensor:
    """Pad the step dim (first) of a label tensor to `steps` with -1."""
    padding = tensor.new_full((steps - tensor.shape[0], *tensor.shape[1:]), -1)
    return torch.cat([tensor, padding])
