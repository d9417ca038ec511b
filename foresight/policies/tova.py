"""TOVA (Oren et al., 2024): keep what the current token attends to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foresight.policies import register
from foresight.runtime.policy import EvictionContext, Policy


@register
@dataclass
class TOVA(Policy):
    """Token Omission Via Attention: the keep score of a candidate is the attention it receives
    from the last query only, averaged over all Hkv x G query heads of the layer, as in the
    authors' official code (docs/algorithms.md section 3). The score is shared by every KV head, so all
    heads of a layer keep the same set. R-KV's repository calls this rule "H2O"; ours is `h2o`.

    Parameters
    ----------
    per_kv_head : bool, default=False
        Average over each KV head's G query heads only: a score per head, which AdaKV's allocation over a
        layer's heads compares (`EvictionConfig(allocation="layer")`; the authors' rule shares one per layer).
    """

    name = "tova"
    summary = "attention from the last query, mean over the layer's heads (one set per layer)"
    needs_attention = True
    rows_alone = True
    runs_pooled = True
    per_kv_head: bool = False

    @property
    def latest_queries(self) -> int:
        return 1

    @property
    def scores_compare_across_heads(self) -> bool:
        return self.per_kv_head

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        last = context.attention[..., -1, : context.num_candidates]  # [batch, Hkv, G, C]
        if self.per_kv_head:
            return last.mean(dim=2)
        layer_mean = last.mean(dim=(1, 2), keepdim=True).squeeze(2)  # [batch, 1, C]
        return layer_mean.expand(-1, last.shape[1], -1)
