"""The supervised objective and its metrics: ranking the B candidates of a step like their future scores α.

Every function reads scores φ and targets α laid out [..., N]: one ranking problem per leading index
(a step's (layer, KV head)), over its N candidates in ascending position.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from foresight.cadence import top_k_mask

DEFAULT_MARGIN = 0.01
"""m of ForesightKV Eq. 6 (App. E.1)."""


def pairwise_ranking_loss(
    scores: torch.Tensor, alpha: torch.Tensor, margin: float = DEFAULT_MARGIN, chunk_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """ForesightKV Eq. 6 per ranking problem: the mean over ordered pairs (i, j) with α_i < α_j of
    max(0, m - (φ_j - φ_i)) (docs/algorithms.md §6). Returns (loss [...], number of pairs [...]); a
    problem without a pair (all α equal) has loss 0 and 0 pairs.

    Every pair is used, none sampled. The N x N pair matrix is built in chunks of `chunk_size`
    rows i, each under activation checkpointing, so forward and backward hold O(chunk_size x N)
    numbers per problem (the paper's B = 1024 would otherwise need N^2 per head and step).
    """
    if scores.shape != alpha.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and alpha {tuple(alpha.shape)} must have the same shape")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    alpha = alpha.to(scores.dtype)
    total = scores.new_zeros(scores.shape[:-1])
    for start in range(0, scores.shape[-1], chunk_size):
        rows = slice(start, start + chunk_size)
        total = total + checkpoint(
            _hinge_sum, scores[..., rows], alpha[..., rows], scores, alpha, margin, use_reentrant=False
        )
    pairs = count_ordered_pairs(alpha)
    return total / pairs.clamp_min(1), pairs


def count_ordered_pairs(alpha: torch.Tensor) -> torch.Tensor:
    """Number of pairs (i, j) with α_i < α_j per problem, by sorting: O(N log N), not N^2."""
    ordered = alpha.sort(dim=-1).values.contiguous()
    larger = alpha.shape[-1] - torch.searchsorted(ordered, alpha.contiguous(), side="right")
    return larger.sum(-1)


def _hinge_sum(
    scores_i: torch.Tensor, alpha_i: torch.Tensor, scores: torch.Tensor, alpha: torch.Tensor, margin: float
) -> torch.Tensor:
    """Sum over i in the chunk and all j with α_i < α_j of max(0, m - (φ_j - φ_i))."""
    ordered = alpha_i[..., :, None] < alpha[..., None, :]
    hinge = torch.relu(margin - (scores[..., None, :] - scores_i[..., :, None]))
    return (hinge * ordered).sum((-1, -2))


def kept_overlap(scores: torch.Tensor, alpha: torch.Tensor, count: int) -> torch.Tensor:
    """Share [...] of the golden kept set (the `count` largest α) that the scorer also keeps."""
    return (top_k_mask(scores, count) & top_k_mask(alpha, count)).sum(-1) / count


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """1-based ranks along the last dim, tied values sharing their mean rank (batched)."""
    ordered = values.sort(dim=-1).values.contiguous()
    below = torch.searchsorted(ordered, values.contiguous(), side="left")
    up_to = torch.searchsorted(ordered, values.contiguous(), side="right")
    return (below + up_to + 1).to(torch.float64) / 2


def spearman(scores: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation [...] of φ with α over each problem's candidates; NaN where either
    is constant (no ranking to compare)."""
    ranks = [average_ranks(x.float()) for x in (scores, alpha)]
    centred = [r - r.mean(-1, keepdim=True) for r in ranks]
    covariance = (centred[0] * centred[1]).sum(-1)
    norms = centred[0].square().sum(-1).sqrt() * centred[1].square().sum(-1).sqrt()
    return (covariance / norms.masked_fill(norms == 0, float("nan"))).float()

