"""bf16 and fp16 end to end: policies score in float32 whatever the cache's dtype, and a padded batch
decodes as each row alone up to the rounding of the half-precision model."""

from __future__ import annotations

import pytest
import torch

from foresight.models import tiny_model
from foresight.policies import EvictionContext
from tests.decoding import assert_batch_decodes_as_each_row_alone
from tests.eviction_steps import GROUP, keep_scores, random_context
from tests.policy_lists import SCORED, make
from tests.prompts import prompts

HALF = (torch.bfloat16, torch.float16)


def in_dtype(context: EvictionContext, dtype: torch.dtype) -> EvictionContext:
    """The same step with keys, values and queries stored in `dtype` (state stays float32)."""
    return EvictionContext(
        layer_idx=context.layer_idx,
        num_layers=context.num_layers,
        keys=context.keys.to(dtype),
        values=context.values.to(dtype),
        positions=context.positions,
        num_candidates=context.num_candidates,
        scaling=context.scaling,
        state=dict(context.state),
        queries=context.queries.to(dtype),
        query_positions=context.query_positions,
    )


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", SCORED)
def test_policies_score_half_precision_caches_in_float32(name, dtype):
    """Scores from a half-precision cache equal, bit for bit, the scores of the same values in float32:
    block attention, norms and the scorer all run in float32."""
    base = random_context(GROUP, seed=4)
    if name == "foresight":  # its scorer was trained for B = 14 valid candidates in every row
        base.positions = base.positions.clamp(min=0)
    rounded = in_dtype(base, dtype)
    upcast = in_dtype(rounded, torch.float32)
    policy = make(name)
    half_scores = keep_scores(policy, rounded)
    assert half_scores.dtype == torch.float32
    assert torch.equal(half_scores, keep_scores(policy, upcast))


# -- a padded batch in half precision -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["full", "streaming", "h2o"])
def test_half_precision_batch_decodes_as_each_row_alone(name, dtype):
    """Policies whose keep sets hinge on near-equal scores (knorm's norms of rounded keys) may keep
    other entries under rounding; these three keep the same sets in a batch and alone."""
    model = tiny_model("qwen3").to(dtype)
    assert_batch_decodes_as_each_row_alone(model, name, prompts([5, 11, 20], seed=1), 30)
