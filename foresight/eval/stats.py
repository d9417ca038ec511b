"""Statistics of the evaluation reports: bootstrap confidence intervals and the pass@k estimator.

Both evaluations report figures pooled over units (traces for the teacher-forced one, problems for
the generation one), and every such figure is a ratio of sums over the units: a mean is the sum of
the values over the count, a loss ratio the evicted NLL summed over traces over the full-cache NLL
summed over the same traces. `bootstrap_interval` therefore takes one numerator and one denominator
per unit, so one implementation serves every column of both reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

RESAMPLES = 2000
CONFIDENCE = 0.95


def bootstrap_interval(
    numerators: Sequence[float],
    denominators: Sequence[float] | None = None,
    *,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of Σ numerators / Σ denominators (the mean of `numerators` when
    `denominators` is None), resampling whole units with replacement.

    Resample r draws the units `numpy.random.default_rng(seed).integers(0, n, (resamples, n))[r]`;
    resamples whose denominators sum to 0 have no value and are left out. The bounds are the
    (1 - confidence) / 2 and (1 + confidence) / 2 quantiles of the resampled values (linear
    interpolation). None when there is no unit or no resample has a value."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    if resamples < 1:
        raise ValueError(f"resamples={resamples} must be at least 1")
    top = np.asarray(numerators, dtype=np.float64)
    bottom = np.ones_like(top) if denominators is None else np.asarray(denominators, dtype=np.float64)
    if top.shape != bottom.shape or top.ndim != 1:
        raise ValueError(f"need one numerator and one denominator per unit, got {top.shape} and {bottom.shape}")
    if top.size == 0:
        return None
    counts = resample_counts(top.size, resamples, seed)
    sums = counts @ bottom
    defined = sums != 0
    if not defined.any():
        return None
    return percentile_interval((counts @ top)[defined] / sums[defined], confidence)


def resample_counts(units: int, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """[resamples, units]: how often resample r draws each unit (with replacement). Every interval of the
    reports draws from this one function, so figures resampled with one seed are paired."""
    draws = np.random.default_rng(seed).integers(0, units, (resamples, units))
    return np.stack([np.bincount(row, minlength=units) for row in draws]).astype(np.float64)


def percentile_interval(values: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The (1 - confidence) / 2 and (1 + confidence) / 2 quantiles of resampled values (linear interpolation)."""
    low, high = np.quantile(values, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k of one problem from `samples` completions of which `correct` are right
    (Chen et al., 2021, "Evaluating Large Language Models Trained on Code", Eq. 1):
    1 - C(n - c, k) / C(n, k), the chance that k completions drawn without replacement include a
    right one."""
    if not 0 <= correct <= samples:
        raise ValueError(f"correct={correct} must be between 0 and samples={samples}")
    if not 1 <= k <= samples:
        raise ValueError(f"k={k} must be between 1 and the number of samples {samples}")
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)
