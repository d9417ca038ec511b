"""The supervised stage's data module: it reads traces, their golden labels and the example cache.

It makes nothing. `foresight fit` makes what it reads first, with the functions of the verbs
(`foresight traces`, `foresight labels`, `foresight examples`; see `trainers.preparation`); an input
that is missing, damaged or made with other settings is a one-line error naming the command that
makes it. One example is one trace's eviction steps (`trainers.examples`); a batch concatenates
the steps of its traces.

Without a example cache (`examples_dir: None`) the examples are replayed from the traces and labels
through the frozen model on every pass instead (`ReplayedTraces`), for runs whose examples are too
large to store (at the paper's B = 1024, one eviction step of a 4B model holds 0.15-0.3 GB of keys
and values). That mode runs the model, but only to compute the scorer's inputs along labels that
exist: it never samples traces or makes labels.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    get_worker_info,
)

from foresight.cadence import Regime, TraceTooShort, eviction_steps, regime_shift
from foresight.data.trace_store import (
    Trace,
    TraceStore,
    describe_traces,
    folder_sources,
    trace_origin,
)
from foresight.labels import LabelKind, LabelStore
from foresight.models import DEFAULT_MODEL, describe, float_dtype, load_config
from foresight.scorer.attention_features import FeatureSet
from trainers.data_stage import FrozenModel
from trainers.example_cache import ExampleCache, ExampleKey
from trainers.examples import TENSORS, golden_steps
from trainers.trace_split import TraceSplitDataModule

CACHED_WORKERS = 2  # loader processes reading cached examples, by default


def concat_steps(examples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Collate traces into one batch of steps: every tensor concatenated along the step dim, in the dtype
    it was stored in, so half-precision examples cross the loader and the copy to the device at half
    the bytes (the module casts them on the device)."""
    return {name: torch.cat([example[name] for example in examples]) for name in TENSORS}


