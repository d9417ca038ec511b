"""The pooled golden bound (studies/pooled_golden): its schedules against a loop, per-head pooling against golden's
labels, and the masked replay against the engine's golden replay."""

from __future__ import annotations

import pytest
import torch

from foresight.artifacts import ArtifactError
from foresight.cadence import Regime, eviction_steps, regime_prefill, regime_shift
from foresight.eval.headroom import TraceScore
from foresight.labels import compute_golden_labels, future_score_table
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from studies.pooled_golden.bound import HeuristicSchedule, Pool, golden_evictions, masked_replay, pooled_schedule
from studies.pooled_golden.run import Settings, kept_scores
from tests.rl_runs import L_, B, random_trace

PROMPT = 30  # > B + L: the decode regime compresses the prompt


def tables(model, trace, regime):
    """α of steps 1..M and, in the decode regime, the compression's row, as the study reads them."""
    shift = regime_shift(trace.prompt_length, B, L_, regime)
    if not shift:
        return future_score_table(model, trace.input_ids, B, L_), None, 0
    table = future_score_table(model, trace.input_ids, B + shift - L_, L_)
    return table[1:], table[0], shift


@pytest.mark.parametrize("regime", list(Regime))
def test_per_head_pooling_is_golden_and_its_masked_replay_is_the_engines(llama, regime):
    """Pooling by head reproduces the labels' kept sets step by step; the masked replay of those kept sets gives the
    engine's golden replay's token losses (float32, a different summation order: 1e-4) and first eviction."""
    trace = random_trace(llama, 90, prompt=PROMPT, seed=3)
    labels = compute_golden_labels(llama, trace.input_ids, B, L_, regime=regime, prompt_length=PROMPT)
    future, compression, shift = tables(llama, trace, regime)
    schedule = pooled_schedule(future, B, L_, Pool.HEAD, floor=0, shift=shift, compression=compression)
    expected = golden_evictions(labels.kept_positions(), labels.prefill_kept, B, L_, future.shape[-1], shift)
    assert [position for position, _ in schedule] == [position for position, _ in expected]
    assert all(torch.equal(mine, theirs) for (_, mine), (_, theirs) in zip(schedule, expected, strict=True))
    engine = EvictionEngine(
        llama, make_policy("golden", labels=[labels]), EvictionConfig(B, L_, sinks=0, protect_prompt=False)
    )
    replayed = engine.replay([trace.input_ids], [regime_prefill(PROMPT, B, L_, regime)])
    nll, _ = masked_replay(llama, trace.input_ids, schedule, L_)
    first = replayed.first_eviction[0]
    assert first == schedule[0][0] + 1
    torch.testing.assert_close(nll[first:], replayed.nll[0][first:].float(), rtol=1e-4, atol=1e-4)


def loop_select(alpha, candidates, share, floor, group_of):
    """By loops: per group, each head its `floor` largest-α candidates, then the group's largest of the rest up to
    its heads' shares; ties: the lower head, then the lower position."""
    layers, heads, width = alpha.shape
    kept = torch.zeros_like(candidates)
    groups = {}
    for layer in range(layers):
        for head in range(heads):
            groups.setdefault(group_of(layer, head), []).append((layer, head))
    for members in groups.values():
        rest = []
        for order, (layer, head) in enumerate(members):
            mine = sorted((-float(alpha[layer, head, i]), i) for i in range(width) if candidates[layer, head, i])
            for _, i in mine[:floor]:
                kept[layer, head, i] = True
            rest += [(score, order, i, layer, head) for score, i in mine[floor:]]
        for *_, i, layer, head in sorted(rest)[: len(members) * (share - floor)]:
            kept[layer, head, i] = True
    return kept


