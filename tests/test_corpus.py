"""Hygiene of the shipped corpus (foresight.data.corpus): no prompt in two folders but the training folders made
from one another, a planted duplicate found, a trace dropped with its reason, and the named subsets hold traces
of their folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from foresight.data.corpus import drop_traces, shared_prompts
from foresight.data.trace_store import TraceStore

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"
TRAINING_GROUPS = (
    frozenset({"gsm-main", "gsm-train"}),  # gsm-main's traces are the first 19 problems of gsm-train's recipe
    frozenset({"gsm-main", "gsm-train", "train52"}),  # train52 drew gsm_symbolic problems 0, 1 and 3 of seed 0
)
"""Training folders allowed to share prompts (data/corpus/README.md); an evaluation folder shares none."""


def corpus_folders() -> list[Path]:
    return sorted(path for path in CORPUS.iterdir() if (path / "manifest.json").is_file())


def test_no_two_corpus_folders_share_a_prompt():
    shared = shared_prompts(corpus_folders(), allowed=TRAINING_GROUPS)
    assert not shared, "; ".join(map(str, shared))


def test_a_planted_duplicate_is_found(tmp_path):
    """A folder holding one of unseen A's traces (a copy of its first shard) shares exactly those prompts."""
    planted = tmp_path / "planted"
    shutil.copytree(CORPUS / "unseen-a", planted, ignore=shutil.ignore_patterns("labels-*"))
    for shard in sorted(planted.glob("shard-*"))[1:]:
        shutil.rmtree(shard)
    copied = {trace.index for trace in TraceStore(planted)}
    shared = shared_prompts([CORPUS / "unseen-a", planted, CORPUS / "unseen-b"])
    assert copied and {holders for s in shared for holders in s.holders} == {
        *(("unseen-a", i) for i in copied),
        *(("planted", i) for i in copied),
    }


def test_a_dropped_trace_leaves_its_folder_with_its_reason(tmp_path):
    folder = Path(shutil.copytree(CORPUS / "gsm-heldout", tmp_path / "gsm", ignore=shutil.ignore_patterns("labels-*")))
    before = json.loads((folder / "manifest.json").read_text())["total"]
    victim = next(iter(TraceStore(folder)))
    drop_traces(folder, [victim.index], "shares its prompt with another folder")
    after = json.loads((folder / "manifest.json").read_text())
    assert victim.index not in {trace.index for trace in TraceStore(folder)}
    assert after["total"]["kept"] == before["kept"] - 1
    assert after["total"]["rejected"] == before.get("rejected", 0) + 1
    assert after["total"]["tokens"] == before["tokens"] - victim.input_ids.numel()
    rows = [row for shard in after["shards"] for row in shard["rejected_rows"]]
    assert {"row": victim.index, "reason": "shares its prompt with another folder"} in rows
    with pytest.raises(ValueError, match=rf"holds no trace \[{victim.index}\]"):
        drop_traces(folder, [victim.index], "again")


def test_the_named_subsets_hold_traces_of_their_folder():
    subsets = json.loads((CORPUS / "subsets.json").read_text())
    for folder, named in subsets.items():
        held = {trace.index for trace in TraceStore(CORPUS / folder)}
        for name, subset in named.items():
            assert set(subset["traces"]) <= held, f"{folder} {name}"
    assert [len(subsets["unseen-b"][name]["traces"]) for name in ("rl-rounds", "rl-branch57-b30")] == [50, 37]
