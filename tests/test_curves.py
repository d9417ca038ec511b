"""`foresight curves`: a run's TensorBoard scalars against the step, resumed runs merged."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from foresight import cli
from foresight.commands.curves import read_scalars, rolling_mean


def log(folder, values: dict[str, list[tuple[int, float]]]) -> None:
    writer = SummaryWriter(str(folder))
    for tag, points in values.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()


def test_a_resumed_run_is_merged_with_its_later_file_winning(tmp_path):
    log(tmp_path / "lightning_logs" / "version_0", {"train/reward": [(0, -1.0), (1, -2.0), (2, -3.0)]})
    time.sleep(0.05)
    later = tmp_path / "lightning_logs" / "version_1"
    log(later, {"train/reward": [(2, -0.5), (3, -0.25)], "train/kl": [(3, 0.1)]})
    (events,) = later.glob("events.out.tfevents.*")
    os.utime(events, (time.time() + 10, time.time() + 10))  # written after version_0's
    scalars = read_scalars(tmp_path)
    assert scalars["train/reward"] == {0: -1.0, 1: -2.0, 2: -0.5, 3: -0.25}
    assert scalars["train/kl"] == pytest.approx({3: 0.1})


def test_rolling_mean_equals_a_loop():
    values = np.array([1.0, 3.0, -2.0, 5.0, 0.5])
    expected = [np.mean(values[max(0, i - 2) : i + 1]) for i in range(len(values))]
    np.testing.assert_allclose(rolling_mean(values, 3), expected)


def test_curves_draws_the_tags_and_refuses_what_was_not_logged(tmp_path, capsys):
    log(tmp_path / "run", {"train/loss": [(step, 1 / (step + 1)) for step in range(20)]})
    out = tmp_path / "curves.png"
    assert cli.main(["curves", str(tmp_path / "run"), "--tags", "train/loss", "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and "over 20 steps" in capsys.readouterr().out
    series = tmp_path / "curves.json"  # beside the PNG: the figure redraws after its run folder is gone
    redrawn_scalars = read_scalars(series)  # TensorBoard logs float32: the values to its precision
    assert list(redrawn_scalars) == ["train/loss"]
    assert redrawn_scalars["train/loss"] == pytest.approx({step: 1 / (step + 1) for step in range(20)}, rel=1e-6)
    redrawn = tmp_path / "redrawn.png"
    assert cli.main(["curves", str(series), "--tags", "train/loss", "--out", str(redrawn)]) == 0
    assert redrawn.read_bytes().startswith(b"\x89PNG") and json.loads(series.read_text())["window"] == 10
    assert cli.main(["curves", str(tmp_path / "run"), "--out", str(tmp_path / "rl.png")]) == 2
    assert "logged no train/reward, train/kl_per_set" in capsys.readouterr().err and not (tmp_path / "rl.png").exists()
    assert cli.main(["curves", str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "holds no TensorBoard logs" in capsys.readouterr().err
    assert cli.main(["curves", str(tmp_path / "run"), "--window", "0", "--out", str(out)]) == 2
    assert "--window must be at least 1 step, got 0" in capsys.readouterr().err
