"""Mean and standard deviation over the present entries of one axis: one rule for every policy and
feature that standardises over a ragged set (EpiKV's rolling window, TriAttention's per-head z-score,
the standardised feature set's candidates)."""

from __future__ import annotations

import torch


def masked_moments(values: torch.Tensor, present: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, population std) of `values` over the entries of `dim` where `present` is true, keeping `dim`.

    Absent entries may hold anything (NaN included): they enter neither sum. An axis with no present
    entry gets mean 0 and std 0."""
    count = present.sum(dim, keepdim=True).clamp(min=1)
    mean = values.masked_fill(~present, 0).sum(dim, keepdim=True) / count
    variance = (values - mean).masked_fill(~present, 0).square().sum(dim, keepdim=True) / count
    return mean, variance.sqrt()
