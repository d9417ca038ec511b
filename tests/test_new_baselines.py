"""Random Attention (random-prompt), VaSE and TriAttention: keep scores against slow loop-based twins, seeds,
batch == single, the TriAttention statistics (calibration, storage, refusal of another model) and the engine."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from foresight import cli
from foresight.commands import calibrate as calibrate_command
from foresight.models import describe, tiny_model
from foresight.policies import EvictionContext, make_policy
from foresight.policies.triattention_stats import calibrate, load_stats
from foresight.policies.vase import sampling_weights
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests import reference_policies as ref
from tests.eviction_steps import CANDIDATES, KV_HEADS, SCALING, random_context, zero_context
from tests.policy_lists import random_stats
from tests.prompts import prompts

TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def assert_close_on_valid(actual: torch.Tensor, expected: list, context: EvictionContext, **tolerance) -> None:
    expected = torch.tensor(expected, dtype=torch.float64)
    valid = context.candidate_positions >= 0
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.double()[valid], expected[valid], **(tolerance or TOLERANCE))


def moved(context: EvictionContext) -> EvictionContext:
    """The same entries with the batch rows swapped and one more invalid slot in front: a row's scores must not
    depend on its batch neighbours or on padding."""

    def shift(tensor, fill):
        pad = torch.full_like(tensor[:, :, :1], fill)
        return torch.cat([pad, tensor], dim=2).flip(0)

    return EvictionContext(
        layer_idx=context.layer_idx,
        num_layers=context.num_layers,
        keys=shift(context.keys, 0.0),
        values=shift(context.values, 0.0),
        positions=shift(context.positions, -1),
        num_candidates=CANDIDATES + 1,
        scaling=SCALING,
        queries=context.queries.flip(0),
        query_positions=context.query_positions.flip(0),
    )


def assert_batch_equals_single(policy, context: EvictionContext) -> None:
    scores = policy.keep_scores(context)
    shifted = policy.keep_scores(moved(context)).flip(0)[..., 1:]
    valid = context.candidate_positions >= 0
    torch.testing.assert_close(shifted[valid], scores[valid])


# -- random-prompt ----------------------------------------------------------------------------------------
def test_random_prompt_matches_reference_and_protects_the_prompt_by_default():
    context = random_context(group=2)
    policy = make_policy("random-prompt", seed=3)
    expected = ref.random_prompt(context.positions.tolist(), 0, 3, CANDIDATES)
    assert_close_on_valid(policy.keep_scores(context), expected, context, atol=1e-7, rtol=0)
    assert policy.default_protect_prompt and not make_policy("random").default_protect_prompt


def test_random_prompt_redraws_at_every_step_unlike_random():
    """The same entries at a later step (newest position moved) get a fresh draw; `random` keeps its draw."""
    context = random_context(group=2)
    later = EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=context.keys,
        values=context.values,
        positions=torch.cat([context.positions, context.positions[..., -1:] + 1], dim=-1),
        num_candidates=CANDIDATES,
        scaling=SCALING,
    )
    valid = context.candidate_positions >= 0
    for name, redraws in (("random-prompt", True), ("random", False)):
        now, then = make_policy(name).keep_scores(context)[valid], make_policy(name).keep_scores(later)[valid]
        assert (not torch.equal(now, then)) == redraws
    now, then = make_policy("random-prompt").keep_scores(context), make_policy("random-prompt").keep_scores(later)
    assert abs(torch.corrcoef(torch.stack([now[valid], then[valid]]))[0, 1]) < 0.5


def test_random_prompt_is_reproducible_uniform_and_batch_equals_single():
    context = random_context(group=2)
    first = make_policy("random-prompt", seed=5).keep_scores(context)
    torch.testing.assert_close(make_policy("random-prompt", seed=5).keep_scores(context), first)
    assert not torch.equal(make_policy("random-prompt", seed=6).keep_scores(context), first)
    assert_batch_equals_single(make_policy("random-prompt", seed=5), context)
    scores = make_policy("random-prompt").keep_scores(zero_context(20000, 19990, layer_idx=1, num_layers=2))
    shares = torch.histc(scores, bins=10, min=0.0, max=1.0) / scores.numel()
    assert (shares - 0.1).abs().max() < 0.01


# -- vase -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group, query_start", [(2, None), (3, None), (3, 20)])
@pytest.mark.parametrize("share, magnitude", [(0.25, "range"), (0.5, "l2"), (0.3, "var")])
def test_vase_matches_reference(group, query_start, share, magnitude):
    context = random_context(group, seed=2, query_start=query_start)
    scores = make_policy("vase", large_share=share, magnitude=magnitude, seed=1).keep_scores(context)
    expected = ref.vase(
        context.queries.tolist(),
        context.query_positions.tolist(),
        context.keys.tolist(),
        context.values.tolist(),
        context.positions.tolist(),
        SCALING,
        CANDIDATES,
        0,
        1,
        share,
        magnitude,
    )
    assert_close_on_valid(
        scores.nan_to_num(neginf=-1e30),
        [[[-1e30 if x == -math.inf else x for x in h] for h in b] for b in expected],
        context,
    )


def test_vase_keeps_the_largest_values_first_and_batch_equals_single():
    context = random_context(group=2, seed=4)
    policy = make_policy("vase")
    scores = policy.keep_scores(context)
    valid = context.candidate_positions >= 0
    span = context.values[..., :CANDIDATES, :].amax(-1) - context.values[..., :CANDIDATES, :].amin(-1)
    for b in range(scores.shape[0]):
        for h in range(KV_HEADS):
            count = int(valid[b, h].sum()) // 4
            largest = span[b, h].masked_fill(~valid[b, h], -1).topk(count).indices
            assert torch.equal(scores[b, h].topk(count).indices.sort().values, largest.sort().values)
            assert (scores[b, h, largest] >= 1).all() and (scores[b, h][valid[b, h]].sort().values[:-count] <= 0).all()
    assert_batch_equals_single(policy, context)


def test_vase_samples_in_proportion_to_attention():
    """Efraimidis-Spirakis keys: over many seeds, the sampled candidate ranked first is candidate n with
    probability w_n / sum(w) (protection off, one row, one head)."""
    context = random_context(group=2, seed=5)
    context = EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=context.keys[:1, :1],
        values=context.values[:1, :1],
        positions=context.positions[:1, :1],
        num_candidates=CANDIDATES,
        scaling=SCALING,
        queries=context.queries[:1, :2],
        query_positions=context.query_positions[:1],
    )
    weights = sampling_weights(context)[0, 0]
    firsts = torch.stack(
        [make_policy("vase", large_share=0.0, seed=seed).keep_scores(context)[0, 0].argmax() for seed in range(4000)]
    )
    frequency = torch.bincount(firsts, minlength=CANDIDATES).float() / len(firsts)
    assert (frequency - weights / weights.sum()).abs().max() < 0.03
    assert not torch.equal(
        make_policy("vase", seed=1).keep_scores(context), make_policy("vase", seed=2).keep_scores(context)
    )


# -- triattention: scores -----------------------------------------------------------------------------------
@pytest.mark.parametrize("group, rope_scale", [(2, 1.0), (3, 1.3)])
@pytest.mark.parametrize("normalize, max_offset", [(True, 65536), (False, 65536), (True, 5)])
def test_triattention_matches_reference(group, rope_scale, normalize, max_offset):
    """The closed form on post-RoPE keys equals the authors' inverse-rotate-then-series form."""
    context = random_context(group, seed=3)
    stats = random_stats(group, rope_scale)
    scores = make_policy("triattention", stats=stats, normalize=normalize, max_offset=max_offset).keep_scores(context)
    offsets = [2**j for j in range(max_offset.bit_length())]
    expected = ref.triattention(
        context.keys.tolist(),
        context.positions.tolist(),
        stats.q_mean[0].tolist(),
        stats.q_abs_mean[0].tolist(),
        stats.inv_freq.tolist(),
        rope_scale,
        offsets,
        CANDIDATES,
        normalize,
    )
    assert_close_on_valid(scores, expected, context, atol=2e-4 if normalize else 2e-3, rtol=1e-4)
    assert_batch_equals_single(make_policy("triattention", stats=stats), context)


