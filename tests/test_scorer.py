"""The stacked scorer against independent MLPs, its Hub save/load, and eviction sampling (Eq. 2)."""

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch

from foresight.scorer.eviction_sampling import (
    draw_eviction,
    evict_lowest,
    eviction_pool,
    guided_eviction,
    plackett_luce_logprob,
    sample_eviction,
)
from foresight.scorer.model import ForesightScorer
from tests.reference_features import independent_mlp
from tests.scorers import make_config, make_scorer, random_inputs


def test_stacked_scorer_equals_independent_mlps():
    scorer = make_scorer()
    config = scorer.config
    keys, values, features = random_inputs(config, config.num_layers, 2)
    all_layers = scorer(keys, values, features)
    assert all_layers.shape == (config.num_layers, 2, config.num_kv_heads, 5)
    for layer in range(config.num_layers):
        one_layer = scorer.score_layer(layer, keys[layer], values[layer], features[layer])
        for head in range(config.num_kv_heads):
            x = torch.cat([keys[layer, :, head], values[layer, :, head], features[layer, :, head]], -1)
            expected = independent_mlp(scorer, layer, head)(x).squeeze(-1)
            torch.testing.assert_close(one_layer[:, head], expected, rtol=0, atol=1e-6)
            torch.testing.assert_close(all_layers[layer, :, head], expected, rtol=0, atol=1e-6)


def test_a_features_only_scorer_is_the_mlp_of_the_features_alone():
    """key_values=False: x_n = a_n, so the keys and values cannot change a score."""
    scorer = make_scorer(key_values=False)
    config = scorer.config
    assert config.input_dim == config.feature_width
    keys, values, features = random_inputs(config, config.num_layers, 2)
    scores = scorer(keys, values, features)
    torch.testing.assert_close(scorer(keys * 3 + 1, -values, features), scores, rtol=0, atol=0)
    for layer in range(config.num_layers):
        for head in range(config.num_kv_heads):
            expected = independent_mlp(scorer, layer, head)(features[layer, :, head]).squeeze(-1)
            torch.testing.assert_close(scores[layer, :, head], expected, rtol=0, atol=1e-6)


def test_a_standardised_scorer_reads_unit_norm_keys_and_values_and_older_ones_raw_keys(tmp_path):
    """The standardised set's MLP sees k / |k| and v / |v| (so per-entry rescaling changes nothing); a scorer
    of an older set still sees raw keys and values; both survive a save and load."""
    scorer = make_scorer(feature_set="standardised")
    config = scorer.config
    assert (config.feature_width, config.input_dim) == (7 * 2, 2 * 8 + 14)
    keys, values, features = random_inputs(config, config.num_layers, 2)
    scale = torch.rand(*keys.shape[:-1], 1, generator=torch.Generator().manual_seed(2)) * 10 + 0.1
    scores = scorer(keys, values, features)
    torch.testing.assert_close(scorer(keys * scale, values / scale, features), scores, rtol=0, atol=1e-5)
    unit = [torch.nn.functional.normalize(tensor, dim=-1) for tensor in (keys, values)]
    for layer, head in itertools.product(range(config.num_layers), range(config.num_kv_heads)):
        x = torch.cat([unit[0][layer, :, head], unit[1][layer, :, head], features[layer, :, head]], -1)
        expected = independent_mlp(scorer, layer, head)(x).squeeze(-1)
        torch.testing.assert_close(scores[layer, :, head], expected, rtol=0, atol=1e-6)
    older = make_scorer(feature_set="paper")
    older_features = torch.rand(*keys.shape[:-1], older.config.feature_width)
    assert not torch.allclose(older(keys * scale, values, older_features), older(keys, values, older_features))
    scorer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["feature_set"] == "standardised"
    assert torch.equal(ForesightScorer.from_pretrained(tmp_path)(keys, values, features), scores)


