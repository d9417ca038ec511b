"""Training data of the supervised stage: scorer inputs along the golden schedule (ForesightKV §3.2, App. E.1).

Each trace is teacher-forced through the frozen model (no grad) in the eviction runtime, its cache
following the golden schedule of its labels (the `golden` policy), so later layers see the evicted
cache as they would at inference (docs/algorithms.md §6). At every eviction step t and layer, a recorder
wrapped around the golden policy reads, from the same `EvictionContext` the learned policy sees, the
scorer inputs of the B candidates (keys, values, and attention features computed exactly as the
`foresight` policy computes them) and pairs them with the candidates' future scores α_{·,t}.

One example is one trace, as the paper batches (App. E.1): its M eviction steps, each with keys,
values [M, layers, Hkv, B, D], features [M, layers, Hkv, B, F*G] and alpha [M, layers, Hkv, B],
candidates in ascending position. A batch concatenates the steps of its traces.

Replays start from a one-token prompt: the labels' cadence (step t after position B + tL - 1) holds
from the first token, whatever the trace's prompt length. Rows of a replay batch have equal prompts,
so they evict together; a row that ends early replays padding, which is not recorded.

Examples are made on the fly on every pass over the data (`ReplayedTraces`, for GPUs and large
models) or, with `cache_dir`, once per trace by `prepare_data` and written as safetensors
(CACHE/B{B}-L{L}-{features}/trace-{index:06d}.safetensors), so CPU runs, reruns and other ranks
never pay for the model forward again.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lightning as L
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info
from tqdm.auto import tqdm

from foresight.features import FeatureSet
from foresight.cadence import TraceTooShort, check_budget, eviction_steps
from foresight.labels import GoldenLabels, LabelStore, compute_golden_labels, save_labels
from foresight.models import DEFAULT_MODEL, base_model_config, describe, load_model
from foresight.policies import make_policy
from foresight.runtime.policy import EvictionContext, Policy
from foresight.policies.foresight import FEATURE_STATE, observe_features
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.tasks import source_names
from foresight.traces import Trace, TraceStore, describe_traces, folder_sources, generate_traces, trace_origin

FORMAT = "foresight-golden-steps/1"
TENSORS = ("keys", "values", "features", "alpha")


@dataclass
class GoldenStepRecorder(Policy):
    """Follows `golden` (keep scores and any state) and records the scorer inputs of every step.

    Not registered: it exists only to make training data. `feature_set` picks the attention features.
    """

    name = "golden-steps"
    summary = "golden schedule, recording scorer inputs"
    needs_attention = True
    state_fields = FEATURE_STATE

    golden: Policy
    feature_set: str = FeatureSet.PAPER.value
    storage_dtype: torch.dtype = torch.float16
    buffers: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _features: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.golden.state_fields:
            raise ValueError("the recorded golden policy must keep no per-entry state of its own")
        schedule = self.golden.schedule
        self.labels: Sequence[GoldenLabels] = self.golden.labels
        self.num_steps = schedule.num_steps

    def reset(self) -> None:
        self.golden.reset()
        self.buffers = {}

    def observe(self, context: EvictionContext) -> dict[str, torch.Tensor]:
        self._features, state = observe_features(context, self.feature_set)
        return {**self.golden.observe(context), **state}

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        scores = self.golden.keep_scores(context)  # also checks that the cache holds the golden candidates
        self._record(context)
        return scores

    def _record(self, context: EvictionContext) -> None:
        """Write this step's candidates of the rows still inside their trace into the step buffers."""
        steps = self.golden.schedule.step_of(context.positions.amax(dim=(1, 2)).cpu())
        rows = (steps <= self.num_steps).nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        candidates = slice(0, context.num_candidates)
        inputs = {
            "keys": context.keys[..., candidates, :],
            "values": context.values[..., candidates, :],
            "features": self._features[..., candidates, :],
        }
        if not self.buffers:
            self._allocate(context, inputs)
        index = (rows, steps[rows] - 1, context.layer_idx)
        for name, value in inputs.items():
            self.buffers[name][index] = value[rows.to(value.device)].to("cpu", self.storage_dtype)

    def _allocate(self, context: EvictionContext, inputs: dict[str, torch.Tensor]) -> None:
        """Buffers [rows, M_max, layers, Hkv, B, *] and the α of every row's steps."""
        leading = (len(self.labels), int(self.num_steps.max()), context.num_layers)
        for name, value in inputs.items():
            self.buffers[name] = torch.zeros(*leading, *value.shape[1:], dtype=self.storage_dtype)
        alpha = torch.zeros(*leading, *inputs["keys"].shape[1:3])
        for row, labels in enumerate(self.labels):
            alpha[row, : labels.num_steps] = labels.alpha
        self.buffers["alpha"] = alpha

    def examples(self) -> list[dict[str, torch.Tensor]]:
        """Per replayed trace: {keys, values, features, alpha} with a leading step dim of its M steps."""
        return [
            {name: buffer[row, : int(steps)].clone() for name, buffer in self.buffers.items()}
            for row, steps in enumerate(self.num_steps)
        ]


