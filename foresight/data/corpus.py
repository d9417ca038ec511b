"""Hygiene of a trace corpus (the folders of `data/corpus`): no prompt in two folders, and a trace taken out of a
folder with its reason kept in the folder's records.

A prompt is a trace's prompt token ids (`Trace.input_ids[:prompt_length]`), so two folders of one model share a
prompt exactly when a problem was sampled twice, whatever its text says. A trace is taken out by `drop_traces`:
its shard is rewritten without it and it is counted as rejected with the reason, as an import refuses a row, so
`generated = kept + rejected + too_short + incorrect` still holds and the manifest says what happened.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import datasets

from foresight.data.trace_store import SHARD_RECORD, TRACE_SCHEMA, TraceStore, folder_sources, rebuild_manifest


@dataclass(frozen=True)
class SharedPrompt:
    """One prompt held by traces of several folders: (folder name, trace index) of each."""

    holders: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        return ", ".join(f"{folder} trace {index}" for folder, index in self.holders)


def shared_prompts(
    folders: Iterable[str | os.PathLike], allowed: Collection[frozenset[str]] = ()
) -> list[SharedPrompt]:
    """Every prompt that traces of two or more of `folders` hold, except where the folders holding it are one
    of the `allowed` groups (by folder name: training folders made from one another by design)."""
    holders: dict[tuple[int, ...], list[tuple[str, int]]] = defaultdict(list)
    for folder in map(Path, folders):
        for trace in TraceStore(folder):
            holders[tuple(trace.input_ids[: trace.prompt_length].tolist())].append((folder.name, trace.index))
    shared = []
    for found in holders.values():
        names = frozenset(name for name, _ in found)
        if len(names) > 1 and names not in allowed:
            shared.append(SharedPrompt(tuple(found)))
    return shared


TEST_SET_PREFIX = "unseen-"
"""The corpus folders that are test sets (data/corpus/unseen-*): no training trace may be of one of their families."""


def test_set_folders(corpus: str | os.PathLike) -> list[Path]:
    """The test sets of a corpus folder: its `unseen-*` trace folders."""
    return sorted(path for path in Path(corpus).glob(f"{TEST_SET_PREFIX}*") if (path / "manifest.json").is_file())


def refuse_test_families(traces: str | os.PathLike, test_sets: Iterable[str | os.PathLike]) -> None:
    """A one-line ValueError naming the first trace of `traces` whose prompt source (family) a test set holds (the
    test sets' families read from their manifests): called before any fit reads the corpus."""
    held = {source: Path(folder).name for folder in test_sets for source in folder_sources(folder)}
    for trace in TraceStore(traces):
        if trace.source in held:
            raise ValueError(
                f"trace {trace.index} of {traces} is of {trace.source}, a family of test set {held[trace.source]}; "
                "a training corpus holds no test family (remove its traces, or leave the family out of the recipe)"
            )


def drop_traces(folder: str | os.PathLike, indices: Collection[int], reason: str) -> None:
    """Take the traces `indices` out of `folder`: each is rewritten out of its shard and counted there as a
    rejected row with `reason`; the manifest is rebuilt. A trace the folder does not hold is a ValueError."""
    folder, wanted = Path(folder), set(indices)
    held = {trace.index for trace in TraceStore(folder)}
    if missing := sorted(wanted - held):
        raise ValueError(f"{folder} holds no trace {missing}; it holds traces {sorted(held)}")
    for shard in sorted(folder.glob("shard-*")):
        rows = datasets.load_from_disk(str(shard))
        dropped = [row for row in rows if row["index"] in wanted]
        if not dropped:
            continue
        record = json.loads((shard / SHARD_RECORD).read_text())
        for row in dropped:
            for counts in (record, record["sources"][row["source"]]):
                counts["kept"] -= 1
                counts["rejected"] = counts.get("rejected", 0) + 1
                counts["tokens"] -= len(row["input_ids"])
            record["rejected_rows"] = sorted(
                [*record.get("rejected_rows", []), {"row": row["index"], "reason": reason}], key=lambda r: r["row"]
            )
        kept = [row for row in rows if row["index"] not in wanted]
        columns = {name: [row[name] for row in kept] for name in TRACE_SCHEMA}
        _replace_folder(shard, datasets.Dataset.from_dict(columns, features=TRACE_SCHEMA), record)
    rebuild_manifest(folder)


def _replace_folder(shard: Path, rows: datasets.Dataset, record: dict) -> None:
    """Write the shard anew beside it, then swap it in (a stop between the two renames leaves the old shard
    under a name no reader opens, and the new one complete)."""
    staging, old = shard.with_name(f".{shard.name}.new"), shard.with_name(f".{shard.name}.old")
    for leftover in (staging, old):
        shutil.rmtree(leftover, ignore_errors=True)
    rows.save_to_disk(str(staging), num_shards=1)
    (staging / SHARD_RECORD).write_text(json.dumps(record, indent=1))
    shard.rename(old)
    staging.rename(shard)
    shutil.rmtree(old)