def test_a_residual_scorer_starts_as_its_feature_and_adds_its_mlp(tmp_path):
    """With residual last_1 the output layer starts at 0, so the scores start as the mean of the group's last_1
    columns (head-major: column g·F + 7); trained, they are that mean plus the per-(layer, head) MLP, by a loop;
    the option survives a save and load, and a feature the set lacks is named in one line."""
    scorer = make_scorer(feature_set="standardised-heuristic", residual="last_1")
    config = scorer.config
    keys, values, features = random_inputs(config, config.num_layers, 2)
    base = features[..., [7, 9 + 7]].mean(-1)  # F = 9 features per query head, G = 2
    torch.testing.assert_close(scorer(keys, values, features), base, rtol=0, atol=0)
    with torch.no_grad():
        scorer.w2.normal_(generator=torch.Generator().manual_seed(3))
    scores = scorer(keys, values, features)
    unit = [torch.nn.functional.normalize(tensor, dim=-1) for tensor in (keys, values)]
    for layer, head in itertools.product(range(config.num_layers), range(config.num_kv_heads)):
        x = torch.cat([unit[0][layer, :, head], unit[1][layer, :, head], features[layer, :, head]], -1)
        expected = independent_mlp(scorer, layer, head)(x).squeeze(-1) + base[layer, :, head]
        torch.testing.assert_close(scores[layer, :, head], expected, rtol=0, atol=1e-6)
    scorer.save_pretrained(tmp_path)
    assert torch.equal(ForesightScorer.from_pretrained(tmp_path)(keys, values, features), scores)
    with pytest.raises(ValueError, match="residual 'last_2' is not a feature of the standardised set; its features:"):
        make_config(feature_set="standardised", residual="last_2")


def test_a_norms_scorer_reads_unit_keys_and_values_and_their_log_norms(tmp_path):
    """ "standardised-norms": x_n = [k / |k| || v / |v| || a_n || log|k| || log|v|], so a per-entry rescaling
    now changes the score, through the two norm columns only."""
    scorer = make_scorer(feature_set="standardised-norms")
    config = scorer.config
    assert (config.feature_width, config.norm_width, config.input_dim) == (7 * 2, 2, 2 * 8 + 14 + 2)
    keys, values, features = random_inputs(config, config.num_layers, 2)
    scores = scorer(keys, values, features)
    unit = [torch.nn.functional.normalize(tensor, dim=-1) for tensor in (keys, values)]
    norms = torch.stack([keys.norm(dim=-1).log(), values.norm(dim=-1).log()], dim=-1)
    for layer, head in itertools.product(range(config.num_layers), range(config.num_kv_heads)):
        x = torch.cat(
            [unit[0][layer, :, head], unit[1][layer, :, head], features[layer, :, head], norms[layer, :, head]], -1
        )
        expected = independent_mlp(scorer, layer, head)(x).squeeze(-1)
        torch.testing.assert_close(scores[layer, :, head], expected, rtol=0, atol=1e-5)
    assert not torch.allclose(scorer(keys * 3, values, features), scores)
    scorer.save_pretrained(tmp_path)
    assert torch.equal(ForesightScorer.from_pretrained(tmp_path)(keys, values, features), scores)


@pytest.mark.parametrize("layers, kv_heads", [(1, 1), (3, 2), (4, 4)])
def test_matmul_calls_do_not_grow_with_layers_or_heads(monkeypatch, layers, kv_heads):
    calls = []
    for name in ("bmm", "baddbmm"):
        original = getattr(torch, name)
        monkeypatch.setattr(
            torch, name, lambda *args, name=name, original=original: calls.append(name) or original(*args)
        )
    accumulate = torch.Tensor.baddbmm_
    monkeypatch.setattr(
        torch.Tensor, "baddbmm_", lambda self, *args: calls.append("baddbmm_") or accumulate(self, *args)
    )
    scorer = make_scorer(num_layers=layers, num_kv_heads=kv_heads, num_query_heads=2 * kv_heads)
    keys, values, features = random_inputs(scorer.config, layers, 2)
    scorer(keys, values, features)
    scorer.score_layer(layers - 1, keys[0], values[0], features[0])
    # four per call: the feature, key and value blocks of the hidden layer (the last two accumulated in
    # place), then the output layer
    assert calls == ["baddbmm", "baddbmm_", "baddbmm_", "bmm"] * 2


def test_init_is_linear_default_per_head():
    scorer = make_scorer(num_layers=4)
    config = scorer.config
    for params, fan_in in (((scorer.w1, scorer.b1), config.input_dim), ((scorer.w2, scorer.b2), config.hidden)):
        bound = fan_in**-0.5
        for param in params:
            assert param.abs().max() <= bound
            assert param.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.25)
    assert not torch.equal(scorer.w1[0, 0], scorer.w1[0, 1])


