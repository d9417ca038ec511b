"""LagKV, LazyEviction, RaaS and EpiKV against slow loop-based twins, step-by-step replays, and in the engine."""

from __future__ import annotations

import pytest
import torch

import foresight.runtime.capture as capture
import foresight.runtime.policy as policy_base
from foresight.models import tiny_model
from foresight.policies import EvictionContext, make_policy
from foresight.policies.epikv import band_layers, rolling_z_scores
from foresight.runtime.cache import EvictionLayer
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests import reference_policies as ref
from tests.eviction_steps import KV_HEADS, candidate_positions
from tests.prompts import random_prompts

GROUP, DIM = 2, 8
NEW_POLICIES = ("lagkv", "lazy", "raas", "epikv")


# -- random eviction steps ---------------------------------------------------------------------------
def random_context(candidates: int, interval: int, seed: int, state: dict | None = None) -> EvictionContext:
    """An eviction step as the engine builds it: `candidates` slots (each head its own sorted
    positions, row 1 with invalid slots in front) then the recent window, whose tokens are the
    buffered queries."""
    generator = torch.Generator().manual_seed(seed)
    window_start = 3 * candidates
    recent = torch.arange(window_start, window_start + interval)
    positions = torch.cat(
        [candidate_positions(generator, window_start, candidates), recent.expand(2, KV_HEADS, -1)], dim=-1
    )
    shape = (2, KV_HEADS, candidates + interval, DIM)
    return EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=torch.randn(shape, generator=generator) * 2,
        values=torch.randn(shape, generator=generator),
        positions=positions,
        num_candidates=candidates,
        scaling=DIM**-0.5,
        state=state or {},
        queries=torch.randn(2, KV_HEADS * GROUP, interval, DIM, generator=generator) * 2,
        query_positions=recent.expand(2, -1).clone(),
    )


def with_queries(context: EvictionContext, rows: slice, state: dict) -> EvictionContext:
    """The same step seen by only the buffered queries in `rows` (a decode step is one query)."""
    return EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=context.keys,
        values=context.values,
        positions=context.positions,
        num_candidates=context.num_candidates,
        scaling=context.scaling,
        state=state,
        queries=context.queries[:, :, rows],
        query_positions=context.query_positions[:, rows],
    )


def valid_close(actual: torch.Tensor, expected: list, context: EvictionContext, atol: float = 1e-5) -> None:
    """Compare [batch, Hkv, C] on valid candidates (the engine drops the others whatever they score)."""
    expected = torch.tensor(expected, dtype=torch.float64)
    valid = context.candidate_positions >= 0
    torch.testing.assert_close(actual.double()[valid], expected[valid], atol=atol, rtol=0)


# -- LagKV ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("candidates, interval, lag", [(14, 4, None), (16, 4, None), (13, 5, 3), (9, 3, 1)])
def test_lagkv_matches_reference(candidates, interval, lag):
    fill = {"lagkv_rank": torch.full((2, KV_HEADS, candidates + interval), float("nan"))}
    context = random_context(candidates, interval, seed=candidates + interval, state=fill)
    policy = make_policy("lagkv", lag_size=lag)
    context.state.update(policy.observe(context))
    expected = ref.lagkv(
        context.keys.tolist(), context.values.tolist(), context.positions.tolist(), candidates, lag or interval
    )
    valid_close(policy.keep_scores(context), expected, context, atol=1e-6)


def test_lagkv_scores_are_frozen_and_steady_state_scores_the_newest_chunk():
    """Scored entries keep their score; the L entries that just left the recent window are scored
    against the recent window, exactly as when every candidate is new."""
    candidates, interval = 12, 4
    unscored = {"lagkv_rank": torch.full((2, KV_HEADS, candidates + interval), float("nan"))}
    context = random_context(candidates, interval, seed=5, state=unscored)
    policy = make_policy("lagkv")
    fresh = policy.observe(context)["lagkv_rank"]
    frozen = torch.rand(2, KV_HEADS, candidates + interval)
    frozen[..., candidates - interval :] = float("nan")
    context.state = {"lagkv_rank": frozen.clone()}
    steady = policy.observe(context)["lagkv_rank"]
    old = slice(0, candidates - interval)
    assert torch.equal(steady[..., old], frozen[..., old])
    newest = slice(candidates - interval, candidates)
    assert torch.equal(steady[..., newest], fresh[..., newest])


def test_lagkv_constant_channel_gives_no_nan():
    context = random_context(12, 4, seed=3, state={"lagkv_rank": torch.full((2, KV_HEADS, 16), float("nan"))})
    context.keys[..., 0] = 1.5  # a channel constant everywhere
    context.values[..., :] = 0.25  # every value channel constant
    scores = make_policy("lagkv").observe(context)["lagkv_rank"][..., :12]
    valid = context.candidate_positions >= 0
    assert not scores.isnan().any()
    assert ((scores[valid] >= 0) & (scores[valid] < 1)).all()