def test_triattention_refuses_stats_of_another_model_shape():
    stats = random_stats(group=2)
    context = random_context(group=2)
    other = EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=context.keys[:, :1],
        values=context.values[:, :1],
        positions=context.positions[:, :1],
        num_candidates=CANDIDATES,
        scaling=SCALING,
    )
    with pytest.raises(
        ValueError,
        match=r"made for 'random' \(1 layers x 4 query / 2 KV heads x 8 dims\) do not fit "
        r"this model \(1 layers x 4 query / 1 KV heads x 8 dims\)",
    ) as error:
        make_policy("triattention", stats=stats).keep_scores(other)
    assert "\n" not in str(error.value) and "foresight calibrate" in str(error.value)
    with pytest.raises(ValueError, match="do not fit"):
        make_policy("triattention", stats=random_stats(group=3)).keep_scores(context)  # 6 query heads, not 4


# -- triattention: statistics --------------------------------------------------------------------------------
def pre_rope_query_means(model, sequences):
    """The q_proj outputs (Llama's pre-RoPE queries) of whole-sequence forwards, averaged per band."""
    shape, outputs = describe(model), {}
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(
            lambda m, i, o, layer=l: outputs.setdefault(layer, []).append(o[0])
        )
        for l, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        for ids in sequences:
            model(input_ids=ids[None])
    for hook in hooks:
        hook.remove()
    queries = torch.stack([torch.cat(outputs[l]) for l in range(shape.num_layers)])  # [layers, T, Hq * D]
    queries = queries.unflatten(-1, (shape.num_query_heads, shape.head_dim)).transpose(1, 2)
    real, imag = queries.chunk(2, dim=-1)
    return torch.complex(real, imag).mean(2), torch.hypot(real, imag).mean(2)


