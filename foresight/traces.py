"""Reasoning-trace generation and storage (ForesightKV §3.2 and App. E.1).

Traces are sampled from the frozen model with the full cache by continuous batching
(`foresight.sampler`: a row that ends is replaced by the next problem at once), and each stores
every token's full-cache loss and entropy, read off the predictions made while sampling: the
reinforcement stage's reward and the evaluation's loss ratio compare against them
(docs/algorithms.md §7-8). Traces made by another engine are imported by `foresight.trace_import`
into the same layout.

Layout of an output folder::

    manifest.json            settings, per finished shard its record, totals overall and per source
    shard-00000/             a `datasets` Arrow folder of the traces of problems [0, shard_size)
        shard.json           that shard's record: problem range, counts (overall and per source)
    shard-00001/ ...
    .shard-00003.tmp-PID/    a shard being written (renamed to shard-00003 when complete)
    .lock                    file lock guarding manifest.json

Atomic and resumable: a shard is written to a temporary folder and renamed, so a killed run leaves
complete shards and leftovers only; a rerun skips complete shards and deletes the leftovers of the
shards it owns. Each problem samples with its own generator seeded from (seed, problem index), so
a trace does not depend on the batch size, the shards, the other problems or an interruption (up
to the rounding of batched kernels). Concurrency: processes with different ``shard=(i, n)`` own
disjoint shards (k % n == i); the shard folders with their ``shard.json`` are the source of truth
and ``manifest.json`` is rebuilt from them under a file lock after every shard, so it is never torn
and never misses a shard. Settings that define the data are fixed by the first run into a folder;
a rerun with other settings is refused.

Size: settings, sampling into shards, the shard writer and the store share the shard format; the
sampler and the import already live in foresight/sampler.py and foresight/trace_import.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from filelock import FileLock
from tqdm.auto import tqdm

from foresight.artifacts import atomic_folder, remove_leftovers, write_text
from foresight.runtime.engine import SamplingConfig
from foresight.sampler import Completion, Request, auto_batch_size, chunked_losses, sample_completions
from foresight.tasks import Problem, chat_prompt_ids, check_answer, load_problems, recorded_source, source_names

MANIFEST = "manifest.json"
SHARD_RECORD = "shard.json"
LOSS_CHUNK = 1024  # positions per LM-head chunk: 1024 x 49K vocab x 4 bytes = 200 MB of logits
FEATURES = datasets.Features(
    {
        "index": datasets.Value("int64"),
        "source": datasets.Value("string"),
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
_SHOWN_ROWS = 8  # row numbers named per rejection reason in a summary


class Sharded:
    """Problems (or imported rows) [0, num) stored in shards of `shard_size`."""

    num: int
    shard_size: int

    @property
    def num_shards(self) -> int:
        return math.ceil(self.num / self.shard_size)

    def shard_range(self, shard: int) -> range:
        """Problem indices covered by a shard."""
        return range(shard * self.shard_size, min((shard + 1) * self.shard_size, self.num))


@dataclass(frozen=True)
class TraceSettings(Sharded):
    """What defines a trace folder's data; a rerun into the folder must repeat them exactly.
    `source` is the prompt SOURCE as `foresight.tasks.recorded_source` writes it (a mixture included)."""

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


@dataclass(frozen=True)
class TraceCounts:
    """What happened to a shard's (or a run's) problems. Filters apply in order: rejection (an
    imported row that cannot be a trace), length, then correctness, so
    generated = kept + rejected + too_short + incorrect."""

    generated: int = 0
    kept: int = 0
    too_short: int = 0
    incorrect: int = 0
    checked: int = 0  # traces whose answer could be checked
    correct: int = 0
    truncated: int = 0  # reached max_new_tokens without an EOS
    tokens: int = 0  # total length of the kept traces
    rejected: int = 0  # imported rows that cannot be traces (each with its reason in the shard record)

    def __add__(self, other: TraceCounts) -> TraceCounts:
        return TraceCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TraceCounts:
        """The counts in a shard record (which holds other keys too; `rejected` is 0 in older records)."""
        return cls(**{f.name: record.get(f.name, 0) for f in fields(cls)})

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.checked if self.checked else None


@dataclass(frozen=True)
class TraceRunSummary:
    """The shards a call owns (written now or found complete), their summed counts, the counts per
    source and the rows refused with their reasons ({reason: [row, ...]})."""

    out_dir: Path
    shards_written: int
    shards_skipped: int
    counts: TraceCounts
    by_source: dict[str, TraceCounts] = field(default_factory=dict)
    rejected: dict[str, list[int]] = field(default_factory=dict)

    def describe(self) -> str:
        """One line stating what the folder holds for this call's shards."""
        c = self.counts
        accuracy = f"accuracy {c.accuracy:.1%} ({c.correct}/{c.checked})" if c.checked else "no answers to check"
        refused = f", {c.rejected} rejected" if c.rejected else ""
        line = (
            f"{self.out_dir}: kept {c.kept} of {c.generated} traces ({c.too_short} too short, "
            f"{c.incorrect} incorrect, {c.truncated} truncated{refused}), {accuracy}, {c.tokens} tokens; "
            f"{self.shards_written} shard(s) written, {self.shards_skipped} already complete"
        )
        if len(self.by_source) > 1:
            line += "; by source: " + ", ".join(
                f"{source} {n.kept}/{n.generated}" for source, n in sorted(self.by_source.items())
            )
        if self.rejected:
            line += "; rejected: " + "; ".join(
                f"{len(rows)} {reason} (row {', '.join(map(str, rows[:_SHOWN_ROWS]))}{', ...' if len(rows) > _SHOWN_ROWS else ''})"
                for reason, rows in sorted(self.rejected.items())
            )
        return line


