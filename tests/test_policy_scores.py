"""Heuristic policies' keep scores against slow loop-based twins, and each policy in the engine."""

from __future__ import annotations

import pytest
import torch

from foresight.models import tiny_model
from foresight.policies import EvictionContext, make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests import reference_policies as ref
from tests.eviction_steps import (
    BATCH,
    CANDIDATES,
    DIM,
    INTERVAL,
    KV_HEADS,
    SCALING,
    candidate_positions,
    clustered_keys,
    random_context,
    zero_context,
)

TOLERANCE = dict(atol=1e-5, rtol=1e-5)
TENSOR_POLICIES = ("knorm", "streaming", "random", "h2o", "tova", "snapkv", "rkv")


def assert_close_on_valid(actual: torch.Tensor, expected: list, context: EvictionContext) -> None:
    """Compare [batch, Hkv, C] scores on valid candidates only (the engine masks the others)."""
    expected = torch.tensor(expected, dtype=torch.float64)
    valid = context.candidate_positions >= 0
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.double()[valid], expected[valid], **TOLERANCE)


def test_contexts_exercise_the_redundancy_threshold():
    """Guard for the rkv comparison: both similar and dissimilar key pairs occur."""
    keys = random_context(group=2).keys[..., :CANDIDATES, :]
    unit = keys / keys.norm(dim=-1, keepdim=True)
    cosine = unit @ unit.transpose(-1, -2)
    share = (cosine > 0.5).float().mean().item()
    assert 0.1 < share < 0.7


@pytest.mark.parametrize("group", [2, 3])
def test_knorm_matches_reference(group):
    context = random_context(group)
    scores = make_policy("knorm").keep_scores(context)
    expected = ref.knorm(context.keys.tolist(), context.positions.tolist(), CANDIDATES)
    assert_close_on_valid(scores, expected, context)


def test_streaming_matches_reference():
    context = random_context(group=2)
    scores = make_policy("streaming").keep_scores(context)
    assert_close_on_valid(scores, ref.streaming(context.positions.tolist(), CANDIDATES), context)


def test_random_matches_reference():
    context = random_context(group=2)
    context.layer_idx = 3
    scores = make_policy("random", seed=5).keep_scores(context)
    assert_close_on_valid(scores, ref.random(context.positions.tolist(), 3, 5, CANDIDATES), context)


def test_random_is_reproducible_from_its_seed():
    """A score is a fixed function of (seed, layer, KV head, position): the same on every call and
    instance, unchanged when the entry sits in another slot or batch row, different across seeds."""
    context = random_context(group=2)
    first = make_policy("random", seed=5).keep_scores(context)
    torch.testing.assert_close(make_policy("random", seed=5).keep_scores(context), first)
    assert not torch.equal(make_policy("random", seed=6).keep_scores(context), first)
    assert ((first >= 0) & (first < 1)).all()
    shifted = EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=context.keys.flip(0),
        values=context.values.flip(0),
        positions=context.positions.flip(0).roll(1, dims=-1),
        num_candidates=CANDIDATES + 1,
        scaling=SCALING,
    )
    moved = make_policy("random", seed=5).keep_scores(shifted).flip(0)[..., 1:]
    valid = context.candidate_positions >= 0
    torch.testing.assert_close(moved[valid], first[valid])


def test_random_scores_are_uniform():
    scores = make_policy("random").keep_scores(zero_context(20000, 20000, layer_idx=3, num_layers=4))
    shares = torch.histc(scores, bins=10, min=0.0, max=1.0) / scores.numel()
    assert (shares - 0.1).abs().max() < 0.01
    assert not torch.equal(scores[0, 0], scores[0, 1])


@pytest.mark.parametrize("group, query_start", [(2, None), (3, None), (3, 20)])
def test_tova_matches_reference(group, query_start):
    context = random_context(group, query_start=query_start)
    scores = make_policy("tova").keep_scores(context)
    expected = ref.tova(**ref.context_lists(context), candidates=CANDIDATES)
    assert_close_on_valid(scores, expected, context)


@pytest.mark.parametrize("group, query_start", [(2, None), (3, None), (3, 20)])
@pytest.mark.parametrize("window, kernel_size", [(8, 7), (2, 3)])
def test_snapkv_matches_reference(group, query_start, window, kernel_size):
    context = random_context(group, query_start=query_start)
    scores = make_policy("snapkv", window=window, kernel_size=kernel_size).keep_scores(context)
    expected = ref.snapkv(**ref.context_lists(context), candidates=CANDIDATES, window=window, kernel_size=kernel_size)
    assert_close_on_valid(scores, expected, context)


@pytest.mark.parametrize("group, query_start", [(2, None), (3, None), (3, 20)])
@pytest.mark.parametrize("threshold", [0.5, 0.2])
def test_rkv_matches_reference(group, query_start, threshold):
    context = random_context(group, seed=1, query_start=query_start)
    scores = make_policy("rkv", threshold=threshold).keep_scores(context)
    expected = ref.rkv(
        **ref.context_lists(context),
        candidates=CANDIDATES,
        window=8,
        kernel_size=7,
        mix_lambda=0.1,
        threshold=threshold,
    )
    assert_close_on_valid(scores, expected, context)


