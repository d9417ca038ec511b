"""Named benchmark sets (foresight.data.benchmarks) as prompt sources: local copies, the Hub path at the
pinned revision (a saved dataset stands in for the Hub), GPQA's shuffled choices and letter grading,
bad names, and `foresight eval --prompts gsm8k:PATH` on a tiny model."""

from __future__ import annotations

import json
import re

import datasets
import pytest

from foresight import cli
from foresight.data.benchmarks import BENCHMARKS, CHOICE_INSTRUCTION, choice_letter
from foresight.data.tasks import ANSWER_INSTRUCTION, check_answer, load_problems, parse_sources, recorded_source
from tests.prompts import write_lines

GSM8K_ROWS = [
    {"question": "Tom has 40 apples and buys 2 more. How many apples?", "answer": "40 + 2 = 42\n#### 42"},
    {"question": "A shop sells 1,000 pens on Monday and 234 on Tuesday. How many pens?", "answer": "#### 1,234"},
    {"question": "What is 5 - 5?", "answer": "5 - 5 = 0\n#### 0"},
]
GPQA_ROWS = [
    {
        "Question": f"Which particle is number {i}?",
        "Correct Answer": "the right one",
        "Incorrect Answer 1": "wrong one",
        "Incorrect Answer 2": "wrong two",
        "Incorrect Answer 3": "wrong three",
    }
    for i in range(8)
]
# A few rows with each set's fields (their other columns left out).
SET_ROWS = {
    "aime24": [{"problem": "Find $x$ if $x + 1 = 3$.", "answer": "2"}],
    "aime25": [{"problem": "Find $n$ if $2n = 8$.", "answer": "4"}],
    "math500": [{"problem": "Simplify $\\frac{2}{4}$.", "answer": "\\frac{1}{2}"}],
    "gsm8k": GSM8K_ROWS,
    "gpqa-diamond": GPQA_ROWS,
}


@pytest.fixture
def gsm8k_jsonl(tmp_path) -> str:
    return write_lines(tmp_path / "gsm8k.jsonl", [json.dumps(row) for row in GSM8K_ROWS])


@pytest.fixture
def hub_calls(monkeypatch, tmp_path) -> list[tuple]:
    """`datasets.load_dataset` answered from a saved folder of each set's rows; the calls are recorded."""
    calls = []

    def load_dataset(repo, config, *, split, revision):
        calls.append((repo, config, split, revision))
        name = next(s.name for s in BENCHMARKS.values() if s.repo == repo)
        folder = tmp_path / "hub" / name
        datasets.Dataset.from_list(SET_ROWS[name]).save_to_disk(str(folder))
        return datasets.load_from_disk(str(folder))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_a_local_gsm8k_jsonl_gives_the_number_after_the_marks(gsm8k_jsonl):
    problems = load_problems(f"gsm8k:{gsm8k_jsonl}", 3)
    assert [p.index for p in problems] == [0, 1, 2]
    assert [p.prompt for p in problems] == [f"{row['question']}\n{ANSWER_INSTRUCTION}" for row in GSM8K_ROWS]
    assert [p.answer for p in problems] == ["42", "1234", "0"]
    assert {p.source for p in problems} == {"gsm8k"}  # recorded under the set's name, like the Hub's
    assert recorded_source(f"gsm8k:{gsm8k_jsonl}") == "gsm8k"
    assert check_answer(problems[0], "so \\boxed{42}") and not check_answer(problems[0], "\\boxed{41}")
    assert check_answer(problems[1], "The answer is 1,234.")
    assert load_problems(f"gsm8k:{gsm8k_jsonl}", 2) == problems[:2]


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_set_loads_from_the_hub_at_its_pinned_revision(name, hub_calls):
    spec = BENCHMARKS[name]
    problems = load_problems(name, len(SET_ROWS[name]))
    assert hub_calls == [(spec.repo, spec.config, spec.split, spec.revision)]
    assert re.fullmatch(r"[0-9a-f]{40}", spec.revision)
    assert {p.source for p in problems} == {name}
    assert all(p.prompt.endswith(f"\n{ANSWER_INSTRUCTION}") for p in problems)
    if not spec.wrong_choices:
        assert problems[0].prompt.startswith(SET_ROWS[name][0][spec.question])
        assert check_answer(problems[0], f"\\boxed{{{problems[0].answer}}}")


def test_the_hub_sets_answer_fields(hub_calls):
    assert load_problems("math500", 1)[0].answer == "\\frac{1}{2}"
    assert check_answer(load_problems("math500", 1)[0], "\\boxed{0.5}")  # by value
    assert [p.answer for p in load_problems("gsm8k", 3)] == ["42", "1234", "0"]


def test_a_saved_split_dict_gives_the_sets_split(tmp_path):
    folder = tmp_path / "math500"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(SET_ROWS["math500"])}).save_to_disk(str(folder))
    assert load_problems(f"math500:{folder}", 1)[0].answer == "\\frac{1}{2}"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(SET_ROWS["math500"])}).save_to_disk(str(folder))
    with pytest.raises(ValueError, match=r"has splits \['train'\], not 'test'"):
        load_problems(f"math500:{folder}", 1)


def gpqa_problems(tmp_path):
    path = write_lines(tmp_path / "gpqa.jsonl", [json.dumps(row) for row in GPQA_ROWS])
    return load_problems(f"gpqa-diamond:{path}", len(GPQA_ROWS))


