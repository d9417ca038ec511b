"""The supervised objective and its metrics: ranking the B candidates of a step like their future scores α.

Every function reads scores φ and targets α laid out [..., N]: one ranking problem per leading index
(a step's (layer, KV head)), over its N candidates in ascending position.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from foresight.cadence import top_k_mask
from foresight.choices import Choice

DEFAULT_MARGIN = 0.01
"""m of ForesightKV Eq. 6 (App. E.1)."""


class RankingPairs(Choice):
    """Which pairs of a step's candidates the ranking loss reads.

    "all": every pair with α_i < α_j (Eq. 6). "evicted": only the pairs whose lower member is one of
    the L candidates the golden step evicts (the L smallest α), the pairs that decide which entries
    the deterministic policy evicts; the order among the kept entries, most of the pairs, is left free.
    """

    ALL = "all"
    EVICTED = "evicted"


PAIR_BLOCK_ELEMENTS = 2**18
"""Pair-matrix elements built at once (problems x rows x candidates): 1 MiB of float32, small enough to
stay in a core's L2 cache, where a batch's whole [problems, N, N] matrix (hundreds of MB) runs at memory
speed, several times slower (this project's CPU has 1 MiB of L2 per core); the same sums either way."""


class PairWeight(Choice):
    """How much each pair (i, j) with α_i < α_j counts in its problem's mean.

    "uniform": every pair alike (Eq. 6). "gap": in proportion to α_j − α_i, the future attention lost
    by keeping i instead of j, so the pairs an eviction can hurt most weigh most and the ordering among
    entries nobody will attend to, most of the pairs, weighs little.
    """

    UNIFORM = "uniform"
    GAP = "gap"


class ProblemWeight(Choice):
    """How much each ranking problem (a step's (layer, KV head)) counts in the batch's mean.

    "equal": every problem alike (Eq. 6). "regret": in proportion to what the scorer's eviction of that problem
    costs now, the target mass of the L candidates it scores lowest minus that of the L golden evicts
    (`eviction_regret`; with loss-aligned labels, `data.label_kind: value`, the loss change), normalised to a
    mean of 1 over the batch: problems where the scorer already evicts golden's choice weigh nothing, those where
    its mistakes cost most weigh most (`SupervisedScorer`, problem_weight)."""

    EQUAL = "equal"
    REGRET = "regret"


def eviction_regret(scores: torch.Tensor, alpha: torch.Tensor, evicted: int) -> torch.Tensor:
    """Per problem [...]: Σ α over the `evicted` lowest-scored candidates minus Σ α over the `evicted` smallest α
    (golden's eviction; ties as `top_k_mask` breaks them): >= 0, and 0 when the scorer evicts as golden does."""
    kept = alpha.shape[-1] - evicted
    ours = (alpha * ~top_k_mask(scores, kept)).sum(-1)
    golden = (alpha * ~top_k_mask(alpha, kept)).sum(-1)
    return ours - golden


def regret_weights(scores: torch.Tensor, alpha: torch.Tensor, evicted: int) -> torch.Tensor:
    """`ProblemWeight.REGRET`'s weights [...]: each problem's regret over the mean regret of all of them, no
    gradient (all ones when no problem has any)."""
    with torch.no_grad():
        regret = eviction_regret(scores.detach(), alpha, evicted)
        mean = regret.mean()
        return regret / mean if mean > 0 else torch.ones_like(regret)


def pairwise_ranking_loss(
    scores: torch.Tensor,
    alpha: torch.Tensor,
    margin: float = DEFAULT_MARGIN,
    chunk_size: int = 256,
    lowest: int | None = None,
    weight: PairWeight = PairWeight.UNIFORM,
    block_elements: int | None = PAIR_BLOCK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ForesightKV Eq. 6 per ranking problem: the mean over ordered pairs (i, j) with α_i < α_j of
    max(0, m - (φ_j - φ_i)) (docs/algorithms.md §6), each pair weighted by `weight` (`PairWeight`).
    Returns (loss [...], total pair weight [...]: the number of pairs, an int, when uniform); a problem without
    a pair (all α equal) has loss 0 and weight 0. `lowest`: only pairs whose i is among the `lowest`
    entries of its problem that the golden step evicts (the smallest α; ties evict the higher index,
    the newer entry).

    Every such pair is used, none sampled. The N x N pair matrices are built in blocks of problems and
    of `chunk_size` rows i (at most `block_elements` numbers; None: every problem at once), with the gradient summed in the same pass (`_PairwiseHinge`), so the loss
    holds O(chunk_size x N) numbers per problem (the paper's B = 1024 would otherwise need N^2 per head
    and step) and each block's work stays in cache.
    """
    if scores.shape != alpha.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and alpha {tuple(alpha.shape)} must have the same shape")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if lowest is not None and not 1 <= lowest <= alpha.shape[-1]:
        raise ValueError(f"lowest must be in 1..{alpha.shape[-1]} (the candidates of a problem), got {lowest}")
    alpha = alpha.to(scores.dtype)
    # The golden step keeps the N - lowest largest α, ties to the older entry; i ranges over the rest.
    rows_used = None if lowest is None else ~top_k_mask(alpha, alpha.shape[-1] - lowest)
    gap = weight is PairWeight.GAP
    weights = gap_weight_totals(alpha, rows_used) if gap else count_ordered_pairs(alpha, rows_used)
    if scores.numel() == 0:
        return scores.new_zeros(scores.shape[:-1]), weights
    candidates = scores.shape[-1]
    flat = [None if tensor is None else tensor.reshape(-1, candidates) for tensor in (scores, alpha, rows_used)]
    rows_per_block = min(chunk_size, candidates)
    problems_per_block = None if block_elements is None else max(1, block_elements // (rows_per_block * candidates))
    total = _PairwiseHinge.apply(*flat, margin, gap, rows_per_block, problems_per_block).reshape(scores.shape[:-1])
    return total / (weights.clamp_min(torch.finfo(scores.dtype).tiny) if gap else weights.clamp_min(1)), weights


def count_ordered_pairs(alpha: torch.Tensor, rows_used: torch.Tensor | None = None) -> torch.Tensor:
    """Number of pairs (i, j) with α_i < α_j per problem (only rows i where `rows_used`), by sorting:
    O(N log N), not N^2."""
    ordered = alpha.sort(dim=-1).values.contiguous()
    larger = alpha.shape[-1] - torch.searchsorted(ordered, alpha.contiguous(), side="right")
    return (larger if rows_used is None else larger * rows_used).sum(-1)


def gap_weight_totals(alpha: torch.Tensor, rows_used: torch.Tensor | None = None) -> torch.Tensor:
    """Σ (α_j − α_i) over the pairs with α_i < α_j (only rows i where `rows_used`) per problem, by sorting:
    for each i, the sum of the larger α minus their count times α_i; O(N log N), not N^2. Over every
    row, Σ_k α_(k) (2k − N − 1) of the sorted α (1-based k; a tied pair adds 0 either way)."""
    ordered = alpha.sort(dim=-1).values.contiguous()
    if rows_used is None:
        count = alpha.shape[-1]
        return ordered @ (2 * torch.arange(count, dtype=alpha.dtype, device=alpha.device) + 1 - count)
    larger_from = torch.searchsorted(ordered, alpha.contiguous(), side="right")
    suffix = torch.cat([ordered.flip(-1).cumsum(-1).flip(-1), ordered.new_zeros(*ordered.shape[:-1], 1)], -1)
    larger_sum = suffix.gather(-1, larger_from) - (alpha.shape[-1] - larger_from) * alpha
    return (larger_sum * rows_used).sum(-1)


def _active_pair_weights(
    alpha_i: torch.Tensor, used_i: torch.Tensor | None, alpha: torch.Tensor, hinge_on: torch.Tensor, gap: bool
) -> torch.Tensor:
    """[..., chunk, N] the weight of each pair (i, j) whose hinge is on: 0 unless α_i < α_j, i is used (None:
    every i) and `hinge_on`; else 1, or α_j − α_i (positive exactly when α_i < α_j, gradual underflow
    included)."""
    on = hinge_on if used_i is None else hinge_on & used_i[..., :, None]
    if not gap:
        return ((alpha_i[..., :, None] < alpha[..., None, :]) & on).to(alpha.dtype)
    return (alpha[..., None, :] - alpha_i[..., :, None]).clamp_min_(0).mul_(on)


class _PairwiseHinge(torch.autograd.Function):
    """Σ_ij w_ij max(0, m − (φ_j − φ_i)) per problem over flat [problems, N] scores, with its gradient
    computed in the same pass over the pair blocks.

    With A_ij = w_ij·1[φ_j < φ_i + m] (the pairs whose hinge is on), the sum is
    Σ_i (φ_i + m)·Σ_j A_ij − Σ_j φ_j·Σ_i A_ij and the gradient Σ_j A_ij − Σ_i A_ji: each block builds A
    alone. Why not autograd through the blocks: storing them would hold N^2 numbers per problem, and
    recomputing them in the backward (activation checkpointing) builds every block twice; the gradient
    is [problems, N], as small as the scores. The scores are centred per problem first: the loss and its
    gradient do not change, and the two sums above do not cancel large offsets in float32. Once
    differentiable (no second derivative)."""

    @staticmethod
    def forward(ctx, scores, alpha, rows_used, margin, gap, rows_per_block, problems_per_block):
        problems, candidates = scores.shape
        step = problems if problems_per_block is None else problems_per_block
        scores = scores - scores.mean(-1, keepdim=True)
        want_grad = ctx.needs_input_grad[0]
        total, grad = scores.new_zeros(problems), torch.zeros_like(scores) if want_grad else None
        for first in range(0, problems, step):
            block = slice(first, first + step)
            block_scores, block_alpha = scores[block], alpha[block]
            block_used = None if rows_used is None else rows_used[block]
            for start in range(0, candidates, rows_per_block):
                rows = slice(start, start + rows_per_block)
                raised = block_scores[:, rows] + margin
                hinge_on = block_scores[:, None, :] < raised[:, :, None]
                used = None if block_used is None else block_used[:, rows]
                active = _active_pair_weights(block_alpha[:, rows], used, block_alpha, hinge_on, gap)
                row_sums, column_sums = active.sum(-1), active.sum(-2)
                total[block] += (raised * row_sums).sum(-1) - (block_scores * column_sums).sum(-1)
                if want_grad:
                    grad[block, rows] += row_sums
                    grad[block] -= column_sums
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return grad_total[:, None] * grad, None, None, None, None, None, None


def kept_overlap(scores: torch.Tensor, alpha: torch.Tensor, count: int) -> torch.Tensor:
    """Share [...] of the golden kept set (the `count` largest α) that the scorer also keeps."""
    return (top_k_mask(scores, count) & top_k_mask(alpha, count)).sum(-1) / count


def pooled_overlap(scores: torch.Tensor, alpha: torch.Tensor, count: int) -> torch.Tensor:
    """`kept_overlap` of one budget spent across a layer's heads: scores and α [..., Hkv, N] pooled over the heads,
    the Hkv * `count` largest kept. High only when scores compare across heads as α does."""
    heads = scores.shape[-2]
    return kept_overlap(scores.flatten(-2), alpha.flatten(-2), heads * count)


LOG_TARGET_EPS = 1e-6
"""ε of the calibration's target log(α + ε): below the attention any entry of a 135M-to-7B model's window
receives that still matters, so the log of a zero α stays finite."""


def calibration_loss(scores: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Mean squared error [...] per problem between the scores and log(α + ε): trains the scores (output bias
    included) to one scale across heads and layers (`foresight.scorer.model.ScoreScale`)."""
    return (scores - (alpha + LOG_TARGET_EPS).log()).square().mean(-1)


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
