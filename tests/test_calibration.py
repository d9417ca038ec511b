"""Scores on one scale (issue 55): the calibration loss against a hand computation, the pooled kept-set overlap
against a loop, b2 trained only when calibrating, and a scale this version cannot read named in one line."""

from __future__ import annotations

import json

import pytest
import torch

from foresight.models import tiny_model
from foresight.scorer.model import ScoreScale, read_scorer_config
from tests.scorers import random_scorer
from trainers.ranking import LOG_TARGET_EPS, calibration_loss, pooled_overlap
from trainers.supervised import SupervisedScorer


def test_the_calibration_loss_is_the_squared_error_against_the_log_target():
    alpha = torch.tensor([[0.5, 0.0, 0.25]])
    scores = torch.tensor([[0.0, -10.0, -1.0]])
    targets = [torch.log(torch.tensor(a + LOG_TARGET_EPS)) for a in (0.5, 0.0, 0.25)]
    expected = sum((s - t) ** 2 for s, t in zip((0.0, -10.0, -1.0), targets)) / 3
    assert float(calibration_loss(scores, alpha)[0]) == pytest.approx(float(expected))
    assert float(calibration_loss((alpha + LOG_TARGET_EPS).log(), alpha)[0]) == pytest.approx(0.0, abs=1e-12)


def test_pooled_overlap_spends_one_budget_across_a_layers_heads():
    """Head 0's α are all larger than head 1's: pooled, golden keeps head 0's entries. Scores ordinal inside each head
    but shifted up on head 1 agree inside every head and miss the pooled set; the same scores on α's scale hit it."""
    alpha = torch.tensor([[[0.9, 0.8, 0.7, 0.6], [0.04, 0.03, 0.02, 0.01]]])
    ordinal = torch.tensor([[[4.0, 3.0, 2.0, 1.0], [14.0, 13.0, 12.0, 11.0]]])
    keep = 2
    golden = set(alpha.flatten().topk(2 * keep).indices.tolist())
    for scores, expected in ((ordinal, 0.0), (alpha.log(), 1.0)):
        kept = set(scores.flatten().topk(2 * keep).indices.tolist())
        assert (
            float(pooled_overlap(scores, alpha, keep)[0]) == pytest.approx(len(kept & golden) / (2 * keep)) == expected
        )


def test_calibrating_trains_the_output_bias_and_records_the_scale():
    scorer = random_scorer(tiny_model("llama"), 16, 4)
    spec = {k: v for k, v in vars(scorer.config).items() if k not in ("hidden", "key_values", "scale", "residual")}
    plain, calibrated = SupervisedScorer(dict(spec)), SupervisedScorer(dict(spec), calibration=0.1)
    assert plain.scorer.config.scale is ScoreScale.ORDINAL and not plain.scorer.get_parameter("b2").requires_grad
    assert (
        calibrated.scorer.config.scale is ScoreScale.LOG_TARGET and calibrated.scorer.get_parameter("b2").requires_grad
    )
    assert "log(α + ε)" in calibrated.stage_settings()["ranking loss"]
    with pytest.raises(ValueError, match="calibration >= 0"):
        SupervisedScorer(dict(spec), calibration=-1.0)


def test_a_residual_fit_starts_from_its_feature():
    scorer = random_scorer(tiny_model("llama"), 16, 4)
    spec = {k: v for k, v in vars(scorer.config).items() if k not in ("hidden", "key_values", "scale", "residual")}
    module = SupervisedScorer(dict(spec, feature_set="standardised-heuristic"), residual="last_1")
    assert module.scorer.config.residual == "last_1" and not module.scorer.w2.any() and not module.scorer.b2.any()
    with pytest.raises(
        ValueError, match=f"residual 'last_1' is not a feature of the {scorer.config.feature_set.value} set"
    ):
        SupervisedScorer(dict(spec), residual="last_1")


def test_a_scale_this_version_cannot_read_is_named_in_one_line(tmp_path):
    scorer = random_scorer(tiny_model("llama"), 16, 4)
    scorer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"scale": "probability"}))
    with pytest.raises(
        ValueError, match="unknown score scale 'probability'; allowed: 'ordinal', 'log-target'"
    ) as error:
        read_scorer_config(tmp_path / "config.json")
    assert "\n" not in str(error.value)
