"""Teacher-forced metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from foresight.metrics import (
    EntropyDamage,
    attention_cosine,
    golden_overlap,
    loss_ratio,
    low_entropy_damage,
    low_entropy_tokens,
    scored_tokens,
    token_damage,
)


def test_scored_tokens_start_at_the_first_eviction():
    assert scored_tokens(6, 4).tolist() == [False] * 4 + [True] * 2
    assert scored_tokens(3, None).tolist() == [False] * 3


def test_loss_ratio_hand_computed():
    # mean(2, 3, 4) / mean(1, 2, 3) = 3 / 2
    assert loss_ratio(torch.tensor([2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0])) == 1.5
    same = torch.rand(7)
    assert loss_ratio(same, same.clone()) == 1.0
    with pytest.raises(ValueError, match="no scored tokens"):
        loss_ratio(torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError, match="one length"):
        loss_ratio(torch.zeros(2), torch.zeros(3))


def test_low_entropy_tokens_are_the_bottom_share():
    entropy = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0])  # 80% quantile = 4.2: all but the 5
    assert low_entropy_tokens(entropy).tolist() == [False, True, True, True, True]
    entropy = torch.arange(10.0)  # 80% quantile = 7.2: the 8 lowest
    assert low_entropy_tokens(entropy).sum() == 8
    assert low_entropy_tokens(torch.ones(4)).all()  # ties are all in
    with pytest.raises(ValueError, match="share"):
        low_entropy_tokens(entropy, share=0.0)


def test_low_entropy_damage_hand_computed():
    full_nll = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    evicted = torch.tensor([2.1, 0.2, 3.3, 0.4, 9.5])  # ΔL = 2, 0, 3, 0, 9
    entropy = torch.tensor([0.5, 0.1, 0.2, 0.3, 4.0])  # the last token is the high-entropy one
    damage = low_entropy_damage(evicted, full_nll, entropy)
    # Low-entropy tokens 0-3; damaged (ΔL > 1.5): tokens 0 and 2 with ΔL 2 and 3.
    assert (damage.low_entropy, damage.damaged) == (4, 2)
    assert damage.squared_sum == pytest.approx(4 + 9)
    assert damage.share == 0.5 and damage.mean_squared == pytest.approx(6.5)
    # ΔL exactly at the threshold does not count.
    exact = torch.tensor([0.5, 1.0, 0.25, 2.0, 0.75])  # binary fractions: exact + 1.5 - exact == 1.5
    assert low_entropy_damage(exact + 1.5, exact, entropy, threshold=1.5).damaged == 0
    pooled = damage + EntropyDamage(low_entropy=4, damaged=1, squared_sum=3.0)
    assert (pooled.share, pooled.mean_squared) == (3 / 8, pytest.approx(16 / 3))
    assert EntropyDamage().share == 0.0 and EntropyDamage().mean_squared == 0.0


def test_token_damage_per_token_with_another_threshold_and_exponent():
    full_nll = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    evicted = torch.tensor([2.1, 0.2, 3.3, 1.4, 9.5])  # ΔL = 2, 0, 3, 1, 9
    entropy = torch.tensor([0.5, 0.1, 0.2, 0.3, 4.0])  # the last token is the high-entropy one
    damage = token_damage(evicted, full_nll, entropy, threshold=0.5, exponent=3.0)
    assert damage.low_entropy.tolist() == [True, True, True, True, False]
    assert damage.damaged.tolist() == [True, False, True, True, False]  # ΔL > 0.5 among the low-entropy ones
    torch.testing.assert_close(
        damage.terms, torch.tensor([8.0, 0.0, 27.0, 1.0, 0.0], dtype=torch.float64), rtol=1e-6, atol=0
    )
    assert damage.counts() == EntropyDamage(low_entropy=4, damaged=3, squared_sum=pytest.approx(36.0))
    assert low_entropy_damage(evicted, full_nll, entropy, threshold=0.5).squared_sum == pytest.approx(4 + 9 + 1)


def test_mean_of_replays_of_the_same_tokens():
    replays = [EntropyDamage(4, 1, 2.0), EntropyDamage(4, 2, 5.0), EntropyDamage(4, 0, 0.0)]
    assert EntropyDamage.mean(replays) == EntropyDamage(4, 1.0, pytest.approx(7 / 3))
    with pytest.raises(ValueError, match=r"must score the same tokens, got low-entropy counts \[3, 4\]"):
        EntropyDamage.mean([EntropyDamage(4, 1, 2.0), EntropyDamage(3, 1, 2.0)])


def test_attention_cosine_hand_computed():
    evicted = torch.tensor([[[1.0, 0.0], [1.0, 1.0]], [[3.0, 4.0], [0.0, 2.0]]])
    full = torch.tensor([[[2.0, 0.0], [1.0, -1.0]], [[4.0, 3.0], [0.0, -5.0]]])
    expected = torch.tensor([[1.0, 0.0], [24 / 25, -1.0]])
    torch.testing.assert_close(attention_cosine(evicted, full), expected)
    with pytest.raises(ValueError, match="shape"):
        attention_cosine(evicted, full[:1])


def test_golden_overlap_hand_computed():
    # Two heads; the policy kept 3 candidates on each (-1 pads), golden kept 3 on each.
    kept = torch.tensor([[[4, 0, 7, -1], [1, 2, 3, -1]]])
    golden = torch.tensor([[[0, 5, 7], [4, 5, 6]]])
    hits, count = golden_overlap(kept, golden)
    assert hits.tolist() == [[2, 0]] and count.tolist() == [[3, 3]]
    hits, count = golden_overlap(golden, golden)
    assert torch.equal(hits, count) and count.tolist() == [[3, 3]]


def test_golden_overlap_equals_a_set_loop():
    generator = torch.Generator().manual_seed(0)
    kept = torch.randint(-1, 40, (3, 4, 12), generator=generator)
    golden = torch.stack([torch.randperm(40, generator=generator)[:10].sort().values for _ in range(12)]).view(3, 4, 10)
    hits, count = golden_overlap(kept, golden)
    for index in range(12):
        row, head = divmod(index, 4)
        values = [p for p in kept[row, head].tolist() if p >= 0]
        assert count[row, head] == len(values)
        assert hits[row, head] == sum(p in set(golden[row, head].tolist()) for p in values)
    assert not math.isnan(float(hits.sum() / count.sum()))
