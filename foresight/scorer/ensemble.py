"""Several scorers as one: the mean of their keep scores, written as a single wider scorer.

Fits of one recipe that differ only in their seed rank the same entries differently (on unseen task
families a fit's share of the headroom moves by about 5 points with the seed alone); their mean score
averages that out. Since phi = W2 GELU(W1 x + b1) + b2 is linear in W2, the mean of k scorers of width H
is exactly one scorer of width k*H: W1 and b1 side by side, W2 side by side divided by k, b2 the mean.
It loads, runs, exports and refines (`foresight rl`) like any other scorer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from foresight.scorer.model import ForesightScorer

SHARED_FIELDS = (
    "num_layers",
    "num_query_heads",
    "num_kv_heads",
    "head_dim",
    "budget",
    "interval",
    "feature_set",
    "key_values",
    "base_model",
    "residual",
)
"""What the members must agree on: the model, the cadence, the inputs they read and the feature they correct (the
mean of k scorers that add one residual is that residual plus the mean of their MLPs)."""


def ensemble(scorers: Sequence[ForesightScorer]) -> ForesightScorer:
    """One scorer whose keep score is the mean of `scorers`' (at least two, of one model, cadence and
    feature set; their widths may differ)."""
    if len(scorers) < 2:
        raise ValueError(f"an ensemble needs at least 2 scorers, got {len(scorers)}")
    first = scorers[0].config
    for index, scorer in enumerate(scorers[1:], start=1):
        differing = [name for name in SHARED_FIELDS if getattr(scorer.config, name) != getattr(first, name)]
        if differing:
            pairs = ", ".join(
                f"{name} {_shown(first, name)!r} vs {_shown(scorer.config, name)!r}" for name in differing
            )
            raise ValueError(
                f"scorer {index} does not fit scorer 0 ({pairs}): an ensemble's members read the same inputs"
            )
    sources = sorted({source for scorer in scorers for source in scorer.config.training_sources})
    config = dataclasses.replace(
        first, hidden=sum(scorer.config.hidden for scorer in scorers), training_sources=sources
    )
    merged = ForesightScorer(config)
    with torch.no_grad():
        merged.w1.copy_(torch.cat([scorer.w1 for scorer in scorers], dim=-1))
        merged.b1.copy_(torch.cat([scorer.b1 for scorer in scorers], dim=-1))
        merged.w2.copy_(torch.cat([scorer.w2 for scorer in scorers], dim=-1) / len(scorers))
        merged.b2.copy_(torch.stack([scorer.b2 for scorer in scorers]).mean(0))
        for name, buffer in merged.named_buffers():  # the base model's, alike in every member (the transfer set's)
            buffer.copy_(getattr(scorers[0], name))
    return merged.eval()


def split(scorer: ForesightScorer, members: int) -> list[ForesightScorer]:
    """The `members` equal-width scorers `ensemble` averaged into `scorer`, undone: each member's W1 and b1 its
    own columns, its W2 the columns times `members`. A member's own output bias is lost in the mean, so each takes
    the ensemble's: it shifts every score of a (layer, head) alike, so no kept set of a head depends on it (the
    members of a calibrated scorer compare across heads only up to it)."""
    hidden = scorer.config.hidden
    if members < 2 or hidden % members:
        raise ValueError(f"members must be at least 2 and divide the scorer's width {hidden}, got {members}")
    width = hidden // members
    config = dataclasses.replace(scorer.config, hidden=width)
    parts = []
    with torch.no_grad():
        for index in range(members):
            columns = slice(index * width, (index + 1) * width)
            member = ForesightScorer(config)
            member.w1.copy_(scorer.w1[..., columns])
            member.b1.copy_(scorer.b1[..., columns])
            member.w2.copy_(scorer.w2[..., columns] * members)
            member.b2.copy_(scorer.b2)
            for name, buffer in member.named_buffers():
                buffer.copy_(getattr(scorer, name))
            parts.append(member.eval())
    return parts


def _shown(config, name: str):
    """A config field as a user writes it (a feature set by its name)."""
    value = getattr(config, name)
    return getattr(value, "value", value)
