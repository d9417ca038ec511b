"""The pooled layout (foresight.runtime.pool): one slot pool per layer whose slots are tagged with their KV head.
At allocation 'head' it is the per-head layout's twin (same token losses, same kept positions per layer and head
after every step, in replay and in generation); at allocation 'layer' every step keeps what AdaKV's rule keeps by
a slow loop over the policy's own scores, and the token losses of the study's masked replay of the same rule
(studies/pooled_golden/bound.py); what it does not run yet is refused in one line."""

from __future__ import annotations

import pytest
import torch

from foresight.cadence import Regime, eviction_steps, regime_prefill, regime_shift
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.prefix import ReplayPrefix
from studies.pooled_golden.bound import HeuristicSchedule, Pool, masked_replay
from tests.pooled_runs import (
    PROMPTS,
    B,
    L,
    assert_generates_alike,
    assert_keeps_adakvs_rule,
    assert_replays_alike,
    held_by_head,
    observed_engine,
    recording,
    sequences,
)
from tests.rl_runs import L_, random_trace
from tests.rl_runs import B as TRACE_B

WINDOW_HEURISTICS = [("snapkv", {}), ("tova", {}), ("streaming", {})]


@pytest.mark.parametrize(("name", "options"), WINDOW_HEURISTICS)
def test_allocation_head_replays_as_the_per_head_layout(llama, name, options):
    assert_replays_alike(llama, lambda: make_policy(name, **options))


@pytest.mark.parametrize(("name", "options"), WINDOW_HEURISTICS)
def test_allocation_head_generates_as_the_per_head_layout(llama, name, options):
    assert_generates_alike(llama, lambda: make_policy(name, **options))


