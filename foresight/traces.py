"""Reasoning-trace generation and storage (ForesightKV §3.2 and App. E.1).

Traces are sampled from the frozen model with the full cache (``model.generate``, left-padded
batches), then teacher-forced once more to store each token's full-cache loss and entropy: the
reinforcement stage's reward and the evaluation's loss ratio compare against them (docs/algorithms.md
§7-8).

Layout of an output folder::

    manifest.json            settings, and per finished shard its record (derived, see below)
    shard-00000/             a `datasets` Arrow folder of the traces of problems [0, shard_size)
        shard.json           that shard's record: problem range, counts, batch size
    shard-00001/ ...
    .shard-00003.tmp-PID/    a shard being written (renamed to shard-00003 when complete)
    .lock                    file lock guarding manifest.json

Atomic and resumable: a shard is written to a temporary folder and renamed, so a killed run leaves
complete shards and leftovers only; a rerun skips complete shards and deletes the leftovers of the
shards it owns. Each shard's sampling is seeded from (seed, shard index), so a resumed run writes the
same shards as an uninterrupted one (for the same batch size and device: batching changes the
padding and hence the floating-point path). Concurrency: processes with different ``shard=(i, n)``
own disjoint shards (k % n == i); the shard folders with their ``shard.json`` are the source of truth
and ``manifest.json`` is rebuilt from them under a file lock after every shard, so it is never torn
and never misses a shard. Settings that define the data are fixed by the first run into a folder;
a rerun with other settings is refused.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from filelock import FileLock
from tqdm.auto import tqdm
from transformers import GenerationConfig

from foresight.artifacts import atomic_folder, remove_leftovers, write_text
from foresight.tasks import REASONING_GYM, Problem, chat_prompt_ids, check_answer, load_problems

MANIFEST = "manifest.json"
SHARD_RECORD = "shard.json"
LOSS_CHUNK = 1024  # positions per LM-head chunk: 1024 x 49K vocab x 4 bytes = 200 MB of logits
FEATURES = datasets.Features(
    {
        "index": datasets.Value("int64"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "prompt_length": datasets.Value("int32"),
        "token_nll": datasets.List(datasets.Value("float32")),
        "token_entropy": datasets.List(datasets.Value("float32")),
        "answer": datasets.Value("string"),
        "correct": datasets.Value("bool"),
        "prompt": datasets.Value("string"),
        "completion": datasets.Value("string"),
    }
)
_TENSOR_COLUMNS = ["input_ids", "token_nll", "token_entropy"]


@dataclass(frozen=True)
class TraceSettings:
    """What defines a trace folder's data; a rerun into the folder must repeat them exactly."""

    model: str
    source: str
    num: int
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_tokens: int
    only_correct: bool
    seed: int
    shard_size: int

    def __post_init__(self) -> None:
        for name in ("num", "max_new_tokens", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("temperature", "top_k", "min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def num_shards(self) -> int:
        return math.ceil(self.num / self.shard_size)

    def shard_range(self, shard: int) -> range:
        """Problem indices covered by a shard."""
        return range(shard * self.shard_size, min((shard + 1) * self.shard_size, self.num))


@dataclass(frozen=True)
class TraceCounts:
    """What happened to a shard's (or a run's) problems. Filters apply in order: length, then
    correctness, so generated = kept + too_short + incorrect."""

    generated: int = 0
    kept: int = 0
    too_short: int = 0
    incorrect: int = 0
    checked: int = 0  # traces whose answer could be checked
    correct: int = 0
    truncated: int = 0  # reached max_new_tokens without an EOS
    tokens: int = 0  # total length of the kept traces

    def __add__(self, other: TraceCounts) -> TraceCounts:
        return TraceCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TraceCounts:
        """The counts in a shard record (which holds other keys too)."""
        return cls(**{f.name: record[f.name] for f in fields(cls)})

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.checked if self.checked else None


@dataclass(frozen=True)
class TraceRunSummary:
    """The shards a call owns (written now or found complete) and their summed counts."""

    out_dir: Path
    shards_written: int
    shards_skipped: int
    counts: TraceCounts

    def describe(self) -> str:
        """One line stating what the folder holds for this call's shards."""
        c = self.counts
        accuracy = f"accuracy {c.accuracy:.1%} ({c.correct}/{c.checked})" if c.checked else "no answers to check"
        return (
            f"{self.out_dir}: kept {c.kept} of {c.generated} traces ({c.too_short} too short, "
            f"{c.incorrect} incorrect, {c.truncated} truncated), {accuracy}, {c.tokens} tokens; "
            f"{self.shards_written} shard(s) written, {self.shards_skipped} already complete"
        )


@dataclass(frozen=True)
class Trace:
    """One stored trace. ``token_nll[j]`` and ``token_entropy[j]`` are the full-cache loss and
    entropy of predicting ``input_ids[j + 1]`` from ``input_ids[: j + 1]``."""

    index: int
    input_ids: torch.Tensor = field(repr=False)  # [T] int64, prompt then completion (EOS included when generated)
    prompt_length: int
    token_nll: torch.Tensor = field(repr=False)  # [T - 1] float32
    token_entropy: torch.Tensor = field(repr=False)  # [T - 1] float32
    answer: str | None
    correct: bool | None
    prompt: str
    completion: str

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[self.prompt_length :]


@torch.inference_mode()
def token_losses(model, input_ids: torch.Tensor, chunk_size: int = LOSS_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-cache teacher-forced loss and entropy of one sequence, both [T - 1] float32 on CPU.

    One forward through the decoder, then the LM head over chunks of positions so that the
    [T, vocab] logits never exist at once.
    """
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"model {model.name_or_path!r} soft-caps its logits, which token_losses does not apply")
    ids = input_ids.to(model.device).unsqueeze(0)
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
    targets = ids[0, 1:, None]
    head = model.get_output_embeddings()
    nll, entropy = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        log_probs = torch.log_softmax(head(hidden[start : start + chunk_size]).float(), dim=-1)
        nll.append(-log_probs.gather(-1, targets[start : start + chunk_size]).squeeze(-1))
        entropy.append(-(log_probs.exp() * log_probs).sum(-1))
    return torch.cat(nll).cpu(), torch.cat(entropy).cpu()


def generate_traces(
    model,
    tokenizer,
    source: str,
    *,
    num: int,
    max_new_tokens: int,
    out_dir: str | os.PathLike,
    temperature: float = 0.6,
    top_k: int = 20,
    top_p: float = 0.95,
    min_tokens: int = 0,
    only_correct: bool = False,
    batch_size: int = 8,
    shard_size: int = 64,
    shard: tuple[int, int] = (0, 1),
    seed: int = 0,
    progress: bool = True,
    model_name: str | None = None,
) -> TraceRunSummary:
    """Sample one trace per problem of ``source`` (see foresight.tasks) into ``out_dir``.

    Sampling follows the paper's evaluation settings (T = 0.6, top-k 20, top-p 0.95; temperature 0
    is greedy; options not named here, e.g. a repetition penalty, come from the model's
    ``generation_config`` as in ``transformers``). A trace is kept when its length (prompt +
    completion) is at least ``min_tokens`` and, with ``only_correct``, its answer checks as correct
    (App. E.1 keeps correct traces over 4096 tokens). ``shard=(i, n)`` makes this call write only
    shards k with k % n == i. ``model_name`` (default: the model's ``name_or_path``) is recorded and
    checked on reruns.
    """
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard must be i/n with 0 <= i < n, got {index}/{count}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    settings = TraceSettings(
        model=model.name_or_path if model_name is None else model_name,
        source=recorded_source(source),
        num=num,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k,
        top_p=float(top_p),
        min_tokens=min_tokens,
        only_correct=only_correct,
        seed=seed,
        shard_size=shard_size,
    )
    problems = load_problems(source, num, seed)
    writer = _ShardWriter(Path(out_dir), settings)
    owned = list(range(index, settings.num_shards, count))
    todo = [k for k in owned if not writer.is_complete(k)]
    for k in owned:
        remove_leftovers(writer.shard_dir(k))
    sampler = _Sampler(model, tokenizer, settings, batch_size)
    pending = sum(len(settings.shard_range(k)) for k in todo)
    with tqdm(total=pending, disable=not progress, unit="problem", desc="traces") as bar:
        for k in todo:
            with torch.random.fork_rng(devices=_rng_devices(model), device_type=model.device.type):
                torch.manual_seed(_shard_seed(seed, k))
                rows, counts = sampler.shard([problems[i] for i in settings.shard_range(k)], bar)
            writer.write(k, rows, {"batch_size": batch_size, **asdict(counts)})
    total = sum((writer.counts(k) for k in owned), TraceCounts())
    return TraceRunSummary(Path(out_dir), len(todo), len(owned) - len(todo), total)


def recorded_source(source: str) -> str:
    """A prompt source as the settings record it: reasoning-gym:TASK as given, a file or folder as its absolute path."""
    return source if source.startswith(REASONING_GYM) else str(Path(source).resolve())


def finished_run(
    out_dir: str | os.PathLike, settings: TraceSettings, shard: tuple[int, int] = (0, 1)
) -> TraceRunSummary | None:
    """The summary `generate_traces` would give when every shard it owns in `out_dir` is complete, read from the
    manifest without a model; None when a shard is missing. Refuses a folder made with other settings."""
    out_dir = Path(out_dir)
    manifest = _read_json(out_dir / MANIFEST)
    if manifest is None:
        return None
    _check_same_settings(out_dir, manifest["settings"], asdict(settings))
    records = {record["shard"]: record for record in manifest["shards"]}
    owned = range(shard[0], settings.num_shards, shard[1])
    if any(k not in records for k in owned):
        return None
    counts = sum((TraceCounts.from_record(records[k]) for k in owned), TraceCounts())
    return TraceRunSummary(out_dir, 0, len(owned), counts)


def _rng_devices(model) -> list[torch.device]:
    return [model.device] if model.device.type != "cpu" else []


def _shard_seed(seed: int, shard: int) -> int:
    """The sampling seed of one shard: a function of (seed, shard index) only."""
    return int(np.random.SeedSequence([seed, shard]).generate_state(1)[0])


class _Sampler:
    """Samples, checks, filters and scores the traces of one shard's problems."""

    def __init__(self, model, tokenizer, settings: TraceSettings, batch_size: int) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.settings = settings
        self.batch_size = batch_size
        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        if eos is None:
            raise ValueError(f"model {settings.model!r} has no EOS token id, so a trace could never end")
        self.eos_ids = torch.tensor([eos] if isinstance(eos, int) else list(eos), device=model.device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(self.eos_ids[0])
        sampling = dict(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
        self.generation_config = GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            do_sample=settings.temperature > 0,
            **(sampling if settings.temperature > 0 else {}),
            eos_token_id=self.eos_ids.tolist(),
            pad_token_id=self.pad_id,
        )

    def shard(self, problems: Sequence[Problem], bar: tqdm) -> tuple[dict[str, list], TraceCounts]:
        """Columns of the kept traces (in problem order) and the shard's counts."""
        rows: dict[str, list] = {name: [] for name in FEATURES}
        counts = TraceCounts()
        for start in range(0, len(problems), self.batch_size):
            batch = problems[start : start + self.batch_size]
            prompts = [chat_prompt_ids(self.tokenizer, problem.prompt) for problem in batch]
            completions, truncated = self._sample(prompts)
            for problem, prompt, completion, cut in zip(batch, prompts, completions, truncated):
                counts += self._add(rows, problem, prompt, completion, cut)
            bar.update(len(batch))
        return rows, counts

    def _sample(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[bool]]:
        """Completions of a left-padded batch, each cut after its first EOS; and whether each
        ran out of tokens instead."""
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        out = self.model.generate(
            input_ids=ids.to(self.model.device),
            attention_mask=mask.to(self.model.device),
            generation_config=self.generation_config,
        )[:, width:]
        is_eos = torch.isin(out, self.eos_ids)
        ended = is_eos.any(dim=1)
        lengths = torch.where(ended, is_eos.int().argmax(dim=1) + 1, out.shape[1])
        return [row[:n].tolist() for row, n in zip(out.cpu(), lengths.tolist())], (~ended).tolist()

    def _add(
        self, rows: dict[str, list], problem: Problem, prompt: list[int], completion: list[int], truncated: bool
    ) -> TraceCounts:
        """Check and filter one trace; append it to ``rows`` when kept."""
        text = self.tokenizer.decode(completion, skip_special_tokens=True)
        correct = check_answer(problem, text)
        counts = dict(
            generated=1, checked=int(correct is not None), correct=int(bool(correct)), truncated=int(truncated)
        )
        input_ids = prompt + completion
        if len(input_ids) < self.settings.min_tokens:
            return TraceCounts(too_short=1, **counts)
        if self.settings.only_correct and not correct:
            return TraceCounts(incorrect=1, **counts)
        nll, entropy = token_losses(self.model, torch.tensor(input_ids))
        trace = dict(
            index=problem.index,
            input_ids=input_ids,
            prompt_length=len(prompt),
            token_nll=nll.numpy(),
            token_entropy=entropy.numpy(),
            answer=problem.answer,
            correct=correct,
            prompt=problem.prompt,
            completion=text,
        )
        for name, value in trace.items():
            rows[name].append(value)
        return TraceCounts(kept=1, tokens=len(input_ids), **counts)


class _ShardWriter:
    """Owns a trace folder's files: settings check, atomic shard writes, the derived manifest."""

    def __init__(self, out_dir: Path, settings: TraceSettings) -> None:
        self.out_dir = out_dir
        self.settings = settings
        out_dir.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(str(out_dir / ".lock"))
        with self.lock:
            manifest = _read_json(out_dir / MANIFEST)
            if manifest is not None:
                _check_same_settings(out_dir, manifest["settings"], asdict(settings))
            self._write_manifest()

    def shard_dir(self, shard: int) -> Path:
        return self.out_dir / f"shard-{shard:05d}"

    def is_complete(self, shard: int) -> bool:
        return (self.shard_dir(shard) / SHARD_RECORD).is_file()

    def counts(self, shard: int) -> TraceCounts:
        return TraceCounts.from_record(_read_json(self.shard_dir(shard) / SHARD_RECORD))

    def write(self, shard: int, rows: dict[str, list], record: dict[str, Any]) -> None:
        """Save the shard to a temporary folder, then publish it with one rename."""
        span = self.settings.shard_range(shard)
        record = {"shard": shard, "indices": [span.start, span.stop], **record}
        with atomic_folder(self.shard_dir(shard)) as staging, _quiet_datasets():
            datasets.Dataset.from_dict(rows, features=FEATURES).save_to_disk(str(staging), num_shards=1)
            (staging / SHARD_RECORD).write_text(json.dumps(record, indent=1))
        with self.lock:
            self._write_manifest()

    def _write_manifest(self) -> None:
        """Rebuild manifest.json from the complete shards (call with the lock held)."""
        shards = [_read_json(path) for path in sorted(self.out_dir.glob(f"shard-*/{SHARD_RECORD}"))]
        total = sum(map(TraceCounts.from_record, shards), TraceCounts())
        manifest = {
            "settings": asdict(self.settings),
            "num_shards": self.settings.num_shards,
            "complete": len(shards) == self.settings.num_shards,
            "total": asdict(total),
            "shards": shards,
        }
        write_text(self.out_dir / MANIFEST, json.dumps(manifest, indent=1))


def _check_same_settings(out_dir: Path, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    differing = [f"{name} {stored.get(name)!r} -> {new!r}" for name, new in wanted.items() if stored.get(name) != new]
    if differing:
        raise ValueError(
            f"{out_dir} holds traces made with other settings ({', '.join(differing)}); "
            "use another output folder or the same settings"
        )


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence `datasets`' own progress bars (ours is already on screen)."""
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


class TraceView:
    """A sequence of traces over a `datasets.Dataset` of the trace columns."""

    def __init__(self, dataset: datasets.Dataset, settings: dict[str, Any]) -> None:
        self._dataset = dataset
        self._tensors = dataset.with_format("torch", columns=_TENSOR_COLUMNS, output_all_columns=True)
        self.settings = settings

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, row: int) -> Trace:
        item = self._tensors[row]
        return Trace(**{**item, "input_ids": item["input_ids"].long()})

    def __iter__(self) -> Iterator[Trace]:
        return (self[row] for row in range(len(self)))

    def dataset(self) -> datasets.Dataset:
        """The traces as one plain `datasets.Dataset` (lists, no tensor format)."""
        return self._dataset

    def split(self, holdout: float, seed: int = 0) -> tuple[TraceView, TraceView]:
        """(train, held out): a problem is held out when a uniform draw keyed by (seed, problem
        index) falls below ``holdout``, so membership never changes as a folder gains shards."""
        if not 0 <= holdout <= 1:
            raise ValueError(f"holdout must be a fraction in [0, 1], got {holdout}")
        indices = np.asarray(self._dataset["index"], dtype=np.int64)
        draws = np.random.default_rng(seed).random(int(indices.max(initial=-1)) + 1)
        held = draws[indices] < holdout
        return self._subset(np.flatnonzero(~held)), self._subset(np.flatnonzero(held))

    def _subset(self, rows: np.ndarray) -> TraceView:
        return TraceView(self._dataset.select(rows), self.settings)


class TraceStore(TraceView):
    """The complete shards of a trace folder, in problem order."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        out_dir = Path(out_dir)
        manifest = _read_json(out_dir / MANIFEST)
        if manifest is None:
            raise ValueError(f"{out_dir} is not a trace folder (no {MANIFEST}); write one with `foresight traces`")
        records = sorted(out_dir.glob(f"shard-*/{SHARD_RECORD}"))
        shards = [datasets.load_from_disk(str(path.parent)) for path in records]
        empty = datasets.Dataset.from_dict({name: [] for name in FEATURES}, features=FEATURES)
        dataset = datasets.concatenate_datasets(shards) if shards else empty
        super().__init__(dataset, manifest["settings"])
        self.out_dir = out_dir

    def require_model(self, name: str) -> None:
        """Refuse to use these traces with a model other than the one that made them."""
        if self.settings["model"] != name:
            made_with = self.settings["model"]
            raise ValueError(f"the traces in {self.out_dir} were made by {made_with!r}, not by the model {name!r}")
