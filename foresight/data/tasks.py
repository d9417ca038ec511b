"""Prompt sources and answer checking for trace generation (ForesightKV App. E.1: traces are kept
only when their answer is correct, so every source says how to check one).

A SOURCE is one of
- a named benchmark set, ``aime24``, ``aime25``, ``math500``, ``gsm8k`` or ``gpqa-diamond``, read from
  the Hugging Face Hub at a pinned revision, or ``NAME:PATH`` for a local copy of it (a JSONL file or a
  ``save_to_disk`` folder with the Hub's fields), recorded as NAME either way
  (:mod:`foresight.data.benchmarks`); its question gets the instruction below appended, and it is
  checked with ``math-verify``, GPQA by the letter of the chosen answer;
- ``reasoning-gym:TASK`` or ``reasoning-gym:TASK:KEY=VALUE,...``: procedural problems from the
  ``reasoning-gym`` package (offline, the same problems for the same seed), checked by the task's own
  scorer; the options set fields of the task's config, e.g. ``reasoning-gym:chain_sum:max_terms=2``
  (values read as JSON, else as text);
- a JSONL file of ``{"prompt": ..., "answer": ...}`` objects (``answer`` optional), checked with
  ``math-verify``;
- a folder written by ``datasets.Dataset.save_to_disk`` with a ``prompt`` or ``question`` column and an
  optional ``answer`` column, checked with ``math-verify``;
- a mixture ``SOURCE=WEIGHT,SOURCE=WEIGHT,...`` of the above (a weight defaults to 1): ``num`` problems
  are split between the sources in proportion to their weights (largest remainders) and interleaved
  so that every prefix of the list holds the sources in about those proportions (a held-out split or
  a shard sees the whole mixture). Each source's problems are its own first ones, as if read alone.

Final-answer rules (:func:`extract_answer`), applied to every completion before checking; both are
reported, as lm-evaluation-harness does for GSM8K:

- ``strict``: the content of the last non-empty ``\\boxed{...}``; else the first non-empty line after
  the last ``Answer:`` (any case, the rest of its own line when that is not empty); else nothing;
- ``flexible`` (the default): the strict answer; else what follows the last "answer is" up to the end
  of its sentence or clause ("So, the final answer is 3." gives 3, "the answer is yes, it follows"
  gives yes, "the answer is 2 * 2 = 4." gives 4); else the last number; else the last non-empty line.

Trailing whitespace and periods are stripped from everything but a boxed answer; the flexible rule
also strips Markdown emphasis, dollar signs and quotes around its answer and commas inside a number.

Size: every prompt source (named sets, reasoning-gym with options, JSONL, datasets, weighted mixtures)
and both answer rules, which the sources' checks call.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pickle
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from foresight.choices import Choice
from foresight.data import benchmarks

REASONING_GYM = "reasoning-gym:"
# Appended to reasoning-gym and named-set questions (which carry no format instruction) so that a
# model's final answer lands where extract_answer looks first.
ANSWER_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_SHOWN_LINES = 10  # bad JSONL line numbers named in the warning


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer.

    ``index`` is the problem's position in its source (0-based; traces and shards are keyed by it),
    ``answer`` is None when the source has none, ``metadata`` holds what the source's scorer needs
    (for reasoning-gym: the dataset entry).
    """

    index: int
    prompt: str
    answer: str | None
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightedSource:
    """One source of a mixture and its weight (share of the problems)."""

    source: str
    weight: float = 1.0


def parse_sources(spec: str) -> list[WeightedSource]:
    """The sources of ``SOURCE[=WEIGHT][,SOURCE[=WEIGHT]...]``, each named once, weights positive. The
    options of a reasoning-gym task (``reasoning-gym:TASK:KEY=VALUE,KEY=VALUE``) stay with their task,
    and such a task takes no weight (its last ``=VALUE`` is an option's)."""
    parts = _mixture_entries(spec)
    if not all(parts):
        raise ValueError(f"prompt source {spec!r} has an empty entry; write SOURCE[=WEIGHT][,SOURCE[=WEIGHT]...]")
    sources = []
    for part in parts:
        name, _, weight = part.rpartition("=")
        value = _number(weight) if name and not _has_task_options(part) else None
        if value is None:  # no weight given (a name may itself hold "=")
            name, value = part, 1.0
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"weight {weight!r} of prompt source {name!r} must be a positive number")
        sources.append(WeightedSource(name, value))
    names = [s.source for s in sources]
    if len(set(names)) < len(names):
        raise ValueError(f"prompt source {spec!r} names a source twice")
    return sources


def _has_task_options(source: str) -> bool:
    return source.startswith(REASONING_GYM) and ":" in source[len(REASONING_GYM) :]


