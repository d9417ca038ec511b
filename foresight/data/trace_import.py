"""Import traces sampled by another engine (vLLM, SGLang, ...) into a trace folder.

At scale, completions come from a serving engine; this module turns its prompt/completion pairs
into the layout of `foresight.data.trace_store` (sharded, resumable, one manifest) and adds what the engine
does not give: each token's full-cache loss and entropy under the named model, from one
teacher-forced pass per trace. docs/traces.md shows how to make such a file with vLLM.

Input: a JSONL file (one object per line, blank lines skipped) or a `datasets.save_to_disk` folder.
A row is text or token ids:
- ``prompt`` (string): the user turn; the model's chat template is applied as in generation;
- ``completion`` (string): the generated text, without the stop token;
or
- ``prompt_token_ids`` (list of ints): the ids the engine was given, chat template applied;
- ``completion_token_ids`` (list of ints): the ids it sampled, with or without its stop token;
- ``prompt``, ``completion`` (optional strings): checked against the ids. The prompt must be the user
  turn whose chat-templated ids are ``prompt_token_ids``, or their decoding with special tokens kept;
  the completion must be ``tokenizer.decode`` of the completion ids (less a trailing EOS) with special
  tokens kept or skipped (vLLM's default ``skip_special_tokens=True``);
- ``completion_logprobs`` (optional list of floats): the engine's log-probability of each completion id,
  compared with the project's pass (`foresight.data.engine_logprobs`);
and for both
- ``finish_reason`` (optional): ``"stop"`` (ended by EOS: the stored trace ends with the model's EOS, the
  ids' own when their last is one of the model's EOS ids, else appended, as a sampled trace ends) or
  ``"length"`` (cut by the token limit: counted as truncated, stored as given);
- ``answer`` (optional): checked with ``math-verify`` like a generated trace's;
- ``source`` (optional string): where the prompt came from, recorded per trace (default: the file).

Rows are numbered from 0 in file order; row i belongs to shard i // shard_size. A row that cannot
be a trace is never dropped silently: it is counted as rejected with its reason in the shard record
and the run's summary (not an object with text or ids, an empty completion, one that does not
tokenise back to itself, ids that are not integers or are outside the model's vocabulary, a text that
disagrees with its ids, log-probabilities not one per completion id, a bad finish_reason, or prompt +
completion longer than the model's context).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from foresight.data.engine_logprobs import DEFAULT_TOLERANCE, LogprobAgreement, logprob_agreement
from foresight.data.tasks import Problem, chat_prompt_ids, load_saved_dataset
from foresight.data.trace_generation import build_trace, check_plain_logits, eos_token_ids, token_losses
from foresight.data.trace_store import Sharded, ShardRows, ShardWriter, TraceRunSummary

TEXT = ("prompt", "completion")
IDS = ("prompt_token_ids", "completion_token_ids")
NOT_A_ROW = 'not a JSON object with string "prompt" and "completion" or "prompt_token_ids" and "completion_token_ids"'
EMPTY = "empty completion"
NOT_ROUND_TRIP = "completion does not tokenise back to itself"
NOT_IDS = "prompt_token_ids or completion_token_ids is not a list of integers"
EMPTY_PROMPT = "empty prompt_token_ids"
PROMPT_DISAGREES = "prompt text does not match prompt_token_ids"
COMPLETION_DISAGREES = "completion text is not the decoding of completion_token_ids"
BAD_LOGPROBS = "completion_logprobs is not one number per completion token id"
FINISH_REASONS = ("stop", "length")
AGREEMENT = "logprob_agreement"  # the shard record's list of compared traces


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
    logprob_tolerance: float = DEFAULT_TOLERANCE,
) -> ImportSummary:
    """Score the first ``num`` rows (default: all) of the file at ``path`` with ``model`` into
    ``out_dir``; filters, ``shard`` and ``model_name`` as in `foresight.data.trace_store.generate_traces`;
    a trace whose engine log-probabilities differ from the pass's by more than ``logprob_tolerance`` nats
    on average is flagged in the summary."""
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
            compared = []
            for i in settings.shard_range(k):
                agreement = scorer.add(shard_rows, i, rows[i])
                compared += [] if agreement is None else [agreement]
                bar.update()
            record = {**shard_rows.record(), AGREEMENT: compared}
            writer.write(k, shard_rows.columns(), record)
    summary = writer.summary(owned, written=len(todo))
    compared = tuple(trace for k in owned for trace in writer.record(k).get(AGREEMENT, []))
    return ImportSummary(
        **{f.name: getattr(summary, f.name) for f in fields(summary)},
        logprobs=LogprobAgreement(compared, logprob_tolerance),
    )


@dataclass(frozen=True)
class ImportSummary(TraceRunSummary):
    """A trace run's summary with the agreement of the engine's log-probabilities, where rows carried them."""

    logprobs: LogprobAgreement = LogprobAgreement(())

    def describe(self) -> str:
        agreement = self.logprobs.describe()
        return super().describe() + (f"; {agreement}" if agreement else "")


def read_rows(path: Path) -> list[dict[str, Any] | None]:
    """The rows of a JSONL file or a saved `datasets` folder, in order; None for a row that is not an
    object with string prompt and completion or with prompt and completion ids (a reason for that row,
    not for the file)."""
    if path.is_dir():
        return _dataset_rows(path)
    if not path.is_file():
        raise ValueError(f"import file {path} does not exist; give a JSONL file or a saved dataset folder")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"import file {path} is not JSONL (not UTF-8 text)") from None
    rows = [_row(_json(line)) for line in lines if line.strip()]
    if not any(rows):
        raise ValueError(
            f"import file {path} is not JSONL of prompt/completion pairs: no line is an object with string "
            '"prompt" and "completion" or with "prompt_token_ids" and "completion_token_ids"'
        )
    return rows


def _json(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _row(record: Any) -> dict[str, Any] | None:
    """`record` when it is a text row or an ids row (a dataset's missing values, None, are left out)."""
    if not isinstance(record, dict):
        return None
    record = {name: value for name, value in record.items() if value is not None}
    if all(name in record for name in IDS) or all(isinstance(record.get(name), str) for name in TEXT):
        return record
    return None


def _dataset_rows(path: Path) -> list[dict[str, Any] | None]:
    dataset = load_saved_dataset(path, f"import folder {path}")
    if not any(all(name in dataset.column_names for name in names) for names in (TEXT, IDS)):
        raise ValueError(
            f"dataset {path} has neither prompt and completion nor prompt_token_ids and completion_token_ids "
            f"columns (columns: {dataset.column_names})"
        )
    return [_row(row) for row in dataset]


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


@dataclass(frozen=True)
class _Tokens:
    """A row's trace tokens: the prompt's ids and text, the completion's ids (ending with the model's EOS
    when it stopped there), and the engine's log-probabilities of its own completion ids, if given."""

    prompt: list[int]
    prompt_text: str
    completion: list[int]
    logprobs: list[float] | None = None


class _RowScorer:
    """Turns one imported row into a kept trace, a filtered one or a rejection with its reason."""

    def __init__(self, model, tokenizer, settings: ImportSettings) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.settings = settings
        self.eos = eos_token_ids(model, tokenizer, settings.model)
        self.context = model.config.get_text_config().max_position_embeddings
        self.vocabulary = model.get_input_embeddings().num_embeddings

    def add(self, shard: ShardRows, index: int, row: dict[str, Any] | None) -> dict[str, Any] | None:
        """Add the row to the shard; returns its log-probability agreement when it was compared."""
        source = row.get("source") if row is not None and isinstance(row.get("source"), str) else self.settings.source
        if row is None:
            return shard.reject(index, source, NOT_A_ROW)
        tokens = self._checked(row)
        if isinstance(tokens, str):
            return shard.reject(index, source, tokens)
        answer = row.get("answer")
        problem = Problem(index, tokens.prompt_text, None if answer is None else str(answer), source)
        ids = tokens.prompt + tokens.completion
        index, source, trace, counts = build_trace(
            problem,
            tokens.prompt,
            tokens.completion,
            row.get("finish_reason") == "length",
            self.tokenizer,
            self.settings.min_tokens,
            self.settings.only_correct,
            lambda: token_losses(self.model, torch.tensor(ids)),
        )
        shard.add(index, source, trace, counts)
        if trace is None or tokens.logprobs is None:
            return None
        return logprob_agreement(index, tokens.logprobs, trace["token_nll"], len(tokens.prompt))

    def _checked(self, row: dict[str, Any]) -> _Tokens | str:
        """The row's tokens, or the reason to reject it."""
        finish = row.get("finish_reason")
        if finish is not None and finish not in FINISH_REASONS:
            return f"finish_reason is not one of {', '.join(FINISH_REASONS)}"
        by_ids = all(name in row for name in IDS)
        tokens = self._from_ids(row, finish == "stop") if by_ids else self._from_text(row, finish == "stop")
        if isinstance(tokens, _Tokens) and len(tokens.prompt) + len(tokens.completion) > self.context:
            return f"prompt + completion longer than the model's context of {self.context} tokens"
        return tokens

    def _from_text(self, row: dict[str, Any], stopped: bool) -> _Tokens | str:
        text = row["completion"]
        if not text.strip():
            return EMPTY
        completion = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if self.tokenizer.decode(completion) != text:
            return NOT_ROUND_TRIP
        prompt = chat_prompt_ids(self.tokenizer, row["prompt"])
        return _Tokens(prompt, row["prompt"], completion + ([self.eos[0]] if stopped else []))

    def _from_ids(self, row: dict[str, Any], stopped: bool) -> _Tokens | str:
        prompt, completion = row[IDS[0]], row[IDS[1]]
        if not all(isinstance(ids, list) and all(_is_int(t) for t in ids) for ids in (prompt, completion)):
            return NOT_IDS
        if not prompt:
            return EMPTY_PROMPT
        if any(not 0 <= t < self.vocabulary for t in prompt + completion):
            return f"a token id outside the model's vocabulary of {self.vocabulary} ids"
        ended = stopped and bool(completion) and completion[-1] in self.eos  # the engine returned its stop token
        sampled = completion[:-1] if ended else completion
        if not sampled:
            return EMPTY
        text = row.get("completion")
        if text is not None and text not in {
            self.tokenizer.decode(sampled, skip_special_tokens=s) for s in (False, True)
        }:
            return COMPLETION_DISAGREES
        templated = self.tokenizer.decode(prompt, skip_special_tokens=False)
        prompt_text = row.get("prompt")
        if (
            prompt_text is not None
            and prompt_text != templated
            and chat_prompt_ids(self.tokenizer, prompt_text) != prompt
        ):
            return PROMPT_DISAGREES
        logprobs = row.get("completion_logprobs")
        if logprobs is not None and not (
            isinstance(logprobs, list) and len(logprobs) == len(completion) and all(_is_number(x) for x in logprobs)
        ):
            return BAD_LOGPROBS
        stop = [self.eos[0]] if stopped and not ended else []
        return _Tokens(prompt, templated if prompt_text is None else prompt_text, completion + stop, logprobs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
