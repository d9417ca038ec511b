"""Import traces sampled by another engine (vLLM, SGLang, ...) into a trace folder.

At scale, completions come from a serving engine; this module turns its prompt/completion pairs
into the layout of `foresight.data.trace_store` (sharded, resumable, one manifest) and adds what the engine
does not give: each token's full-cache loss and entropy under the named model, from one
teacher-forced pass per trace. docs/traces.md shows how to make such a file with vLLM.

Input: a JSONL file (one object per line, blank lines skipped) or a `datasets.save_to_disk` folder,
with per row
- ``prompt`` (string): the user turn; the model's chat template is applied as in generation;
- ``completion`` (string): the generated text, without the stop token;
- ``finish_reason`` (optional): ``"stop"`` (ended by EOS: the model's EOS is appended, as a sampled
  trace ends) or ``"length"`` (cut by the token limit: counted as truncated);
- ``answer`` (optional): checked with ``math-verify`` like a generated trace's;
- ``source`` (optional string): where the prompt came from, recorded per trace (default: the file).

Rows are numbered from 0 in file order; row i belongs to shard i // shard_size. A row that cannot
be a trace is never dropped silently: it is counted as rejected with its reason in the shard record
and the run's summary (not an object with string prompt and completion, an empty completion, one
that does not tokenise back to itself, a bad finish_reason, or prompt + completion longer than the
model's context).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from foresight.data.tasks import Problem, chat_prompt_ids, load_saved_dataset, parse_record
from foresight.data.trace_generation import build_trace, check_plain_logits, eos_token_ids, token_losses
from foresight.data.trace_store import Sharded, ShardRows, ShardWriter, TraceRunSummary

NOT_A_ROW = 'not a JSON object with string "prompt" and "completion"'
EMPTY = "empty completion"
NOT_ROUND_TRIP = "completion does not tokenise back to itself"
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class ImportSettings(Sharded):
    """What defines an imported trace folder's data: the model that scored it, the file (path and
    SHA-256 of its bytes) and the filters; a rerun into the folder must repeat them exactly."""

    model: str
    source: str
    sha256: str
    num: int
    min_tokens: int
    only_correct: bool
    shard_size: int

    def __post_init__(self) -> None:
        for name in ("num", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")


def import_traces(
    model,
    tokenizer,
    path: str | os.PathLike,
    *,
    out_dir: str | os.PathLike,
    num: int | None = None,
    min_tokens: int = 0,
    only_correct: bool = False,
    shard_size: int = 64,
    shard: tuple[int, int] = (0, 1),
    progress: bool = True,
    model_name: str | None = None,
) -> TraceRunSummary:
    """Score the first ``num`` rows (default: all) of the file at ``path`` with ``model`` into
    ``out_dir``; filters, ``shard`` and ``model_name`` as in `foresight.data.trace_store.generate_traces`."""
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard must be i/n with 0 <= i < n, got {index}/{count}")
    path = Path(path).resolve()
    rows = read_rows(path)
    if num is not None and not 1 <= num <= len(rows):
        raise ValueError(f"asked for {num} rows but {path} has {len(rows)}")
    settings = ImportSettings(
        model=model.name_or_path if model_name is None else model_name,
        source=str(path),
        sha256=_digest(path),
        num=len(rows) if num is None else num,
        min_tokens=min_tokens,
        only_correct=only_correct,
        shard_size=shard_size,
    )
    check_plain_logits(model)
    scorer = _RowScorer(model, tokenizer, settings)
    writer = ShardWriter(Path(out_dir), settings)
    owned, todo = writer.claim(index, count)
    with tqdm(
        total=sum(len(settings.shard_range(k)) for k in todo), disable=not progress, unit="row", desc="import"
    ) as bar:
        for k in todo:
            shard_rows = ShardRows(settings.shard_range(k))
            for i in settings.shard_range(k):
                scorer.add(shard_rows, i, rows[i])
                bar.update()
            writer.write(k, shard_rows.columns(), shard_rows.record())
    return writer.summary(owned, written=len(todo))


def read_rows(path: Path) -> list[dict[str, Any] | None]:
    """The rows of a JSONL file or a saved `datasets` folder, in order; None for a JSONL line that is
    not an object with string prompt and completion (a reason for that row, not for the file)."""
    if path.is_dir():
        return _dataset_rows(path)
    if not path.is_file():
        raise ValueError(f"import file {path} does not exist; give a JSONL file or a saved dataset folder")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"import file {path} is not JSONL (not UTF-8 text)") from None
    rows = [parse_record(line, "prompt", "completion") for line in lines if line.strip()]
    if not any(rows):
        raise ValueError(
            f'import file {path} is not JSONL of prompt/completion pairs: no line is an object with string "prompt" and "completion"'
        )
    return rows


def _dataset_rows(path: Path) -> list[dict[str, Any] | None]:
    dataset = load_saved_dataset(path, f"import folder {path}")
    missing = [name for name in ("prompt", "completion") if name not in dataset.column_names]
    if missing:
        raise ValueError(f"dataset {path} has no {' or '.join(missing)} column (columns: {dataset.column_names})")
    return [row if isinstance(row["prompt"], str) and isinstance(row["completion"], str) else None for row in dataset]


def _digest(path: Path) -> str:
    """SHA-256 of a file's bytes, or of a folder's files (names and bytes, in name order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode())
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


class _RowScorer:
    """Turns one imported row into a kept trace, a filtered one or a rejection with its reason."""

    def __init__(self, model, tokenizer, settings: ImportSettings) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.settings = settings
        self.eos = eos_token_ids(model, tokenizer, settings.model)[0]
        self.context = model.config.get_text_config().max_position_embeddings

    def add(self, shard: ShardRows, index: int, row: dict[str, Any] | None) -> None:
        source = row.get("source") if row is not None and isinstance(row.get("source"), str) else self.settings.source
        if row is None:
            return shard.reject(index, source, NOT_A_ROW)
        reason, prompt, completion = self._tokens(row)
        if reason is not None:
            return shard.reject(index, source, reason)
        answer = row.get("answer")
        problem = Problem(index, row["prompt"], None if answer is None else str(answer), source)
        ids = prompt + completion
        shard.add(
            *build_trace(
                problem,
                prompt,
                completion,
                row.get("finish_reason") == "length",
                self.tokenizer,
                self.settings.min_tokens,
                self.settings.only_correct,
                lambda: token_losses(self.model, torch.tensor(ids)),
            )
        )

    def _tokens(self, row: dict[str, Any]) -> tuple[str | None, list[int], list[int]]:
        """(reason to reject or None, prompt ids, completion ids)."""
        text = row["completion"]
        if not text.strip():
            return EMPTY, [], []
        finish = row.get("finish_reason")
        if finish is not None and finish not in FINISH_REASONS:
            return f"finish_reason is not one of {', '.join(FINISH_REASONS)}", [], []
        completion = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if self.tokenizer.decode(completion) != text:
            return NOT_ROUND_TRIP, [], []
        prompt = chat_prompt_ids(self.tokenizer, row["prompt"])
        completion += [self.eos] if finish == "stop" else []
        if len(prompt) + len(completion) > self.context:
            return f"prompt + completion longer than the model's context of {self.context} tokens", [], []
        return None, prompt, completion
