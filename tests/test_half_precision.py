"""bf16 and fp16 end to end: policies score in float32 whatever the cache's dtype, and a padded batch
decodes as each row alone up to the rounding of the half-precision model."""

from __future__ import annotations

import pytest
import torch

from foresight.models import tiny_model
from foresight.policies import EvictionContext, make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests.test_foresight_policy import random_scorer
from tests.test_policy_scores import random_context
from tests.test_runtime import prompts

HALF = (torch.bfloat16, torch.float16)
SCORED = ("knorm", "streaming", "random", "h2o", "tova", "snapkv", "rkv", "lagkv", "lazy", "raas", "foresight")
GROUP = 2


def make(name: str, model=None):
    if name != "foresight":
        return make_policy(name)
    model = model or tiny_model("llama", num_attention_heads=2 * GROUP, head_dim=8, num_hidden_layers=1)
    return make_policy("foresight", scorer=random_scorer(model, budget=14, interval=4))


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


def keep_scores(policy, context: EvictionContext) -> torch.Tensor:
    policy.reset()
    shape = context.positions.shape
    for field in policy.state_fields:
        trailing = (GROUP,) if field.per_query_head else ()
        context.state[field.name] = torch.full((*shape, *trailing), field.fill)
    context.state.update(policy.observe(context))
    return policy.keep_scores(context)


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
B, L = 12, 4
ROUNDING = {torch.bfloat16: 0.02, torch.float16: 0.004, torch.float32: 1e-4}
"""Largest logit difference between a row in a batch and alone, as a share of the largest |logit|:
a few units in the last place of the dtype (kernels for different shapes round differently)."""


def assert_decodes_alike(tokens, logits, reference_tokens, reference_logits, dtype: torch.dtype) -> int:
    """Two greedy decodings of the same prompt agree up to rounding: their logits [steps, vocab] agree
    within ROUNDING of the largest |logit| up to and including the first step where the tokens part
    (rounding may pick the other one of two near-equal logits; every later step has other inputs).
    A fault (padding attended, a wrong entry kept) moves logits by far more than rounding before any
    token can part. Returns the number of steps compared."""
    parted = next((step for step, (a, b) in enumerate(zip(tokens, reference_tokens)) if a != b), None)
    compared = min(len(tokens), len(reference_tokens)) if parted is None else parted + 1
    expected = reference_logits[:compared].float()
    difference = float((logits[:compared].float() - expected).abs().max())
    assert difference <= ROUNDING[dtype] * float(expected.abs().max()), f"logits differ by {difference:.4g}"
    return compared


def assert_batch_decodes_as_each_row_alone(model, policy_name: str, batch: list[list[int]], new_tokens: int) -> None:
    """Greedy decoding of a left-padded batch equals decoding each row alone, up to rounding: each row
    decoded alone agrees with its batch row up to their first near-tie (`assert_decodes_alike`), and
    replayed alone token by token along the batch row's tokens it gives every one of them the same
    log-probability (within rounding), so every step is compared, near-ties or not."""
    policy = make(policy_name, model)
    engine = EvictionEngine(model, policy, EvictionConfig(B, L) if policy.evicts else None)
    together = engine.generate(batch, new_tokens, return_logits=True)
    assert not policy.evicts or together.stats.evictions > 0
    for row, prompt in enumerate(batch):
        tokens, logits = together.tokens[row], together.logits[row, : len(together.tokens[row])].float()
        alone = engine.generate([prompt], new_tokens, return_logits=True)
        assert_decodes_alike(tokens, logits, alone.tokens[0], alone.logits[0], model.dtype)
        replayed = engine.replay([torch.tensor(prompt + tokens)], [len(prompt)], max_chunk=1)
        expected = replayed.nll[0][len(prompt) - 1 :]  # entry j predicts token j + 1
        nll = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens, device=logits.device)[:, None])
        tolerance = 2 * ROUNDING[model.dtype] * float(logits.abs().max())  # a log-softmax moves by twice the logits
        assert float((nll.squeeze(-1).cpu() - expected).abs().max()) <= tolerance, f"row {row}"


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["full", "streaming", "h2o"])
def test_half_precision_batch_decodes_as_each_row_alone(name, dtype):
    """Policies whose keep sets hinge on near-equal scores (knorm's norms of rounded keys) may keep
    other entries under rounding; these three keep the same sets in a batch and alone."""
    model = tiny_model("qwen3").to(dtype)
    assert_batch_decodes_as_each_row_alone(model, name, prompts([5, 11, 20], seed=1), 30)
