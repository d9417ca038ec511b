"""The LightningModule base of both training stages: a scorer whose checkpoints carry what made it.

Every checkpoint either stage writes holds the scorer's config and its training record
(`foresight.export.checkpoint_entries`), so `foresight export` needs only the file, whichever Trainer
saved it.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from foresight.export import checkpoint_entries
from foresight.scorer.model import ForesightScorer


class ScorerModule(L.LightningModule):
    """Subclasses set `self.scorer` and may add their own settings to `training_record`."""

    scorer: ForesightScorer

    def training_record(self, extra_metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """What the scorer was trained on and its latest metrics (with `extra_metrics`), as plain values
        (for the model card)."""
        datamodule = getattr(self.trainer, "datamodule", None)
        data = datamodule.summary() if hasattr(datamodule, "summary") else {}
        latest = {**(extra_metrics or {}), **self.trainer.callback_metrics}
        metrics = {name: round(float(value), 6) for name, value in sorted(latest.items())}
        return {**data, **self.stage_settings(), "optimisation steps": self.global_step, "metrics": metrics}

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """The scorer's parameters that change a ranking: W1, b1, W2, not b2.

        Why b2 is left out: it shifts every score of a (layer, head) alike, and every eviction rule (the
        L lowest, Eq. 2's draws) and both stages' losses compare scores within one (layer, head) only, so
        its gradient is zero but for float rounding, which Adam would scale up to full-size steps that
        differ with the batch's layout (one process or DDP ranks)."""
        scorer = self.scorer
        return [scorer.w1, scorer.b1, scorer.w2]

    def stage_settings(self) -> dict[str, str]:
        """Settings of the stage worth naming on the model card, in words (none by default)."""
        return {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint.update(checkpoint_entries(self.scorer, self.training_record()))
