"""Training data of the reinforcement stage: stored traces with their full-cache loss and entropy
(ForesightKV §3.3, App. E.1; docs/algorithms.md §7).

A batch is a list of traces, each to be rolled out G times. Rollout groups may span DDP ranks (every
rank replays its share of each trace's G rollouts, and the rewards are all-gathered), so every rank
must see the same traces in the same order: the sampler is a `DistributedSampler` over one replica,
whose order is a function of (seed, epoch) only, the same on every rank, after a resume and on any
number of ranks, and which skips the batches already taken when a run resumes mid-epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from torch.utils.data import DataLoader, DistributedSampler

from foresight.data.trace_store import Trace, TraceView
from foresight.models import DEFAULT_MODEL
from trainers.trace_split import TraceSplitDataModule


def check_stored_losses(trace: Trace, folder: Path) -> None:
    """One-line error unless `trace` holds its full-cache loss and entropy for every prediction."""
    expected = trace.input_ids.numel() - 1
    held = min(trace.token_nll.numel(), trace.token_entropy.numel())
    if trace.token_nll.numel() != expected or trace.token_entropy.numel() != expected:
        raise ValueError(
            f"trace {trace.index} of {folder} has no stored full-cache loss and entropy ({held} of {expected} "
            "values); the reward compares against them, so make the traces with `foresight traces`"
        )


class RolloutDataModule(TraceSplitDataModule):
    """The training split of a traces folder, in batches of traces.

    traces_dir: a traces folder (`foresight traces`), made by `model` ("default", a folder or a Hub
      id; another is refused). budget, interval: B and L of the rollouts; traces too short for an
      eviction that changes a prediction (fewer than B + L + 2 tokens) are left out.
    holdout, split_seed: the held-out share (by problem index, `TraceView.split`) that training never
      sees; use the same values as the supervised stage so both stages leave the same traces out.
    batch_size: traces per optimisation step (each rolled out G times).
    shuffle, seed: visit the traces in a new seeded order every epoch.
    exclude_sources: prompt sources whose traces are never rolled out (`TraceSplitDataModule`).
    """

    def __init__(
        self,
        traces_dir: str,
        budget: int,
        interval: int,
        model: str = DEFAULT_MODEL,
        holdout: float = 0.1,
        split_seed: int = 0,
        batch_size: int = 4,
        shuffle: bool = True,
        seed: int = 0,
        exclude_sources: list[str] | None = None,
    ) -> None:
        super().__init__(traces_dir, budget, interval, model, holdout, split_seed, batch_size, exclude_sources)
        self.shuffle, self.seed = shuffle, seed
        self.train: TraceView | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train is not None:
            return
        store = self.open_store()
        train, held_out = store.split(self.holdout, self.split_seed) if self.holdout else (store, None)
        shortest = self.budget + self.interval + 2
        rows = [row for row, trace in enumerate(train) if trace.input_ids.numel() >= shortest and self.reads(trace)]
        if not rows:
            raise ValueError(
                f"no training trace of {self.traces_dir} reaches B + L + 2 = {shortest} tokens, so none has an "
                "eviction that changes a prediction"
            )
        self.train = TraceView(train.dataset().select(rows), store.settings)
        for trace in self.train:
            check_stored_losses(trace, self.traces_dir)
        self._summary = {
            "base model": self.model_name,
            "traces": f"{len(self.train)} training traces of {store.settings['source']} "
            f"({sum(t.input_ids.numel() for t in self.train)} tokens; {len(train) - len(rows)} shorter than B + L + 2 "
            f"left out, {0 if held_out is None else len(held_out)} held out)",
            "budget B, interval L": f"{self.budget}, {self.interval}",
        }

    def transfer_batch_to_device(self, batch: list[Trace], device, dataloader_idx: int) -> list[Trace]:
        """Traces stay where they are: the replay moves the token ids it feeds."""
        return batch

    def train_dataloader(self) -> DataLoader:
        sampler = ResumingSampler(self.train, self.shuffle, self.seed, self.batch_size, self._batches_taken)
        return DataLoader(
            self.train,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=list,
            drop_last=len(self.train) >= self.batch_size,
        )

    def _batches_taken(self) -> int:
        """Batches the trainer has already taken this epoch: 0, or more when resuming mid-epoch."""
        trainer = self.trainer
        return 0 if trainer is None else trainer.fit_loop.epoch_loop.batch_progress.current.ready


class ResumingSampler(DistributedSampler):
    """The same seeded order on every rank (one replica), from the first batch not yet taken this epoch,
    so a run resumed from a mid-epoch checkpoint sees the batches the whole run would have seen."""

    def __init__(self, traces: TraceView, shuffle: bool, seed: int, batch_size: int, taken: Callable[[], int]) -> None:
        super().__init__(traces, num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
        self.batch_size, self.taken = batch_size, taken

    def __iter__(self) -> Iterator[int]:
        order = list(super().__iter__())
        return iter(order[self.taken() * self.batch_size :])
