"""Bootstrap intervals against a slow loop-based twin, pass@k against enumerating every draw, masked moments
against the moments of the present entries."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from foresight.eval.stats import bootstrap_interval, pass_at_k


def slow_bootstrap(numerators, denominators, resamples, confidence, seed):
    """One resample at a time, sums by hand, the quantiles by sorting and interpolating."""
    n = len(numerators)
    draws = np.random.default_rng(seed).integers(0, n, (resamples, n)).tolist()
    values = []
    for draw in draws:
        top = sum(numerators[i] for i in draw)
        bottom = sum(denominators[i] for i in draw)
        if bottom != 0:
            values.append(top / bottom)
    values.sort()

    def quantile(q):
        at = q * (len(values) - 1)
        below = math.floor(at)
        above = min(below + 1, len(values) - 1)
        return values[below] + (at - below) * (values[above] - values[below])

    return quantile((1 - confidence) / 2), quantile((1 + confidence) / 2)


@pytest.mark.parametrize("seed", [0, 3])
def test_bootstrap_ratio_matches_the_slow_twin(seed):
    rng = random.Random(seed)
    numerators = [rng.uniform(0, 5) for _ in range(17)]
    denominators = [rng.choice([0.0, 1.0, 2.5, 4.0]) for _ in range(17)]
    low, high = bootstrap_interval(numerators, denominators, resamples=300, confidence=0.9, seed=seed)
    slow_low, slow_high = slow_bootstrap(numerators, denominators, 300, 0.9, seed)
    assert low == pytest.approx(slow_low, rel=1e-12) and high == pytest.approx(slow_high, rel=1e-12)
    point = sum(numerators) / sum(denominators)
    assert low <= point <= high


def test_bootstrap_mean_is_the_ratio_over_ones():
    values = [0.0, 1.0, 1.0, 0.5, 0.25, 1.0]
    assert bootstrap_interval(values, seed=5) == bootstrap_interval(values, [1.0] * 6, seed=5)
    assert bootstrap_interval(values, seed=5) == pytest.approx(slow_bootstrap(values, [1.0] * 6, 2000, 0.95, 5))


def test_bootstrap_interval_narrows_with_more_units_and_covers_the_mean():
    rng = np.random.default_rng(1)
    few = rng.binomial(1, 0.3, 20).astype(float)
    many = rng.binomial(1, 0.3, 2000).astype(float)
    few_low, few_high = bootstrap_interval(few)
    many_low, many_high = bootstrap_interval(many)
    assert many_high - many_low < (few_high - few_low) / 5
    assert many_low < 0.3 < many_high


def test_bootstrap_degenerate_cases():
    assert bootstrap_interval([]) is None
    assert bootstrap_interval([1.0, 2.0], [0.0, 0.0]) is None  # no resample has a denominator
    assert bootstrap_interval([0.7]) == (0.7, 0.7)
    assert bootstrap_interval([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == (2.0, 2.0)
    with pytest.raises(ValueError, match="confidence=1.5"):
        bootstrap_interval([1.0], confidence=1.5)
    with pytest.raises(ValueError, match="one numerator and one denominator per unit"):
        bootstrap_interval([1.0, 2.0], [1.0])


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """Share of all k-subsets of the completions that hold a right one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("samples", [1, 2, 5, 7])
def test_pass_at_k_equals_enumerating_every_draw(samples):
    for correct in range(samples + 1):
        outcomes = [True] * correct + [False] * (samples - correct)
        for k in range(1, samples + 1):
            assert pass_at_k(samples, correct, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12)


def test_pass_at_one_is_the_share_right_and_bad_arguments_are_named():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="k=5 must be between 1 and the number of samples 4"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="correct=5"):
        pass_at_k(4, 5, 1)


def test_masked_moments_equal_the_moments_of_the_present_entries_only():
    from foresight.masked import masked_moments

    generator = torch.Generator().manual_seed(0)
    values = torch.randn(5, 7, generator=generator)
    present = torch.rand(5, 7, generator=generator) > 0.4
    present[0] = False  # a row with nothing present
    mean, std = masked_moments(values.masked_fill(~present, float("nan")), present)
    for row in range(5):
        kept = values[row][present[row]]
        expected = (kept.mean(), kept.std(unbiased=False)) if kept.numel() else (torch.tensor(0.0), torch.tensor(0.0))
        torch.testing.assert_close((mean[row, 0], std[row, 0]), expected)
