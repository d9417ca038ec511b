"""`foresight bench pipeline`: every stage timed on the same traces of the tiny model, with its forward share."""

from __future__ import annotations

import time

import pytest
import torch

from foresight.bench.pipeline import ForwardTimer
from foresight.cli import main
from trainers.preparation import FrozenModel, make_labels

B, L_ = 16, 4
STAGES = ["labels", "examples", "eval replay", "fit before", "fit now", "rl rollouts before", "rl rollouts now",
          "rl rollouts now, 2 traces per replay", "rl rollouts now, bfloat16"]


class Sleeper(torch.nn.Module):
    """A module whose forward takes a known time."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x + self.weight


def test_forward_timer_counts_only_the_forward():
    module = Sleeper()
    timer = ForwardTimer(module)
    with timer.timing():
        for _ in range(3):
            module(torch.zeros(1))
            time.sleep(0.02)
    module(torch.zeros(1))  # after the timing: not counted, the hooks are gone
    assert 0.06 <= timer.seconds < 0.1
    assert not module._forward_pre_hooks and not module._forward_hooks


def table_rows(text: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [cell.strip() for cell in cells[1:]] for cells in rows[1:]}  # past the header


def test_pipeline_times_every_stage_with_its_forward_share(traces_dir, tiny_dir, tmp_path, capsys):
    make_labels(FrozenModel(str(tiny_dir)), traces_dir, B, L_, progress=False)
    out = tmp_path / "bench.md"
    argv = ["bench", "pipeline", "--traces", str(traces_dir), "-B", str(B), "-L", str(L_), "--fit-steps", "3",
            "--group-size", "2", "--out", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    assert "<!-- pipeline-cpu:start -->" in text and f"foresight bench pipeline --traces {traces_dir}" in text
    stages, steps = text.split("Per eviction step")
    rows = table_rows(stages)
    assert list(rows) == STAGES
    for stage, cells in rows.items():
        work, seconds, rate, share = cells[1:]
        assert float(seconds) > 0 and float(rate.split()[0].replace(",", "")) > 0, (stage, cells)
        if stage.startswith("fit"):
            assert work == "2 steps" and share == "–"
        else:
            assert work.endswith("tokens") and 0 < float(share.rstrip("%")) / 100 <= 1, (stage, cells)
    assert "2 worker processes" in rows["fit now"][0]
    counts = table_rows(steps)
    assert list(counts) == ["snapkv", "foresight", "rl rollouts (G = 2)"]
    for replay, (reads, ops) in counts.items():
        assert reads == "0.0" and float(ops.replace(",", "")) > 10, (replay, reads, ops)  # rows in step read nothing back
    assert capsys.readouterr().out.strip().endswith(f"wrote the pipeline section of {out}")


@pytest.mark.parametrize(
    "options, message",
    [(["--fit-steps", "1"], "--fit-steps 1 must be at least 2"), (["--policy", "full"], "--policy 'full' evicts nothing")],
)
def test_pipeline_refuses_bad_options_in_one_line(traces_dir, tmp_path, capsys, options, message):
    argv = ["bench", "pipeline", "--traces", str(traces_dir), "--out", str(tmp_path / "bench.md"), *options]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error


@pytest.mark.parametrize("feature_set, key_values", [("standardised", True), ("paper", True), ("standardised", False)])
def test_the_fit_step_of_before_has_the_scores_loss_and_gradient_of_now(feature_set, key_values):
    """The benchmark's row of before times the same arithmetic as now, up to float rounding: the scores
    of the concatenated einsum forward, Eq. 6 over the whole batch and its gradient."""
    from foresight.bench.fit_before import ranking_loss_before, scores_before
    from foresight.scorer.model import ForesightScorer, ScorerConfig
    from trainers.ranking import PairWeight, pairwise_ranking_loss

    torch.manual_seed(0)
    config = ScorerConfig(num_layers=3, num_query_heads=4, num_kv_heads=2, head_dim=8, budget=16, interval=4,
                          base_model="tiny", feature_set=feature_set, key_values=key_values)
    scorer = ForesightScorer(config)
    shape = (3, 5, 2, 16)  # layers, batch, Hkv, N
    keys, values = (torch.randn(*shape, 8).half() * 4 for _ in range(2))
    features = torch.rand(*shape, config.feature_width).half()
    alpha = torch.rand(*shape) ** 3
    torch.testing.assert_close(scorer(keys, values, features), scores_before(scorer, keys, values, features),
                               rtol=0, atol=2e-6)
    for weight in PairWeight:
        gap = weight is PairWeight.GAP
        now = torch.randn(*shape).mul(0.01).requires_grad_()
        before = now.detach().clone().requires_grad_()
        loss_now = pairwise_ranking_loss(now, alpha, 0.01, weight=weight)[0]
        loss_before = ranking_loss_before(before, alpha, 0.01, gap)
        torch.testing.assert_close(loss_now, loss_before, rtol=1e-5, atol=1e-7)
        loss_now.sum().backward()
        loss_before.sum().backward()
        torch.testing.assert_close(now.grad, before.grad, rtol=1e-5, atol=1e-7)
