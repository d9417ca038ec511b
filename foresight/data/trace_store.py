"""The reasoning-trace store (ForesightKV §3.2 and App. E.1): sharded, resumable Arrow folders.

Traces are sampled from the frozen model with the full cache by continuous batching
(`foresight.data.sampler`: a row that ends is replaced by the next problem at once), and each stores
every token's full-cache loss and entropy, read off the predictions made while sampling: the
reinforcement stage's reward and the evaluation's loss ratio compare against them
(docs/algorithms.md §7-8). Traces made by another engine are imported by `foresight.data.trace_import`
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

Size: the settings, the shard writer, the manifest and the reader share one shard format and one
lock; splitting them would spread that format over several files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from filelock import FileLock

from foresight.artifacts import atomic_folder, check_settings, remove_leftovers, write_text
from foresight.data.tasks import source_names
from foresight.runtime.sampling import Draws

MANIFEST = "manifest.json"
SHARD_RECORD = "shard.json"
TRACE_SCHEMA = datasets.Features(
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
    `source` is the prompt SOURCE as `foresight.data.tasks.recorded_source` writes it (a mixture included)."""

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
    draws: str = Draws.GENERATOR.value  # folders made before the field existed drew from generators

    def __post_init__(self) -> None:
        Draws.parse(self.draws)
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


def finished_run(
    out_dir: str | os.PathLike, settings: TraceSettings, shard: tuple[int, int] = (0, 1)
) -> TraceRunSummary | None:
    """The summary `generate_traces` would give when every shard it owns in `out_dir` is complete, read from the
    manifest without a model; None when a shard is missing. Refuses a folder made with other settings."""
    out_dir = Path(out_dir)
    manifest = _read_json(out_dir / MANIFEST)
    if manifest is None:
        return None
    _check_same_settings(out_dir, _with_defaults(manifest["settings"], settings), asdict(settings))
    records = {record["shard"]: record for record in manifest["shards"]}
    owned = [k for k in range(shard[0], settings.num_shards, shard[1])]
    if any(k not in records for k in owned):
        return None
    done = [records[k] for k in owned]
    return TraceRunSummary(
        out_dir,
        0,
        len(owned),
        sum(map(TraceCounts.from_record, done), TraceCounts()),
        _by_source(done),
        _rejected(done),
    )


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
        return {name: [row[name] for row in rows] for name in TRACE_SCHEMA}

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
                _check_same_settings(out_dir, _with_defaults(manifest["settings"], settings), asdict(settings))
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
            datasets.Dataset.from_dict(rows, features=TRACE_SCHEMA).save_to_disk(str(staging), num_shards=1)
            (staging / SHARD_RECORD).write_text(json.dumps(record, indent=1))
        with self.lock:
            self._write_manifest()

    def summary(self, owned: Sequence[int], written: int) -> TraceRunSummary:
        """What the owned shards hold, `written` of them by this call."""
        records = [self.record(k) for k in owned]
        return TraceRunSummary(
            self.out_dir,
            written,
            len(owned) - written,
            sum(map(TraceCounts.from_record, records), TraceCounts()),
            _by_source(records),
            _rejected(records),
        )

    def _write_manifest(self) -> None:
        """Rebuild manifest.json from the complete shards (call with the lock held)."""
        write_manifest(self.out_dir, asdict(self.settings), self.settings.num_shards)


def write_manifest(out_dir: Path, settings: dict[str, Any], num_shards: int) -> None:
    """manifest.json of a traces folder, from its complete shards' records and the settings it was made with."""
    shards = [_read_json(path) for path in sorted(out_dir.glob(f"shard-*/{SHARD_RECORD}"))]
    total = sum(map(TraceCounts.from_record, shards), TraceCounts())
    manifest = {
        "settings": settings,
        "num_shards": num_shards,
        "complete": len(shards) == num_shards,
        "total": asdict(total),
        "sources": {source: asdict(counts) for source, counts in _by_source(shards).items()},
        "shards": shards,
    }
    write_text(out_dir / MANIFEST, json.dumps(manifest, indent=1))


