"""The reinforcement stage: rollouts against a masked full-attention reference and a brute-force
Plackett-Luce, the advantage and the clipped objective by hand, gradients, the sampled policy's
deterministic limit, `foresight rl` (export, resume, configs, errors) and DDP against one process."""

from __future__ import annotations

import copy
import hashlib
import itertools
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import lightning as L
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen3Config

from foresight import cli
from foresight.commands.rl import request as rl_request
from foresight.data.trace_store import Trace, folder_sources
from foresight.models import tiny_model
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.scorer.model import ForesightScorer, load_scorer
from tests.masked_attention import masked_forward
from tests.rl_runs import (
    L_,
    B,
    KillAtStep,
    Killed,
    enumerated_order_probabilities,
    random_trace,
    rl_args,
    rl_config,
)
from tests.scorers import default_shaped_config, random_scorer
from trainers.cli import rl_cli_main
from trainers.reinforcement import grpo as grpo_module
from trainers.reinforcement.rollouts import (
    EvictionActions,
    equal_reward_groups,
    full_cache_losses,
    group_advantages,
    grpo_objective,
    k3_kl,
    roll_out,
    roll_out_together,
    rollout_seeds,
    score_rollouts,
)
from trainers.reinforcement.stage import lightning_args as rl_lightning_args

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


# -- rollouts against slow references -------------------------------------------------------------
def test_logprob_of_recorded_orders_equals_brute_force_enumeration(llama):
    """B = 6, L = 2: pools of 4 entries, 12 possible orders per (step, layer, row, KV head)."""
    scorer = random_scorer(llama, budget=6, interval=2)
    rollout = roll_out(llama, scorer, random_trace(llama, 20), rollout_seeds(0, 0, 0, range(3)))
    actions = rollout.actions
    logprob = actions.logprob(actions.scores(scorer)).detach()  # [rows, layers, steps, Hkv]
    scores = actions.scores(scorer).detach()
    layers, steps, rows, heads = actions.order.shape[:4]
    assert steps >= 5 and actions.order.shape[-1] == 2 and scores.shape[-1] == 4
    for layer, step, row, head in itertools.product(range(layers), range(steps), range(rows), range(heads)):
        table = enumerated_order_probabilities(
            scores[layer, step, row, head].tolist(), actions.eligible[layer, step, row, head].tolist(), draws=2
        )
        assert len(table) == 12 and math.isclose(sum(table.values()), 1.0, rel_tol=1e-9)
        order = tuple(actions.order[layer, step, row, head].tolist())
        assert math.isclose(float(logprob[row, layer, step, head]), math.log(table[order]), abs_tol=1e-5)


def masked_reference_nll(model, input_ids: torch.Tensor, actions: EvictionActions, row: int) -> torch.Tensor:
    """NLL [T - 1] of one eager forward of the whole trace in which each query sees every earlier token
    except those the rollout row had evicted, per (layer, KV head), before that query was processed."""
    total = len(input_ids)
    layers, steps, _, heads = actions.evicted.shape[:4]
    allowed = torch.ones(total, total, dtype=torch.bool).tril().repeat(layers, heads, 1, 1)
    for layer, step, head in itertools.product(range(layers), range(steps), range(heads)):
        after = int(actions.after[step])
        allowed[layer, head, after + 1 :, actions.evicted[layer, step, row, head]] = False
    logits = masked_forward(model, input_ids, allowed)[0][:-1]
    return -torch.log_softmax(logits.float(), -1).gather(-1, input_ids[1:, None]).squeeze(-1)


def slow_reward(nll: list[float], full: list[float], entropy: list[float], share: float, threshold: float) -> float:
    """−(1/|S|) Σ_{t∈S} ΔL² 1[ΔL > η] with S the tokens whose entropy is at most the `share` quantile
    (linear interpolation between order statistics), by loops."""
    ordered = sorted(entropy)
    position = share * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    cut = ordered[low] + (ordered[high] - ordered[low]) * (position - low)
    chosen = [i for i, value in enumerate(entropy) if value <= cut]
    damage = [(nll[i] - full[i]) ** 2 for i in chosen if nll[i] - full[i] > threshold]
    return -sum(damage) / len(chosen)


def test_reward_equals_a_masked_full_attention_recomputation(llama):
    trace = random_trace(llama, 64, prompt=9, seed=1)
    scorer = random_scorer(llama, B, L_)
    rollout = roll_out(llama, scorer, trace, rollout_seeds(0, 0, trace.index, range(3)), threshold=0.05)
    actions = rollout.actions
    first = int(actions.after[0]) + 1  # predictions from the first position processed after the first eviction
    assert first == B + L_ and rollout.eviction_steps == 12 and actions.after.numel() == 11  # the 12th changes nothing
    rewards = []
    for row in range(3):
        nll = masked_reference_nll(llama, trace.input_ids, actions, row)
        evicted, full, entropy = nll[first:], trace.token_nll[first:], trace.token_entropy[first:]
        rewards.append(slow_reward(evicted.tolist(), full.tolist(), entropy.tolist(), share=0.8, threshold=0.05))
        ratio = float(evicted.double().sum() / full.double().sum())
        assert math.isclose(float(rollout.scores.loss_ratio[row]), ratio, rel_tol=1e-5)
    torch.testing.assert_close(
        rollout.scores.reward, torch.tensor(rewards, dtype=rollout.scores.reward.dtype), rtol=1e-4, atol=1e-6
    )
    assert all(reward < 0 for reward in rewards) and len(set(rewards)) == 3  # rows sampled different evictions