def test_lagkv_needs_no_attention_and_rejects_a_lag_beyond_the_interval():
    assert not make_policy("lagkv").needs_attention and make_policy("lagkv").default_sinks == 16
    context = random_context(12, 4, seed=0, state={"lagkv_rank": torch.full((2, KV_HEADS, 16), float("nan"))})
    with pytest.raises(ValueError, match="lag_size=5 must be at most the interval L=4"):
        make_policy("lagkv", lag_size=5).observe(context)


# -- LazyEviction and RaaS -----------------------------------------------------------------------------
def lazy_state(context: EvictionContext, seed: int) -> dict:
    """t_last between 0 and each entry's position - 1 (or its prompt value 0), MRI a few steps."""
    generator = torch.Generator().manual_seed(seed)
    positions = context.positions.clamp(min=0).float()
    t_last = (torch.rand(positions.shape, generator=generator) * positions).floor()
    t_last = torch.where(torch.rand(positions.shape, generator=generator) < 0.3, torch.zeros_like(t_last), t_last)
    mri = torch.randint(0, 4, positions.shape, generator=generator).float()
    return {"lazy_t_last": t_last, "lazy_mri": mri}


@pytest.mark.parametrize("threshold", [1e-4, 0.05, 0.2])
def test_lazy_matches_reference(threshold):
    context = random_context(14, 6, seed=7)
    context.state = lazy_state(context, seed=1)
    policy = make_policy("lazy", threshold=threshold)
    before = {name: value.tolist() for name, value in context.state.items()}
    context.state.update(policy.observe(context))
    t_last, mri, scores = ref.lazy(context, before["lazy_t_last"], before["lazy_mri"], threshold)
    valid = context.positions >= 0
    for name, expected in (("lazy_t_last", t_last), ("lazy_mri", mri)):
        torch.testing.assert_close(context.state[name][valid], torch.tensor(expected)[valid], atol=0, rtol=0)
    valid_close(policy.keep_scores(context), [[h[:14] for h in b] for b in scores], context)


