"""`foresight bench pipeline`: every stage timed on the same traces of the tiny model, with its forward share."""

from __future__ import annotations

import time

import pytest
import torch

from foresight.bench.pipeline import ForwardTimer
from foresight.cli import main
from trainers.data_stage import FrozenModel, make_labels

B, L_ = 16, 4
STAGES = [
    "labels",
    "examples",
    "eval replay",
    "fit",
    "rl rollouts before",
    "rl rollouts now",
    "rl rollouts now, 2 traces per replay",
    "rl rollouts now, bfloat16",
]


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
    argv = [
        "bench",
        "pipeline",
        "--traces",
        str(traces_dir),
        "-B",
        str(B),
        "-L",
        str(L_),
        "--fit-steps",
        "3",
        "--group-size",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    text = out.read_text()
    assert "<!-- pipeline-cpu:start -->" in text and f"--traces {traces_dir} --budget 16" in text
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
    assert "2 worker processes" in rows["fit"][0]
    counts = table_rows(steps)
    assert list(counts) == ["snapkv", "foresight", "rl rollouts (G = 2)"]
    for replay, (reads, ops) in counts.items():
        assert reads == "0.0" and float(ops.replace(",", "")) > 10, (
            replay,
            reads,
            ops,
        )  # rows in step read nothing back
    assert capsys.readouterr().out.strip().endswith(f"wrote the pipeline section of {out}")


@pytest.mark.parametrize(
    "options, message",
    [
        (["--fit-steps", "1"], "--fit-steps 1 must be at least 2"),
        (["--policy", "full"], "--policy 'full' evicts nothing"),
    ],
)
def test_pipeline_refuses_bad_options_in_one_line(traces_dir, tmp_path, capsys, options, message):
    argv = ["bench", "pipeline", "--traces", str(traces_dir), "--out", str(tmp_path / "bench.md"), *options]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error
