"""The eviction cadence shared by labels, golden, runtime, evaluation and trainer (foresight.cadence)."""

from __future__ import annotations

import pytest
import torch

from foresight.cadence import (
    TraceTooShort,
    check_budget,
    eviction_steps,
    golden_prefill,
    keep_top,
    step_of,
    step_position,
    top_k_mask,
)


@pytest.mark.parametrize(
    ("budget", "interval", "message"),
    [
        (4, 4, "budget B=4 must be larger than the interval L=4"),
        (3, 4, "budget B=3 must be larger than the interval L=4"),
        (8, 0, "interval L=0 must be at least 1"),
        (8.0, 2, "budget B=8.0 must be an integer"),
        (8, True, "interval L=True must be an integer"),
    ],
)
def test_check_budget_refuses_with_the_value(budget, interval, message):
    with pytest.raises(ValueError) as error:
        check_budget(budget, interval)
    assert str(error.value) == message


def test_steps_fit_inside_the_trace():
    budget, interval = 8, 4
    for num_tokens in range(budget + interval, 40):
        steps = eviction_steps(num_tokens, budget, interval)
        assert step_position(steps, budget, interval) <= num_tokens - 1
        assert step_position(steps + 1, budget, interval) > num_tokens - 1
    with pytest.raises(TraceTooShort, match="11 tokens"):
        eviction_steps(11, budget, interval)


def test_step_of_inverts_step_position_and_is_zero_off_cadence():
    budget, interval = 8, 4
    newest = torch.arange(-2, 40)
    steps = step_of(newest, budget, interval)
    expected = [next((t for t in range(1, 20) if step_position(t, budget, interval) == p), 0) for p in newest.tolist()]
    assert steps.tolist() == expected and steps.max() > 5


def test_golden_prefill_is_at_most_b_plus_l_and_the_shortest_prompt():
    assert golden_prefill([50, 7, 9], 8, 4) == 7
    assert golden_prefill([50, 70], 8, 4) == 12


def slow_top_k(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Pick the highest score one at a time; among equal scores the lowest index first."""
    keep = torch.zeros_like(scores, dtype=torch.bool)
    for row in range(scores.shape[0]):
        values = scores[row].tolist()
        chosen = sorted(range(len(values)), key=lambda i: (-values[i], i))[:count]
        keep[row, chosen] = True
    return keep


def test_top_k_mask_equals_a_slow_pick_with_ties_to_the_older_entry():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (50, 12), generator=generator).float()  # many ties
    for count in (0, 1, 5, 12):
        assert torch.equal(top_k_mask(scores, count), slow_top_k(scores, count))
    counts = torch.tensor([1, 3, 5] * 16 + [0, 12])[:, None]
    per_row = top_k_mask(scores, counts)
    assert all(torch.equal(per_row[r], slow_top_k(scores[r : r + 1], int(counts[r]))[0]) for r in range(50))


def test_keep_top_is_the_top_k_mask_read_as_positions():
    generator = torch.Generator().manual_seed(1)
    alpha = torch.randint(0, 3, (6, 10), generator=generator).float()
    candidates = torch.sort(torch.randperm(40, generator=generator)[:10]).values.expand(6, -1)
    kept = keep_top(candidates, alpha, 4)
    expected = torch.stack([candidates[r][top_k_mask(alpha, 4)[r]] for r in range(6)])
    assert torch.equal(kept, expected)
