"""The data-module base of both training stages: one traces folder, one held-out split, one summary.

Both stages split by problem index with the same (holdout, split_seed) (`TraceView.split`), so the
reinforcement stage leaves out exactly the traces the supervised stage held out.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from foresight.cadence import check_budget
from foresight.data.trace_store import TraceStore


class TraceSplitDataModule(L.LightningDataModule):
    """traces_dir, budget, interval, model, holdout, split_seed, batch_size: see the subclasses."""

    def __init__(
        self, traces_dir: str, budget: int, interval: int, model: str, holdout: float, split_seed: int, batch_size: int
    ) -> None:
        super().__init__()
        check_budget(budget, interval)
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if not 0 <= holdout < 1:
            raise ValueError(f"holdout must be a fraction in [0, 1), got {holdout}")
        self.traces_dir = Path(traces_dir)
        self.budget, self.interval, self.model_name = budget, interval, model
        self.holdout, self.split_seed, self.batch_size = holdout, split_seed, batch_size
        self._summary: dict[str, str] = {}

    def open_store(self) -> TraceStore:
        """The traces folder, refused when another model made it."""
        store = TraceStore(self.traces_dir)
        store.require_model(self.model_name)
        return store

    def summary(self) -> dict[str, str]:
        """What the data holds, in words (after `setup`), for checkpoints and the model card."""
        return dict(self._summary)
