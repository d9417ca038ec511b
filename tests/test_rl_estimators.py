"""The reinforcement stage's estimator options against slow references: the evicted set's Plackett-Luce
log-probability (Kool et al. 2020) against the sum over every order of the set, its gradient against
autograd through that sum and finite differences; leave-one-out and self-critical advantages, the dense and
the gated reward by loops;
the resolver's errors; and the GRPO module trained with each choice."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from foresight import cli
from foresight.metrics import dense_terms, token_damage
from foresight.scorer.eviction_sampling import draw_eviction, plackett_luce_logprob, plackett_luce_set_logprob
from studies.__main__ import main as studies_main
from studies.rl_signal.run import chunk_noise_scale, noise_scale
from tests.rl_runs import enumerated_order_probabilities, random_trace, rl_args, rl_config
from tests.scorers import random_scorer
from trainers.reinforcement.estimators import (
    ADVANTAGE_RULES,
    BATCH_ADVANTAGE_RULES,
    LOGPROB_RULES,
    REWARD_RULES,
    Estimator,
    gated_terms,
    leave_one_out_advantages,
    self_critical_advantages,
)
from trainers.reinforcement.rollouts import group_advantages, roll_out, rollout_seeds


# -- the evicted set's log-probability --------------------------------------------------------------
def enumerated_set_logprob(
    scores: torch.Tensor, evicted: list[int], eligible: list[bool], temperature: float
) -> torch.Tensor:
    """log of the sum over every order of `evicted` of the product of sequential softmax ratios over the
    eligible entries still available (Eq. 2's draws, one by one), by loops; differentiable w.r.t. `scores`."""
    logits = -scores / temperature
    total = scores.new_zeros(())
    for order in itertools.permutations(evicted):
        available, probability = [i for i in range(len(eligible)) if eligible[i]], scores.new_ones(())
        for pick in order:
            weights = torch.stack([logits[i] for i in available]).exp()
            probability = probability * logits[pick].exp() / weights.sum()
            available.remove(pick)
        total = total + probability
    return total.log()


@pytest.mark.parametrize(
    "pool_size,num_evict,spread,temperature",
    [
        (4, 2, 1.0, 1.0),
        (6, 3, 0.1, 1.0),
        (6, 3, 3.0, 0.5),
        (7, 3, 1.0, 1.0),
        (8, 4, 5.0, 1.0),
        (8, 4, 1.0, 0.05),
    ],
)
def test_set_logprob_equals_the_sum_over_every_order(pool_size, num_evict, spread, temperature):
    generator = torch.Generator().manual_seed(pool_size * 10 + num_evict)
    for trial in range(3):
        scores = (torch.randn(pool_size, generator=generator, dtype=torch.float64) * spread).requires_grad_()
        eligible = [True] * pool_size
        if trial == 2:  # one ineligible entry: weight 0, never drawn
            eligible[int(torch.randint(pool_size, (1,), generator=generator))] = False
        candidates = [i for i in range(pool_size) if eligible[i]]
        evicted = [candidates[i] for i in torch.randperm(len(candidates), generator=generator)[:num_evict].tolist()]
        pool, order = torch.arange(pool_size), torch.tensor(evicted)
        mask = torch.tensor(eligible)
        value = plackett_luce_set_logprob(scores, pool, order, mask, temperature)
        expected = enumerated_set_logprob(scores, evicted, eligible, temperature)
        assert math.isclose(float(value.detach()), float(expected.detach()), rel_tol=1e-9, abs_tol=1e-9)
        (grad,) = torch.autograd.grad(value, scores)
        (expected_grad,) = torch.autograd.grad(expected, scores)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-7, atol=1e-9)


def test_set_logprob_sums_to_one_over_every_set_and_ignores_the_order():
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(10, generator=generator, dtype=torch.float64)
    sets = torch.tensor(list(itertools.combinations(range(10), 5)))  # 252 sets
    values = plackett_luce_set_logprob(scores.expand(len(sets), 10), torch.arange(10).expand(len(sets), 10), sets)
    assert math.isclose(float(values.exp().sum()), 1.0, rel_tol=1e-9)
    shuffled = sets[:, torch.randperm(5, generator=generator)]
    torch.testing.assert_close(
        plackett_luce_set_logprob(scores.expand(len(sets), 10), torch.arange(10).expand(len(sets), 10), shuffled),
        values,
        rtol=1e-14,
        atol=1e-14,  # the set's factors summed in another order
    )
    orders = plackett_luce_logprob(scores.expand(len(sets), 10), torch.arange(10).expand(len(sets), 10), sets)
    assert bool((values > orders).all())  # a set is at least as likely as any one of its orders