def test_lazy_hand_computed_score():
    """At step 10: t_last = 5, MRI = 3 gives H1 = 2 sigma(-(1 + 5/3)) and H2 = 2 sigma(-2); an entry
    never seen again (MRI 0) gets H2 = 0; one seen right now gets H1 = 2 sigma(-1)."""
    context = EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=torch.zeros(1, 1, 4, DIM),
        values=torch.zeros(1, 1, 4, DIM),
        positions=torch.tensor([[[1, 8, 9, 10]]]),
        num_candidates=3,
        scaling=1.0,
        state={"lazy_t_last": torch.tensor([[[5.0, 9.0, 10.0, 10.0]]]), "lazy_mri": torch.tensor([[[3.0, 0, 0, 0]]])},
    )
    expected = [
        2 * ref.sigmoid(-(1 + 5 / (3 + 1e-5))) + 2 * ref.sigmoid(-2),
        2 * ref.sigmoid(-(1 + 1 / 1e-5)),
        2 * ref.sigmoid(-1),
    ]
    scores = make_policy("lazy").keep_scores(context)[0, 0]
    torch.testing.assert_close(scores.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("threshold", [1e-4, 0.05, 0.2])
def test_raas_matches_reference(threshold):
    context = random_context(14, 6, seed=8)
    stored = torch.where(torch.rand(context.positions.shape) < 0.5, context.positions + 2.0, float("-inf"))
    context.state = {"raas_timestamp": stored}
    policy = make_policy("raas", threshold=threshold)
    expected = ref.raas(context, stored.tolist(), threshold)
    context.state.update(policy.observe(context))
    valid_close(policy.keep_scores(context), [[h[:14] for h in b] for b in expected], context, atol=0)
    assert policy.default_protect_prompt and policy.needs_attention


@pytest.mark.parametrize("name, threshold", [("lazy", 0.05), ("lazy", 1e-4), ("raas", 0.05)])
def test_block_replay_equals_one_decode_step_at_a_time(name, threshold):
    """Observing the L buffered queries at once leaves the state that observing each decode step
    (one query) in order leaves."""
    interval = 6
    context = random_context(14, interval, seed=11)
    policy = make_policy(name, threshold=threshold)
    start = (
        lazy_state(context, seed=2)
        if name == "lazy"
        else {"raas_timestamp": torch.full(context.positions.shape, float("-inf"))}
    )
    block = policy.observe(with_queries(context, slice(None), dict(start)))
    state = dict(start)
    for q in range(interval):
        state.update(policy.observe(with_queries(context, slice(q, q + 1), state)))
    for field, value in block.items():
        torch.testing.assert_close(value, state[field], atol=0, rtol=0)
    if name == "lazy":
        assert (block["lazy_mri"] > start["lazy_mri"]).any(), "the block should lengthen some recurrence intervals"


def test_lazy_stamps_prompt_entries_zero_and_new_entries_their_position_minus_one():
    policy = make_policy("lazy")
    policy.reset()
    prompt = policy.on_forward({}, torch.tensor([[-1, 0, 1], [0, 1, 2]]))["lazy_t_last"]
    decode = policy.on_forward({}, torch.tensor([[2], [3]]))["lazy_t_last"]
    assert prompt.tolist() == [[0, 0, 0], [0, 0, 0]] and decode.tolist() == [[1], [2]]
    policy.reset()
    assert policy.on_forward({}, torch.tensor([[5]]))["lazy_t_last"].tolist() == [[0]]


# -- EpiKV ---------------------------------------------------------------------------------------------
def run_epikv(policy, hidden: dict, positions: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    policy.reset()
    out, start = [], 0
    for size in chunks:
        part = {layer: h[:, start : start + size] for layer, h in hidden.items()}
        out.append(policy.on_forward(part, positions[:, start : start + size])["epikv_score"])
        start += size
    return torch.cat(out, dim=1)


def test_epikv_scores_match_reference_and_do_not_depend_on_chunking():
    generator = torch.Generator().manual_seed(4)
    length, hidden_size, window = 23, 16, 5
    hidden = {layer: torch.randn(2, length, hidden_size, generator=generator) * (1 + layer) for layer in (0, 2)}
    positions = torch.stack([torch.arange(length), torch.arange(length) - 4]).clamp(min=-1)  # row 1 left-padded
    policy = make_policy("epikv", window=window)
    assert policy.tapped_layers(4) == (0, 2)  # hidden states 1 and 3 = decoder layers 0 and 2
    whole = run_epikv(policy, hidden, positions, [length])
    expected = ref.epikv(hidden[0].tolist(), hidden[2].tolist(), positions.tolist(), window)
    torch.testing.assert_close(whole.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-4, rtol=0)
    for chunks in ([1] * length, [9, 1, 1, 7, 5], [4, 19]):
        torch.testing.assert_close(run_epikv(policy, hidden, positions, chunks), whole, atol=1e-5, rtol=0)


def test_rolling_z_score_of_a_constant_or_missing_signal_is_zero():
    values = torch.tensor([[float("nan"), 2.0, 2.0, 2.0]])
    assert rolling_z_scores(values, torch.full((1, 3), float("nan"))).tolist() == [[0.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("layers, bands", [(32, (10, 21)), (30, (9, 20)), (4, (1, 3)), (2, (1, 2))])
def test_epikv_band_layers_scale_with_depth(layers, bands):
    assert band_layers(layers) == bands


def test_epikv_bad_layers_are_one_line():
    with pytest.raises(ValueError, match="at least 2 decoder layers"):
        band_layers(1)
    with pytest.raises(ValueError, match="layer_b=9 must be a hidden-state layer in 1..4"):
        make_policy("epikv", layer_b=9).tapped_layers(4)
    with pytest.raises(ValueError, match="layer_a and layer_b are both 2"):
        make_policy("epikv", layer_a=2, layer_b=2).tapped_layers(4)


def test_epikv_never_computes_attention(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("EpiKV must not compute attention")

    monkeypatch.setattr(capture, "block_attention", forbidden)
    monkeypatch.setattr(policy_base, "block_attention", forbidden)
    monkeypatch.setattr(policy_base, "attention_logits", forbidden)
    monkeypatch.setattr(EvictionLayer, "record_queries", forbidden)  # the query ring buffer stays empty
    engine = EvictionEngine(tiny_model("llama", num_hidden_layers=4), make_policy("epikv"), EvictionConfig(12, 4))
    output = engine.generate([[3, 1, 4, 1, 5]], 30)
    assert output.stats.evictions > 0 and not make_policy("epikv").needs_attention


# -- in the engine -------------------------------------------------------------------------------------
B, L = 16, 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", num_hidden_layers=3)


def config_for(name: str) -> EvictionConfig:
    return EvictionConfig(B, L, sinks=2 if name == "lagkv" else None)


@pytest.mark.parametrize("name", NEW_POLICIES)
def test_engine_batch_decodes_as_each_row_alone_within_budget(model, name):
    batch = random_prompts([4, 9, 15], seed=1)
    policy = make_policy(name)
    engine = EvictionEngine(model, policy, config_for(name))
    together = engine.generate(batch, 40)
    assert together.stats.evictions > 0
    for row, prompt in enumerate(batch):
        alone = engine.generate([prompt], 40)
        assert together.tokens[row] == alone.tokens[0]
        limit = B + L + (len(prompt) if policy.default_protect_prompt else 0)
        assert alone.stats.max_entries == limit  # reached at every eviction step, never passed


@pytest.mark.parametrize("name", NEW_POLICIES)
def test_engine_chunked_replay_equals_token_by_token(model, name):
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, 128, (n,), generator=generator) for n in (50, 70)]
    engine = EvictionEngine(model, make_policy(name), config_for(name))
    chunked = engine.replay(sequences, [7, 30])  # unless protected, row 1's prompt evicts at prefill
    for row, (sequence, prompt_length) in enumerate(zip(sequences, [7, 30])):
        stepwise = engine.replay([sequence], [prompt_length], max_chunk=1)
        torch.testing.assert_close(chunked.nll[row], stepwise.nll[0], atol=1e-4, rtol=0)
        assert chunked.first_eviction[row] == stepwise.first_eviction[0] is not None
