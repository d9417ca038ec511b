"""The supervised step as it ran before the fit's speed work, kept as `foresight bench pipeline`'s row of before.

Three things changed since (docs/benchmarks.md, "Pipeline stages at the speed of the model forward"):
the scorer built x_n = [k_n || v_n || a_n] by concatenating normalised copies and ran its MLPs as
einsums broadcast over the batch (now: one matmul per (layer, head) over the batch's entries, W1 x_n
summed from its blocks); Eq. 6's pair matrices were built for the whole batch at once under activation
checkpointing, so the backward built them again (now: cache-sized blocks, the gradient summed in the
same pass); and batches were cast to float32 in the loader's collate (now: in the scorer's layout copy).
The scores and the loss are the same up to float rounding (tests/test_bench_pipeline.py compares them).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from foresight.scorer.model import UNIT_EPS, ForesightScorer
from trainers.ranking import PairWeight, count_ordered_pairs, gap_weight_totals
from trainers.supervised import SupervisedScorer


def scores_before(scorer: ForesightScorer, keys: torch.Tensor, values: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """`ForesightScorer.forward` of before: keys, values, features [layers, batch, Hkv, N, *] -> scores
    [layers, batch, Hkv, N]."""
    if scorer.config.feature_set.unit_key_values:
        keys, values = (nn.functional.normalize(tensor.float(), dim=-1, eps=UNIT_EPS) for tensor in (keys, values))
    inputs = torch.cat([keys, values, features] if scorer.config.key_values else [features], dim=-1).float()
    w1, b1, w2, b2 = (weight[:, None] for weight in (scorer.w1, scorer.b1, scorer.w2, scorer.b2))
    hidden = torch.einsum("...ni,...ih->...nh", inputs, w1) + b1.unsqueeze(-2)
    return torch.einsum("...nh,...h->...n", nn.functional.gelu(hidden), w2) + b2.unsqueeze(-1)


def ranking_loss_before(scores: torch.Tensor, alpha: torch.Tensor, margin: float, gap: bool) -> torch.Tensor:
    """Eq. 6 per problem [...] (every pair, uniform or gap-weighted) of before: the whole batch's pair
    matrices at once, under activation checkpointing."""
    flat_scores, flat_alpha = scores.reshape(-1, scores.shape[-1]), alpha.reshape(-1, alpha.shape[-1])
    total = checkpoint(_hinge_sum, flat_scores, flat_alpha, margin, gap, use_reentrant=False).reshape(scores.shape[:-1])
    # the totals by sorting, outside the checkpoint, as before
    return total / (gap_weight_totals(alpha).clamp_min(torch.finfo(scores.dtype).tiny) if gap else count_ordered_pairs(alpha).clamp_min(1))


def _hinge_sum(scores: torch.Tensor, alpha: torch.Tensor, margin: float, gap: bool) -> torch.Tensor:
    ordered = alpha[:, :, None] < alpha[:, None, :]
    weights = (alpha[:, None, :] - alpha[:, :, None]) * ordered if gap else ordered
    hinge = torch.relu(margin - (scores[:, None, :] - scores[:, :, None]))
    return (hinge * weights).sum((-1, -2))


class SupervisedScorerBefore(SupervisedScorer):
    """`SupervisedScorer` with the forward and the loss of before (every pair, as `pairs: all`)."""

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = [batch[name].transpose(0, 1) for name in ("keys", "values", "features")]
        return scores_before(self.scorer, *inputs).transpose(0, 1)

    def _loss(self, scores: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        gap = PairWeight.parse(self.hparams.pair_weight) is PairWeight.GAP
        return ranking_loss_before(scores, alpha, self.hparams.margin, gap).mean()