def test_calibrate_recovers_the_pre_rope_queries():
    """Chunked capture, rotated back with the model's rotary, equals q_proj's output averaged per band."""
    model = tiny_model("llama")
    sequences = [torch.tensor(p) for p in prompts([37, 50], seed=1)]
    stats = calibrate(model, sequences, model_name="tiny", chunk_size=16)
    q_mean, q_abs_mean = pre_rope_query_means(model, sequences)
    assert stats.tokens == 87 and stats.shape == describe(model)
    torch.testing.assert_close(stats.q_mean, q_mean, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stats.q_abs_mean, q_abs_mean, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stats.inv_freq, model.model.rotary_emb.inv_freq.float())


def test_calibrate_command_writes_stats_the_policy_loads(tmp_path, traces_dir, tiny_dir):
    assert "calibrate" in cli._verbs()
    parser = argparse.ArgumentParser()
    calibrate_command.add_arguments(parser)
    out = tmp_path / "stats"
    assert (
        calibrate_command.run(
            parser.parse_args(["--traces", str(traces_dir), "--out", str(out), "--max-tokens", "150"])
        )
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    stats = load_stats(out)
    assert stats.model == str(tiny_dir) and stats.tokens >= 150 and stats.source == str(traces_dir)
    stats.check_model(tiny_model("llama"))
    with pytest.raises(ValueError, match="1 KV heads"):
        stats.check_model(tiny_model("llama", num_key_value_heads=1))
    with pytest.raises(ValueError, match="RoPE frequencies"):
        stats.check_model(tiny_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    assert make_policy("triattention", stats=out).stats.tokens == stats.tokens
    with pytest.raises(ValueError, match="not the model that made the traces"):
        calibrate_command.run(parser.parse_args(["--traces", str(traces_dir), "--out", str(out), "--model", "other"]))


def test_stats_folder_refuses_missing_and_torn_files(tmp_path):
    with pytest.raises(ValueError, match="not a TriAttention stats folder"):
        load_stats(tmp_path)
    stats = random_stats(group=2)
    stats.save(tmp_path)
    torch.testing.assert_close(load_stats(tmp_path).q_mean, stats.q_mean)
    config = (tmp_path / "config.json").read_text().replace('"tokens": 0', '"tokens": 7')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match="made with other settings"):
        load_stats(tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["random-prompt", "vase", "triattention"])
def test_half_precision_caches_score_in_float32(name, dtype):
    """Scores of a half-precision cache equal, bit for bit, those of the same values in float32."""
    base = random_context(group=2, seed=4)
    rounded = EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=base.keys.to(dtype),
        values=base.values.to(dtype),
        positions=base.positions,
        num_candidates=CANDIDATES,
        scaling=SCALING,
        queries=base.queries.to(dtype),
        query_positions=base.query_positions,
    )
    upcast = EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=rounded.keys.float(),
        values=rounded.values.float(),
        positions=base.positions,
        num_candidates=CANDIDATES,
        scaling=SCALING,
        queries=rounded.queries.float(),
        query_positions=base.query_positions,
    )
    options = {"stats": random_stats(group=2)} if name == "triattention" else {}
    half = make_policy(name, **options).keep_scores(rounded)
    assert half.dtype == torch.float32
    assert torch.equal(half, make_policy(name, **options).keep_scores(upcast))