def test_rkv_redundancy_prefers_the_latest_duplicate():
    """Hand-made case: three identical keys and one orthogonal key. Each copy's row zeroes its
    latest similar copy, so the latest copy keeps the least similarity and the lowest R."""
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])[None, None]
    context = EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=keys,
        values=keys,
        positions=torch.arange(4)[None, None],
        num_candidates=4,
        scaling=1.0,
    )
    # Copies sit in slots 0, 1 and 3: rows 0 and 1 drop slot 3, row 3 drops slot 1.
    column_means = torch.tensor([2.0, 1.0, 0.0, 0.0]) / 4
    expected = torch.softmax(column_means, dim=0)
    torch.testing.assert_close(make_policy("rkv").redundancy(context)[0, 0], expected)


@pytest.mark.parametrize("group", [2, 3])
def test_h2o_accumulates_like_reference_over_steps(group):
    """Three consecutive eviction steps: the vectorised state (observe, evict by gather, append)
    against per-position sums of loop-computed block attention."""
    window_start, steps = 40, 3
    generator = torch.Generator().manual_seed(3)
    total = window_start + (steps + 1) * INTERVAL
    key_bank = clustered_keys(generator, total)  # key of each position, per head
    query_bank = torch.randn(BATCH, KV_HEADS * group, total, DIM, generator=generator) * 1.5
    positions = torch.cat(
        [
            candidate_positions(generator, window_start, CANDIDATES),
            torch.arange(window_start, window_start + INTERVAL).expand(BATCH, KV_HEADS, -1),
        ],
        dim=-1,
    )
    policy = make_policy("h2o")
    state = torch.zeros(positions.shape)
    cumulative: dict[tuple[int, int, int], float] = {}
    for step in range(steps):
        start = window_start + step * INTERVAL
        keys = key_bank.gather(2, positions.clamp(min=0)[..., None].expand(-1, -1, -1, DIM))
        context = EvictionContext(
            layer_idx=0,
            num_layers=1,
            keys=keys,
            values=keys,
            positions=positions,
            num_candidates=CANDIDATES,
            scaling=SCALING,
            state={"cumulative": state},
            queries=query_bank[:, :, start : start + INTERVAL],
            query_positions=torch.arange(start, start + INTERVAL).expand(BATCH, -1),
        )
        state = policy.observe(context)["cumulative"]
        context.state["cumulative"] = state
        scores = policy.keep_scores(context)

        data = ref.context_lists(context)
        received = ref.block_received(**data)
        for b, row in enumerate(data["positions"]):
            for h, head in enumerate(row):
                for n, position in enumerate(head):
                    if position >= 0:
                        cumulative[b, h, position] = cumulative.get((b, h, position), 0.0) + received[b][h][n]
        expected = [
            [[cumulative.get((b, h, p), ref.NAN) for p in head[:CANDIDATES]] for h, head in enumerate(row)]
            for b, row in enumerate(data["positions"])
        ]
        assert_close_on_valid(scores, expected, context)

        # Evict: keep the top C - L valid candidates (in position order), then append L new tokens.
        ranked = scores.masked_fill(context.candidate_positions < 0, float("-inf"))
        kept = ranked.argsort(dim=-1, descending=True, stable=True)[..., : CANDIDATES - INTERVAL].sort().values
        arrivals = torch.arange(start + INTERVAL, start + 2 * INTERVAL).expand(BATCH, KV_HEADS, -1)
        positions = torch.cat([positions.gather(2, kept), positions[..., CANDIDATES:], arrivals], dim=-1)
        state = torch.cat([state.gather(2, kept), state[..., CANDIDATES:], torch.zeros(arrivals.shape)], dim=-1)


# -- in the engine ----------------------------------------------------------------------------------
BUDGET, ENGINE_INTERVAL, NEW_TOKENS = 12, 4, 28
PROMPTS = ([5, 9, 17, 33, 65, 70, 100, 7], [11, 12, 13])


def generate(policy, prompts=PROMPTS):
    engine = EvictionEngine(tiny_model("llama"), policy, EvictionConfig(budget=BUDGET, interval=ENGINE_INTERVAL))
    return engine.generate([list(p) for p in prompts], max_new_tokens=NEW_TOKENS)


def record_positions(policy) -> list[torch.Tensor]:
    """Wrap the policy's keep_scores to record the entry positions of every eviction step."""
    seen, keep_scores = [], policy.keep_scores

    def recording(context: EvictionContext) -> torch.Tensor:
        seen.append(context.positions.clone())
        return keep_scores(context)

    policy.keep_scores = recording
    return seen


@pytest.mark.parametrize("name", TENSOR_POLICIES)
def test_policy_runs_in_engine_within_budget(name):
    """Batched greedy generation with left padding: the cache peaks at exactly B + L, the policy
    evicts, and each row decodes as it does alone (padding never changes a valid entry's score)."""
    output = generate(make_policy(name))
    assert output.stats.max_entries == BUDGET + ENGINE_INTERVAL
    assert output.stats.evictions >= (len(PROMPTS[1]) + NEW_TOKENS - BUDGET) // ENGINE_INTERVAL
    assert [len(t) for t in output.tokens] == [NEW_TOKENS] * len(PROMPTS)
    for prompt, tokens in zip(PROMPTS, output.tokens):
        assert generate(make_policy(name), prompts=(prompt,)).tokens[0] == tokens


@pytest.mark.parametrize("name, shared", [("tova", True), ("snapkv", False)])
def test_tova_keeps_one_set_per_layer(name, shared):
    """Kept sets show up as the entry positions of the next eviction step: identical across KV
    heads for tova; snapkv (per-head scores) is the control that the check can tell them apart."""
    policy = make_policy(name)
    seen = record_positions(policy)
    generate(policy, prompts=PROMPTS[:1])
    assert len(seen) > 4
    same = [bool((positions == positions[:, :1]).all()) for positions in seen]
    assert all(same) if shared else not all(same)
