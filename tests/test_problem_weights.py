"""Cost-weighted ranking problems (issue 55): the regret of a scorer's eviction against loops, its weights, the
weighted loss against a hand-weighted mean, and an unknown weighting named in one line."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from foresight.models import tiny_model
from tests.scorers import random_scorer
from trainers.ranking import eviction_regret, pairwise_ranking_loss, regret_weights
from trainers.supervised import SupervisedScorer

EVICTED = 3


def loop_regret(scores: list[float], alpha: list[float], evicted: int) -> float:
    by_score = sorted(range(len(scores)), key=lambda n: scores[n])[:evicted]
    return sum(alpha[n] for n in by_score) - sum(sorted(alpha)[:evicted])


def test_eviction_regret_equals_a_loop_and_is_zero_for_golden_order():
    generator = torch.Generator().manual_seed(0)
    scores, alpha = torch.randn(4, 2, 10, generator=generator), torch.rand(4, 2, 10, generator=generator)
    regret = eviction_regret(scores, alpha, EVICTED)
    for index in itertools.product(range(4), range(2)):
        expected = loop_regret(scores[index].tolist(), alpha[index].tolist(), EVICTED)
        assert float(regret[index]) == pytest.approx(expected, abs=1e-6)
    assert torch.equal(eviction_regret(alpha.log(), alpha, EVICTED), torch.zeros(4, 2))
    weights = regret_weights(scores, alpha, EVICTED)
    assert float(weights.mean()) == pytest.approx(1.0) and torch.allclose(weights * regret.mean(), regret)
    assert torch.equal(regret_weights(alpha, alpha, EVICTED), torch.ones(4, 2))  # no regret anywhere: Eq. 6


def test_a_regret_weighted_loss_is_the_regret_weighted_mean_of_the_problems():
    scorer = random_scorer(tiny_model("llama"), 16, 4)
    spec = {k: v for k, v in vars(scorer.config).items() if k not in ("hidden", "key_values", "scale", "residual")}
    module = SupervisedScorer(dict(spec), problem_weight="regret")
    module._trainer = SimpleNamespace(world_size=1)
    generator = torch.Generator().manual_seed(1)
    scores, alpha = torch.randn(2, 3, 2, 16, generator=generator), torch.rand(2, 3, 2, 16, generator=generator)
    per_problem, _ = pairwise_ranking_loss(scores, alpha)
    regret = torch.zeros(2, 3, 2)
    for index in itertools.product(range(2), range(3), range(2)):
        regret[index] = loop_regret(scores[index].tolist(), alpha[index].tolist(), 4)  # L = 4 evicted
    expected = (per_problem * regret).sum() / regret.sum()
    assert float(module._loss(scores, alpha)) == pytest.approx(float(expected), rel=1e-5)
    assert "regret of the scorer's eviction" in module.stage_settings()["ranking loss"]
    with pytest.raises(ValueError, match="'costly'") as error:
        SupervisedScorer(dict(spec), problem_weight="costly")
    assert "'regret'" in str(error.value) and "\n" not in str(error.value)
