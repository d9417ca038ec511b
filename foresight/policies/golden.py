"""Golden Eviction (ForesightKV §3.2, Eq. 5): replay the stored golden schedule of a trace.

The oracle of docs/algorithms.md section 4, for teacher-forced replay of the very traces its labels were
made from: at eviction step t it keeps the B - L candidates with the largest future score α_{·,t},
read from the labels (`GoldenLabels.kept_positions`). It is what every learned or heuristic policy
is measured against (ForesightKV Table 2). Labels of the decode regime also hold the kept set of the
compression step that follows a long prompt (`GoldenLabels.prefill_kept`), which it keeps there.
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
    positions (ascending, -1 past a row's last step); num_steps [rows] is each row's M; shift [rows] each
    row's `GoldenLabels.shift` and prefill_kept [rows, layers, Hkv, B - L] its compression's kept set (-1 for
    a row without one).
    """

    candidates: torch.Tensor
    kept: torch.Tensor
    num_steps: torch.Tensor
    budget: int
    interval: int
    shift: torch.Tensor
    prefill_kept: torch.Tensor

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
        budget, interval = settings[0]
        none = torch.full((*labels[0].candidates.shape[1:3], budget - interval), -1, dtype=torch.long)
        return cls(
            candidates=torch.stack([_pad_steps(item.candidates.long(), steps) for item in labels]),
            kept=torch.stack([_pad_steps(item.kept_positions().long(), steps) for item in labels]),
            num_steps=torch.tensor([item.num_steps for item in labels]),
            budget=budget,
            interval=interval,
            shift=torch.tensor([item.shift for item in labels]),
            prefill_kept=torch.stack(
                [none if item.prefill_kept is None else item.prefill_kept.long() for item in labels]
            ),
        )

    def step_of(self, newest: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Step t of each row's eviction whose newest position is p_t = B + tL - 1 + shift (0 where none is)."""
        return step_of(newest, self.budget, self.interval, self.shift[rows])

    def compresses(self, newest: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Whether each row's eviction is its decode compression step (newest position P - 1 = B - 1 + shift)."""
        shift = self.shift[rows]
        return (shift > 0) & (newest == self.budget - 1 + shift)


@register
@dataclass
class GoldenEviction(Policy):
    """Keeps the golden kept set of each step: keep score 1 for a candidate the golden schedule keeps
    at this step, 0 otherwise.

    labels: the golden labels of the trace replayed in each batch row, in row order (required, so
    the policy is built by `foresight eval`, not by name alone). All must share one (B, L).

    Which step: step t evicts right after position p_t = B + tL - 1 + shift, so the newest position in a
    row's cache gives t; a decode label's compression step follows its prompt (P - 1 = B - 1 + shift).
    Steps past a row's last label (the row is replaying padding after its trace ended) score 0. The
    labels assume their regime's cadence: no sinks, no protected prompt, and in the streaming regime a
    prefill of at most B + L tokens (in the decode regime, the whole prompt). Each step checks that the
    cache holds exactly the golden candidates of that step, so any other setting (sinks, a protected
    prompt, labels for another B, L or regime) stops with a one-line error instead of replaying a wrong
    schedule. Which labels belong to which trace is the caller's to get right (`LabelStore.load` checks
    the trace index and length).
    """

    name = "golden"
    summary = "oracle: the golden schedule of stored labels (needs labels)"
    labels: Sequence[GoldenLabels] = field(repr=False)
    schedule: GoldenSchedule = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.schedule = GoldenSchedule.stack(self.labels)

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        return self.golden_keeps(context, own_schedule=True).float()

    def golden_keeps(self, context: EvictionContext, own_schedule: bool = False) -> torch.Tensor:
        """Whether golden's kept set at this context's step holds each candidate -> bool [batch, Hkv, C]. With
        `own_schedule` (golden replaying its labels) a cache holding other candidates than golden's at this step is
        refused; without, another policy's cache on the same cadence reads which of its candidates golden keeps
        (the reinforcement stage's golden swap)."""
        schedule = self.schedule
        rows = self._rows(context)
        newest = context.positions.amax(dim=(1, 2)).cpu()
        compressing = schedule.compresses(newest, rows)
        self._check_shape(context, compressing)
        positions = context.candidate_positions
        device = positions.device
        steps = self._steps(newest, rows, compressing)
        active = (steps >= 1) & (steps <= schedule.num_steps[rows])
        index = (torch.minimum(steps, schedule.num_steps[rows]) - 1).clamp(min=0)
        budget = schedule.budget
        expected = schedule.candidates[rows, index, context.layer_idx].to(device)
        stepping = active.to(device)[:, None, None]
        # A row's B candidates are the last of the candidate slots: another row's compression at the same step
        # widens them, and this row's invalid slots come first.
        extra = positions.shape[-1] - budget
        differs = stepping & ((positions[..., extra:] != expected) | (positions[..., :extra] >= 0).any(-1, True))
        if own_schedule and bool(differs.any()):
            row = int(differs.flatten(1).any(1).nonzero()[0])
            raise ValueError(
                f"golden: at step {int(steps[row])} of layer {context.layer_idx} the cache of row {row} holds other "
                "candidates than the golden schedule; replay its own trace from the first token with sinks=0, "
                "protect_prompt=False and the labels' regime"
            )
        kept = torch.where(
            compressing[:, None, None],
            schedule.prefill_kept[rows, context.layer_idx],
            schedule.kept[rows, index, context.layer_idx],
        ).to(device)  # ascending positions
        slot = torch.searchsorted(kept, positions.contiguous()).clamp(max=kept.shape[-1] - 1)
        keep = (kept.gather(-1, slot) == positions) & (positions >= 0)
        return keep & (stepping | compressing.to(device)[:, None, None])

    def _rows(self, context: EvictionContext) -> torch.Tensor:
        """The labelled traces of the context's rows (the run's rows, or the evicting subset)."""
        count = context.positions.shape[0]
        rows = torch.arange(count) if context.rows is None else context.rows.cpu()
        if context.rows is None and count != len(self.labels):
            raise ValueError(
                f"golden holds labels for {len(self.labels)} trace(s) but {count} row(s) evict at this step; "
                "replay exactly the labelled traces"
            )
        return rows

    def _check_shape(self, context: EvictionContext, compressing: torch.Tensor) -> None:
        """One-line errors for a model or a (B, L) the labels were not made for."""
        schedule = self.schedule
        kv_heads, entries = context.positions.shape[1:]
        layers, heads = schedule.candidates.shape[2:4]
        if (context.num_layers, kv_heads) != (layers, heads):
            raise ValueError(
                f"golden labels were made for a model with {layers} layers and {heads} KV heads, "
                f"not {context.num_layers} and {kv_heads}"
            )
        interval = entries - context.num_candidates
        if bool(compressing.all()):
            return  # a compression step's candidates are the whole prompt but its window
        if (context.num_candidates, interval) != (schedule.budget, schedule.interval) and not bool(compressing.any()):
            raise ValueError(
                f"golden labels were made for B={schedule.budget}, L={schedule.interval}, but this eviction step "
                f"has {context.num_candidates} candidates and a recent window of {interval} (another B, L or "
                "regime, a protected prompt, a prefill longer than B + L or a padded batch)"
            )

    def _steps(self, newest: torch.Tensor, rows: torch.Tensor, compressing: torch.Tensor) -> torch.Tensor:
        """Step t of each row, from its newest position p_t = B + tL - 1 + shift (docs/algorithms.md §4); 0 at a
        compression step."""
        steps = self.schedule.step_of(newest, rows)
        if bool(((steps == 0) & ~compressing).any()):
            raise ValueError(
                f"golden: an eviction after position(s) {newest.tolist()} is off the golden cadence "
                f"p_t = B + tL - 1 + shift with B={self.schedule.budget}, L={self.schedule.interval}; replay from the "
                "first token with protect_prompt=False, in the labels' regime (streaming: a prefill of at most "
                "B + L tokens; decode: the whole prompt)"
            )
        return steps


def _pad_steps(tensor: torch.Tensor, steps: int) -> torch.Tensor:
    """Pad the step dim (first) of a label tensor to `steps` with -1."""
    padding = tensor.new_full((steps - tensor.shape[0], *tensor.shape[1:]), -1)
    return torch.cat([tensor, padding])