def test_a_row_rolls_out_the_same_in_any_group(llama):
    """Rows 2 and 3 of a group of 4 equal a group of only rows 2 and 3 (how groups split across ranks)."""
    trace, scorer = random_trace(llama, 48, seed=2), random_scorer(llama, B, L_)
    whole = roll_out(llama, scorer, trace, rollout_seeds(5, 1, trace.index, range(4)))
    part = roll_out(llama, scorer, trace, rollout_seeds(5, 1, trace.index, range(2, 4)))
    assert torch.equal(whole.actions.order[:, :, 2:], part.actions.order)
    torch.testing.assert_close(whole.scores.reward[2:], part.scores.reward, rtol=0, atol=1e-6)
    assert not torch.equal(whole.actions.order[:, :, 0], whole.actions.order[:, :, 1])


def with_token_rows(model, run):
    """`run()`'s result and the token rows (batch rows x tokens) the model's forwards were fed during it."""
    token_rows = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: token_rows.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        return run(), sum(token_rows)
    finally:
        hook.remove()


def test_a_group_runs_the_forwards_before_its_first_eviction_once(llama):
    """The G rows hold the same tokens until the first eviction: the model runs those B + L tokens on one
    row, the group reuses them, and every rollout is the one of running them on every row."""
    trace, scorer = random_trace(llama, 64, prompt=9, seed=3), random_scorer(llama, B, L_)
    seeds = rollout_seeds(2, 0, trace.index, range(4))
    shared, shared_rows = with_token_rows(llama, lambda: roll_out(llama, scorer, trace, seeds))
    alone, alone_rows = with_token_rows(llama, lambda: roll_out(llama, scorer, trace, seeds, share_prefix=False))
    assert alone_rows - shared_rows == (len(seeds) - 1) * (B + L_) - 1  # the recording feeds one token more
    assert torch.equal(shared.actions.order, alone.actions.order)
    torch.testing.assert_close(shared.scores.reward, alone.scores.reward, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(shared.scores.loss_ratio, alone.scores.loss_ratio, rtol=1e-5, atol=1e-6)


def test_groups_rolled_out_together_equal_each_group_alone(llama):
    """Two traces of different lengths in one replay: each group samples, scores and records what it does
    alone, the shorter one's rows dropping the steps and losses past its end; the prefill runs on one
    row per trace."""
    scorer = random_scorer(llama, B, L_)
    traces = [random_trace(llama, 64, prompt=9, seed=6), random_trace(llama, 47, prompt=30, seed=7)]
    seeds = [rollout_seeds(1, 0, trace.index, range(3)) for trace in traces]
    together, shared_rows = with_token_rows(llama, lambda: roll_out_together(llama, scorer, traces, seeds))
    _, alone_rows = with_token_rows(llama, lambda: roll_out_together(llama, scorer, traces, seeds, share_prefix=False))
    assert alone_rows - shared_rows == len(traces) * ((3 - 1) * (B + L_) - 1)
    for trace, group_seeds, packed in zip(traces, seeds, together, strict=True):
        alone = roll_out(llama, scorer, trace, group_seeds)
        assert packed.trace_index == trace.index
        assert torch.equal(packed.actions.order, alone.actions.order)
        assert torch.equal(packed.actions.evicted, alone.actions.evicted)
        assert torch.equal(packed.actions.after, alone.actions.after)
        torch.testing.assert_close(packed.actions.features, alone.actions.features, rtol=1e-4, atol=1e-5)
        for name in ("reward", "loss_ratio", "damage_share", "reward_to_go"):
            torch.testing.assert_close(getattr(packed.scores, name), getattr(alone.scores, name), rtol=1e-5, atol=1e-6)
    assert together[1].actions.after.numel() < together[0].actions.after.numel()  # the shorter trace's steps


def test_groups_rolled_out_together_refuse_bad_groups_in_one_line(llama):
    traces = [random_trace(llama, 40, seed=8), random_trace(llama, 40, seed=9)]
    with pytest.raises(ValueError, match=r"all of one size: got sizes \[2, 3\] for 2 traces"):
        roll_out_together(llama, random_scorer(llama, B, L_), traces, [(1, 2), (3, 4, 5)])
    with pytest.raises(ValueError, match=r"non-empty group of seeds per trace, all of one size: got sizes \[0, 0\]"):
        roll_out_together(llama, random_scorer(llama, B, L_), traces, [(), ()])
    with pytest.raises(ValueError, match="give one reference \\(or None\\) per trace: got 1 for 2 traces"):
        roll_out_together(llama, random_scorer(llama, B, L_), traces, [(1, 2), (3, 4)], reference_nll=[None])


def test_rollouts_in_another_dtype_are_scored_against_the_models_own_full_cache_losses(llama):
    """The replayed reference equals the stored losses in the dtype that made them; in bfloat16 it is the
    bfloat16 model's own, and a group is scored against it (`score_rollouts` reads it in place of the
    stored losses), so a row's ΔL counts eviction damage, not the dtype's rounding."""
    trace, scorer = random_trace(llama, 64, prompt=9, seed=4), random_scorer(llama, B, L_)
    torch.testing.assert_close(full_cache_losses(llama, trace), trace.token_nll, rtol=1e-5, atol=1e-5)
    low = copy.deepcopy(llama).to(torch.bfloat16)
    reference = full_cache_losses(low, trace)
    assert reference.dtype == torch.float32 and not torch.allclose(reference, trace.token_nll, atol=1e-3)
    seeds = rollout_seeds(0, 0, trace.index, range(2))
    replayed = roll_out(low, scorer, trace, seeds, threshold=0.0, reference_nll=reference)
    stored = roll_out(low, scorer, trace, seeds, threshold=0.0)
    assert torch.equal(replayed.actions.order, stored.actions.order)
    assert not torch.allclose(replayed.scores.reward, stored.scores.reward)
    rows = [
        trace.token_nll + 0.5 * torch.rand(trace.token_nll.shape, generator=torch.Generator().manual_seed(row))
        for row in range(2)
    ]
    scores = score_rollouts(
        rows, [20, 20], trace, torch.tensor([19]), share=0.8, threshold=0.0, reference_nll=reference
    )
    for row, nll in enumerate(rows):
        want = slow_reward(
            nll[20:].tolist(), reference[20:].tolist(), trace.token_entropy[20:].tolist(), share=0.8, threshold=0.0
        )
        assert math.isclose(float(scores.reward[row]), want, rel_tol=1e-5)


def scaled(scorer: ForesightScorer, factor: float) -> ForesightScorer:
    """A copy of `scorer` whose keep scores are `factor` times its own (the last layer scaled)."""
    copy = ForesightScorer(scorer.config)
    copy.load_state_dict(scorer.state_dict())
    with torch.no_grad():
        copy.w2.mul_(factor)
        copy.b2.mul_(factor)
    return copy


def test_sampling_temperature_divides_the_scores(llama):
    """Rolling out at τ samples and scores exactly as τ = 1 with keep scores divided by τ; the recorded
    actions recompute their log-probabilities at the τ they were sampled at."""
    trace, scorer, tau = random_trace(llama, 56, seed=4), random_scorer(llama, B, L_), 0.05
    seeds = rollout_seeds(1, 0, trace.index, range(3))
    tempered = roll_out(llama, scorer, trace, seeds, temperature=tau)
    divided = roll_out(llama, scaled(scorer, 1 / tau), trace, seeds)
    assert tempered.actions.temperature == tau and divided.actions.temperature == 1.0
    assert torch.equal(tempered.actions.order, divided.actions.order)
    with torch.no_grad():
        expected = divided.actions.logprob(divided.actions.scores(scaled(scorer, 1 / tau)))
        torch.testing.assert_close(
            tempered.actions.logprob(tempered.actions.scores(scorer)), expected, rtol=1e-5, atol=1e-4
        )
    at_one = roll_out(llama, scorer, trace, seeds)
    assert not torch.equal(at_one.actions.order, tempered.actions.order)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0, got 0"):
        make_policy("foresight", scorer=scorer, mode="sampled", temperature=0)


def test_sampling_at_temperature_zero_is_the_deterministic_policy(llama):
    """τ → 0: every row evicts the L lowest, as the deterministic policy does."""
    trace = random_trace(llama, 56, seed=3)
    scorer = random_scorer(llama, B, L_)
    rollout = roll_out(llama, scorer, trace, rollout_seeds(0, 0, 0, range(3)), temperature=1e-6)
    deterministic = make_policy("foresight", scorer=scorer)
    engine = EvictionEngine(llama, deterministic, EvictionConfig(B, L_, sinks=0, protect_prompt=False))
    output = engine.replay([trace.input_ids], [trace.prompt_length])
    first = B + L_
    for row in range(3):
        assert torch.equal(rollout.actions.evicted[:, :, row], rollout.actions.evicted[:, :, 0])
    reference = output.nll[0][first:]
    scored = slice(first, None)
    expected = reference.double().sum() / trace.token_nll[scored].double().sum()
    torch.testing.assert_close(rollout.scores.loss_ratio, expected.float().expand(3), rtol=1e-6, atol=0)


# -- advantage and objective by hand --------------------------------------------------------------
def test_group_advantage_by_hand():
    rewards = torch.tensor([[-1.0, -2.0, -3.0, -6.0], [0.5, 0.5, 0.5, 0.5]])
    # mean -3, population std sqrt((4 + 1 + 0 + 9) / 4) = sqrt(3.5); a group of equal rewards gets 0.
    expected = torch.tensor([[2.0, 1.0, 0.0, -3.0], [0.0] * 4]) / torch.tensor([[math.sqrt(3.5)], [1.0]])
    torch.testing.assert_close(group_advantages(rewards), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="at least 2 rollouts"):
        group_advantages(torch.tensor([[1.0]]))


def test_clipped_objective_and_kl_by_hand():
    """Two rows (advantages +1, -2), three actions each, ratios 1.5, 0.5, e^10 (log-ratio 20, clamped)."""
    old = torch.zeros(2, 3)
    logprob = torch.log(torch.tensor([[1.5, 0.5, 1.0]] * 2))
    logprob[:, 2] = 20.0
    logprob.requires_grad_()
    ref = torch.full((2, 3), -0.1)
    advantages = torch.tensor([1.0, -2.0])
    objective = grpo_objective(logprob, old, ref, advantages, beta=0.5)
    # row +1: min(1.5, 1.2) = 1.2 (clipped), min(0.5, 0.8) = 0.5, min(e^10, 1.2) = 1.2 (clipped)
    # row -2: min(-3, -2.4) = -3, min(-1, -1.6) = -1.6 (clipped), min(-2e^10, -2.4) = -2e^10
    surrogate = [1.2, 0.5, 1.2, -3.0, -1.6, -2 * math.exp(10)]
    kl = [math.exp(x) - x - 1 for x in (-0.1 - math.log(1.5), -0.1 - math.log(0.5), -0.1 - 20.0)] * 2
    assert math.isclose(float(objective.surrogate), sum(surrogate) / 6, rel_tol=1e-6)
    assert math.isclose(float(objective.kl), sum(kl) / 6, rel_tol=1e-6)
    torch.testing.assert_close(objective.kl_terms, torch.tensor([kl[:3], kl[3:]]), rtol=1e-6, atol=0)
    assert math.isclose(float(objective.loss), -sum(surrogate) / 6 + 0.5 * sum(kl) / 6, rel_tol=1e-6)
    assert math.isclose(float(objective.clip_fraction), 3 / 6)
    objective.loss.backward()
    # Clipped actions pass no gradient through the surrogate, only the KL's: d/dlogp [exp(r - l) - (r - l)] = 1 - exp(r - l).
    kl_gradient = 0.5 / 6 * (1 - math.exp(-0.1 - math.log(1.5)))
    assert math.isclose(float(logprob.grad[0, 0]), kl_gradient, rel_tol=1e-5)
    unclipped = 3.0 / 6 + 0.5 / 6 * (1 - math.exp(-0.1 - math.log(1.5)))  # d(-r·A)/dlogp = -r·A
    assert math.isclose(float(logprob.grad[1, 0]), unclipped, rel_tol=1e-5)
    assert float(k3_kl(torch.tensor(0.3), torch.tensor(0.3))) == 0.0


# -- reward-to-go and the zero-advantage share ----------------------------------------------------
def low_entropy_cut(entropy: list[float], share: float) -> float:
    """The `share` quantile of `entropy`, linear interpolation between order statistics, by hand."""
    ordered = sorted(entropy)
    position = share * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def slow_rewards_to_go(
    nll: list[float],
    full: list[float],
    entropy: list[float],
    first: int,
    after: list[int],
    share: float,
    threshold: float,
    exponent: float,
) -> list[float]:
    """R_s = −(1/|S|) Σ_{t∈S, t > after_s} ΔL_t^p·1[ΔL_t > η] of every step s, by loops over positions t of
    the predictions (S: the low-entropy ones among those from `first` on)."""
    scored = range(first, len(nll))
    cut = low_entropy_cut([entropy[t] for t in scored], share)
    chosen = [t for t in scored if entropy[t] <= cut]
    rewards = []
    for step_position in after:
        total = 0.0
        for t in chosen:
            delta = nll[t] - full[t]
            if t > step_position and delta > threshold:
                total += delta**exponent
        rewards.append(-total / len(chosen))
    return rewards


def test_reward_to_go_equals_a_loop_over_steps_and_tokens():
    """12 predictions, evicted from position 4 on, steps after positions 3, 6 and 9; η = 0.5, p = 3."""
    full = [0.5, 0.25, 1.0, 0.5, 0.25, 0.5, 1.0, 0.25, 0.5, 0.75, 0.25, 0.5]
    entropy = [0.1, 0.2, 0.3, 0.4, 0.9, 0.1, 0.5, 0.2, 3.0, 0.3, 0.6, 0.2]
    rows = [
        [0.5, 0.25, 1.0, 0.5, 2.25, 0.5, 1.0, 3.25, 0.5, 1.75, 0.25, 1.5],
        [0.5, 0.25, 1.0, 0.5, 0.25, 2.5, 1.0, 0.25, 4.5, 0.75, 2.25, 0.5],
    ]
    trace = Trace(
        index=0,
        source="hand",
        input_ids=torch.arange(13),
        prompt_length=2,
        token_nll=torch.tensor(full),
        token_entropy=torch.tensor(entropy),
        answer=None,
        correct=None,
        prompt="",
        completion="",
    )
    after = [3, 6, 9]
    scores = score_rollouts(
        [torch.tensor(row) for row in rows], [4, 4], trace, torch.tensor(after), share=0.8, threshold=0.5, exponent=3.0
    )
    expected = [slow_rewards_to_go(row, full, entropy, 4, after, 0.8, 0.5, 3.0) for row in rows]
    torch.testing.assert_close(scores.reward_to_go, torch.tensor(expected), rtol=1e-6, atol=0)
    torch.testing.assert_close(
        scores.reward, scores.reward_to_go[:, 0], rtol=1e-6, atol=0
    )  # the first step sees it all
    # Of the 8 scored tokens, 6 are low-entropy (positions 4 and 8 lie above the 80% cut, 0.78). Row 0 damages
    # positions 4 (ΔL 2, not low-entropy), 7 (ΔL 3), 9 and 11 (ΔL 1 each): 27 + 1 + 1 for the steps after
    # positions 3 and 6, only position 11's 1 for the step after position 9.
    torch.testing.assert_close(scores.reward_to_go[0], torch.tensor([-29 / 6, -29 / 6, -1 / 6]), rtol=1e-6, atol=0)


def test_step_advantages_normalise_each_step_across_the_group():
    """Rewards-to-go [G = 3, steps = 2]: each step's column is normalised on its own; an advantage per
    (row, step) weighs exactly the actions of that step in the objective."""
    to_go = torch.tensor([[-3.0, -1.0], [-1.0, -1.0], [-2.0, -1.0]])
    advantages = group_advantages(to_go, dim=0)
    first = torch.tensor([-1.0, 1.0, 0.0]) / (math.sqrt(2 / 3) + 1e-8)
    torch.testing.assert_close(advantages, torch.stack([first, torch.zeros(3)], 1), rtol=1e-6, atol=0)
    logprob = torch.randn(3, 2, 4, 5, generator=torch.Generator().manual_seed(0))  # [rows, steps, layers, Hkv]
    old, ref = logprob - 0.1, logprob + 0.05
    per_step = grpo_objective(logprob, old, ref, advantages, beta=0.1)
    per_action = grpo_objective(
        logprob, old, ref, advantages[:, :, None, None].expand_as(logprob).contiguous(), beta=0.1
    )
    torch.testing.assert_close(per_step.loss, per_action.loss, rtol=0, atol=0)
    torch.testing.assert_close(per_step.clip_fraction, per_action.clip_fraction, rtol=0, atol=0)


def test_zero_advantage_groups_by_hand():
    """Groups of equal rewards have advantage exactly 0, even where their rounded mean differs from them."""
    rewards = torch.tensor([[-0.25, -0.5, -0.25, -0.25], [-0.1] * 4, [0.0] * 4])
    assert equal_reward_groups(rewards).tolist() == [False, True, True]
    assert float(equal_reward_groups(rewards).float().mean()) == pytest.approx(2 / 3)
    assert torch.equal(group_advantages(torch.full((8,), -0.1)), torch.zeros(8))
    to_go = torch.tensor([[-3.0, -1.0, 0.0], [-1.0, -1.0, 0.0]])  # per step: one group of 3 steps has unequal rewards
    assert equal_reward_groups(to_go, dim=0).tolist() == [False, True, True]


# -- the module, the CLI, DDP ---------------------------------------------------------------------
class GradientProbe(L.Callback):
    """Records which parameters hold a gradient when the optimiser steps."""

    def __init__(self) -> None:
        self.seen: list[dict[str, bool]] = []

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        frozen = module.frozen_model
        self.seen.append(
            {
                "scorer": all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in module.trained_parameters())
                and module.scorer.b2.grad is None,
                "reference": any(p.grad is not None or p.requires_grad for p in module.reference.parameters()),
                "frozen": any(p.grad is not None or p.requires_grad for p in frozen.parameters()),
                "optimised": {id(p) for group in optimizer.param_groups for p in group["params"]}
                == {id(p) for p in module.scorer.parameters() if p is not module.scorer.b2},
            }
        )


