"""The headroom at equal bytes (`foresight.eval.equal_bytes`) against a slow loop-based reference: the common
token set, the pooled ratios on it and the linear interpolation along each heuristic's sweep."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import foresight.bench.equal_bytes as equal_bytes_bench
from foresight.eval.equal_bytes import (
    TOKEN_NLL,
    TokenLosses,
    common_starts,
    common_token_sums,
    equal_bytes,
    interpolate,
    save_token_losses,
)
from foresight.eval.metric_registry import TokenSet

L = 4
LENGTHS = {0: 60, 1: 45, 2: 52}  # predictions per trace
SWEEPS = {"snapkv": (8, 12, 16), "tova": (8, 16)}
HELD = {("foresight", 8): 1.30, ("golden", 8): 1.0, ("snapkv", 8): 1.05, ("snapkv", 12): 1.25, ("snapkv", 16): 1.45}
HELD |= {("tova", 8): 1.02, ("tova", 16): 1.38}


def synthetic(seed: int = 0) -> tuple[list[TokenLosses], dict[int, torch.Tensor]]:
    """Random NLL per prediction; a larger budget loses less and evicts later (first eviction B + L), and
    tova skips trace 1 at B = 16 (too short for it, say)."""
    generator = torch.Generator().manual_seed(seed)
    reference = {i: torch.rand(n, generator=generator) + 0.5 for i, n in LENGTHS.items()}
    rows = [("foresight", 8), ("golden", 8), *((p, b) for p, bs in SWEEPS.items() for b in bs)]
    losses = []
    for policy, budget in rows:
        for index, n in LENGTHS.items():
            if (policy, budget, index) == ("tova", 16, 1):
                continue
            extra = torch.rand(n, generator=generator) * 8 / budget
            losses.append(TokenLosses(policy, budget, index, budget + L, reference[index] + extra))
    return losses, reference


def reference_ratio(losses, reference, policy: str, budget: int, traces: list[int], start: int) -> float:
    """Σ NLL / Σ full NLL over the predictions j >= start of `traces`, one token at a time."""
    top = bottom = 0.0
    for loss in losses:
        if (loss.policy, loss.budget) == (policy, budget) and loss.index in traces:
            for j in range(start, loss.nll.numel()):
                top += float(loss.nll[j])
                bottom += float(reference[loss.index][j])
    return top / bottom


def test_every_row_is_scored_after_the_largest_budgets_first_eviction():
    losses, reference = synthetic()
    rows = [("foresight", 8), ("golden", 8), ("snapkv", 8), ("snapkv", 16)]
    assert common_starts(losses, rows) == {0: 16 + L, 1: 16 + L, 2: 16 + L}
    assert common_starts(losses, [*rows, ("tova", 16)]) == {0: 16 + L, 2: 16 + L}  # trace 1: tova did not score it
    assert common_starts(losses, rows[:2]) == {0: 8 + L, 1: 8 + L, 2: 8 + L}


def test_equal_bytes_equals_the_slow_reference():
    losses, reference = synthetic()
    result = equal_bytes(losses, reference, HELD, "foresight", 8, ["snapkv", "tova"], resamples=50)
    traces, start = [0, 2], 16 + L  # tova never scored trace 1 at B = 16
    assert (result.traces, result.tokens) == (2, sum(LENGTHS[i] - start for i in traces))
    ratio = {row: reference_ratio(losses, reference, *row, traces, start) for row in HELD}
    assert result.learned_ratio.value == pytest.approx(ratio["foresight", 8], rel=1e-12)
    assert result.golden_ratio.value == pytest.approx(ratio["golden", 8], rel=1e-12)
    at = {}
    for curve in result.curves:
        xs = [HELD[curve.policy, b] for b in SWEEPS[curve.policy]]
        ys = [ratio[curve.policy, b] for b in SWEEPS[curve.policy]]
        assert [r.value for r in curve.loss_ratio] == pytest.approx(ys, rel=1e-12)
        at[curve.policy] = float(np.interp(HELD["foresight", 8], xs, ys))
        assert curve.at_learned.value == pytest.approx(at[curve.policy], rel=1e-12)
    best = min(at, key=at.get)
    assert result.best == best
    share = (at[best] - ratio["foresight", 8]) / (at[best] - ratio["golden", 8])
    assert result.share.value == pytest.approx(share, rel=1e-9)
    assert result.gain.value == pytest.approx(at[best] - ratio["foresight", 8], rel=1e-9)
    entries = min(SWEEPS, key=lambda p: ratio[p, 8])
    assert result.best_entries == entries
    share = (ratio[entries, 8] - ratio["foresight", 8]) / (ratio[entries, 8] - ratio["golden", 8])
    assert result.share_entries.value == pytest.approx(share, rel=1e-9)
    assert result.share.low <= result.share.value <= result.share.high


def test_the_learned_curve_meets_each_heuristic_at_its_own_points_bytes():
    """The learned scorer at a second budget (a fit at B = 12 under the same row name) joins the common
    tokens and meets the best heuristic at its own bytes; the headroom stays at B = 8, where golden is."""
    losses, reference = synthetic()
    generator = torch.Generator().manual_seed(1)
    for index, n in LENGTHS.items():
        extra = torch.rand(n, generator=generator) * 0.3
        losses.append(TokenLosses("foresight", 12, index, 12 + L, reference[index] + extra))
    held = HELD | {("foresight", 12): 1.40}
    result = equal_bytes(losses, reference, held, "foresight", 8, ["snapkv", "tova"], resamples=50)
    traces, start = [0, 2], 16 + L
    ratio = {row: reference_ratio(losses, reference, *row, traces, start) for row in held}
    assert result.learned_curve.budgets == (8, 12) and result.learned_curve.held_mib == (1.30, 1.40)
    assert [r.value for r in result.learned_curve.loss_ratio] == pytest.approx(
        [ratio["foresight", 8], ratio["foresight", 12]], rel=1e-12
    )
    expected = {}
    for budget in (8, 12):
        mib = held["foresight", budget]
        at = {
            policy: float(np.interp(mib, [held[policy, b] for b in bs], [ratio[policy, b] for b in bs]))
            for policy, bs in SWEEPS.items()
            if held[policy, bs[0]] <= mib <= held[policy, bs[-1]]
        }
        best = min(at, key=at.get)
        expected[budget] = (best, at[best] - ratio["foresight", budget])
    assert "tova" not in {m.best for m in result.meetings if m.budget == 12}  # tova's sweep stops at 1.38 MiB
    assert {m.budget: (m.best, pytest.approx(m.gain.value, rel=1e-9)) for m in result.meetings} == expected
    assert result.meetings[0].gain.value == pytest.approx(result.gain.value, rel=1e-12)
    assert "foresight's curve at B = 12 (1.40 MiB): best heuristic at those bytes snapkv" in result.markdown()


def test_a_sweep_that_does_not_reach_the_learned_bytes_gives_no_figure():
    losses, reference = synthetic()
    held = HELD | {("foresight", 8): 1.50}
    result = equal_bytes(losses, reference, held, "foresight", 8, ["snapkv"], resamples=10)
    assert result.curves[0].at_learned is None and result.share is None and result.best is None
    assert "beyond its sweep" in result.markdown()
    with pytest.raises(ValueError, match="no per-token losses for lazy"):
        equal_bytes(losses, reference, HELD, "foresight", 8, ["lazy"], resamples=10)


def test_interpolation_is_linear_between_the_bracketing_points():
    xs, ys = [1.0, 2.0, 4.0], np.array([[3.0, 1.0], [2.0, 1.0], [0.0, 5.0]])
    for x in (1.0, 1.5, 2.0, 3.0, 4.0):
        expected = [np.interp(x, xs, ys[:, k]) for k in range(2)]
        assert interpolate(xs, ys, x) == pytest.approx(expected, rel=1e-15)
    assert interpolate(xs, ys, 0.5) is None and interpolate(xs, ys, 4.5) is None


def test_the_benchmark_reads_eval_folders(tmp_path):
    """`foresight bench equal-bytes` merges the folders' token_nll.pt and results.json (kv_mib) into one figure."""
    losses, reference = synthetic()
    folders = [tmp_path / "at-8", tmp_path / "sweep"]
    for folder, keep in zip(folders, (lambda b: b == 8, lambda b: b != 8)):
        folder.mkdir()
        mine = [loss for loss in losses if keep(loss.budget)]
        save_token_losses(folder / TOKEN_NLL, mine, reference)
        rows = [{"policy": p, "budget": b, "kv_mib": mib} for (p, b), mib in HELD.items() if keep(b)]
        (folder / "results.json").write_text(json.dumps(rows))
    text = equal_bytes_bench.run(
        equal_bytes_bench.Settings(
            sets=(f"toy={folders[0]},{folders[1]}",), learned="foresight", budget=8, heuristics="snapkv,tova"
        )
    )
    direct = equal_bytes(losses, reference, HELD, "foresight", 8, ["snapkv", "tova"])
    assert direct.markdown() in text and f"{direct.share.value:.1%}" in text