@pytest.mark.parametrize("pool", [Pool.LAYER, Pool.ALL])
def test_pooled_schedules_equal_a_loop_and_spend_each_groups_share(pool):
    """On ties (α on a grid of 0.1) and for both groups: each step's kept set is the loop's, from the same
    candidates (the last kept set plus the L leaving the window); every group keeps its heads' shares in all
    and every head at least the floor."""
    layers, heads, steps, floor = 3, 2, 6, 2
    width = B + steps * L_
    future = (torch.rand(steps, layers, heads, width, generator=torch.Generator().manual_seed(1)) * 10).round() / 10
    schedule = pooled_schedule(future, B, L_, pool, floor=floor)
    group_of = (lambda layer, head: layer) if pool is Pool.LAYER else (lambda layer, head: 0)
    kept = torch.zeros(layers, heads, width, dtype=torch.bool)
    kept[..., : B - L_] = True
    for step, (position, mine) in enumerate(schedule):
        assert position == B + (step + 1) * L_ - 1
        leaving = B + (step - 1) * L_
        candidates = kept.clone()
        candidates[..., leaving : leaving + L_] = True
        kept = loop_select(future[step], candidates, B - L_, floor, group_of)
        assert torch.equal(mine, kept), step
        counts = mine.sum(-1)
        assert int(counts.min()) >= floor
        totals = counts.sum(-1) if pool is Pool.LAYER else counts.sum()
        assert (totals == (heads if pool is Pool.LAYER else layers * heads) * (B - L_)).all()
    assert len({int(c) for _, held in schedule for c in held.sum(-1).flatten()}) > 1  # heads did keep differently


def test_a_floor_a_head_cannot_meet_is_one_line():
    with pytest.raises(ValueError, match="floor=5 must be 0..L=4"):
        pooled_schedule(torch.zeros(1, 1, 1, B + L_), B, L_, Pool.LAYER, floor=5)


@pytest.mark.parametrize("heuristic", ["snapkv", "tova"])
@pytest.mark.parametrize("regime", list(Regime))
def test_a_heuristic_per_head_is_the_engines_and_pooled_spends_each_layers_share(llama, regime, heuristic):
    """SnapKV and TOVA scored inside the masked replay from their own trajectory's logits keep what the engine's
    policies keep: the same token losses (1e-4); pooled over a layer's heads (AdaKV's allocation) every step keeps
    the layer's share in all, each head at least the floor, and the heads keep different counts."""
    trace = random_trace(llama, 90, prompt=PROMPT, seed=3)
    shift = regime_shift(PROMPT, B, L_, regime)
    steps = eviction_steps(90, B, L_, shift)
    per_head = HeuristicSchedule(B, L_, steps, Pool.HEAD, shift=shift, heuristic=heuristic)
    nll, _ = masked_replay(llama, trace.input_ids, per_head, L_)
    engine = EvictionEngine(llama, make_policy(heuristic), EvictionConfig(B, L_))
    replayed = engine.replay([trace.input_ids], [regime_prefill(PROMPT, B, L_, regime)])
    first = replayed.first_eviction[0]
    assert first == per_head.positions[0] + 1
    torch.testing.assert_close(nll[first:], replayed.nll[0][first:].float(), rtol=1e-4, atol=1e-4)
    pooled, kept = HeuristicSchedule(B, L_, steps, Pool.LAYER, floor=2, shift=shift, heuristic=heuristic), []
    choose = pooled.kept
    pooled.kept = lambda *args: kept.append(choose(*args)) or kept[-1]
    masked_replay(llama, trace.input_ids, pooled, L_)
    counts = torch.stack([held.sum(-1) for held in kept])  # [steps, layers, heads]
    assert (counts.sum(-1) == 2 * (B - L_)).all() and int(counts.min()) >= 2 and len(set(counts.flatten().tolist())) > 1
    with pytest.raises(ValueError, match="heuristic 'h2o': the masked replay scores 'snapkv' and 'tova'"):
        HeuristicSchedule(B, L_, steps, Pool.HEAD, heuristic="h2o")


def test_the_study_keeps_each_traces_scores_and_refuses_other_settings(tmp_path):
    """--work keeps a trace's scores once computed and reads them back instead of computing again; a run of other
    settings on the same folder is refused in one line."""
    (tmp_path / "eval").mkdir()
    settings = Settings(traces=tmp_path / "traces", eval=tmp_path / "eval", work=tmp_path / "work")
    score = TraceScore("golden-layer", 128, 3, "tiny", 10, 11.0, 10.0, 8, 1.0, flipped=0.0, squared_sum=0.5)
    calls = []
    first = kept_scores(settings, 3, lambda: calls.append(1) or [score])
    again = kept_scores(settings, 3, lambda: calls.append(1) or [])
    assert first == again == [score] and calls == [1]
    other = Settings(traces=tmp_path / "traces", eval=tmp_path / "eval", work=tmp_path / "work", floor=8)
    with pytest.raises(ArtifactError, match="made with other settings \\(floor=19, not 8\\); give another --work"):
        kept_scores(other, 3, lambda: [score])
