"""The learned policy on the pooled layout (foresight.runtime.pool), reading the window's queries at each step or
streaming them: its per-entry state rides in the pool's slots, is gathered into each head's view at a step (or a
streamed block) and written back. At allocation 'head' it is the per-head layout's twin; at allocation 'layer' a
calibrated scorer's steps keep what AdaKV's loop twin keeps over its scores; what the pool does not run of it is
refused in one line."""

from __future__ import annotations

import pytest
import torch

from foresight.cadence import Regime, regime_shift
from foresight.models import describe
from foresight.policies import make_policy
from foresight.runtime.cache import OWNERS, EvictionCache
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.held_memory import held_bytes
from foresight.runtime.pool import OwnerView
from tests.pooled_runs import (
    PROMPTS,
    B,
    L,
    assert_generates_alike,
    assert_keeps_adakvs_rule,
    assert_replays_alike,
    observed_engine,
    recording,
    sequences,
)
from tests.scorers import random_scorer

REGIME_PROMPTS = {Regime.STREAMING: PROMPTS, Regime.DECODE: [23, 30]}  # the decode regime's prompts pass B + L
OBSERVED = [("standardised", "window"), ("standardised-grouped", "window"), ("paper", "window")]
OBSERVED += [("standardised", "stream"), ("standardised-grouped", "stream")]
"""(feature set, observation): state per query head, per KV head (no trailing dim) and the older sets' sums, read at
the step; the standardised sets' streamed, their window sums in the state too."""


def learned(model, feature_set: str = "standardised", scale: str = "ordinal", **options):
    """The learned policy with a random scorer of `model` at (B, L) (its default observation streams)."""
    scorer = random_scorer(model, B, L, feature_set=feature_set, scale=scale)
    return make_policy("foresight", scorer=scorer, **options)


def state_by_head(cache: EvictionCache) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each state field as each (layer, row, KV head) holds it, in either layout: (positions [layers, rows, H, W], -1
    in front of a head's entries, and the state [layers, rows, H, W, *trailing], 0 there), the pool's gathered
    through a fresh `OwnerView`."""
    positions = torch.stack([layer.entry_positions() for layer in cache.layers])
    view = None
    if cache.slots_per_token > 1:
        view = OwnerView.of(cache.stacked(OWNERS), positions, cache.slots_per_token)
        positions = view.gather(positions).masked_fill(~view.held, -1)
    held = {}
    for field in cache.layers[0].state_fields:
        state = cache.stacked(field.name) if view is None else view.gather(cache.stacked(field.name))
        valid = (positions >= 0).view(*positions.shape, *(1,) * (state.dim() - positions.dim()))
        held[field.name] = (positions, state.masked_fill(~valid, 0))
    return held


@pytest.mark.parametrize(("feature_set", "observation"), OBSERVED)
@pytest.mark.parametrize("regime", list(Regime))
def test_allocation_head_replays_as_the_per_head_layout(llama, regime, feature_set, observation):
    """`assert_replays_alike` in either regime (the decode regime's prompts compress at their prefill), for each kind
    of state and observation."""
    prompts = REGIME_PROMPTS[regime]
    assert all((regime_shift(length, B, L, regime) > 0) == (regime is Regime.DECODE) for length in prompts)
    assert learned(llama, feature_set, observation=observation).observed_queries.value == observation
    assert_replays_alike(llama, lambda: learned(llama, feature_set, observation=observation), prompts)


@pytest.mark.parametrize("observation", ["window", "stream"])
def test_allocation_head_generates_as_the_per_head_layout(llama, observation):
    assert_generates_alike(llama, lambda: learned(llama, observation=observation))


@pytest.mark.parametrize(("feature_set", "observation"), OBSERVED)
def test_the_state_written_back_to_the_pool_is_the_per_head_runs(llama, feature_set, observation):
    """After every step, each state field of the pool gathered through a fresh view holds, at the positions each head
    holds, what the per-head run holds there (float32: the keys differ by the pool's rounding of attention)."""
    runs = []
    for layout in ("heads", "pooled"):
        config = EvictionConfig(B, L, layout=layout)
        policy = learned(llama, feature_set, observation=observation)
        engine, steps = observed_engine(llama, policy, config, read=state_by_head)
        engine.replay(sequences(llama.config.vocab_size), PROMPTS)
        runs.append(steps.held)
    heads, pooled = runs
    assert len(heads) == len(pooled) >= 10
    assert set(pooled[0]) == {field.name for field in policy.state_fields}
    for per_head, pool in zip(heads, pooled, strict=True):
        assert any(state.abs().amax() > 0 for _, state in pool.values())  # a step resets the streamed window sums
        for name, (positions, state) in pool.items():
            head_positions, head_state = per_head[name]
            width = positions.shape[3]  # the fullest head's; the per-head cache holds its rows' invalid slots too
            assert (head_positions[..., :-width] < 0).all() and (positions >= 0).any()
            assert torch.equal(positions, head_positions[..., -width:])
            torch.testing.assert_close(state, head_state[:, :, :, -width:])


@pytest.mark.parametrize("observation", ["window", "stream"])
@pytest.mark.parametrize("regime", list(Regime))
def test_allocation_layer_keeps_what_a_loop_of_adakvs_rule_keeps(llama, regime, observation):
    """A calibrated scorer (scale 'log-target') at allocation 'layer': at every step each head keeps its floor of
    best-scored candidates and the layer its best of the rest, as `pooled_keep` loops it over the scorer's keep
    scores, and the heads keep different counts."""
    floor = 2
    options = learned(llama, scale="log-target", observation=observation).options()
    policy, scored = recording("foresight", **options)
    assert policy.scores_compare_across_heads
    engine, steps = observed_engine(
        llama, policy, EvictionConfig(B, L, layout="pooled", allocation="layer", floor=floor)
    )
    engine.replay(sequences(llama.config.vocab_size), REGIME_PROMPTS[regime])
    assert len(assert_keeps_adakvs_rule(scored, steps.held, floor, llama.config.num_key_value_heads)) > 1


REFUSALS = [
    (
        dict(allocation="layer"),
        dict(),
        "allocation='layer' ranks keep scores across a layer's heads, and the scorer's scale is 'ordinal', which ranks "
        "within a head only; allowed: snapkv, streaming, tova with per_kv_head=True, foresight with a scorer of scale "
        "'log-target'",
    ),
    (
        dict(),
        dict(mode="sampled"),
        "layout='pooled' does not run policy 'foresight' in mode 'sampled' yet; give mode='deterministic'",
    ),
]


@pytest.mark.parametrize(("config", "options", "message"), REFUSALS)
def test_what_the_pool_does_not_run_of_the_learned_policy_is_refused_in_one_line(llama, config, options, message):
    policy = learned(llama, **options)
    with pytest.raises(ValueError) as refused:
        EvictionEngine(llama, policy, EvictionConfig(B, L, layout="pooled", **config))
    assert str(refused.value) == message and "\n" not in message
    if not config:  # the accounting refuses what the runtime does not run
        with pytest.raises(ValueError, match="^layout='pooled' does not run policy 'foresight' "):
            held_bytes(describe(llama), policy, B, L, torch.float32, layout="pooled")
