"""The LightningModule base of both training stages: a scorer whose checkpoints carry what made it.

Every checkpoint either stage writes holds the scorer's config and its training record
(`trainers.export.checkpoint_entries`), so `foresight export` needs only the file, whichever Trainer
saved it.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from foresight.scorer.model import ForesightScorer
from trainers.export import checkpoint_entries

UNTRAINED = "b2"
"""The scorer parameter neither stage trains (`ScorerModule.freeze_untrained`)."""


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

    def setup(self, stage: str) -> None:
        """A new scorer that reads log‖W_o v‖ (the transfer set) takes its output factors from the frozen model
        its data is made with, so the factors it saves are those of the model it was trained on."""
        if self.scorer.needs_output_factors:
            self.scorer.set_output_factors(self.trainer.datamodule.frozen.load()[0])

    def freeze_untrained(self) -> None:
        """Stop gradients to b2 (call once `self.scorer` is set).

        Why b2 is not trained: it shifts every score of a (layer, head) alike, and every eviction rule (the
        L lowest, Eq. 2's draws) and both stages' losses compare scores within one (layer, head) only, so
        its gradient is zero but for float rounding, which Adam would scale up to full-size steps that
        differ with the batch's layout (one process or DDP ranks)."""
        self.scorer.get_parameter(UNTRAINED).requires_grad_(False)

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """The scorer's parameters that change a ranking: every one but b2 (`freeze_untrained`)."""
        return [parameter for name, parameter in self.scorer.named_parameters() if name != UNTRAINED]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resume a run saved while b2 was still optimised: its optimiser groups held every scorer
        parameter, b2 (registered last) among them; that entry and its state are dropped."""
        trained = len(self.trained_parameters())
        for optimizer in checkpoint.get("optimizer_states", []):
            for group in optimizer["param_groups"]:
                if len(group["params"]) == trained + 1:
                    optimizer["state"].pop(group["params"].pop(), None)

    def stage_settings(self) -> dict[str, str]:
        """Settings of the stage worth naming on the model card, in words (none by default)."""
        return {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint.update(checkpoint_entries(self.scorer, self.training_record()))
