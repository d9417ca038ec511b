"""foresight.scorer.ensemble: one wider scorer whose keep score is the mean of its members'."""

from __future__ import annotations

import pytest
import torch

from foresight.scorer.ensemble import ensemble, split
from foresight.scorer.model import load_scorer
from tests.scorers import make_scorer, random_inputs


@pytest.mark.parametrize(
    "feature_set, residual", [("official-8", None), ("standardised", None), ("standardised-heuristic", "last_1")]
)
def test_the_ensemble_scores_the_mean_of_its_members_and_round_trips(tmp_path, feature_set, residual):
    members = [
        make_scorer(seed, feature_set=feature_set, hidden=hidden, training_sources=[source], residual=residual)
        for seed, hidden, source in ((0, 16, "a"), (1, 8, "b"), (2, 16, "a"))
    ]
    with torch.no_grad():  # a residual scorer's output layer starts at 0: trained members differ
        for seed, member in enumerate(members):
            member.w2.normal_(generator=torch.Generator().manual_seed(seed))
    merged = ensemble(members)
    assert merged.config.hidden == 40 and merged.config.training_sources == ["a", "b"]
    keys, values, features = random_inputs(merged.config, 3, 2)
    with torch.no_grad():
        mean = sum(member(keys, values, features) for member in members) / 3
        torch.testing.assert_close(merged(keys, values, features), mean, rtol=0, atol=1e-6)
        layer = [tensor[1] for tensor in (keys, values, features)]
        torch.testing.assert_close(merged.score_layer(1, *layer), mean[1], rtol=0, atol=1e-6)
    merged.save_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(
            load_scorer(tmp_path)(keys, values, features), merged(keys, values, features), rtol=0, atol=0
        )


def test_members_that_read_other_inputs_are_refused():
    with pytest.raises(ValueError, match="at least 2 scorers, got 1"):
        ensemble([make_scorer()])
    with pytest.raises(ValueError, match=r"scorer 1 does not fit scorer 0 \(budget 16 vs 32\)"):
        ensemble([make_scorer(), make_scorer(budget=32)])
    with pytest.raises(ValueError, match="feature_set 'official-8' vs 'paper'"):
        ensemble([make_scorer(), make_scorer(feature_set="paper")])
    heuristic = "standardised-heuristic"
    with pytest.raises(ValueError, match="residual None vs 'last_1'"):
        ensemble([make_scorer(feature_set=heuristic), make_scorer(feature_set=heuristic, residual="last_1")])


def test_split_gives_back_each_members_scores_up_to_their_output_bias():
    members = [make_scorer(seed, feature_set="standardised-grouped", hidden=8) for seed in range(3)]
    merged = ensemble(members)
    keys, values, features = random_inputs(merged.config, merged.config.num_layers, 2)
    parts = split(merged, 3)
    assert [part.config.hidden for part in parts] == [8, 8, 8]
    with torch.no_grad():
        for member, part in zip(members, parts):
            shift = (merged.b2 - member.b2)[:, None, :, None]  # the ensemble's bias replaces the member's
            expected = member(keys, values, features) + shift
            torch.testing.assert_close(part(keys, values, features), expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="divide the scorer's width 24, got 5"):
        split(merged, 5)
    with pytest.raises(ValueError, match="at least 2 and divide the scorer's width 24, got 1"):
        split(merged, 1)