@torch.no_grad()
def golden_steps(
    model,
    traces: Sequence[Trace],
    labels: Sequence[GoldenLabels],
    feature_set: str = FeatureSet.PAPER.value,
    storage_dtype: torch.dtype = torch.float16,
) -> list[dict[str, torch.Tensor]]:
    """Replay `traces` as one batch along their golden schedules; the training examples of each."""
    recorder = GoldenStepRecorder(make_policy("golden", labels=list(labels)), feature_set, storage_dtype)
    budget, interval = labels[0].budget, labels[0].interval
    engine = EvictionEngine(model, recorder, EvictionConfig(budget, interval, sinks=0, protect_prompt=False))
    engine.replay([trace.input_ids for trace in traces], [1] * len(traces))
    return recorder.examples()


def concat_steps(examples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Collate traces into one batch of steps: every tensor concatenated along the step dim, as float32."""
    return {name: torch.cat([example[name] for example in examples]).float() for name in TENSORS}


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

    For runs whose examples are too large to cache (at the paper's B = 1024, one eviction step of a
    4B model holds 0.15-0.3 GB of keys and values). Each pass visits the traces in a new seeded order (or in order, without `shuffle`),
    split across DDP ranks and data-loader workers; every rank gets the same number of traces (the
    order is padded by repeating its start), so ranks run the same number of steps.
    """

    def __init__(
        self,
        traces: Sequence[Trace],
        labels: LabelStore,
        load: Callable[[], object],
        feature_set: str,
        replay_batch_size: int,
        shuffle: bool,
        seed: int = 0,
    ) -> None:
        self.traces, self.labels, self.load = list(traces), labels, load
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
        model = self.load()
        for start in range(0, len(order), self.replay_batch_size):
            batch = [self.traces[i] for i in order[start : start + self.replay_batch_size]]
            labels = [self.labels.load(trace.index, num_tokens=trace.input_ids.numel()) for trace in batch]
            yield from golden_steps(model, batch, labels, self.feature_set, storage_dtype=torch.float32)


def _world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


@dataclass
class TraceRecipe:
    """How `prepare_data` makes the traces when the traces folder does not hold them yet (see
    `foresight.traces.generate_traces`; defaults are the paper's sampling settings)."""

    prompts: str
    num: int
    max_new_tokens: int
    min_tokens: int = 0
    only_correct: bool = False
    temperature: float = 0.6
    top_k: int = 20
    top_p: float = 0.95
    batch_size: int = 8
    shard_size: int = 64
    seed: int = 0


class GoldenDataModule(L.LightningDataModule):
    """Traces -> golden labels -> per-trace examples of the scorer's inputs and targets.

    model: the frozen model, "default" or a folder / Hub id; it must be the one that made the traces.
    traces_dir: a traces folder (`foresight traces`); its labels go to traces_dir/labels-B{B}-L{L}.
    budget, interval: B and L. feature_set: "paper" or "official-8".
    generate: a `TraceRecipe` to make (or resume) the traces in `traces_dir` first; None uses the
      folder as it is.
    holdout: share of traces held out for validation (by problem index, `TraceView.split`).
    batch_size: traces per optimisation step and process, each bringing all its eviction steps
      (the paper's batch is 8 traces).
    replay_batch_size: traces replayed together through the frozen model.
    cache_dir: cache the examples there as safetensors, made once by `prepare_data`; None replays
      the traces on every pass instead (`ReplayedTraces`).
    storage_dtype: dtype of the cached keys, values and features (α stays float32).
    shuffle: shuffle the training traces every epoch. split_seed: seed of the holdout split.
    device, dtype: where and in which dtype the frozen model runs.
    """

    def __init__(
        self,
        traces_dir: str,
        budget: int,
        interval: int,
        model: str = DEFAULT_MODEL,
        feature_set: str = FeatureSet.PAPER.value,
        generate: TraceRecipe | None = None,
        holdout: float = 0.1,
        batch_size: int = 8,
        replay_batch_size: int = 4,
        cache_dir: str | None = None,
        storage_dtype: str = "float16",
        shuffle: bool = True,
        split_seed: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        super().__init__()
        check_budget(budget, interval)
        for name, value in (("batch_size", batch_size), ("replay_batch_size", replay_batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not 0 <= holdout < 1:
            raise ValueError(f"holdout must be a fraction in [0, 1), got {holdout}")
        self.traces_dir = Path(traces_dir)
        self.budget, self.interval = budget, interval
        self.model_name = model
        self.feature_set = FeatureSet.parse(feature_set).value
        self.recipe = generate
        self.holdout, self.split_seed = holdout, split_seed
        self.batch_size, self.replay_batch_size = batch_size, replay_batch_size
        self.cache_dir = None if cache_dir is None else Path(cache_dir) / f"B{budget}-L{interval}-{self.feature_set}"
        self.storage_dtype = _float_dtype("storage_dtype", storage_dtype)
        self.model_dtype = _float_dtype("dtype", dtype)
        self.shuffle, self.device = shuffle, device
        self.labels = LabelStore(self.traces_dir, budget, interval)
        self.train: Dataset | None = None
        self.val: Dataset | None = None
        self._summary: dict[str, str] = {}
        self._model = None

    @property
    def scorer_spec(self) -> dict:
        """The `ScorerConfig` fields the data fixes (model shape, B, L, features, base model, the
        traces' prompt sources)."""
        shape = describe(base_model_config(self.model_name))
        sources = folder_sources(self.traces_dir) or (source_names(self.recipe.prompts) if self.recipe else [])
        return {
            **asdict(shape),
            "budget": self.budget,
            "interval": self.interval,
            "base_model": self.model_name,
            "feature_set": self.feature_set,
            "training_sources": sources,
        }

    def prepare_data(self) -> None:
        """Make what is missing, once per node: traces (with a recipe), labels, and the example cache."""
        if self.recipe is not None:
            recipe = asdict(self.recipe)
            model, tokenizer = self._frozen_model()
            generate_traces(
                model, tokenizer, recipe.pop("prompts"), model_name=self.model_name, out_dir=self.traces_dir, **recipe
            )
        traces = self._labelled_traces(make_missing=True)
        if self.cache_dir is not None:
            todo = [trace for trace in traces if not self._cache_path(trace).is_file()]
            ordered = sorted(todo, key=lambda trace: trace.input_ids.numel())  # similar lengths replay together
            groups = [ordered[i : i + self.replay_batch_size] for i in range(0, len(ordered), self.replay_batch_size)]
            for group in tqdm(groups, desc="golden replay", unit="batch"):
                labels = [self.labels.load(trace.index, num_tokens=trace.input_ids.numel()) for trace in group]
                examples = golden_steps(self._frozen_model()[0], group, labels, self.feature_set, self.storage_dtype)
                for trace, tensors in zip(group, examples):
                    self._write_cache(trace, tensors)
        self._model = None

    def setup(self, stage: str | None = None) -> None:
        if self.train is not None:
            return
        traces = self._labelled_traces(make_missing=False)
        held_out = self._held_out(traces)
        splits = {
            "train": [trace for trace in traces if trace.index not in held_out],
            "val": [trace for trace in traces if trace.index in held_out],
        }
        if not splits["train"]:
            raise ValueError(f"no training traces: every labelled trace of {self.traces_dir} is held out")
        if self.cache_dir is not None:
            self.train, self.val = (CachedTraces([self._checked_cache(t) for t in splits[name]]) for name in ("train", "val"))
        else:
            self.train, self.val = (
                ReplayedTraces(
                    splits[name], self.labels, lambda: self._frozen_model()[0], self.feature_set, self.replay_batch_size,
                    shuffle=self.shuffle and name == "train", seed=self.split_seed,
                )
                for name in ("train", "val")
            )
        settings = self._store().settings
        self._summary = {
            "base model": self.model_name,
            "traces": f"{describe_traces(traces)}; {trace_origin(settings)}",
            "budget B, interval L": f"{self.budget}, {self.interval}",
            "split": f"{len(splits['train'])} training and {len(splits['val'])} held-out traces",
            "eviction steps (training)": str(sum(self._num_steps(t) for t in splits["train"])),
        }

    def summary(self) -> dict[str, str]:
        """What the data holds, in words (after `setup`), for checkpoints and the model card."""
        return dict(self._summary)

    def train_dataloader(self) -> DataLoader:
        """Cached traces go through a `DistributedSampler` on one process too: its order is a function
        of (split_seed, epoch) only, so a resumed run and a run on any number of ranks see the same
        global batches."""
        if isinstance(self.train, ReplayedTraces):  # orders and shards itself
            return DataLoader(self.train, batch_size=self.batch_size, collate_fn=concat_steps)
        sampler = DistributedSampler(
            self.train, num_replicas=_world_size(), rank=_rank(), shuffle=self.shuffle, seed=self.split_seed
        )
        return DataLoader(
            self.train, batch_size=self.batch_size, sampler=sampler, collate_fn=concat_steps,
            drop_last=len(sampler) >= self.batch_size,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val is None or len(self.val) == 0:
            return []
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=concat_steps)

    # -- helpers -----------------------------------------------------------------------------------
    def _frozen_model(self):
        if self._model is None:
            self._model = load_model(self.model_name, dtype=self.model_dtype, device=self.device)
        return self._model

    def _store(self) -> TraceStore:
        store = TraceStore(self.traces_dir)
        made_with = store.settings["model"]
        if made_with != self.model_name:
            raise ValueError(
                f"the traces in {self.traces_dir} were made by {made_with!r}, not by the model {self.model_name!r}"
            )
        return store

    def _num_steps(self, trace: Trace) -> int:
        return eviction_steps(trace.input_ids.numel(), self.budget, self.interval)

    def _labelled_traces(self, make_missing: bool) -> list[Trace]:
        """Traces long enough for an eviction step, their labels made first when asked."""
        traces = []
        for trace in self._store():
            try:
                self._num_steps(trace)
            except TraceTooShort:
                continue
            if trace.index not in self.labels:
                if not make_missing:
                    raise ValueError(f"trace {trace.index} of {self.traces_dir} has no golden labels; run prepare_data first")
                labels = compute_golden_labels(
                    self._frozen_model()[0], trace.input_ids, self.budget, self.interval,
                    trace_index=trace.index, model_name=self.model_name,
                )
                save_labels(labels, self.labels.path(trace.index))
            traces.append(trace)
        if not traces:
            raise ValueError(
                f"no trace of {self.traces_dir} reaches B + L = {self.budget + self.interval} tokens, so none has an "
                "eviction step to learn from"
            )
        return traces

    def _held_out(self, traces: Sequence[Trace]) -> set[int]:
        if self.holdout == 0:
            return set()
        _, held = self._store().split(self.holdout, self.split_seed)
        return {trace.index for trace in held} & {trace.index for trace in traces}

    def _cache_path(self, trace: Trace) -> Path:
        return self.cache_dir / f"trace-{trace.index:06d}.safetensors"

    def _metadata(self, trace: Trace) -> dict[str, str]:
        return {
            "format": FORMAT,
            "model": self.model_name,
            "budget": str(self.budget),
            "interval": str(self.interval),
            "feature_set": self.feature_set,
            "trace_index": str(trace.index),
            "num_tokens": str(trace.input_ids.numel()),
        }

    def _write_cache(self, trace: Trace, tensors: dict[str, torch.Tensor]) -> None:
        """Write atomically: a temporary file renamed into place."""
        path = self._cache_path(trace)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file({name: t.contiguous() for name, t in tensors.items()}, temporary, metadata=self._metadata(trace))
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def _checked_cache(self, trace: Trace) -> Path:
        path = self._cache_path(trace)
        if not path.is_file():
            raise ValueError(f"no cached examples at {path}; run prepare_data first")
        with safe_open(path, framework="pt") as handle:
            stored = handle.metadata() or {}
        expected = self._metadata(trace)
        differing = [f"{key} {stored.get(key)!r} != {value!r}" for key, value in expected.items() if stored.get(key) != value]
        if differing:
            raise ValueError(f"cached examples at {path} were made for something else ({', '.join(differing)}); use another cache_dir")
        return path


def _float_dtype(name: str, value: str) -> torch.dtype:
    dtype = getattr(torch, value, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name} must name a torch float dtype such as 'float16' or 'float32', got {value!r}")
    return dtype
