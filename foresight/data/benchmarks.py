"""Named benchmark sets for ``--prompts``: AIME 2024 and 2025, MATH-500, GSM8K and GPQA-Diamond, the
sets KV-compression work reports on, read from their Hugging Face Hub datasets at a pinned revision or
from a local copy.

A named-set SOURCE is ``NAME`` (the Hub, through ``datasets.load_dataset``) or ``NAME:PATH``, a local
copy with the Hub's fields: a JSONL file of its rows, or a folder written by ``save_to_disk`` (the split
itself, or the whole ``DatasetDict``, whose split of the table is taken). Both are recorded under NAME,
so a local copy gives the same records and sampling seeds as the Hub.

Each problem comes out as (question, answer). AIME and MATH-500 take the answer field as it is, GSM8K
the number after ``####``. GPQA lists the right answer and the three wrong ones as choices A-D in an
order shuffled per problem (seeded by the set's name and the problem's index, so every run and every
copy shows the same order); its answer is the right choice's letter, graded by letter (`choice_letter`).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LETTERS = "ABCD"
CHOICE_INSTRUCTION = "Give the letter (A, B, C or D) of the correct choice as your final answer."


@dataclass(frozen=True)
class BenchmarkSet:
    """Where a named set lives on the Hub and which of its fields hold what.

    ``wrong_choices`` makes the set multiple choice (``answer`` then names the right choice's field);
    ``answer_after`` cuts the answer to what follows that mark (GSM8K's ``####``).
    """

    name: str
    repo: str
    config: str | None
    split: str
    revision: str
    question: str
    answer: str
    wrong_choices: tuple[str, ...] = ()
    answer_after: str | None = None


# Each revision is the commit sha the loader asks the Hub for, and must be the sha of the revision whose
# rows were checked. These are the shas public evaluation code pins for these repositories; they were
# not re-checked from this machine, which has no Hub access. GPQA is gated: accept its terms on the Hub
# and log in (`hf auth login`) first.
BENCHMARKS: dict[str, BenchmarkSet] = {
    s.name: s
    for s in (
        BenchmarkSet(
            "aime24",
            "HuggingFaceH4/aime_2024",
            None,
            "train",
            "2fe88a2f1091d5048c0f36abc874fb997b3dd99a",
            "problem",
            "answer",
        ),
        BenchmarkSet(
            "aime25",
            "yentinglin/aime_2025",
            None,
            "train",
            "6f71d77b0b89b9dabe07ab466c51df33f514df7f",
            "problem",
            "answer",
        ),
        BenchmarkSet(
            "math500",
            "HuggingFaceH4/MATH-500",
            None,
            "test",
            "6e4ed1a2a79af7d8630a6b768ec859cb5af4d3be",
            "problem",
            "answer",
        ),
        BenchmarkSet(
            "gsm8k",
            "openai/gsm8k",
            "main",
            "test",
            "740312add88f781978c0658806c59bc2815b9866",
            "question",
            "answer",
            answer_after="####",
        ),
        BenchmarkSet(
            "gpqa-diamond",
            "Idavidrein/gpqa",
            "gpqa_diamond",
            "train",
            "633f5ee89ab8ad4522a9f850766b73f62147ffdd",
            "Question",
            "Correct Answer",
            wrong_choices=("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"),
        ),
    )
}

# The letter a final answer starts with: "B", "(B)", "\text{B}", "**B**", "B) 42", "B. 42" (not "A detailed ...").
_CHOICE = re.compile(r"[\s(\[{*$]*(?:\\text(?:bf)?\{|\\mathrm\{)?\s*\(?([A-D])(?:[\s)\]}*$.]*$|[).:])")


def named_set(source: str) -> tuple[BenchmarkSet, Path | None] | None:
    """The set a SOURCE names and its local copy (None: the Hub), or None when it names no set."""
    name, colon, path = source.partition(":")
    if name not in BENCHMARKS:
        return None
    if colon and not path.strip():
        raise ValueError(f"prompt source {source!r} names no local copy; write {name} or {name}:PATH")
    return BENCHMARKS[name], Path(path) if colon else None


def is_multiple_choice(source: str) -> bool:
    """Whether problems recorded under `source` are graded by the letter of their choice."""
    named = named_set(source)
    return named is not None and bool(named[0].wrong_choices)


def choice_letter(answer: str) -> str | None:
    """The letter (A-D) a final answer gives, or None when it gives none."""
    match = _CHOICE.match(answer)
    return match.group(1) if match else None


def set_entries(spec: BenchmarkSet, local: Path | None) -> list[tuple[str, str]]:
    """(question, answer) of every problem of a set, in its order, from the Hub or its `local` copy
    (as `named_set` gives them)."""
    rows = _hub_rows(spec) if local is None else _local_rows(spec, local)
    return [_entry(spec, index, row) for index, row in enumerate(rows)]


def _hub_rows(spec: BenchmarkSet) -> Sequence[Mapping[str, Any]]:
    import datasets

    try:
        return datasets.load_dataset(spec.repo, spec.config, split=spec.split, revision=spec.revision)
    except OSError as error:  # offline, gated without a login, or a revision the Hub does not hold
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"cannot load {spec.name} from the Hub ({spec.repo}@{spec.revision}): {reason}; "
            f"give a local copy as {spec.name}:PATH"
        ) from None


def _local_rows(spec: BenchmarkSet, path: Path) -> Sequence[Mapping[str, Any]]:
    if path.is_file():
        return _jsonl_rows(path)
    if path.is_dir():
        return _saved_rows(spec, path)
    raise ValueError(f"local copy {path} of {spec.name} is neither a JSONL file nor a saved dataset folder")


def _jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """Every non-blank line of a JSONL file as an object; a set's copy with a bad line is refused, since
    skipping it would renumber the problems after it."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {number} is not a JSON object")
        rows.append(row)
    return rows


def _saved_rows(spec: BenchmarkSet, path: Path) -> Sequence[Mapping[str, Any]]:
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise ValueError(f"local copy {path} of {spec.name} is not a dataset saved with save_to_disk") from None
    if not isinstance(saved, datasets.DatasetDict):
        return saved
    if spec.split not in saved:
        raise ValueError(f"local copy {path} of {spec.name} has splits {sorted(saved)}, not {spec.split!r}")
    return saved[spec.split]


def _entry(spec: BenchmarkSet, index: int, row: Mapping[str, Any]) -> tuple[str, str]:
    missing = [f for f in (spec.question, spec.answer, *spec.wrong_choices) if f not in row]
    if missing:
        raise ValueError(f"row {index} of {spec.name} has no field {missing[0]!r} (fields: {', '.join(row)})")
    question, answer = str(row[spec.question]).strip(), str(row[spec.answer]).strip()
    if spec.wrong_choices:
        return _choice_question(spec, index, question, [answer, *(str(row[f]).strip() for f in spec.wrong_choices)])
    if spec.answer_after is not None:
        if spec.answer_after not in answer:
            raise ValueError(f"row {index} of {spec.name} has no {spec.answer_after!r} in its answer")
        answer = answer.rpartition(spec.answer_after)[2].strip().replace(",", "")
    return question, answer


def _choice_question(spec: BenchmarkSet, index: int, question: str, choices: list[str]) -> tuple[str, str]:
    """The question with its choices listed A-D in the problem's own shuffled order (the right one is
    ``choices[0]``), and the right choice's letter."""
    order = list(range(len(choices)))
    random.Random(f"{spec.name}:{index}").shuffle(order)  # a str seed hashes the same in every process
    listed = "\n".join(f"{letter}) {choices[i]}" for letter, i in zip(LETTERS, order))
    return f"{question}\n\n{listed}\n\n{CHOICE_INSTRUCTION}", LETTERS[order.index(0)]