def _mixture_entries(spec: str) -> list[str]:
    """``spec`` split on commas, except those between the KEY=VALUE options of a reasoning-gym task."""
    entries: list[str] = []
    for part in (part.strip() for part in spec.split(",")):
        name = part.rpartition("=")[0]
        names_source = name.startswith(REASONING_GYM) or Path(name).exists() or benchmarks.named_set(name) is not None
        continues_options = entries and _has_task_options(entries[-1]) and "=" in part and not names_source
        if continues_options:
            entries[-1] += "," + part
        else:
            entries.append(part)
    return entries


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def recorded_source(spec: str) -> str:
    """A SOURCE as a folder's settings record it: reasoning-gym:TASK as given, a named set by its name
    (a local copy too), a file or folder as its absolute path; in a mixture each entry so, with its weight
    (weights of 1 written only in mixtures)."""
    sources = parse_sources(spec)
    names = [_recorded_name(s.source) for s in sources]
    if len(sources) == 1 and sources[0].weight == 1:
        return names[0]
    return ",".join(f"{name}={s.weight:g}" for name, s in zip(names, sources))


def _recorded_name(source: str) -> str:
    named = benchmarks.named_set(source)
    if named is not None:
        return named[0].name
    return source if source.startswith(REASONING_GYM) else str(Path(source).resolve())


def source_names(spec: str) -> list[str]:
    """The sources a SOURCE names (one, or each entry of a mixture), as `recorded_source` writes them."""
    return [recorded_source(s.source) for s in parse_sources(spec)]


def mixture_counts(num: int, weights: list[float]) -> list[int]:
    """Problems per source: ``num`` split in proportion to ``weights`` by largest remainders
    (ties to the earlier source)."""
    quotas = [num * w / sum(weights) for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: num - sum(counts)]:
        counts[i] += 1
    return counts


def mixture_order(counts: list[int]) -> list[int]:
    """The source of each position: at every step the source furthest behind its share of the steps
    so far takes the next position (ties to the earlier source), so each prefix follows the weights."""
    total, taken, order = sum(counts), [0] * len(counts), []
    for step in range(1, total + 1):
        source = max(range(len(counts)), key=lambda i: (counts[i] * step / total - taken[i], -i))
        taken[source] += 1
        order.append(source)
    return order


def load_problems(source: str, num: int, seed: int = 0) -> list[Problem]:
    """The first ``num`` problems of ``source`` (see the module docstring for the forms).

    ``seed`` picks the reasoning-gym problems; file and dataset sources are read in order. A
    problem's ``source`` is the one it came from, as `recorded_source` writes it.
    """
    if num < 1:
        raise ValueError(f"num must be at least 1, got {num}")
    sources = parse_sources(source)
    if sys.flags.hash_randomization and any(s.source.startswith(REASONING_GYM) for s in sources):
        return _under_hash_seed_zero(source, num, seed)
    if len(sources) == 1:
        return _source_problems(sources[0].source, num, seed)
    counts = mixture_counts(num, [s.weight for s in sources])
    empty = [s.source for s, count in zip(sources, counts) if count == 0]
    if empty:
        raise ValueError(f"{num} problems leave none for {', '.join(empty)}; ask for more problems or raise its weight")
    pools = [iter(_source_problems(s.source, count, seed)) for s, count in zip(sources, counts)]
    return [replace(next(pools[s]), index=index) for index, s in enumerate(mixture_order(counts))]


def _under_hash_seed_zero(source: str, num: int, seed: int) -> list[Problem]:
    """`load_problems` in a child interpreter run with PYTHONHASHSEED=0. Some reasoning-gym tasks (acre,
    isomorphic_strings) iterate over sets of strings, whose order follows the interpreter's hash seed, so
    the same seed would give other problems in another process and a resumed sampling run would not
    find its own rows."""
    package_root = str(Path(__file__).resolve().parents[2])
    paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from foresight.data import tasks; tasks._answer_child(sys.stdin.buffer)"],
        input=pickle.dumps((source, num, seed)),
        capture_output=True,
        env={**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": os.pathsep.join(paths)},
        check=False,
    )
    if child.returncode != 0:
        last = (child.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"making the problems of {source!r} failed in its child interpreter: {last}")
    problems = pickle.loads(child.stdout)
    if isinstance(problems, Exception):
        raise problems
    return problems


def _answer_child(request) -> None:
    """The child's side of `_under_hash_seed_zero`: the problems, or the error they raised, pickled to stdout; what
    a task prints goes to stderr, so it never mixes into the answer."""
    answer_stream, sys.stdout = sys.stdout.buffer, sys.stderr
    source, num, seed = pickle.load(request)
    try:
        answer: list[Problem] | Exception = load_problems(source, num, seed)
    except Exception as error:  # noqa: BLE001  # raised again by the parent, as it would have been here
        answer = error
    answer_stream.write(pickle.dumps(answer))