def rebuild_manifest(out_dir: str | os.PathLike) -> None:
    """manifest.json again from the shards (after a shard was rewritten), with the settings it records."""
    out_dir = Path(out_dir)
    manifest = _read_json(out_dir / MANIFEST)
    if manifest is None:
        raise ValueError(f"{out_dir} holds no {MANIFEST}: not a traces folder")
    with FileLock(str(out_dir / ".lock")):
        write_manifest(out_dir, manifest["settings"], manifest["num_shards"])


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


def _with_defaults(stored: dict[str, Any], settings: Sharded) -> dict[str, Any]:
    """A manifest's settings with the fields added to the class of `settings` since it was written at their
    defaults (which say how the older folders were made)."""
    added = {f.name: f.default for f in fields(settings) if f.default is not MISSING and f.name not in stored}
    return {**stored, **added}


def _check_same_settings(out_dir: Path, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    every = {name: wanted.get(name) for name in dict.fromkeys([*wanted, *stored])}  # a setting on one side counts
    draws = f" (--draws {stored['draws']} keeps its draws)" if stored.get("draws") != wanted.get("draws") else ""
    check_settings(f"the traces in {out_dir}", stored, every, f"use another output folder or the same settings{draws}")


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

    def first_of_each(self, count: int) -> TraceView:
        """The first `count` traces (by problem index) of each source, in order: a sample of every family that does
        not change as a folder gains shards of later problems."""
        if count < 1:
            raise ValueError(f"per_source must be at least 1, got {count}")
        return self._subset(_first_of_each(self._dataset, count))

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
        empty = datasets.Dataset.from_dict({name: [] for name in TRACE_SCHEMA}, features=TRACE_SCHEMA)
        dataset = datasets.concatenate_datasets(shards) if shards else empty
        super().__init__(dataset, manifest["settings"])
        self.out_dir = out_dir

    def require_model(self, name: str) -> None:
        """Refuse to use these traces with a model other than the one that made them."""
        if self.settings["model"] != name:
            made_with = self.settings["model"]
            raise ValueError(f"the traces in {self.out_dir} were made by {made_with!r}, not by the model {name!r}")


def select_traces(
    store: TraceView,
    holdout: float | None,
    seed: int,
    max_traces: int | None,
    sources: Collection[str] | None = None,
    per_source: int | None = None,
) -> TraceView:
    """The held-out split (or every trace), of the prompt `sources` only when given (the held-out families of a
    fold), the first `per_source` traces of each source when given (a fold study's sample of every family), cut
    to the first `max_traces`: what `foresight eval` and the benchmarks that compare on held-out traces read."""
    view: TraceView = store if holdout is None else store.split(holdout, seed)[1]
    if sources is not None:
        held = set(store.sources())
        if unknown := sorted(set(sources) - held):
            raise ValueError(f"no trace of source {', '.join(unknown)}; the folder holds {', '.join(sorted(held))}")
        view = view.where(lambda trace: trace.source in sources)
    if per_source is not None:
        view = view.first_of_each(per_source)
    if max_traces is not None:
        if max_traces < 1:
            raise ValueError(f"--max-traces must be at least 1, got {max_traces}")
        view = TraceView(view.dataset().select(range(min(max_traces, len(view)))), view.settings)
    return view


def _first_of_each(dataset: datasets.Dataset, count: int) -> np.ndarray:
    """The rows of the first `count` traces (by index) of each source, in row order, read from the index and source
    columns alone (no trace is decoded)."""
    indices, sources = dataset["index"], dataset["source"]
    taken: Counter = Counter()
    rows = []
    for row in sorted(range(len(indices)), key=indices.__getitem__):
        if taken[sources[row]] < count:
            taken[sources[row]] += 1
            rows.append(row)
    return np.array(sorted(rows), dtype=np.int64)


def _with_source(shard: datasets.Dataset, manifest: dict[str, Any]) -> datasets.Dataset:
    """A shard written before traces named their source gets the folder's source in that column."""
    if "source" in shard.column_names:
        return shard
    return shard.add_column("source", [manifest["settings"]["source"]] * len(shard)).cast(TRACE_SCHEMA)