# -- in the engine ------------------------------------------------------------------------------------------
BUDGET, INTERVAL, NEW_TOKENS = 12, 4, 28
PROMPTS = ([5, 9, 17, 33, 65, 70, 100, 7], [11, 12, 13])


@pytest.fixture(scope="module")
def tiny_stats():
    return calibrate(tiny_model("llama"), [torch.tensor(p) for p in prompts([64, 40], seed=2)], model_name="tiny")


def generate(policy, prompts=PROMPTS, protect_prompt=None):
    config = EvictionConfig(budget=BUDGET, interval=INTERVAL, protect_prompt=protect_prompt)
    return EvictionEngine(tiny_model("llama"), policy, config).generate(
        [list(p) for p in prompts], max_new_tokens=NEW_TOKENS
    )


@pytest.mark.parametrize("name", ["random-prompt", "vase", "triattention"])
def test_policy_runs_in_engine_and_rows_decode_as_alone(name, tiny_stats):
    """The prompt is protected by default (so only the decode entries count against B), the cache peaks at
    B + L + prompt, and each row of a left-padded batch decodes as it does alone."""
    make = (lambda: make_policy(name, stats=tiny_stats)) if name == "triattention" else (lambda: make_policy(name))
    output = generate(make(), protect_prompt=False)
    assert output.stats.max_entries == BUDGET + INTERVAL and output.stats.evictions > 0
    for prompt, tokens in zip(PROMPTS, output.tokens):
        assert generate(make(), prompts=(prompt,), protect_prompt=False).tokens[0] == tokens
    if make().default_protect_prompt:
        seen, policy = [], make()
        keep_scores = policy.keep_scores
        policy.keep_scores = lambda context: seen.append(context.positions.clone()) or keep_scores(context)
        generate(policy, prompts=PROMPTS[:1])
        assert seen and all(set(range(len(PROMPTS[0]))) <= set(p[0, h].tolist()) for p in seen for h in range(KV_HEADS))


def test_triattention_refuses_in_the_engine_for_another_model(tiny_stats):
    policy = make_policy("triattention", stats=tiny_stats)
    engine = EvictionEngine(tiny_model("llama", num_key_value_heads=1), policy, EvictionConfig(BUDGET, INTERVAL))
    with pytest.raises(ValueError, match="do not fit this model"):
        engine.generate([list(PROMPTS[0])], max_new_tokens=NEW_TOKENS)