def test_the_token_sets_split_the_common_tokens_and_add_up():
    """With prompts ending inside the common tokens, the generated and prompt sums of every row are its
    predictions of j + 1 >= P and < P (a loop over the tokens), and they add up to the all-token sums."""
    prompts = {0: 30, 1: 24, 2: 60}  # trace 2's prompt outlasts its predictions: no generated token
    losses, reference = synthetic()
    losses = [replace(loss, prompt_length=prompts[loss.index]) for loss in losses]
    rows = [("foresight", 8), ("golden", 8), ("snapkv", 8), ("snapkv", 12), ("snapkv", 16), ("tova", 8)]
    starts = common_starts(losses, rows)
    for row in rows:
        parts = {
            s: common_token_sums(losses, reference, starts, row, TokenSet(s)) for s in ("all", "prompt", "generated")
        }
        for i, (index, start) in enumerate(starts.items()):
            loss = next(x for x in losses if (x.policy, x.budget, x.index) == (*row, index))
            generated = sum(float(loss.nll[j]) for j in range(start, loss.nll.numel()) if j + 1 >= prompts[index])
            assert parts["generated"][0][i] == pytest.approx(generated)
            assert parts["prompt"][0][i] + parts["generated"][0][i] == pytest.approx(parts["all"][0][i])
            assert parts["prompt"][1][i] + parts["generated"][1][i] == pytest.approx(parts["all"][1][i])
    result = equal_bytes(losses, reference, HELD, "foresight", 8, list(SWEEPS), token_set="generated")
    assert result.token_set is TokenSet.GENERATED and result.traces == 1  # 1: no tova at B = 16; 2: no generated
    with pytest.raises(ValueError, match="written before the token sets"):
        equal_bytes(synthetic()[0], reference, HELD, "foresight", 8, list(SWEEPS), token_set="prompt")