def _source_problems(source: str, num: int, seed: int) -> list[Problem]:
    """The first ``num`` problems of one source, each naming it as `recorded_source` writes it."""
    recorded = recorded_source(source)
    return [replace(problem, source=recorded) for problem in _read_source(source, num, seed)]


def _read_source(source: str, num: int, seed: int) -> list[Problem]:
    if source.startswith(REASONING_GYM):
        return _reasoning_gym_problems(source, num, seed)
    named, path = benchmarks.named_set(source), Path(source)
    if named is not None:
        problems = [Problem(i, _instructed(q), a, source) for i, (q, a) in enumerate(benchmarks.set_entries(*named))]
    elif path.is_dir():
        problems = _disk_dataset_problems(path, source)
    elif path.is_file():
        problems = _jsonl_problems(path, source)
    else:
        raise ValueError(
            f"prompt source {source!r} is neither 'reasoning-gym:TASK', a named set ({', '.join(benchmarks.BENCHMARKS)}; "
            "NAME:PATH for a local copy), a JSONL file nor a saved dataset folder"
        )
    if len(problems) < num:
        raise ValueError(f"asked for {num} problems but {source} has only {len(problems)}")
    return problems[:num]


def _reasoning_gym_problems(source: str, num: int, seed: int) -> list[Problem]:
    import reasoning_gym

    task, options = _reasoning_gym_task(source)
    if task not in reasoning_gym.factory.DATASETS:
        known = ", ".join(sorted(reasoning_gym.factory.DATASETS))
        raise ValueError(f"unknown reasoning-gym task {task!r}; known tasks: {known}")
    fields = [
        f.name for f in dataclasses.fields(reasoning_gym.factory.DATASETS[task][1]) if f.name not in ("seed", "size")
    ]
    unknown = [key for key in options if key not in fields]
    if unknown:
        raise ValueError(
            f"reasoning-gym task {task!r} has no option {unknown[0]!r}; its options are: {', '.join(fields)}"
        )
    try:
        dataset = reasoning_gym.create_dataset(task, size=num, seed=seed, **options)
    except (AssertionError, TypeError, ValueError) as error:
        raise ValueError(f"reasoning-gym task {task!r} refused the options {options}: {error}") from None
    return [
        Problem(i, _instructed(entry["question"]), str(entry["answer"]), source, dict(entry))
        for i, entry in enumerate(dataset)
    ]


def _instructed(question: str) -> str:
    return f"{question}\n{ANSWER_INSTRUCTION}"


def _reasoning_gym_task(source: str) -> tuple[str, dict[str, Any]]:
    """The task name and config options of a ``reasoning-gym:TASK[:KEY=VALUE,...]`` source."""
    task, _, text = source[len(REASONING_GYM) :].partition(":")
    options = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"reasoning-gym option {item!r} in {source!r} must look like KEY=VALUE")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value.strip()
    return task, options


def _jsonl_problems(path: Path, source: str) -> list[Problem]:
    """Problems from a JSONL file; lines that are not a JSON object with a string "prompt" are
    skipped and named in one warning; blank lines are ignored."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"prompt file {source} is not JSONL (not UTF-8 text)") from None
    problems: list[Problem] = []
    bad: list[int] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = parse_record(line)
        if record is None:
            bad.append(number)
            continue
        problems.append(Problem(len(problems), record["prompt"], _answer_text(record.get("answer")), source))
    if not problems:
        raise ValueError(f'prompt file {source} is not JSONL: no line is a JSON object with a "prompt" string')
    if bad:
        shown = ", ".join(map(str, bad[:_SHOWN_LINES])) + (", ..." if len(bad) > _SHOWN_LINES else "")
        warnings.warn(
            f'{source}: skipped {len(bad)} line(s) that are not JSON objects with a "prompt" string (line {shown})',
            stacklevel=3,
        )
    return problems


def parse_record(line: str, *text_fields: str) -> dict[str, Any] | None:
    """A JSONL line as a record whose `text_fields` (default: "prompt") are strings, or None."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not all(
        isinstance(record.get(name), str) for name in text_fields or ("prompt",)
    ):
        return None
    return record


def load_saved_dataset(path: Path, what: str):
    """The one-split `datasets.Dataset` saved in `path`; `what` names the folder in the errors."""
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise ValueError(f"{what} is not a dataset saved with save_to_disk") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(f"{what} holds splits {sorted(dataset)}; pass one split's folder")
    return dataset


