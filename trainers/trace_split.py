"""The data-module base of both training stages: one traces folder, one held-out split, one summary.

Both stages split by problem index with the same (holdout, split_seed) (`TraceView.split`), so the
reinforcement stage leaves out exactly the traces the supervised stage held out.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from foresight.cadence import check_budget
from foresight.data.trace_store import Trace, TraceStore


class TraceSplitDataModule(L.LightningDataModule):
    """traces_dir, budget, interval, model, holdout, split_seed, batch_size: see the subclasses. exclude_sources:
    prompt sources (families, as a trace's `source` names them) whose traces the stage never reads, neither to
    train nor to validate: the held-out families of a fold (`python -m studies folds`)."""

    def __init__(
        self,
        traces_dir: str,
        budget: int,
        interval: int,
        model: str,
        holdout: float,
        split_seed: int,
        batch_size: int,
        exclude_sources: list[str] | None = None,
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
        self.excluded_sources = frozenset(exclude_sources or ())
        self._summary: dict[str, str] = {}

    def reads(self, trace: Trace) -> bool:
        """Whether the stage may read the trace (its source is not excluded)."""
        return trace.source not in self.excluded_sources

    def open_store(self) -> TraceStore:
        """The traces folder, refused when another model made it."""
        store = TraceStore(self.traces_dir)
        store.require_model(self.model_name)
        return store

    def summary(self) -> dict[str, str]:
        """What the data holds, in words (after `setup`), for checkpoints and the model card."""
        return dict(self._summary)
