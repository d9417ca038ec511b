"""The "transfer" feature set (issue 55): the window's logit moments and three projections of each key and value,
against loops; its scorer's output factors from the model, saved with it and required; it never streams."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from foresight.models import describe
from foresight.policies import make_policy
from foresight.runtime.policy import ObservedQueries
from foresight.scorer.attention_features import FEATURE_NAMES, FeatureSet
from foresight.scorer.ensemble import ensemble
from foresight.scorer.model import ForesightScorer, load_scorer
from foresight.scorer.standardised_features import window_logit_moments
from tests.eviction_steps import standardised_step
from tests.reference_features import independent_mlp, loop_standardise, loop_standardised_features
from tests.scorers import random_scorer

SUMS = FEATURE_NAMES[FeatureSet.STANDARDISED_HEURISTIC]
"""The transfer set's first nine features, the heuristic set's."""


def loop_logit_moments(queries, query_positions, keys, scaling):
    """Mean and log(population variance + 1e-6) of q·k × scaling over each row's valid queries, one float at a
    time: queries [batch, Hq, l, D], keys [batch, Hkv, N, D] -> two [batch, Hkv, N, G] tensors."""
    batch, query_heads, window, _ = queries.shape
    kv_heads, entries = keys.shape[1], keys.shape[2]
    group = query_heads // kv_heads
    mean = torch.zeros(batch, kv_heads, entries, group, dtype=torch.float64)
    variance = torch.zeros_like(mean)
    for b, h, n, g in itertools.product(range(batch), range(kv_heads), range(entries), range(group)):
        logits = [
            float(queries[b, h * group + g, q].double() @ keys[b, h, n].double()) * scaling
            for q in range(window)
            if query_positions[b, q] >= 0
        ]
        centre = sum(logits) / len(logits)
        mean[b, h, n, g] = centre
        variance[b, h, n, g] = math.log(sum((x - centre) ** 2 for x in logits) / len(logits) + 1e-6)
    return mean, variance


def loop_output_norms(model, layer: int, head: int, values: torch.Tensor) -> torch.Tensor:
    """‖W_o v‖ over the group's query heads, from the model's output projection by its column slices: values
    [N, D] -> [N], sqrt(Σ_g ‖W_g v‖²)."""
    shape = describe(model)
    weight = model.get_decoder().layers[layer].self_attn.o_proj.weight.detach().double()
    total = torch.zeros(values.shape[0], dtype=torch.float64)
    for g in range(shape.group_size):
        query_head = head * shape.group_size + g
        columns = weight[:, query_head * shape.head_dim : (query_head + 1) * shape.head_dim]
        total += (values.double() @ columns.T).square().sum(-1)
    return total.sqrt()


def test_window_logit_moments_equal_loops_and_leave_padding_queries_out():
    generator = torch.Generator().manual_seed(3)
    queries = torch.randn(2, 4, 5, 8, generator=generator)
    keys = torch.randn(2, 2, 7, 8, generator=generator)
    query_positions = torch.tensor([[10, 11, 12, 13, 14], [-1, -1, 12, 13, 14]])
    moments = window_logit_moments(queries, query_positions, keys, 8**-0.5)
    mean, variance = loop_logit_moments(queries, query_positions, keys, 8**-0.5)
    torch.testing.assert_close(moments["mean_logit"].double(), mean, rtol=0, atol=1e-5)
    torch.testing.assert_close(moments["logit_variance"].double(), variance, rtol=0, atol=1e-4)
    padded = window_logit_moments(queries[1:, :, 2:], query_positions[1:, 2:], keys[1:], 8**-0.5)
    torch.testing.assert_close(padded["mean_logit"], moments["mean_logit"][1:], rtol=0, atol=1e-6)


def test_output_factors_give_the_norm_of_the_output_projection(llama):
    """‖R v‖ = sqrt(Σ_g ‖W_g v‖²) for every layer and KV head, R taken from the model's o_proj."""
    scorer = random_scorer(llama, feature_set="transfer")
    values = torch.randn(6, describe(llama).head_dim, generator=torch.Generator().manual_seed(4))
    for layer, head in itertools.product(range(scorer.config.num_layers), range(scorer.config.num_kv_heads)):
        factored = (values.double() @ scorer.output_factors[layer, head].double().T).norm(dim=-1)
        torch.testing.assert_close(factored, loop_output_norms(llama, layer, head, values), rtol=1e-5, atol=1e-6)


def test_transfer_keep_scores_equal_independent_mlps_on_loop_features(llama, tmp_path):
    """x_n = [a_n || log‖k‖ || log‖v‖ || log‖W_o v‖]: the nine sums, then the two logit moments per query head,
    standardised over each row's valid candidates, then the three projections; no key or value vector."""
    scorer = random_scorer(llama, feature_set="transfer")
    config = scorer.config
    group = config.group_size
    assert (config.feature_width, config.norm_width, config.input_dim) == (11 * group, 3, 11 * group + 3)
    policy = make_policy("foresight", scorer=scorer)
    assert policy.observed_queries is ObservedQueries.WINDOW  # the default observation streams; this set cannot
    context = standardised_step(scorer)
    policy.observe(context)
    scores = policy.keep_scores(context)
    sums, _ = loop_standardised_features(
        context.attention, context.state, context.positions, context.query_positions, SUMS, context.first_observed
    )
    moments = loop_logit_moments(context.queries, context.query_positions, context.keys, context.scaling)
    per_head = torch.cat([sums.unflatten(-1, (group, len(SUMS))), torch.stack(moments, -1)], -1)
    valid = context.candidate_positions >= 0
    features = loop_standardise(per_head.flatten(-2)[..., : context.num_candidates, :], valid).float()
    candidates = context.num_candidates
    for row, head in itertools.product(range(2), range(config.num_kv_heads)):
        keys, values = context.keys[row, head, :candidates], context.values[row, head, :candidates]
        norms = [keys.norm(dim=-1), values.norm(dim=-1), loop_output_norms(llama, 1, head, values).float()]
        inputs = torch.cat([features[row, head], torch.stack(norms, -1).log()], -1)
        expected = independent_mlp(scorer, 1, head)(inputs).squeeze(-1)
        torch.testing.assert_close(scores[row, head], expected, rtol=0, atol=1e-4)
    scorer.save_pretrained(tmp_path)
    assert torch.equal(load_scorer(tmp_path).output_factors, scorer.output_factors)


def test_a_transfer_scorer_without_output_factors_is_refused_in_one_line(llama):
    fresh = ForesightScorer(random_scorer(llama, feature_set="transfer").config)
    assert fresh.needs_output_factors and not random_scorer(llama, feature_set="standardised").needs_output_factors
    with pytest.raises(ValueError, match=r"reads log‖W_o v‖ \(the transfer set\) but holds no output factors"):
        make_policy("foresight", scorer=fresh)


def test_an_ensemble_of_transfer_scorers_keeps_the_output_factors(llama):
    members = [random_scorer(llama, feature_set="transfer", seed=seed) for seed in (0, 1)]
    assert torch.equal(ensemble(members).output_factors, members[0].output_factors)


def test_a_scorer_folder_of_a_feature_set_this_version_lacks_is_one_line(llama, tmp_path):
    random_scorer(llama, feature_set="transfer").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "feature_set": "transfer-2"}))
    with pytest.raises(ValueError) as error:
        load_scorer(tmp_path)
    assert "'transfer-2'" in str(error.value) and "transfer" in str(error.value) and "\n" not in str(error.value)
