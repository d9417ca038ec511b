"""A `foresight fit` config of the tiny model, shared by the tests that fit (the trainer's, the fold study's)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.rl_runs import L_, B


def tiny_config(path: Path, tiny_dir: Path, traces: dict | None = None, **data) -> Path:
    """A config of the tiny model; its example cache is redirected into --out by `foresight fit`."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 4,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        },
        "model": {"lr": 0.01},
        "data": {
            "model": str(tiny_dir),
            "traces_dir": str(path.parent / "unused"),
            "budget": B,
            "interval": L_,
            "examples_dir": str(path.parent / "unused-features"),
            "batch_size": 2,
            "holdout": 0.2,
            **data,
        },
        "traces": traces,
    }
    path.write_text(yaml.safe_dump(config))
    return path