def _disk_dataset_problems(path: Path, source: str) -> list[Problem]:
    dataset = load_saved_dataset(path, f"prompt folder {source}")
    column = next((name for name in ("prompt", "question") if name in dataset.column_names), None)
    if column is None:
        raise ValueError(f"dataset {source} has no 'prompt' or 'question' column (columns: {dataset.column_names})")
    answers = dataset["answer"] if "answer" in dataset.column_names else [None] * len(dataset)
    return [Problem(i, str(p), _answer_text(a), source) for i, (p, a) in enumerate(zip(dataset[column], answers))]


def _answer_text(answer: Any) -> str | None:
    return None if answer is None else str(answer)


class AnswerRule(Choice):
    """How a completion's final answer is found (module docstring)."""

    STRICT = "strict"
    FLEXIBLE = "flexible"


_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*(.+)", flags=re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?:\s|$)|,\s")  # "the answer is yes, it follows" gives yes
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def extract_answer(completion: str, rule: AnswerRule | str = AnswerRule.FLEXIBLE) -> str:
    """The final answer in a completion by `rule` (module docstring); "" when the rule finds none."""
    rule = AnswerRule.parse(rule)
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    marks = list(re.finditer(r"answer\s*:", completion, flags=re.IGNORECASE))
    if marks:
        return _clean(_non_empty_lines(completion[marks[-1].end() :])[:1])
    if rule is AnswerRule.STRICT:
        return ""
    stated = [m.group(1) for m in _ANSWER_IS.finditer(completion)]
    if stated and (sentence := _loose(_SENTENCE_END.split(stated[-1], maxsplit=1)[0])):
        return sentence
    numbers = _NUMBER.findall(completion)
    if numbers:
        return _loose(numbers[-1])
    return _loose(_clean(_non_empty_lines(completion)[-1:]))


def _loose(text: str) -> str:
    """A flexible answer: the right-hand side of an equation ("2 * 2 = 4" gives 4), without
    surrounding emphasis, dollar signs, quotes and periods, a number without its thousands separators."""
    text = text.rpartition("=")[2].strip().strip("*$\"'").strip().rstrip(".").rstrip()
    return text.replace(",", "") if _NUMBER.fullmatch(text) else text


def _non_empty_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _clean(lines: list[str]) -> str:
    """The one line given (or ""), without surrounding whitespace and trailing periods."""
    return lines[0].strip().rstrip(".").rstrip() if lines else ""


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces and a non-blank content (an empty
    one is the instruction echoed back, not an answer), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        content = _braced(text, start + len("\\boxed"))
        if content is not None and content.strip():
            return content
        start = text.rfind("\\boxed{", 0, start)
    return None


def _braced(text: str, open_at: int) -> str | None:
    """What lies between the brace at ``open_at`` and its matching brace; None if unbalanced."""
    depth = 0
    for position in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[open_at + 1 : position]
    return None


def check_answer(problem: Problem, completion: str, rule: AnswerRule | str = AnswerRule.FLEXIBLE) -> bool | None:
    """Whether the completion's final answer (found by `rule`) is right; None when the problem has no
    answer. A completion in which the rule finds no answer is wrong.

    reasoning-gym problems use the task's own scorer (correct = full score 1.0) when they carry its
    dataset entry; multiple-choice sets (GPQA) compare the letter of the chosen answer; other sources
    (and imported rows, which carry none) compare with ``math-verify`` (numbers and LaTeX expressions by
    value).
    """
    if problem.answer is None:
        return None
    predicted = extract_answer(completion, rule)
    if not predicted:
        return False
    if problem.source.startswith(REASONING_GYM) and problem.metadata:
        score = _reasoning_gym_scorer(_reasoning_gym_task(problem.source)[0])(predicted, problem.metadata)
        return score >= 1.0
    if benchmarks.is_multiple_choice(problem.source):
        return benchmarks.choice_letter(predicted) == problem.answer
    from math_verify import verify

    return bool(verify(_math_parse(problem.answer), _math_parse(predicted)))


@functools.cache
def _reasoning_gym_scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def _math_parse(text: str) -> list:
    """The whole text read as one LaTeX expression (``$text$``), so that ``\\frac{5}{6}+1`` is not
    cut to its first term; math-verify's own extraction only when that reads nothing."""
    from math_verify import parse

    return parse(f"${text}$") or parse(text)


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a user turn: the model's chat template with the assistant turn opened, or the
    plain encoding (with the tokenizer's special tokens) when it has no template."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)
    return list(tokenizer(prompt).input_ids)


def stop_token_ids(model, tokenizer) -> list[int]:
    """The tokens that end the model's turn: its generation config's EOS (one id or several), else the
    tokenizer's."""
    eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    eos = tokenizer.eos_token_id if eos is None else eos
    if eos is None:
        raise ValueError("neither the model's generation config nor its tokenizer names an EOS token")
    return [eos] if isinstance(eos, int) else list(eos)