def race_integral_logprob(logits: torch.Tensor, drawn: torch.Tensor, nodes: int = 400_000) -> float:
    """log ∫_0^∞ e^{-v} prod_{i in S} (1 - e^{-v w_i / W_R}) dv (the exponential race of Kool et al. 2020
    with v = W_R t) by the midpoint rule on a fine uniform grid of v up to L + 60, where e^{-v} is below
    e^{-40} of the integrand's mass: an independent twin for pools too large to enumerate."""
    weights = logits.double().exp()
    ratio = weights[drawn] / weights[~drawn].sum()
    end = int(drawn.sum()) + 60
    v = (torch.arange(nodes, dtype=torch.float64) + 0.5) * (end / nodes)
    log_integrand = -v + torch.log(-torch.expm1(-v[:, None] * ratio)).sum(-1)
    return float(log_integrand.logsumexp(0)) + math.log(end / nodes)


@pytest.mark.parametrize("spread", [0.05, 0.5, 1.5])
def test_set_logprob_of_large_pools_equals_a_fine_quadrature_in_the_papers_variable(spread):
    """L = 32 of a pool of 64, as the default B = 128, L = 32: float32 and float64 alike."""
    generator = torch.Generator().manual_seed(int(spread * 100))
    scores = torch.randn(64, generator=generator) * spread
    for evicted in (torch.randperm(64, generator=generator)[:32], scores.topk(32, largest=False).indices):
        drawn = torch.zeros(64, dtype=torch.bool)
        drawn[evicted] = True
        expected = race_integral_logprob(-scores, drawn)
        for dtype, tolerance in ((torch.float64, 1e-6), (torch.float32, 1e-5)):
            value = float(plackett_luce_set_logprob(scores.to(dtype), torch.arange(64), evicted))
            assert math.isclose(value, expected, rel_tol=tolerance, abs_tol=tolerance), (dtype, value, expected)