def test_a_prefix_recorded_in_one_layout_serves_the_other(llama):
    """A recorded forward holds each KV head's new keys and values, whichever layout recorded it: replays that inject
    it give the token losses of replays that run the model."""
    ids = sequences(llama.config.vocab_size)
    for recorder, injector in (("heads", "pooled"), ("pooled", "heads")):
        prefix = ReplayPrefix()
        EvictionEngine(llama, make_policy("snapkv"), EvictionConfig(B, L, layout=recorder)).replay(
            ids, PROMPTS, prefix=prefix
        )
        assert prefix.forwards
        injected, ran = (
            EvictionEngine(llama, make_policy("snapkv"), EvictionConfig(B, L, layout=injector)).replay(
                ids, PROMPTS, prefix=p
            )
            for p in (prefix, None)
        )
        for ours, theirs in zip(injected.nll, ran.nll, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_rows_copied_mid_replay_continue_as_those_rows_run_through(llama):
    """A pooled replay at allocation 'layer' paused before step 4, its rows copied in the other order, then run on:
    each copied row holds what the row run through holds (owners included) and gives its token losses."""
    ids, config = sequences(llama.config.vocab_size), EvictionConfig(B, L, layout="pooled", allocation="layer", floor=2)
    engine = EvictionEngine(llama, make_policy("snapkv"), config)
    replay = engine.advance(engine.start_replay(ids, PROMPTS), stop_before_step=4)
    forked = engine.advance(replay.select_rows([1, 0])).output()
    forked_held = held_by_head(engine.last_cache)
    through = engine.replay(ids[::-1], PROMPTS[::-1])
    assert forked_held == held_by_head(engine.last_cache) and forked.stats.evictions == through.stats.evictions
    for ours, theirs in zip(forked.nll, through.nll, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("name", "options"), [("snapkv", {}), ("tova", {"per_kv_head": True})])
def test_allocation_layer_keeps_what_a_loop_of_adakvs_rule_keeps(llama, name, options):
    """At every step, in every layer and evicting row: each head keeps its floor of best-scored candidates and the
    layer its H·(B - L - floor) best of the rest, as `pooled_keep` loops it over the same scores; so every head
    keeps at least the floor and the layer H·(B - L) candidates, and the heads do keep different counts."""
    floor = 2
    policy, scored = recording(name, **options)
    config = EvictionConfig(B, L, layout="pooled", allocation="layer", floor=floor)
    engine, steps = observed_engine(llama, policy, config)
    engine.replay(sequences(llama.config.vocab_size), PROMPTS)
    assert len(assert_keeps_adakvs_rule(scored, steps.held, floor, llama.config.num_key_value_heads)) > 1


@pytest.mark.parametrize(("name", "options"), [("snapkv", {}), ("tova", {"per_kv_head": True})])
@pytest.mark.parametrize("regime", list(Regime))
def test_allocation_layer_gives_the_masked_replays_token_losses(llama, regime, name, options):
    """The engine's pooled replay at allocation 'layer' against the study's masked replay of AdaKV's allocation over
    the same heuristic (full-cache forwards, each head's attention masked to its kept set): the same token losses
    (float32, other kernels: 1e-4) after the same first eviction."""
    trace = random_trace(llama, 90, prompt=30, seed=3)
    shift = regime_shift(30, TRACE_B, L_, regime)
    steps = eviction_steps(90, TRACE_B, L_, shift)
    schedule = HeuristicSchedule(TRACE_B, L_, steps, Pool.LAYER, floor=2, shift=shift, heuristic=name)
    nll, _ = masked_replay(llama, trace.input_ids, schedule, L_)
    config = EvictionConfig(TRACE_B, L_, layout="pooled", allocation="layer", floor=2)
    replayed = EvictionEngine(llama, make_policy(name, **options), config).replay(
        [trace.input_ids], [regime_prefill(30, TRACE_B, L_, regime)]
    )
    first = replayed.first_eviction[0]
    assert first == schedule.positions[0] + 1
    torch.testing.assert_close(nll[first:], replayed.nll[0][first:].float(), rtol=1e-4, atol=1e-4)


REFUSALS = [
    (dict(layout="pool"), "snapkv", {}, "unknown layout 'pool'; allowed: 'heads', 'pooled'"),
    (dict(layout="pooled", allocation="model"), "snapkv", {}, "unknown allocation 'model'; allowed: 'head', 'layer'"),
    (
        dict(allocation="layer"),
        "snapkv",
        {},
        "allocation='layer' needs layout='pooled': layout='heads' holds B - L = 8",
    ),
    (dict(layout="pooled", allocation="layer", floor=0), "snapkv", {}, "floor=0 must be 1..B - L = 8"),
    (dict(layout="pooled", allocation="layer", floor=9), "snapkv", {}, "floor=9 must be 1..B - L = 8"),
    (
        dict(layout="pooled", floor=2),
        "snapkv",
        {},
        "floor=2 is allocation 'layer''s; allocation 'head' keeps B - L = 8",
    ),
    (dict(layout="pooled", sinks=9), "streaming", {}, "sinks=9 must be between 0 and B - L = 8"),
    (
        dict(layout="pooled"),
        "h2o",
        {},
        "layout='pooled' does not run policy 'h2o' yet; it runs foresight, snapkv, streaming, tova",
    ),
    (dict(layout="pooled"), "rkv", {}, "layout='pooled' does not run policy 'rkv' yet"),
    (
        dict(layout="pooled", allocation="layer"),
        "tova",
        {},
        "allocation='layer' ranks keep scores across a layer's heads, and policy 'tova' with options "
        "{'per_kv_head': False} scores no head apart; allowed: snapkv, streaming, tova with per_kv_head=True",
    ),
]


@pytest.mark.parametrize(("config", "name", "options", "message"), REFUSALS)
def test_what_the_pooled_layout_does_not_run_is_refused_in_one_line(llama, config, name, options, message):
    with pytest.raises(ValueError) as refused:
        EvictionEngine(llama, make_policy(name, **options), EvictionConfig(B, L, **config))
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("decode_step", ["static", "graph"])
def test_a_fixed_shape_decode_is_refused_in_one_line(llama, decode_step):
    with pytest.raises(ValueError) as refused:
        EvictionEngine(llama, make_policy("snapkv"), EvictionConfig(B, L, layout="pooled"), decode_step=decode_step)
    message = str(refused.value)
    assert f"decode_step={decode_step!r} runs fixed-shape forwards; layout='pooled' runs 'eager' only" == message


def test_the_default_floor_is_adakvs_share():
    assert EvictionConfig(128, 32, layout="pooled", allocation="layer").floor == 19
    assert EvictionConfig(12, 8, layout="pooled", allocation="layer").floor == 1
    assert EvictionConfig(128, 32, layout="pooled").floor is None
