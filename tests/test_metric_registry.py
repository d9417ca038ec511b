"""The metric registry: every metric pools declared sums, and the paired ones pool sums every trace score keeps."""

from dataclasses import fields

import pytest
import torch

from foresight.eval.headroom import FIGURES, TraceScore
from foresight.eval.metric_registry import METRICS, SUM, Metric, Sum


def test_every_metric_pools_declared_sums_and_names_are_unique():
    assert len({m.name for m in METRICS}) == len(METRICS)
    for metric in METRICS:
        assert metric.numerator in SUM and metric.denominator in (None, *SUM), metric.name
        assert metric.label is not None or not (metric.interval or metric.plotted), (
            f"{metric.name}: a figure with no label"
        )


def test_paired_metrics_read_sums_every_trace_score_keeps():
    kept = {f.name for f in fields(TraceScore)}
    assert (
        list(FIGURES)
        == [m.name for m in METRICS if m.paired]
        == ["loss_ratio", "low_entropy_damage", "low_entropy_penalty", "low_entropy_flip_rate"]
    )
    for numerator, denominator in FIGURES.values():
        assert {numerator, denominator} <= kept


def test_a_metric_is_its_pooled_ratio_a_count_or_its_empty_value():
    pooled = {"damaged": 3, "low_entropy": 12, "overlap_hits": 0, "overlap_kept": 0}
    assert Metric("share", "damaged", "low_entropy").value(pooled) == 0.25
    assert Metric("count", "damaged").value(pooled) == 3
    assert Metric("overlap", "overlap_hits", "overlap_kept", empty=None).value(pooled) is None
    assert Metric("overlap", "overlap_hits", "overlap_kept").value(pooled) == 0.0


def test_a_sum_pools_tokens_averages_seeds_and_keeps_what_the_trace_fixes():
    terms = Sum("terms", lambda s: s)
    parts = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    assert terms.of_trace(parts[0]) == 3.0 and terms.pooled(parts) == 6.0
    assert torch.equal(
        terms.mean([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])]), torch.tensor([2.0, 3.5], dtype=torch.float64)
    )
    assert Sum("count", lambda s: s).mean([1, 2]) == 1.5
    shared = Sum("tokens", lambda s: s, shared=True)
    assert shared.mean([4, 4]) == 4
    with pytest.raises(ValueError, match="same tokens"):
        shared.mean([4, 5])