def test_save_load_round_trip_is_bit_exact(tmp_path):
    scorer = make_scorer(seed=3, hidden=7, budget=64, interval=16)
    scorer.save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors"} <= {p.name for p in tmp_path.iterdir()}
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved == {
        "num_layers": 3,
        "num_query_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "budget": 64,
        "interval": 16,
        "base_model": "tiny-llama",
        "hidden": 7,
        "feature_set": "official-8",
        "stage": "supervised",
        "started_from": None,
        "training_sources": [],
        "key_values": True,
        "regime": "streaming",
        "scale": "ordinal",
        "residual": None,
        "sums_dtype": "float32",
    }
    loaded = ForesightScorer.from_pretrained(tmp_path)
    assert loaded.config == scorer.config
    assert loaded.state_dict().keys() == scorer.state_dict().keys()
    for name, tensor in scorer.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    keys, values, features = random_inputs(scorer.config, 3, 2)
    assert torch.equal(loaded(keys, values, features), scorer(keys, values, features))
    assert torch.equal(
        loaded.score_layer(1, keys[1], values[1], features[1]), scorer.score_layer(1, keys[1], values[1], features[1])
    )


def test_a_config_without_a_stage_is_a_supervised_scorer(tmp_path):
    """Folders written before scorers recorded their training stage load as the supervised stage."""
    scorer = make_scorer(stage="reinforcement", started_from="runs/fit/scorer")
    scorer.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["stage"], saved["started_from"]) == ("reinforcement", "runs/fit/scorer")
    del saved["stage"], saved["started_from"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert ForesightScorer.from_pretrained(tmp_path).config.stage == "supervised"


def test_loading_is_strict(tmp_path):
    scorer = make_scorer()
    scorer.save_pretrained(tmp_path)
    weights = safetensors.torch.load_file(tmp_path / "model.safetensors")
    del weights["b2"]
    safetensors.torch.save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"does not hold the weights of the scorer its config.json describes \(.*b2"):
        ForesightScorer.from_pretrained(tmp_path)


def test_check_compatible_names_both_shapes():
    scorer = make_scorer()
    scorer.check_compatible(SimpleNamespace(num_layers=3, num_query_heads=4, num_kv_heads=2, head_dim=8))
    other = SimpleNamespace(num_layers=30, num_query_heads=9, num_kv_heads=3, head_dim=64)
    with pytest.raises(ValueError) as error:
        scorer.check_compatible(other)
    message = str(error.value)
    assert "\n" not in message
    assert "tiny-llama (layers=3, query heads=4, KV heads=2, head dim=8)" in message
    assert "(layers=30, query heads=9, KV heads=3, head dim=64)" in message


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_query_heads": 5}, "num_query_heads=5 is not a multiple of num_kv_heads=2"),
        ({"budget": 4}, "budget B=4 must be larger than the interval L=4"),
        ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
        ({"feature_set": "h2o"}, "unknown feature set 'h2o'"),
        ({"stage": "grpo"}, "stage must be one of 'supervised', 'reinforcement', got 'grpo'"),
        ({"key_values": "no"}, "key_values must be true or false, got 'no'"),
    ],
)
def test_bad_config_raises(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_config(**overrides)


def test_bad_inputs_raise():
    scorer = make_scorer()
    keys, values, features = random_inputs(scorer.config, 2)
    with pytest.raises(ValueError, match=r"features must be .*last dim 16, got shape \(2, 2, 5, 12\)"):
        scorer.score_layer(0, keys, values, features[..., :12])
    with pytest.raises(ValueError, match="layer 3 out of range"):
        scorer.score_layer(3, keys, values, features)
    with pytest.raises(ValueError, match="expected 3 layers on dim 0, got 2"):
        scorer(*random_inputs(scorer.config, 2, 1))


def test_low_precision_inputs_are_scored_in_parameter_dtype():
    scorer = make_scorer()
    keys, values, features = random_inputs(scorer.config, 2)
    half = scorer.score_layer(0, keys.bfloat16(), values.bfloat16(), features)
    assert half.dtype == torch.float32
    assert torch.equal(half, scorer.score_layer(0, keys.bfloat16().float(), values.bfloat16().float(), features))


# -- eviction (Eq. 2) --------------------------------------------------------------------------------


def lowest_reference(scores, num_evict, eligible=None):
    """Per row, in python: eligible candidates sorted by score, the first num_evict."""
    rows = scores.reshape(-1, scores.shape[-1])
    allowed = torch.ones_like(scores, dtype=torch.bool) if eligible is None else eligible.expand_as(scores)
    allowed = allowed.reshape(rows.shape)
    picked = []
    for r in range(rows.shape[0]):
        candidates = [i for i in range(rows.shape[1]) if allowed[r, i]]
        picked.append(sorted(candidates, key=lambda i: float(rows[r, i]))[:num_evict])
    return torch.tensor(picked).view(*scores.shape[:-1], num_evict)


def sequential_logprob(scores, pool, order, eligible=None):
    """Draw by draw: log softmax of the negated score over the pool entries still available."""
    result = torch.zeros(scores.shape[:-1], dtype=torch.float64)
    for index in itertools.product(*map(range, scores.shape[:-1])):
        available = [int(i) for i in pool[index] if eligible is None or eligible[index][int(i)]]
        total = 0.0
        for chosen in order[index].tolist():
            logits = torch.tensor([-float(scores[index][i]) for i in available], dtype=torch.float64)
            total += -float(scores[index][chosen]) - float(logits.logsumexp(0))
            available.remove(chosen)
        result[index] = total
    return result


def test_evict_lowest_matches_sort_reference():
    scores = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(evict_lowest(scores, 3), lowest_reference(scores, 3))
    assert torch.equal(eviction_pool(scores, 3), lowest_reference(scores, 6))
    assert torch.equal(eviction_pool(scores, 7), lowest_reference(scores, 10))  # pool clamps to C


def test_evict_lowest_respects_eligibility():
    scores = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(1))
    sinks = torch.arange(10) >= 2  # first two candidates are sinks, broadcast to every row
    per_row = torch.rand(3, 4, 10, generator=torch.Generator().manual_seed(2)) > 0.3
    per_row[..., :4] = True
    for eligible in (sinks, per_row):
        evicted = evict_lowest(scores, 3, eligible)
        assert torch.equal(evicted, lowest_reference(scores, 3, eligible))
        assert eligible.expand_as(scores).gather(-1, evicted).all()