def test_gpqa_lists_the_choices_in_a_shuffled_order_seeded_per_problem(tmp_path):
    problems = gpqa_problems(tmp_path)
    assert gpqa_problems(tmp_path) == problems  # the same order every time
    for problem in problems:
        listed = re.findall(r"^([A-D])\) (.+)$", problem.prompt, flags=re.MULTILINE)
        assert sorted(text for _, text in listed) == ["the right one", "wrong one", "wrong three", "wrong two"]
        assert dict(listed)[problem.answer] == "the right one"
        assert problem.prompt.endswith(f"{CHOICE_INSTRUCTION}\n{ANSWER_INSTRUCTION}")
    orders = {tuple(re.findall(r"^[A-D]\) (.+)$", p.prompt, flags=re.MULTILINE)) for p in problems}
    assert len(orders) > 1  # not one order for every problem
    assert len({p.answer for p in problems}) > 1


def test_gpqa_is_graded_by_letter(tmp_path):
    problem = gpqa_problems(tmp_path)[0]
    wrong = next(letter for letter in "ABCD" if letter != problem.answer)
    for completion in (
        f"\\boxed{{{problem.answer}}}",
        f"Answer: ({problem.answer})",
        f"the answer is {problem.answer}.",
    ):
        assert check_answer(problem, completion) is True, completion
    assert check_answer(problem, f"\\boxed{{{wrong}}}") is False
    assert check_answer(problem, "\\boxed{the right one}") is False  # the text is not the letter


@pytest.mark.parametrize(
    ("answer", "letter"),
    [
        ("B", "B"),
        ("(C)", "C"),
        ("\\text{D}", "D"),
        ("**A**", "A"),
        ("B) 42 kg", "B"),
        ("C.", "C"),
        ("D: x", "D"),
        ("\\textbf{(A)}", "A"),
        ("A detailed look", None),
        ("E", None),
        ("42", None),
        ("", None),
    ],
)
def test_choice_letter(answer, letter):
    assert choice_letter(answer) == letter


@pytest.mark.parametrize("source", ["aime23", "gsm8:data.jsonl"])
def test_a_bad_set_name_is_a_one_line_error_naming_the_sets(source):
    with pytest.raises(ValueError) as error:
        load_problems(source, 1)
    message = str(error.value)
    assert f"prompt source {source!r}" in message and "\n" not in message
    assert all(name in message for name in BENCHMARKS)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("gsm8k:", "names no local copy; write gsm8k or gsm8k:PATH"),
        ("gsm8k:no/such.jsonl", "local copy no/such.jsonl of gsm8k is neither a JSONL file nor a saved dataset folder"),
    ],
)
def test_a_bad_local_copy_is_a_one_line_error(source, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_problems(source, 1)


def test_a_local_copy_without_the_sets_fields_is_refused(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [json.dumps({"prompt": "What is 1 + 1?", "answer": "#### 2"})])
    with pytest.raises(ValueError, match="row 0 of gsm8k has no field 'question' \\(fields: prompt, answer\\)"):
        load_problems(f"gsm8k:{path}", 1)
    path = write_lines(tmp_path / "y.jsonl", [json.dumps({"question": "What is 1 + 1?", "answer": "2"})])
    with pytest.raises(ValueError, match="row 0 of gsm8k has no '####' in its answer"):
        load_problems(f"gsm8k:{path}", 1)


def test_an_unreachable_hub_names_the_local_copy(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)\nmore")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError) as error:
        load_problems("gsm8k", 1)
    assert str(error.value) == (
        f"cannot load gsm8k from the Hub (openai/gsm8k@{BENCHMARKS['gsm8k'].revision}): Couldn't reach "
        "'openai/gsm8k' on the Hub (OfflineModeIsEnabled); give a local copy as gsm8k:PATH"
    )


def test_named_sets_mix_with_other_sources(gsm8k_jsonl):
    spec = f"reasoning-gym:chain_sum:max_terms=2,gsm8k:{gsm8k_jsonl}=2,aime24"
    assert [(s.source, s.weight) for s in parse_sources(spec)] == [
        ("reasoning-gym:chain_sum:max_terms=2", 1.0),
        (f"gsm8k:{gsm8k_jsonl}", 2.0),
        ("aime24", 1.0),
    ]
    problems = load_problems(f"reasoning-gym:chain_sum=1,gsm8k:{gsm8k_jsonl}=2", 3)
    assert [p.source for p in problems] == ["gsm8k", "reasoning-gym:chain_sum", "gsm8k"]


def test_eval_prompts_runs_on_a_local_gsm8k_copy(tmp_path, tiny_dir, gsm8k_jsonl, capsys):
    out = tmp_path / "gen"
    argv = [
        "eval",
        "--prompts",
        f"gsm8k:{gsm8k_jsonl}",
        "--model",
        str(tiny_dir),
        "--num",
        "2",
        "-k",
        "1",
        "--policies",
        "full",
        "--budgets",
        "128",
        "-L",
        "32",
        "--max-new-tokens",
        "8",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())
    assert [(r["policy"], r["budget"], r["problems"], r["samples"]) for r in rows] == [("full", 128, 2, 1)]
    assert all(0.0 <= r[metric] <= 1.0 for r in rows for metric in ("pass1_flexible", "pass1_strict"))
    assert "| gsm8k |" in (out / "results.md").read_text()  # the full cache's row for the set
    records = [r for path in (out / "completions" / "full").glob("batch-*.json") for r in json.loads(path.read_text())]
    assert sorted((r["source"], r["problem"]) for r in records) == [("gsm8k", 0), ("gsm8k", 1)]
    assert "generated 2 completions" in capsys.readouterr().out.splitlines()[-1]