def test_set_logprob_gradient_of_large_pools_equals_finite_differences():
    generator = torch.Generator().manual_seed(5)
    scores = (torch.randn(64, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    evicted = torch.randperm(64, generator=generator)[:32]
    value = plackett_luce_set_logprob(scores, torch.arange(64), evicted, temperature=0.7)
    (grad,) = torch.autograd.grad(value, scores)
    step = 1e-5
    for index in (int(evicted[0]), int(evicted[5]), *[i for i in range(64) if i not in evicted.tolist()][:3]):
        shifted = [scores.detach().clone() for _ in range(2)]
        shifted[0][index] += step
        shifted[1][index] -= step
        up, down = (float(plackett_luce_set_logprob(s, torch.arange(64), evicted, temperature=0.7)) for s in shifted)
        assert math.isclose(float(grad[index]), (up - down) / (2 * step), rel_tol=1e-5, abs_tol=1e-8)
    assert math.isclose(float(grad.sum()), 0.0, abs_tol=1e-9)  # a shift of every score changes no draw


def test_set_logprob_stays_finite_and_exact_where_weights_differ_by_hundreds_of_nats():
    """τ = 0.005 (docs/notes/rl-rounds.md's third round) on scores a few tenths apart: logits hundreds apart, a set member
    may outweigh the rest by e^100 and more (float32 overflows at e^88). Values against the sum over orders, gradients
    against finite differences of the function itself (the enumeration's autograd loses digits here)."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(6):
        scores = (
            torch.randn(8, generator=generator, dtype=torch.float64) * 0.3
        )  # log P down to ~-600: float64 enumerates it
        evicted = torch.randperm(8, generator=generator)[:4]
        if trial % 2:
            evicted = scores.topk(4, largest=False).indices  # the most probable set: members far outweigh the rest
        expected = float(enumerated_set_logprob(scores, evicted.tolist(), [True] * 8, 0.005))
        for dtype in (torch.float64, torch.float32):
            leaf = scores.to(dtype).requires_grad_()
            value = plackett_luce_set_logprob(leaf, torch.arange(8), evicted, temperature=0.005)
            (grad,) = torch.autograd.grad(value, leaf)
            assert torch.isfinite(grad).all() and math.isclose(
                float(value.detach()), expected, rel_tol=1e-6, abs_tol=1e-5
            )
        leaf = scores.clone().requires_grad_()
        (grad,) = torch.autograd.grad(
            plackett_luce_set_logprob(leaf, torch.arange(8), evicted, temperature=0.005), leaf
        )
        for index in range(8):
            up, down = scores.clone(), scores.clone()
            up[index] += 1e-7
            down[index] -= 1e-7
            difference = (
                float(plackett_luce_set_logprob(up, torch.arange(8), evicted, temperature=0.005))
                - float(plackett_luce_set_logprob(down, torch.arange(8), evicted, temperature=0.005))
            ) / 2e-7
            assert math.isclose(float(grad[index]), difference, rel_tol=1e-5, abs_tol=1e-3)


def test_set_logprob_matches_the_frequency_of_sampled_sets():
    """Eq. 2's sampler and the set probability agree: the share of 20,000 draws that evict each set."""
    generator = torch.Generator().manual_seed(7)
    scores = torch.tensor([0.3, -0.5, 1.2, 0.0, -1.0, 0.8])
    draws = draw_eviction(scores.expand(20_000, 6), 3, generator=generator, temperature=0.8)
    counts: dict[tuple, int] = {}
    for row in draws.order.sort(-1).values.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    for evicted, count in counts.items():
        probability = float(
            plackett_luce_set_logprob(scores, torch.arange(6), torch.tensor(evicted), temperature=0.8).exp()
        )
        assert abs(count / 20_000 - probability) < 4 * math.sqrt(probability * (1 - probability) / 20_000) + 1e-4


def test_set_logprob_of_a_pool_whose_rest_is_ineligible_is_zero_and_batches_broadcast():
    scores = torch.tensor([[0.1, 0.4, -0.2, 3.0], [0.5, 0.1, 0.2, 0.3]], requires_grad=True)
    eligible = torch.tensor([[True, True, False, False], [True, True, True, True]])
    order = torch.tensor([[1, 0], [3, 2]])
    value = plackett_luce_set_logprob(scores, torch.arange(4).expand(2, 4), order, eligible)
    assert float(value[0].detach()) == 0.0 and float(value[1].detach()) < 0
    value.sum().backward()
    assert torch.isfinite(scores.grad).all() and bool((scores.grad[0] == 0).all())


def test_set_logprob_of_recorded_evictions_sums_their_enumerated_orders(llama):
    """B = 6, L = 2: pools of 4 entries; the recorded set's probability is that of its two orders."""
    scorer = random_scorer(llama, budget=6, interval=2)
    actions = roll_out(llama, scorer, random_trace(llama, 20), rollout_seeds(0, 0, 0, range(2))).actions
    scores = actions.scores(scorer).detach()
    logprob = actions.logprob(scores, plackett_luce_set_logprob)  # [rows, layers, steps, Hkv]
    layers, steps, rows, heads = actions.order.shape[:4]
    for layer, step, row, head in itertools.product(range(layers), range(steps), range(rows), range(heads)):
        table = enumerated_order_probabilities(
            scores[layer, step, row, head].tolist(), actions.eligible[layer, step, row, head].tolist(), draws=2
        )
        first, second = actions.order[layer, step, row, head].tolist()
        expected = math.log(table[(first, second)] + table[(second, first)])
        assert math.isclose(float(logprob[row, layer, step, head]), expected, abs_tol=1e-5)


# -- advantages and rewards ---------------------------------------------------------------------------
def test_leave_one_out_advantages_by_loops():
    generator = torch.Generator().manual_seed(11)
    rewards = torch.randn(5, 8, generator=generator, dtype=torch.float64) * 0.01
    rewards[3] = -0.25  # a group of equal rewards
    advantages = leave_one_out_advantages(rewards, dim=-1)
    for group, row in enumerate(rewards.tolist()):
        for k, reward in enumerate(row):
            others = row[:k] + row[k + 1 :]
            assert math.isclose(float(advantages[group, k]), reward - sum(others) / len(others), abs_tol=1e-15)
    assert torch.equal(advantages[3], torch.zeros(8, dtype=torch.float64))
    assert float(advantages.abs().max()) < 0.1  # in the reward's units: no std scaling to ±1
    torch.testing.assert_close(leave_one_out_advantages(rewards.T, dim=0), advantages.T, rtol=0, atol=0)
    with pytest.raises(ValueError, match="at least 2 rollouts"):
        leave_one_out_advantages(torch.zeros(3, 1))


def slow_dense_terms(
    evicted: list[float], full: list[float], entropy: list[float], share: float, offset: float, exponent: float
) -> list[float]:
    """(ΔL − δ)₊^p on the tokens whose entropy is at most the `share` quantile (linear interpolation), 0 elsewhere."""
    ordered = sorted(entropy)
    position = share * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    cut = ordered[low] + (ordered[high] - ordered[low]) * (position - low)
    return [max(e - f - offset, 0.0) ** exponent if h <= cut else 0.0 for e, f, h in zip(evicted, full, entropy)]


@pytest.mark.parametrize("offset,exponent", [(0.0, 2.0), (0.1, 1.0), (0.5, 1.5)])
def test_dense_damage_by_loops(offset, exponent):
    generator = torch.Generator().manual_seed(int(offset * 10 + exponent))
    full = torch.rand(60, generator=generator, dtype=torch.float64) * 2
    evicted = full + torch.randn(60, generator=generator, dtype=torch.float64) * 0.8
    entropy = torch.rand(60, generator=generator, dtype=torch.float64)
    terms = Estimator("dense", offset=offset).damage_terms
    dense = token_damage(evicted, full, entropy, share=0.8, threshold=1.0, exponent=exponent, terms=terms)
    expected = slow_dense_terms(evicted.tolist(), full.tolist(), entropy.tolist(), 0.8, offset, exponent)
    torch.testing.assert_close(dense.terms, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    thresholded = token_damage(evicted, full, entropy, share=0.8, threshold=1.0, exponent=exponent)
    assert torch.equal(dense.damaged, thresholded.damaged)  # the damage share counts ΔL > η whatever the rule
    assert int((dense.terms > 0).sum()) > int((thresholded.terms > 0).sum())  # the dense term counts more tokens


def test_self_critical_advantages_by_hand():
    """d_k already measured against the backbone: each is divided by one rms over the whole batch, so a group
    whose d differ by 1e-4 keeps 1e-4 of the push of a 5-nat miss, and a group of equal non-zero d (every draw
    the same set, other than the backbone's) keeps its sign."""
    rewards = torch.tensor([[0.0, -5.0, 1.0, 0.0], [1e-4, -1e-4, 0.0, 0.0], [-0.5, -0.5, -0.5, -0.5]])
    squares = [d * d for row in rewards.tolist() for d in row]
    rms = math.sqrt(sum(squares) / len(squares))  # sqrt((25 + 1 + 2e-8 + 4 * 0.25) / 12)
    advantages = self_critical_advantages(rewards)
    for group, row in enumerate(rewards.tolist()):
        for k, d in enumerate(row):
            assert math.isclose(float(advantages[group, k]), d / (rms + 1e-8), rel_tol=1e-6, abs_tol=1e-12)
    assert math.isclose(rms, math.sqrt(27.00000002 / 12), rel_tol=1e-12)
    assert float(advantages[1].abs().max()) < 1e-4 and float(advantages[0].abs().max()) > 3  # one scale for all
    assert bool((advantages[2] < 0).all())  # Eq. 9 would give this group 0
    assert torch.equal(self_critical_advantages(torch.zeros(2, 3)), torch.zeros(2, 3))


def test_gated_damage_weighs_the_tail_by_loops():
    """(ΔL)₊^p·σ((ΔL − η) / w): half of ΔL^p at η, next to nothing a few w below it, all of it a few w above."""
    delta = torch.tensor([-1.0, 0.0, 0.3, 1.0, 1.5, 2.0, 4.0], dtype=torch.float64)
    terms = Estimator("gated", gate_width=0.2).damage_terms(delta, 1.5, 2.0)
    expected = [max(d, 0.0) ** 2 / (1 + math.exp(-(d - 1.5) / 0.2)) for d in delta.tolist()]
    torch.testing.assert_close(terms, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert math.isclose(float(terms[4]), 1.5**2 / 2) and float(terms[3]) < 0.08 * 1.0 and float(terms[6]) > 0.99 * 16
    torch.testing.assert_close(terms, gated_terms(delta, 1.5, 2.0, width=0.2))


def test_estimator_resolves_every_rule_and_rejects_unknown_ones():
    assert set(REWARD_RULES) == {"thresholded", "dense", "gated"} and set(ADVANTAGE_RULES) == {
        "group_normalised",
        "leave_one_out",
    }
    assert set(BATCH_ADVANTAGE_RULES) == {"self_critical"} and Estimator(advantage="self_critical").batch_wide
    assert Estimator("gated", gate_width=0.3).describe().startswith("reward rule gated (w = 0.3)")
    assert set(LOGPROB_RULES) == {"order", "set"}
    estimator = Estimator("dense", "leave_one_out", "set", offset=0.2)
    assert estimator.name == "set / leave_one_out / dense" and estimator.action_logprob is plackett_luce_set_logprob
    delta = torch.tensor([-0.5, 0.1, 0.3, 2.0], dtype=torch.float64)
    torch.testing.assert_close(estimator.damage_terms(delta, 1.5, 2.0), dense_terms(delta, 1.5, 2.0, offset=0.2))
    rewards = torch.tensor([[0.0, -1.0, -3.0]])
    torch.testing.assert_close(estimator.advantages(rewards, dim=-1), leave_one_out_advantages(rewards))
    torch.testing.assert_close(Estimator().advantages(rewards, dim=-1), group_advantages(rewards))
    for options, message in (
        (
            {"advantage": "ppo"},
            "unknown advantage_rule 'ppo'; allowed: 'group_normalised', 'leave_one_out', 'self_critical'",
        ),
        ({"reward": "sparse"}, "unknown reward_rule 'sparse'; allowed: 'thresholded', 'dense', 'gated'"),
        ({"logprob": "sets"}, "unknown logprob_rule 'sets'; allowed: 'order', 'set'"),
        ({"offset": -0.1}, "damage_offset (δ of the dense reward) must be a finite number >= 0, got -0.1"),
        ({"gate_width": 0.0}, "damage_gate_width (w of the gated reward) must be a finite number > 0, got 0.0"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            Estimator(**options)


# -- the GRPO module with each option ------------------------------------------------------------------
def test_rl_trains_with_the_set_log_probability_rloo_and_the_dense_reward(
    tmp_path, tiny_dir, traces_dir, start_scorer, capsys
):
    config = rl_config(
        tmp_path / "rl.yaml",
        tiny_dir,
        traces_dir,
        model={"logprob_rule": "set", "advantage_rule": "leave_one_out", "reward_rule": "dense", "damage_offset": 0.05},
    )
    run = tmp_path / "run"
    assert cli.main(rl_args(config, start_scorer, run)) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    reward, paper = (float(last.split(f"train/{name} ")[1].split(",")[0]) for name in ("reward", "paper_reward"))
    assert paper < reward <= 0  # η = 0: both count every loss increase, and (ΔL − δ)₊² < ΔL² wherever ΔL > 0
    hparams = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]
    chosen = tuple(hparams[name] for name in ("logprob_rule", "advantage_rule", "reward_rule", "damage_offset"))
    assert chosen == ("set", "leave_one_out", "dense", 0.05)
    card = (run / "scorer" / "README.md").read_text()
    assert "reward rule dense (δ = 0.05), advantage rule leave_one_out, log-probability rule set" in card
    start = load_file(start_scorer / "model.safetensors")
    assert any(
        not torch.equal(tensor, start[name]) for name, tensor in load_file(run / "scorer" / "model.safetensors").items()
    )


def test_dense_reward_without_offset_trains_as_the_threshold_at_zero(tmp_path, tiny_dir, traces_dir, start_scorer):
    """(ΔL − 0)₊^p and ΔL^p·1[ΔL > 0] are the same numbers: the same rewards, so the same trained weights;
    with the set log-probability and RLOO the weights differ from the paper's estimator's."""
    config = rl_config(tmp_path / "rl.yaml", tiny_dir, traces_dir)
    weights = {}
    for name, overrides in (
        ("thresholded", []),
        ("dense", ["model.reward_rule=dense"]),
        ("set-rloo", ["model.logprob_rule=set", "model.advantage_rule=leave_one_out"]),
    ):
        assert cli.main(rl_args(config, start_scorer, tmp_path / name, *overrides)) == 0
        weights[name] = load_file(tmp_path / name / "scorer" / "model.safetensors")
    for name, tensor in weights["thresholded"].items():
        assert torch.equal(weights["dense"][name], tensor), name
    assert any(
        not torch.equal(weights["set-rloo"][name], tensor)
        for name, tensor in weights["thresholded"].items()
        if name != "b2"
    )


# -- foresight bench rl-signal ------------------------------------------------------------------------------
def test_noise_scale_of_samples_with_known_mean_and_covariance():
    """M = 4,000 samples of G + noise in 50 dimensions, tr(Σ) = 50·0.09, |G|² = 0.25: both estimates
    (from the Gram matrix, and from the means of 8 parts) recover B_noise = 18 within 10%."""
    generator = torch.Generator().manual_seed(0)
    mean = torch.zeros(50, dtype=torch.float64)
    mean[:4] = 0.25
    samples = mean + 0.3 * torch.randn(4000, 50, generator=generator, dtype=torch.float64)
    expected = 50 * 0.09 / 0.25
    scale, signal, mean_norm = noise_scale((samples @ samples.T).numpy())
    assert math.isclose(scale, expected, rel_tol=0.1) and math.isclose(signal, 0.25, rel_tol=0.1)
    assert mean_norm > signal  # the measured mean carries the noise of 4,000 samples on top
    parts = [samples[part::8].mean(0) for part in range(8)]
    assert math.isclose(chunk_noise_scale(parts, 4000), expected, rel_tol=0.1)
    assert math.isinf(noise_scale(np.zeros((40, 40)))[0])  # gradients of exactly 0: no signal, B_noise ∞


def test_rl_signal_on_a_tiny_model(tmp_path, tiny_dir, traces_dir, start_scorer, capsys):
    """No token is damaged past η = 10⁶, so the thresholded reward teaches nothing (every group's advantages
    are 0, no signal resolved) in episodes and branch groups alike, while the dense one does (resolved for
    episodes; the 8 branch groups are too few to promise it); the planted reward's true gradient is
    recovered, more closely with more episodes."""
    out = tmp_path / "bench.md"
    argv = [
        "rl-signal",
        "--traces",
        str(traces_dir),
        "--count",
        "2",
        "--tokens",
        "48",
        "--scorer",
        str(start_scorer),
        "--groups",
        "2",
        "--group-size",
        "4",
        "--sample-temperature",
        "1.0",
        "--damage-threshold",
        "1e6",
        "--damage-offset",
        "0.05",
        "--planted-groups",
        "32",
        "--reference-draws",
        "512",
        "--resamples",
        "50",
        "--out",
        str(out),
    ]
    assert studies_main(argv) == 0
    text = out.read_text()
    lines = [line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    noise = {(cells[0], cells[1]): " | ".join(cells[2:]) for cells in lines if len(cells) == 6}
    for kind in ("episodes", "branch groups"):
        for name in ("order / group_normalised / thresholded", "set / leave_one_out / thresholded"):
            assert noise[kind, name].startswith("100% | 0.00 | ∞ (no signal resolved)"), (kind, name)
        for name in ("order / group_normalised / dense", "set / leave_one_out / dense"):
            assert not noise[kind, name].startswith("100%")  # dense rewards differ within groups
    for name in ("order / group_normalised / dense", "set / leave_one_out / dense"):
        assert "∞ (no signal resolved)" not in noise["episodes", name]
    reference = float(text.split("cosine of its two halves: ")[1].split(")")[0])
    assert reference > 0.9
    planted = {cells[0]: cells[1:] for cells in lines if len(cells) == 10}  # 6 episode counts, 2 targets, B_noise
    branches = "order / group_normalised, per-layer branch groups (K = 8"
    for name in (
        "order / group_normalised",
        "order / leave_one_out",
        "set / group_normalised",
        "set / leave_one_out",
        f"{branches})",
    ):
        cosines = [float(cell) for cell in planted[name][:6]]  # n = 4 .. 128 episodes (or groups) per trace
        assert cosines[-1] > max(cosines[0], 0.3), (name, cosines)
    episode, branch = (float(planted[name][5]) for name in ("order / group_normalised", f"{branches})"))
    assert branch > episode  # per-layer credit: closer to the truth at equal groups than whole-episode credit
    assert len(planted[f"{branches}, 1 golden swap)"]) == 9
    assert f"wrote the rl-signal section of {out}" in capsys.readouterr().out


def test_rl_signal_rejects_bad_settings_in_one_line(capsys):
    assert studies_main(["rl-signal", "--planted-groups", "5"]) == 2
    assert "planted_groups must be at least 8 (its tr(Σ) comes from 8 parts), got 5" in capsys.readouterr().err