def test_eviction_request_errors():
    scores = torch.randn(2, 5)
    with pytest.raises(ValueError, match="num_evict must be in 1..5 .* got 6"):
        evict_lowest(scores, 6)
    with pytest.raises(ValueError, match="a row has fewer eligible candidates than num_evict=2"):
        sample_eviction(scores, 2, eligible=torch.tensor([True, False, False, False, False]))
    with pytest.raises(ValueError, match=r"eligible mask \(3,\) does not broadcast to scores \(2, 5\)"):
        evict_lowest(scores, 2, eligible=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="order must hold distinct candidates that all lie in the pool"):
        plackett_luce_logprob(scores, torch.tensor([[0, 1], [0, 1]]), torch.tensor([[0, 2], [1, 0]]))


def test_logprob_matches_sequential_reference():
    scores = torch.randn(2, 3, 9, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    eligible = torch.rand(2, 3, 9, generator=torch.Generator().manual_seed(4)) > 0.2
    eligible[..., :5] = True
    for mask in (None, eligible):
        order, logprob = sample_eviction(scores, 3, torch.Generator().manual_seed(5), eligible=mask)
        pool = eviction_pool(scores, 3, mask)
        expected = sequential_logprob(scores, pool, order, mask)
        torch.testing.assert_close(logprob, expected, rtol=0, atol=1e-10)
        torch.testing.assert_close(plackett_luce_logprob(scores, pool, order, mask), expected, rtol=0, atol=1e-10)
        draw = draw_eviction(scores, 3, torch.Generator().manual_seed(5), eligible=mask)  # the same draw, with its pool
        assert torch.equal(draw.pool, pool) and torch.equal(draw.order, order) and torch.equal(draw.logprob, logprob)
        assert torch.equal(pool.gather(-1, draw.picks), order)


def test_a_guided_eviction_evicts_what_the_guide_drops_first_within_the_pool():
    """By a loop: the pool's eligible entries sorted by (kept by the guide, score), the first L evicted; its
    log-probability is the sequential Plackett-Luce one of that order; an ineligible slot is never evicted."""
    generator = torch.Generator().manual_seed(8)
    scores = torch.randn(3, 4, 10, generator=generator, dtype=torch.float64)
    keeps = torch.rand(3, 4, 10, generator=generator) > 0.5
    eligible = torch.rand(3, 4, 10, generator=generator) > 0.15
    eligible[..., :6] = True
    for mask in (None, eligible):
        draw = guided_eviction(scores, 3, keeps, mask, temperature=0.5)
        pool = eviction_pool(scores, 3, mask)
        assert torch.equal(draw.pool, pool) and torch.equal(pool.gather(-1, draw.picks), draw.order)
        for row in itertools.product(range(3), range(4)):
            members = [int(c) for c in pool[row] if mask is None or bool(mask[row][c])]
            expected = sorted(members, key=lambda c: (bool(keeps[row][c]), float(scores[row][c])))[:3]
            assert draw.order[row].tolist() == expected, row
        torch.testing.assert_close(
            draw.logprob, sequential_logprob(scores / 0.5, pool, draw.order, mask), rtol=0, atol=1e-10
        )


@pytest.mark.parametrize(
    "scores, eligible",
    [
        ([0.3, -0.5, 1.2, 0.0], None),  # pool = all four
        ([0.3, -0.5, 1.2, 0.0, 2.0, 0.7], None),  # pool = the four lowest of six
        ([0.3, -0.5, 1.2, 0.0, -2.0], [True, True, True, True, False]),  # lowest is a sink
        ([0.3, -0.5, 1.2, 0.0], [True, False, True, True]),  # pool holds an ineligible entry
    ],
)
def test_orderings_sum_to_one_and_sampling_frequencies_match(scores, eligible):
    scores = torch.tensor(scores)
    eligible = None if eligible is None else torch.tensor(eligible)
    candidates, num_evict = scores.shape[0], 2
    pool = eviction_pool(scores, num_evict, eligible)
    pairs = torch.tensor(list(itertools.permutations(range(candidates), num_evict)))
    in_pool = torch.isin(pairs, pool).all(-1)
    allowed = in_pool if eligible is None else in_pool & eligible[pairs].all(-1)
    pairs = pairs[allowed]
    probability = plackett_luce_logprob(
        scores.expand(len(pairs), -1), pool.expand(len(pairs), -1), pairs, eligible
    ).exp()
    assert probability.sum().item() == pytest.approx(1.0, abs=1e-6)

    draws = 20000
    order, _ = sample_eviction(scores.expand(draws, -1), num_evict, torch.Generator().manual_seed(0), eligible)
    codes = order[:, 0] * candidates + order[:, 1]
    assert torch.isin(codes, pairs[:, 0] * candidates + pairs[:, 1]).all(), "sampled outside the pool or a sink"
    counts = torch.stack([(codes == a * candidates + b).sum() for a, b in pairs.tolist()]).double()
    expected = draws * probability.double()
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 3 * len(pairs) + 10  # df = len(pairs) - 1 <= 11: fails only at p-values below ~1e-3


def test_sampled_logprob_is_that_of_the_sampled_order():
    scores = torch.randn(64, 6, generator=torch.Generator().manual_seed(6))
    order, logprob = sample_eviction(scores, 2, torch.Generator().manual_seed(7))
    expected = sequential_logprob(scores, eviction_pool(scores, 2), order)
    torch.testing.assert_close(logprob.double(), expected, rtol=0, atol=1e-5)


def test_temperature_divides_the_scores_of_the_draw_and_its_logprob():
    scores, tau = torch.randn(64, 6, generator=torch.Generator().manual_seed(6), dtype=torch.float64), 0.3
    order, logprob = sample_eviction(scores, 2, torch.Generator().manual_seed(7), temperature=tau)
    divided_order, divided_logprob = sample_eviction(scores / tau, 2, torch.Generator().manual_seed(7))
    assert torch.equal(order, divided_order)
    expected = sequential_logprob(scores / tau, eviction_pool(scores, 2), order)
    torch.testing.assert_close(logprob, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(divided_logprob, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(
        plackett_luce_logprob(scores, eviction_pool(scores, 2), order, temperature=tau), expected, rtol=0, atol=1e-10
    )


def test_sampling_is_reproducible_with_a_generator():
    scores = torch.randn(4, 3, 20)
    first = sample_eviction(scores, 5, torch.Generator().manual_seed(11))
    second = sample_eviction(scores, 5, torch.Generator().manual_seed(11))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("candidates, num_evict", [(8, 3), (3, 3)])  # (3, 3): every pool entry is drawn
def test_logprob_gradient_flows_to_pool_only(candidates, num_evict):
    scores = torch.randn(2, candidates, generator=torch.Generator().manual_seed(8), requires_grad=True)
    order, _ = sample_eviction(scores.detach(), num_evict, torch.Generator().manual_seed(9))
    pool = eviction_pool(scores.detach(), num_evict)
    plackett_luce_logprob(scores, pool, order).sum().backward()
    assert torch.isfinite(scores.grad).all()
    outside = torch.ones_like(scores, dtype=torch.bool).scatter(-1, pool, False)
    assert (scores.grad[outside] == 0).all()
    if candidates > num_evict:
        assert (scores.grad[~outside] != 0).any()