@dataclass(frozen=True)
class Trace:
    """One stored trace. ``token_nll[j]`` and ``token_entropy[j]`` are the full-cache loss and
    entropy of predicting ``input_ids[j + 1]`` from ``input_ids[: j + 1]``. ``source`` is the
    prompt source it came from (one entry of a mixture, or an imported row's own)."""

    index: int
    source: str
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


def check_plain_logits(model) -> None:
    """Refuse a model whose logits are soft-capped: the stored losses read the LM head directly."""
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"model {model.name_or_path!r} soft-caps its logits, which trace losses do not apply")


@torch.inference_mode()
def token_losses(model, input_ids: torch.Tensor, chunk_size: int = LOSS_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-cache teacher-forced loss and entropy of one sequence, both [T - 1] float32 on CPU.

    One forward through the decoder, then the LM head over chunks of positions so that the
    [T, vocab] logits never exist at once.
    """
    check_plain_logits(model)
    ids = input_ids.to(model.device).unsqueeze(0)
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
    return chunked_losses(model.get_output_embeddings(), hidden, ids[0, 1:], chunk_size)


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
    batch_size: int | None = None,
    shard_size: int = 64,
    shard: tuple[int, int] = (0, 1),
    seed: int = 0,
    progress: bool = True,
    model_name: str | None = None,
) -> TraceRunSummary:
    """Sample one trace per problem of ``source`` (see foresight.tasks; a weighted mixture of
    sources too) into ``out_dir``.

    Sampling follows the paper's evaluation settings (T = 0.6, top-k 20, top-p 0.95; temperature 0
    is greedy; the model's ``generation_config`` is not read). Up to ``batch_size`` problems decode
    together by continuous batching (None: sized to the machine, `foresight.sampler.auto_batch_size`).
    A trace is kept when its length (prompt + completion) is at least ``min_tokens`` and, with
    ``only_correct``, its answer checks as correct (App. E.1 keeps correct traces over 4096 tokens).
    ``shard=(i, n)`` makes this call write only shards k with k % n == i. ``model_name`` (default:
    the model's ``name_or_path``) is recorded and checked on reruns.
    """
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard must be i/n with 0 <= i < n, got {index}/{count}")
    if batch_size is not None and batch_size < 1:
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
    check_plain_logits(model)
    eos_ids = eos_token_ids(model, tokenizer, settings.model)
    problems = load_problems(source, num, seed)
    writer = ShardWriter(Path(out_dir), settings)
    owned, todo = writer.claim(index, count)
    prompts = {i: chat_prompt_ids(tokenizer, problems[i].prompt) for k in todo for i in settings.shard_range(k)}
    if batch_size is None:
        batch_size = auto_batch_size(model, max(map(len, prompts.values()), default=0) + max_new_tokens)
    requests = (Request(i, prompt, problem_seed(seed, i)) for i, prompt in prompts.items())
    sampling = SamplingConfig(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    shards = {k: ShardRows(settings.shard_range(k)) for k in todo}
    shard_of = {i: k for k in todo for i in settings.shard_range(k)}
    with tqdm(total=len(prompts), disable=not progress, unit="problem", desc="traces") as bar:
        tokens = Counter()

        def count(n: int) -> None:
            tokens["sampled"] += n
            bar.set_postfix_str(f"{tokens['sampled']} tokens, {n} rows", refresh=False)

        completions = sample_completions(
            model, requests, max_new_tokens=max_new_tokens, eos_token_ids=eos_ids, sampling=sampling,
            batch_size=batch_size, on_token=count,
        )
        for completion in completions:
            k = shard_of[completion.key]
            rows = shards[k]
            rows.add(*sampled_trace(problems[completion.key], completion, tokenizer, settings))
            bar.update()
            if rows.is_complete():
                writer.write(k, rows.columns(), {"batch_size": batch_size, **rows.record()})
                del shards[k]
    return writer.summary(owned, written=len(todo))


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
    owned = [k for k in range(shard[0], settings.num_shards, shard[1])]
    if any(k not in records for k in owned):
        return None
    done = [records[k] for k in owned]
    return TraceRunSummary(
        out_dir, 0, len(owned), sum(map(TraceCounts.from_record, done), TraceCounts()), _by_source(done), _rejected(done)
    )


def eos_token_ids(model, tokenizer, name: str) -> list[int]:
    """The ids that end a completion: the model's generation config, else the tokenizer's EOS."""
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    if eos is None:
        raise ValueError(f"model {name!r} has no EOS token id, so a trace could never end")
    return [eos] if isinstance(eos, int) else list(eos)


def problem_seed(seed: int, index: int) -> int:
    """The sampling seed of one problem: a function of (seed, problem index) only."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def sampled_trace(
    problem: Problem, completion: Completion, tokenizer, settings: TraceSettings
) -> tuple[int, str, dict[str, Any] | None, TraceCounts]:
    """A sampled completion checked and filtered: (index, source, trace row or None, counts)."""
    return build_trace(
        problem, completion.prompt, completion.tokens, completion.truncated, tokenizer,
        settings.min_tokens, settings.only_correct, lambda: (completion.token_nll, completion.token_entropy),
    )


def build_trace(
    problem: Problem,
    prompt: list[int],
    completion: list[int],
    truncated: bool,
    tokenizer,
    min_tokens: int,
    only_correct: bool,
    losses: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[int, str, dict[str, Any] | None, TraceCounts]:
    """Check and filter one trace (kept when at least ``min_tokens`` long and, with ``only_correct``,
    correct); ``losses`` is called only for a kept trace. Returns (index, source, row or None, counts)."""
    text = tokenizer.decode(completion, skip_special_tokens=True)
    correct = check_answer(problem, text)
    counts = dict(
        generated=1, checked=int(correct is not None), correct=int(bool(correct)), truncated=int(truncated)
    )
    input_ids = prompt + completion
    if len(input_ids) < min_tokens:
        return problem.index, problem.source, None, TraceCounts(too_short=1, **counts)
    if only_correct and not correct:
        return problem.index, problem.source, None, TraceCounts(incorrect=1, **counts)
    nll, entropy = losses()
    trace = dict(
        index=problem.index,
        source=problem.source,
        input_ids=input_ids,
        prompt_length=len(prompt),
        token_nll=nll.numpy(),
        token_entropy=entropy.numpy(),
        answer=problem.answer,
        correct=correct,
        prompt=problem.prompt,
        completion=text,
    )
    return problem.index, problem.source, trace, TraceCounts(kept=1, tokens=len(input_ids), **counts)


class ShardRows:
    """The traces of one shard as they come (in any order): kept rows, counts overall and per
    source, and the rows refused with their reasons."""

    def __init__(self, indices: range) -> None:
        self.indices = indices
        self.seen: set[int] = set()
        self.kept: dict[int, dict[str, Any]] = {}
        self.counts = TraceCounts()
        self.by_source: dict[str, TraceCounts] = defaultdict(TraceCounts)
        self.rejected: list[dict[str, Any]] = []

    def add(self, index: int, source: str, trace: dict[str, Any] | None, counts: TraceCounts) -> None:
        self.seen.add(index)
        if trace is not None:
            self.kept[index] = trace
        self.counts += counts
        self.by_source[source] += counts

    def reject(self, index: int, source: str, reason: str) -> None:
        """An imported row that cannot be a trace, and why."""
        self.add(index, source, None, TraceCounts(generated=1, rejected=1))
        self.rejected.append({"row": index, "reason": reason})

    def is_complete(self) -> bool:
        return len(self.seen) == len(self.indices)

    def columns(self) -> dict[str, list]:
        """The kept traces as columns, in problem order."""
        rows = [self.kept[i] for i in sorted(self.kept)]
        return {name: [row[name] for row in rows] for name in FEATURES}

    def record(self) -> dict[str, Any]:
        """The shard's counts, its counts per source and its refused rows, for shard.json."""
        return {
            **asdict(self.counts),
            "sources": {source: asdict(counts) for source, counts in sorted(self.by_source.items())},
            "rejected_rows": sorted(self.rejected, key=lambda r: r["row"]),
        }


class ShardWriter:
    """Owns a trace folder's files: settings check, atomic shard writes, the derived manifest."""

    def __init__(self, out_dir: Path, settings: Sharded) -> None:
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

    def claim(self, index: int, count: int) -> tuple[list[int], list[int]]:
        """The shards process `index` of `count` owns and those of them still to write; clears what
        dead writers of those shards left behind."""
        owned = list(range(index, self.settings.num_shards, count))
        for k in owned:
            remove_leftovers(self.shard_dir(k))
        return owned, [k for k in owned if not self.is_complete(k)]

    def is_complete(self, shard: int) -> bool:
        return (self.shard_dir(shard) / SHARD_RECORD).is_file()

    def record(self, shard: int) -> dict[str, Any]:
        return _read_json(self.shard_dir(shard) / SHARD_RECORD)

    def write(self, shard: int, rows: dict[str, list], record: dict[str, Any]) -> None:
        """Save the shard to a temporary folder, then publish it with one rename."""
        span = self.settings.shard_range(shard)
        record = {"shard": shard, "indices": [span.start, span.stop], **record}
        with atomic_folder(self.shard_dir(shard)) as staging, _quiet_datasets():
            datasets.Dataset.from_dict(rows, features=FEATURES).save_to_disk(str(staging), num_shards=1)
            (staging / SHARD_RECORD).write_text(json.dumps(record, indent=1))
        with self.lock:
            self._write_manifest()

    def summary(self, owned: Sequence[int], written: int) -> TraceRunSummary:
        """What the owned shards hold, `written` of them by this call."""
        records = [self.record(k) for k in owned]
        return TraceRunSummary(
            self.out_dir, written, len(owned) - written, sum(map(TraceCounts.from_record, records), TraceCounts()),
            _by_source(records), _rejected(records),
        )

    def _write_manifest(self) -> None:
        """Rebuild manifest.json from the complete shards (call with the lock held)."""
        shards = [_read_json(path) for path in sorted(self.out_dir.glob(f"shard-*/{SHARD_RECORD}"))]
        total = sum(map(TraceCounts.from_record, shards), TraceCounts())
        manifest = {
            "settings": asdict(self.settings),
            "num_shards": self.settings.num_shards,
            "complete": len(shards) == self.settings.num_shards,
            "total": asdict(total),
            "sources": {source: asdict(counts) for source, counts in _by_source(shards).items()},
            "shards": shards,
        }
        write_text(self.out_dir / MANIFEST, json.dumps(manifest, indent=1))


def _by_source(records: Sequence[dict[str, Any]]) -> dict[str, TraceCounts]:
    """Counts per source summed over shard records (older records without them count under none)."""
    total: dict[str, TraceCounts] = defaultdict(TraceCounts)
    for record in records:
        for source, counts in record.get("sources", {}).items():
            total[source] += TraceCounts.from_record(counts)
    return dict(sorted(total.items()))


def _rejected(records: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    """{reason: rows} of the refused rows of shard records."""
    reasons: dict[str, list[int]] = defaultdict(list)
    for record in records:
        for row in record.get("rejected_rows", []):
            reasons[row["reason"]].append(row["row"])
    return dict(reasons)


def _check_same_settings(out_dir: Path, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    differing = [
        f"{name} {stored.get(name)!r} -> {wanted.get(name)!r}"
        for name in dict.fromkeys([*wanted, *stored]) if stored.get(name) != wanted.get(name)
    ]
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


def folder_sources(out_dir: str | os.PathLike) -> list[str]:
    """The prompt sources of a trace folder's traces, from its manifest ([] when there is none yet)."""
    manifest = _read_json(Path(out_dir) / MANIFEST)
    if manifest is None:
        return []
    return sorted(manifest.get("sources") or source_names(manifest["settings"]["source"]))


def trace_origin(settings: dict[str, Any]) -> str:
    """How a folder's traces were made, from its settings: the sampling limits, or the imported file."""
    if "max_new_tokens" not in settings:
        return f"imported from {settings['source']}"
    return f"at most {settings['max_new_tokens']} new tokens, temperature {settings['temperature']}"


def describe_traces(traces: Sequence[Trace]) -> str:
    """How many traces, how long, from which sources: e.g. "40 traces, 31200 tokens (length 412 / 790 /
    1093 min / median / max), from reasoning-gym:chain_sum (20), reasoning-gym:lcm (20)"."""
    if not traces:
        return "no traces"
    lengths = sorted(t.input_ids.numel() for t in traces)
    sources = ", ".join(f"{source} ({n})" for source, n in sorted(Counter(t.source for t in traces).items()))
    return (
        f"{len(lengths)} traces, {sum(lengths)} tokens (length {lengths[0]} / {lengths[len(lengths) // 2]} / "
        f"{lengths[-1]} min / median / max), from {sources}"
    )


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

    def sources(self) -> Counter:
        """How many traces come from each source."""
        return Counter(self._dataset["source"])

    def where(self, keep: Callable[[Trace], bool]) -> TraceView:
        """The traces for which ``keep`` is true, in order."""
        return self._subset(np.flatnonzero([keep(trace) for trace in self]))


class TraceStore(TraceView):
    """The complete shards of a trace folder, in problem order."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        out_dir = Path(out_dir)
        manifest = _read_json(out_dir / MANIFEST)
        if manifest is None:
            raise ValueError(f"{out_dir} is not a trace folder (no {MANIFEST}); write one with `foresight traces`")
        records = sorted(out_dir.glob(f"shard-*/{SHARD_RECORD}"))
        shards = [_with_source(datasets.load_from_disk(str(path.parent)), manifest) for path in records]
        empty = datasets.Dataset.from_dict({name: [] for name in FEATURES}, features=FEATURES)
        dataset = datasets.concatenate_datasets(shards) if shards else empty
        super().__init__(dataset, manifest["settings"])
        self.out_dir = out_dir

    def require_model(self, name: str) -> None:
        """Refuse to use these traces with a model other than the one that made them."""
        if self.settings["model"] != name:
            made_with = self.settings["model"]
            raise ValueError(f"the traces in {self.out_dir} were made by {made_with!r}, not by the model {name!r}")


def _with_source(shard: datasets.Dataset, manifest: dict[str, Any]) -> datasets.Dataset:
    """A shard written before traces named their source gets the folder's source in that column."""
    if "source" in shard.column_names:
        return shard
    return shard.add_column("source", [manifest["settings"]["source"]] * len(shard)).cast(FEATURES)