def test_gradients_reach_the_scorer_and_nothing_else(tmp_path, tiny_dir, traces_dir, start_scorer):
    config = rl_config(tmp_path / "rl.yaml", tiny_dir, traces_dir)
    built = rl_cli_main(
        [
            "--config",
            str(config),
            f"--model.scorer={start_scorer}",
            f"--trainer.default_root_dir={tmp_path}",
            f"--checkpoint.dirpath={tmp_path / 'ckpt'}",
        ],
        run=False,
    )
    probe = GradientProbe()
    built.trainer.callbacks.append(probe)
    start = load_scorer(start_scorer).state_dict()
    built.trainer.fit(built.model, datamodule=built.datamodule)
    assert probe.seen and all(
        step == {"scorer": True, "reference": False, "frozen": False, "optimised": True} for step in probe.seen
    )
    module = built.model
    for name, tensor in start.items():
        torch.testing.assert_close(module.reference.state_dict()[name], tensor, rtol=0, atol=0)
        # b2 shifts every score of a (layer, head) alike: no ranking, so no update (`trained_parameters`)
        assert torch.equal(module.scorer.state_dict()[name], tensor) == (name == "b2"), name
    assert not any(name.startswith("_frozen") for name in module.state_dict())  # the frozen model is never saved


def safetensors_digest(path: Path) -> str:
    """SHA-256 over a weights file's tensors in name order (name, dtype, shape, bytes), read from the file."""
    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(path).items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_rl_trains_exports_and_resumes_from_last(tmp_path, tiny_dir, traces_dir, start_scorer, capsys):
    config = rl_config(
        tmp_path / "rl.yaml", tiny_dir, traces_dir, trainer={"max_steps": 3}, checkpoint={"every_n_train_steps": 1}
    )
    whole = tmp_path / "whole"
    assert cli.main(rl_args(config, start_scorer, whole)) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"{whole / 'scorer'}: scorer refined by GRPO for 3 steps from {start_scorer}; ")
    for metric in (
        "train/reward",
        "train/reward_std",
        "train/kl_per_set",
        "train/kl_per_step",
        "train/clip_fraction",
        "train/entropy",
        "train/loss_ratio",
        "train/damage",
    ):
        assert f"{metric} " in last
    exported = load_scorer(whole / "scorer")
    started_from = f"sha256:{safetensors_digest(start_scorer / 'model.safetensors')} ({start_scorer})"
    assert (exported.config.stage, exported.config.started_from) == ("reinforcement", started_from)
    rollout_sources = folder_sources(traces_dir)  # the sources of both stages
    assert rollout_sources and set(rollout_sources) - set(load_scorer(start_scorer).config.training_sources)
    assert exported.config.training_sources == sorted(
        {*load_scorer(start_scorer).config.training_sources, *rollout_sources}
    )
    card = (whole / "scorer" / "README.md").read_text()
    assert "Reinforcement stage (ForesightKV §3.3)" in card and f"started from `{started_from}`" in card
    final = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, final[f"scorer.{name}"], rtol=0, atol=0)
    # Killed after the checkpoint of step 2, then resumed from last.ckpt: the same batches, the same weights.
    split = tmp_path / "split"
    args = rl_args(config, start_scorer, split)
    killed = rl_cli_main(
        rl_lightning_args(rl_request(cli.build_parser().parse_args(args)))[1:], run=False
    )  # no subcommand
    killed.trainer.callbacks.append(KillAtStep(2))
    with pytest.raises(Killed):
        killed.trainer.fit(killed.model, datamodule=killed.datamodule)
    assert torch.load(split / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert cli.main([*args, "--ckpt-path", "last"]) == 0
    resumed = torch.load(split / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 3
    for name, tensor in final.items():
        torch.testing.assert_close(resumed["state_dict"][name], tensor, rtol=0, atol=1e-6)


def test_reward_to_go_credit_and_a_replayed_reference_train_and_record_their_settings(
    tmp_path, tiny_dir, traces_dir, start_scorer, capsys
):
    config = rl_config(
        tmp_path / "rl.yaml",
        tiny_dir,
        traces_dir,
        model={"credit": "reward_to_go", "damage_exponent": 3.0, "loss_reference": "replay"},
    )
    run = tmp_path / "run"
    assert cli.main(rl_args(config, start_scorer, run)) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert 0 <= float(last.split("train/zero_advantage_share ")[1].split(",")[0]) < 1
    hparams = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert (hparams["credit"], hparams["damage_threshold"], hparams["damage_exponent"]) == ("reward_to_go", 0.0, 3.0)
    assert (hparams["storage_dtype"], hparams["loss_reference"]) == ("float32", "replay")
    assert "reward ΔL^3.0·1[ΔL > 0.0], credit: reward_to_go" in (run / "scorer" / "README.md").read_text()
    start = load_file(start_scorer / "model.safetensors")
    assert any(
        not torch.equal(tensor, start[name]) for name, tensor in load_file(run / "scorer" / "model.safetensors").items()
    )


def test_groups_of_equal_rewards_teach_nothing(tmp_path, tiny_dir, traces_dir, start_scorer, capsys):
    """No token is damaged (η = 10⁶), so every group's rewards are 0: the logged share of zero-advantage
    groups is 1 and the scorer does not move (the KL term's gradient is 0 at π_θ = π_ref)."""
    config = rl_config(tmp_path / "rl.yaml", tiny_dir, traces_dir, model={"damage_threshold": 1e6})
    run = tmp_path / "run"
    assert cli.main(rl_args(config, start_scorer, run)) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert float(last.split("train/zero_advantage_share ")[1].split(",")[0]) == 1.0
    start = load_file(start_scorer / "model.safetensors")
    for name, tensor in load_file(run / "scorer" / "model.safetensors").items():
        assert torch.equal(tensor, start[name]), name


def without_stored_losses(traces: Path, out: Path) -> Path:
    """A copy of a traces folder whose traces hold no full-cache loss and entropy."""
    shutil.copytree(traces, out, ignore=shutil.ignore_patterns("labels-*"))
    for shard in sorted(out.glob("shard-*")):
        emptied = datasets.load_from_disk(str(shard)).map(lambda row: {"token_nll": [], "token_entropy": []})
        emptied.save_to_disk(str(shard) + ".new")
        record = (shard / "shard.json").read_text()
        shutil.rmtree(shard)
        os.rename(str(shard) + ".new", shard)
        (shard / "shard.json").write_text(record)
    return out


def test_bad_input_is_a_one_line_error(tmp_path, tiny_dir, traces_dir, start_scorer, capsys):
    config = rl_config(tmp_path / "rl.yaml", tiny_dir, traces_dir)
    other_shape = tmp_path / "three-layers"
    random_scorer(tiny_model("llama", num_hidden_layers=3), B, L_, base_model="other").save_pretrained(other_shape)
    no_losses = without_stored_losses(traces_dir, tmp_path / "no-losses")
    capsys.readouterr()
    cases = [
        (
            rl_args(config, other_shape, tmp_path / "a"),
            "scorer trained for other (layers=3, query heads=4, KV heads=2, "
            "head dim=16) does not fit the model (layers=2, query heads=4, KV heads=2, head dim=16)",
        ),
        (
            rl_args(config, start_scorer, tmp_path / "b", "data.budget=20"),
            f"scorer {start_scorer} was trained for B=16, L=4, but the rollouts use B=20, L=4",
        ),
        (
            rl_args(config, start_scorer, tmp_path / "c", f"data.traces_dir={no_losses}"),
            f"of {no_losses} has no stored full-cache loss and entropy (0 of ",
        ),
        (rl_args(config, start_scorer, tmp_path / "d", "model.group_size=1"), "group_size G must be at least 2"),
        (
            rl_args(config, start_scorer, tmp_path / "f", "model.credit=steps"),
            "unknown credit 'steps'; allowed: 'rollout', 'reward_to_go'",
        ),
        (
            rl_args(config, start_scorer, tmp_path / "h", "model.loss_reference=full"),
            "unknown loss reference 'full'; allowed: 'stored', 'replay'",
        ),
        (
            rl_args(config, start_scorer, tmp_path / "i", "model.traces_per_replay=0"),
            "traces_per_replay must be at least 1, got 0",
        ),
        (
            rl_args(config, start_scorer, tmp_path / "g", "model.damage_exponent=0"),
            "need a finite damage_threshold >= 0 and damage_exponent > 0, got damage_threshold=0.0, damage_exponent=0.0",
        ),
        (rl_args(tmp_path / "missing.yaml", start_scorer, tmp_path / "e"), "missing.yaml does not exist"),
    ]
    for args, message in cases:
        assert cli.main(args) == 2, message
        error = capsys.readouterr().err.strip()
        assert message in error and error.count("\n") == 0, error


PAPER_RL = {
    "qwen3-4b-rl.yaml": (
        "Qwen/Qwen3-4B",
        0.01,
        Qwen3Config(
            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=2560
        ),
    ),
    "qwen3-1.7b-rl.yaml": (
        "Qwen/Qwen3-1.7B",
        0.03,
        Qwen3Config(
            num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_size=2048
        ),
    ),
    "r1-distill-qwen-7b-rl.yaml": (
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        0.1,
        Qwen2Config(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_size=3584),
    ),
}


@pytest.mark.parametrize("name", sorted(PAPER_RL))
def test_paper_rl_configs_hold_the_papers_settings_and_build(name, tmp_path, monkeypatch):
    model_id, beta, model_config = PAPER_RL[name]
    monkeypatch.setattr(grpo_module, "load_config", lambda requested: model_config)  # no hub here
    config = yaml.safe_load((REPO / "configs" / name).read_text())
    assert config["data"]["model"] == model_id and (config["data"]["budget"], config["data"]["interval"]) == (1024, 256)
    assert config["data"]["batch_size"] == 32  # groups span ranks: every rank sees the whole batch
    model = config["model"]
    assert (model["group_size"], model["lr"], model["warm_up"], model["beta"], model["clip"]) == (
        8,
        3e-4,
        10,
        beta,
        0.2,
    )
    assert config["trainer"]["max_steps"] == 200
    scorer = tmp_path / "scorer"
    random_scorer(model_config, budget=1024, interval=256, base_model=model_id).save_pretrained(scorer)
    built = rl_cli_main(
        ["--config", str(REPO / "configs" / name), f"--model.scorer={scorer}", "--trainer.accelerator=cpu"], run=False
    )  # no GPU here
    assert built.model.hparams.beta == beta and built.model.scorer.config.stage == "reinforcement"


def test_default_rl_config_builds_for_the_shipped_scorer(monkeypatch):
    monkeypatch.setattr(
        grpo_module,
        "load_config",
        lambda requested: default_shaped_config(),
    )
    shipped = REPO / "checkpoints" / "default"
    built = rl_cli_main(["--config", str(REPO / "configs" / "default-rl.yaml"), f"--model.scorer={shipped}"], run=False)
    module = built.model
    started_from = f"sha256:{safetensors_digest(shipped / 'model.safetensors')} ({shipped})"
    assert module.hparams.group_size == 8 and module.scorer.config.started_from == started_from
    assert (module.hparams.credit, module.hparams.damage_threshold, module.hparams.damage_exponent) == (
        "rollout",
        1.5,
        2.0,
    )
    assert module.storage_dtype == torch.float32  # recorded scorer inputs are not rounded by default
    assert (built.datamodule.budget, built.datamodule.interval) == (128, 32)


def tensorboard_scalars(run: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = run.rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return {event.step: event.value for event in accumulator.Scalars(tag)}


@pytest.mark.slow
@pytest.mark.parametrize("credit", ["rollout", "reward_to_go"])
def test_two_processes_with_groups_across_ranks_make_the_same_update_as_one(
    tmp_path, tiny_dir, traces_dir, start_scorer, credit
):
    """Two gloo processes replaying 2 of each trace's 4 rollouts against one process replaying all 4:
    the same all-gathered rewards (and rewards-to-go), the same logged figures, the same trained weights."""
    config = rl_config(tmp_path / "rl.yaml", tiny_dir, traces_dir, trainer={"max_steps": 3}, model={"credit": credit})
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, devices in (("one", 1), ("two", 2)):
        out = tmp_path / name
        strategy = "ddp" if devices > 1 else "auto"
        command = [
            sys.executable,
            "-m",
            "foresight.cli",
            *rl_args(config, start_scorer, out, f"trainer.devices={devices}", f"trainer.strategy={strategy}"),
        ]
        subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
        runs[name] = out
    for tag in ("train/reward", "train/reward_std", "train/zero_advantage_share"):
        one, two = (tensorboard_scalars(runs[name], tag) for name in ("one", "two"))
        assert sorted(one) == sorted(two) and len(one) == 3
        for step in one:
            assert math.isclose(one[step], two[step], rel_tol=1e-4, abs_tol=1e-7), (tag, step, one[step], two[step])
    assert_same_update(*(runs[name] / "scorer" for name in ("one", "two")), start_scorer)


def assert_same_update(one: Path, two: Path, start: Path) -> None:
    """Two runs' scorer folders hold the same weights (float32 rounding: 1e-4 relative), moved from the start
    scorer's. b2 shifts every keep score of a head alike, which no eviction probability sees: its gradient
    is 0 up to rounding, and Adam turns that rounding into steps of any sign, so it is not compared."""
    weights = [load_file(folder / "model.safetensors") for folder in (one, two)]
    for name, tensor in weights[0].items():
        if name != "b2":
            torch.testing.assert_close(weights[1][name], tensor, rtol=1e-4, atol=1e-6)
    started = load_file(start / "model.safetensors")
    assert any(not torch.equal(tensor, started[name]) for name, tensor in weights[0].items())


def test_traces_replayed_together_train_as_one_trace_per_replay(
    tmp_path, tiny_dir, traces_dir, start_scorer, capsys, monkeypatch
):
    """`traces_per_replay` 2 packs each batch's two groups into one replay: the same rollouts, so the same
    update as one trace per replay (b2 left out, as in the test above)."""
    config = rl_config(tmp_path / "rl.yaml", tiny_dir, traces_dir)
    replays = []  # the traces of each `roll_out_together` call
    rolled_out = grpo_module.roll_out_together
    monkeypatch.setattr(
        grpo_module,
        "roll_out_together",
        lambda model, scorer, traces, *args, **kwargs: (
            replays.append(len(traces)) or rolled_out(model, scorer, traces, *args, **kwargs)
        ),
    )
    for pack in (1, 2):
        out = tmp_path / f"pack{pack}"
        replays.clear()
        assert cli.main(rl_args(config, start_scorer, out, f"model.traces_per_replay={pack}")) == 0
        assert replays and set(replays) == {pack}, (pack, replays)  # each replay packs `pack` traces
    assert_same_update(tmp_path / "pack1" / "scorer", tmp_path / "pack2" / "scorer", start_scorer)
    capsys.readouterr()


def test_further_epochs_on_one_batch_clip_the_ratio(tmp_path, tiny_dir, traces_dir, start_scorer, capsys):
    """Three updates on one batch of rollouts (max_steps counts updates): after the first the ratio leaves
    1 and, with a large learning rate, some evictions are clipped; the rollouts are drawn once."""
    config = rl_config(
        tmp_path / "rl.yaml",
        tiny_dir,
        traces_dir,
        trainer={"max_steps": 3},
        model={"epochs": 3, "lr": 0.5, "warm_up": 0, "max_grad_norm": None},
    )
    assert cli.main(rl_args(config, start_scorer, tmp_path / "run")) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "scorer refined by GRPO for 3 steps" in last
    assert float(last.split("train/clip_fraction ")[1].split(",")[0]) > 0
    assert float(last.split("train/kl_per_set ")[1].split(",")[0]) > 0