class CachedTraces(Dataset):
    """Map-style dataset of cached traces: item i is the examples of trace file i."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return load_file(self.paths[index])


class ReplayedTraces(IterableDataset):
    """The examples of traces made on the fly: each pass replays the traces through the frozen model.

    Each pass visits the traces in a new seeded order (or in order, without `shuffle`), split across
    DDP ranks and data-loader workers; every rank gets the same number of traces (the order is padded
    by repeating its start), so ranks run the same number of steps.
    """

    def __init__(
        self,
        traces: Sequence[Trace],
        labels: LabelStore,
        frozen: FrozenModel,
        feature_set: str,
        replay_batch_size: int,
        shuffle: bool,
        seed: int = 0,
    ) -> None:
        self.traces, self.labels, self.frozen = list(traces), labels, frozen
        self.feature_set, self.replay_batch_size = feature_set, replay_batch_size
        self.shuffle, self.seed, self.passes = shuffle, seed, 0

    def __len__(self) -> int:
        return math.ceil(len(self.traces) / _world_size())

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        order = list(range(len(self.traces)))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.passes)
            order = torch.randperm(len(order), generator=generator).tolist()
        self.passes += 1
        world, rank = _world_size(), _rank()
        order = (order * world)[: len(self) * world][rank::world]
        worker = get_worker_info()
        if worker is not None:
            order = order[worker.id :: worker.num_workers]
        model = self.frozen.load()[0]
        for start in range(0, len(order), self.replay_batch_size):
            batch = [self.traces[i] for i in order[start : start + self.replay_batch_size]]
            labels = [self.labels.load(trace.index, num_tokens=trace.input_ids.numel()) for trace in batch]
            yield from golden_steps(model, batch, labels, self.feature_set, storage_dtype=torch.float32)


def _world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class GoldenDataModule(TraceSplitDataModule):
    """Traces, golden labels and the example cache -> batches of the scorer's inputs and targets.

    model: the frozen model, "default" or a folder / Hub id; it must be the one that made the traces.
    traces_dir: a traces folder (`foresight traces`); its labels are in traces_dir/labels-B{B}-L{L}.
    budget, interval: B and L. feature_set: "paper", "official-8", "pooled", "standardised" or "standardised-heuristic"
      (`foresight.scorer.attention_features`).
    examples_dir: the example cache (`foresight examples`); None replays the traces on every pass.
    on_policy_dirs: example caches of the scorer's own trajectories (`foresight fit --rounds`), each
      holding every training trace; their examples join the golden ones in training (validation stays
      golden, so its figures compare across rounds).
    storage_dtype: dtype of the cached keys, values and features (α stays float32).
    label_kind: the labels the targets come from (`foresight labels --kind`: alpha or another `LabelKind`);
      part of the example cache's key, so the examples of one kind are never read as another's.
    regime: the eviction regime whose steps the examples follow (`foresight.cadence.Regime`: streaming or
      decode); its labels are those of that regime, it is part of the example cache's key, and the scorer's
      config records it.
    exclude_sources: prompt sources whose traces are never read (`TraceSplitDataModule`); the example cache
      still holds them, so every fold of a fold study reads one cache.
    per_source: read only the first N traces (by problem index) of each prompt source, and label and cache only
      those (None: every trace): a sample of every family, whose labels and examples a machine makes in a
      fraction of the corpus's time.
    device, dtype: where and in which dtype the frozen model runs, for the features (the dtype is part
      of the cache's key) or the replay.
    replay_batch_size: traces replayed together through the frozen model.
    holdout: share of traces held out for validation (by problem index, `TraceView.split`).
    batch_size: traces per optimisation step and process, each bringing all its eviction steps
      (the paper's batch is 8 traces).
    shuffle: shuffle the training traces every epoch. split_seed: seed of the holdout split.
    num_workers: loader processes (persistent across epochs); None: 2 reading an example cache, 0 when
      replaying (the replay runs the frozen model, in this process).
    pin_memory: collate into pinned memory, for asynchronous copies to the GPU; None: when the
      trainer runs on CUDA.
    """

    def __init__(
        self,
        traces_dir: str,
        budget: int,
        interval: int,
        model: str = DEFAULT_MODEL,
        feature_set: str = FeatureSet.PAPER.value,
        examples_dir: str | None = None,
        on_policy_dirs: list[str] | None = None,
        storage_dtype: str = "float16",
        device: str = "cpu",
        dtype: str = "float32",
        replay_batch_size: int = 4,
        holdout: float = 0.1,
        batch_size: int = 8,
        shuffle: bool = True,
        split_seed: int = 0,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        label_kind: str = LabelKind.ALPHA.value,
        regime: str = Regime.STREAMING.value,
        exclude_sources: list[str] | None = None,
        per_source: int | None = None,
    ) -> None:
        super().__init__(traces_dir, budget, interval, model, holdout, split_seed, batch_size, exclude_sources)
        if per_source is not None and per_source < 1:
            raise ValueError(f"per_source must be at least 1 (or null for every trace), got {per_source}")
        self.per_source = per_source
        if replay_batch_size < 1:
            raise ValueError(f"replay_batch_size must be at least 1, got {replay_batch_size}")
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers must be at least 0 (or null for the default), got {num_workers}")
        self.feature_set = FeatureSet.parse(feature_set).value
        self.frozen = FrozenModel(model, device=device, dtype=float_dtype("dtype", dtype))
        self.regime = Regime.parse(regime)
        key = ExampleKey(
            model,
            dtype,
            budget,
            interval,
            self.feature_set,
            storage_dtype,
            label_kind=label_kind,
            regime=self.regime.value,
        )
        self.examples = None if examples_dir is None else ExampleCache(examples_dir, traces_dir, key)
        self.on_policy = [ExampleCache.of_trajectory(folder, traces_dir, key) for folder in on_policy_dirs or []]
        if self.on_policy and self.examples is None:
            raise ValueError("on_policy_dirs need the golden examples in a cache too (data.examples_dir, not null)")
        self.replay_batch_size = replay_batch_size
        self.shuffle = shuffle
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self._resumed_epoch = 0  # the sampler epoch of a run resumed from a checkpoint (`load_state_dict`)
        self.labels = LabelStore(self.traces_dir, budget, interval, label_kind, self.regime)
        self.train: Dataset | None = None
        self.train_indices: list[int] = []  # the training split, after `setup`
        self.val: Dataset | None = None

    @property
    def scorer_spec(self) -> dict:
        """The `ScorerConfig` fields the data fixes (model shape, B, L, features, base model, the
        traces' prompt sources when the folder already holds traces)."""
        shape = describe(load_config(self.model_name))
        sources = [source for source in folder_sources(self.traces_dir) if source not in self.excluded_sources]
        return {
            **asdict(shape),
            "budget": self.budget,
            "interval": self.interval,
            "base_model": self.model_name,
            "feature_set": self.feature_set,
            "training_sources": sources,
            "regime": self.regime.value,
        }

    def setup(self, stage: str | None = None) -> None:
        if self.train is not None:
            return
        store = self.open_store()
        sample = store if self.per_source is None else store.first_of_each(self.per_source)
        traces = [trace for trace in sample if self._num_steps(trace) and self.reads(trace)]
        if not traces:
            raise ValueError(
                f"no trace of {self.traces_dir} reaches B + L = {self.budget + self.interval} tokens, so none has an "
                "eviction step to learn from"
            )
        held_out = self._held_out(store, traces)
        splits = {
            "train": [trace for trace in traces if trace.index not in held_out],
            "val": [trace for trace in traces if trace.index in held_out],
        }
        if not splits["train"]:
            raise ValueError(f"no training traces: every trace of {self.traces_dir} with an eviction step is held out")
        if self.examples is not None:
            on_policy = [path for cache in self.on_policy for path in cache.paths(splits["train"])]
            self.train = CachedTraces(self.examples.paths(splits["train"]) + on_policy)
            self.val = CachedTraces(self.examples.paths(splits["val"]))
        else:
            for trace in traces:
                self.labels.require(trace.index, num_tokens=trace.input_ids.numel())
            self.train, self.val = (
                ReplayedTraces(
                    splits[name],
                    self.labels,
                    self.frozen,
                    self.feature_set,
                    self.replay_batch_size,
                    shuffle=self.shuffle and name == "train",
                    seed=self.split_seed,
                )
                for name in ("train", "val")
            )
        settings = store.settings
        self._summary = {
            "base model": self.model_name,
            "traces": f"{describe_traces(traces)}; {trace_origin(settings)}",
            "budget B, interval L": f"{self.budget}, {self.interval}",
            "split": f"{len(splits['train'])} training and {len(splits['val'])} held-out traces",
            "eviction steps (training)": str(sum(self._num_steps(t) for t in splits["train"])),
        }
        if self.on_policy:
            self._summary["on-policy examples"] = f"{len(self.on_policy)} round(s) of the scorer's own trajectories"
        if self.per_source is not None:
            self._summary["sample"] = f"the first {self.per_source} traces of each prompt source"
        if self.excluded_sources:
            self._summary["sources never read"] = ", ".join(sorted(self.excluded_sources))
        self.train_indices = [trace.index for trace in splits["train"]]

    def train_dataloader(self) -> DataLoader:
        """Cached traces go through a `DistributedSampler` on one process too: its order is a function
        of (split_seed, epoch) only, so a resumed run and a run on any number of ranks see the same
        global batches."""
        if isinstance(self.train, ReplayedTraces):  # orders and shards itself
            return DataLoader(self.train, batch_size=self.batch_size, collate_fn=concat_steps, **self._loading())
        sampler = DistributedSampler(
            self.train, num_replicas=_world_size(), rank=_rank(), shuffle=self.shuffle, seed=self.split_seed
        )
        # Lightning makes a fit's first iterator before it sets the sampler's epoch, and worker processes
        # draw their first indices as it is made: a resumed run would replay epoch 0's order
        # (Lightning-AI/pytorch-lightning#21938). The epoch it resumes in comes from the checkpoint instead.
        sampler.set_epoch(self._resumed_epoch)
        self._resumed_epoch = 0  # once: a later fit of this module starts from epoch 0 unless it resumes too
        return DataLoader(
            self.train,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=concat_steps,
            drop_last=len(sampler) >= self.batch_size,
            **self._loading(),
        )

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps of the data: the epoch the sampler orders when a run resumes from it (the
        one Lightning will set, `fit_loop.epoch_progress.current.processed`)."""
        return {"sampler_epoch": self.trainer.fit_loop.epoch_progress.current.processed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restored before the loaders are made (see `train_dataloader`)."""
        self._resumed_epoch = state_dict["sampler_epoch"]

    def val_dataloader(self) -> DataLoader | list:
        if self.val is None or len(self.val) == 0:
            return []
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=concat_steps, **self._loading())

    def _loading(self) -> dict[str, int | bool]:
        """The loaders' workers and pinned memory, defaults resolved (see the class docstring)."""
        workers = self.num_workers
        if workers is None:
            workers = 0 if self.examples is None else CACHED_WORKERS
        pin = self.pin_memory
        if pin is None:
            pin = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return {"num_workers": workers, "pin_memory": pin, "persistent_workers": workers > 0}

    def _num_steps(self, trace: Trace) -> int:
        """Eviction steps of a trace in the regime; 0 for one too short for one."""
        try:
            shift = regime_shift(trace.prompt_length, self.budget, self.interval, self.regime)
            return eviction_steps(trace.input_ids.numel(), self.budget, self.interval, shift)
        except TraceTooShort:
            return 0

    def _held_out(self, store: TraceStore, traces: Sequence[Trace]) -> set[int]:
        if self.holdout == 0:
            return set()
        _, held = store.split(self.holdout, self.split_seed)
        return {trace.index for trace in held} & {trace.index for trace in traces}
