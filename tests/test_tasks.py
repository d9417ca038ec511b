"""Prompt sources, final-answer extraction, answer checking and chat encoding (foresight.data.tasks)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import datasets
import pytest
import reasoning_gym

from foresight.data.tasks import (
    ANSWER_INSTRUCTION,
    Problem,
    WeightedSource,
    chat_prompt_ids,
    check_answer,
    extract_answer,
    load_problems,
    mixture_counts,
    mixture_order,
    parse_sources,
    recorded_source,
)
from tests.prompts import CHAT_TEMPLATE, DATA, char_tokenizer, write_lines


def test_reasoning_gym_problems_are_the_packages_with_the_instruction():
    problems = load_problems("reasoning-gym:basic_arithmetic", 4, seed=3)
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=3))
    assert [p.index for p in problems] == [0, 1, 2, 3]
    assert [p.prompt for p in problems] == [f"{e['question']}\n{ANSWER_INSTRUCTION}" for e in entries]
    assert [p.answer for p in problems] == [str(e["answer"]) for e in entries]
    assert load_problems("reasoning-gym:basic_arithmetic", 4, seed=3) == problems
    assert load_problems("reasoning-gym:basic_arithmetic", 2, seed=3) == problems[:2]
    other_seed = load_problems("reasoning-gym:basic_arithmetic", 4, seed=4)
    assert [p.prompt for p in other_seed] != [p.prompt for p in problems]


@pytest.mark.parametrize(
    ("completion", "strict", "flexible"),
    [
        ("so 3 + 4 = 7, hence \\boxed{7}. Done.", "7", "7"),
        ("\\boxed{1} first, then \\boxed{\\frac{3}{4}} at last", "\\frac{3}{4}", "\\frac{3}{4}"),
        ("unbalanced \\boxed{2 and \\boxed{5}", "5", "5"),
        ("\\boxed{8}, put within \\boxed{ }", "8", "8"),  # an empty box is the instruction echoed back
        ("the final answer within \\boxed{}\nis 41.", "", "41"),
        ("steps...\nFinal answer: -12.\nThanks", "-12", "-12"),
        ("answer: 3\nANSWER:  41 ", "41", "41"),
        ("the answer is below\nAnswer:\n\n  9.\nmore text", "9", "9"),
        ("we add them\n\n  15.  \n\n", "", "15"),
        ("", "", ""),
        ("\\boxed{-4", "", "-4"),  # no closing brace: not strict; the last number for flexible
        ("2 - -1 means adding 1.\nSo, the final answer is 3.", "", "3"),
        ("The answer is **-17.5**. Let me check: 4 + 2 = 6.", "", "-17.5"),
        ("I think the answer is $1,234$.", "", "1234"),
        ("The answer is: No. Because some reptiles are not butterflies.", "", "No"),
        ("So, the answer is yes, it does logically follow.", "", "yes"),
        ('So, the answer is "3".', "", "3"),
        ("So the final answer is 2 * 2 = 4.\nThis is how multiplication works.", "", "4"),
        ("we add 8 and 0:\n8 + 0 = 8", "", "8"),
        ("the answer is 7.\nWait, the answer is 8", "", "8"),  # the last statement
        ("First 12 apples, then 1,500 more, 2.5 kg each", "", "2.5"),
        ("There were 3 then 4/5 of them", "", "4/5"),
        ("The word reversed is\n**olleh**", "", "olleh"),  # no number: the last line
        ("Answer: 5\nthe answer is 6", "5", "5"),  # an Answer: line outranks a stated answer
        ("\\boxed{10}\nthe answer is 11", "10", "10"),
    ],
)
def test_extract_answer_strict_and_flexible(completion, strict, flexible):
    assert extract_answer(completion, "strict") == strict
    assert extract_answer(completion, "flexible") == flexible
    assert extract_answer(completion) == flexible


def test_extract_answer_names_an_unknown_rule():
    with pytest.raises(ValueError, match="unknown answer rule 'loose'; allowed: 'strict', 'flexible'"):
        extract_answer("42", "loose")


def test_the_flexible_rule_reads_a_stated_answer_that_the_strict_rule_misses():
    problem = Problem(0, "Calculate 2 - -1.", "3", "reasoning-gym:basic_arithmetic", {"answer": "3"})
    assert check_answer(problem, "So, the final answer is 3.", "strict") is False
    assert check_answer(problem, "So, the final answer is 3.", "flexible") is True
    assert check_answer(problem, "So, the final answer is 4.", "flexible") is False


def test_reasoning_gym_options_set_the_task_config_and_its_scorer_still_checks():
    problems = load_problems("reasoning-gym:chain_sum:max_terms=2,max_digits=1", 6, seed=2)
    entries = list(reasoning_gym.create_dataset("chain_sum", size=6, seed=2, max_terms=2, max_digits=1))
    assert [p.prompt for p in problems] == [f"{e['question']}\n{ANSWER_INSTRUCTION}" for e in entries]
    assert all(p.metadata["metadata"]["num_terms"] == 2 for p in problems)
    assert all(check_answer(p, f"\\boxed{{{p.answer}}}") for p in problems)
    assert not any(check_answer(p, f"\\boxed{{{p.answer}1}}") for p in problems)
    assert (
        load_problems("reasoning-gym:syllogism:allow_all=false", 2)[0].source
        == "reasoning-gym:syllogism:allow_all=false"
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("reasoning-gym:no_such_task", "unknown reasoning-gym task 'no_such_task'; known tasks: ab, acre,"),
        (
            "reasoning-gym:chain_sum:max_term=2",
            "reasoning-gym task 'chain_sum' has no option 'max_term'; its options are: min_terms,",
        ),
        (
            "reasoning-gym:chain_sum:max_terms",
            "reasoning-gym option 'max_terms' in 'reasoning-gym:chain_sum:max_terms' must look like KEY=VALUE",
        ),
        ("reasoning-gym:chain_sum:min_terms=5,max_terms=2", "reasoning-gym task 'chain_sum' refused the options"),
    ],
)
def test_bad_reasoning_gym_sources_are_named(source, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_problems(source, 2)


def test_reasoning_gym_problems_do_not_follow_the_interpreters_hash_seed():
    """acre and isomorphic_strings iterate over sets of strings: under two hash seeds the same seed must still
    give the same problems, or a resumed sampling run would not find its own rows."""
    code = (
        "import json; from foresight.data.tasks import load_problems; "
        "print(json.dumps([p.prompt for p in load_problems("
        "'reasoning-gym:acre=1,reasoning-gym:isomorphic_strings=1', 6, seed=6)]))"
    )
    prompts = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", code],
                env={**os.environ, "PYTHONHASHSEED": hash_seed},
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for hash_seed in ("1", "2")
    ]
    assert prompts[0] == prompts[1]
    assert prompts[0] == [
        p.prompt for p in load_problems("reasoning-gym:acre=1,reasoning-gym:isomorphic_strings=1", 6, 6)
    ]


def test_check_answer_uses_reasoning_gym_scorer():
    problem = next(p for p in load_problems("reasoning-gym:basic_arithmetic", 10) if p.answer == "-4")
    assert check_answer(problem, "5 - 3 = 2, 2 - 6 = -4, so \\boxed{-4}") is True
    assert check_answer(problem, "Answer: -4") is True
    assert check_answer(problem, "\\boxed{4}") is False
    assert check_answer(problem, "it is -4 or maybe 3") is False


def test_check_answer_uses_math_verify_for_files():
    problem = Problem(0, "What is 1/2 + 1/4?", "\\frac{3}{4}", "problems.jsonl")
    assert check_answer(problem, "\\boxed{0.75}") is True
    assert check_answer(problem, "Answer: 3/4") is True
    assert check_answer(problem, "\\boxed{\\dfrac{6}{8}}") is True
    assert check_answer(problem, "\\boxed{\\frac{2}{3}}") is False
    assert check_answer(Problem(0, "Simplify x + x - 1.", "2x-1", "p.jsonl"), "\\boxed{-1 + 2x}") is True
    assert check_answer(Problem(0, "Say hi.", None, "p.jsonl"), "hi") is None


def test_shipped_prompt_set_answers_check():
    problems = load_problems(str(DATA / "arithmetic.jsonl"), 30)
    assert all(p.answer for p in problems)
    assert all(check_answer(p, f"work...\n\\boxed{{{p.answer}}}") for p in problems)
    assert not any(check_answer(p, f"\\boxed{{{p.answer}+1}}") for p in problems)


def test_jsonl_bad_lines_are_skipped_and_counted(tmp_path):
    source = write_lines(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "a", "answer": "1"}),
            "not json",
            json.dumps({"question": "no prompt key"}),
            "",
            json.dumps({"prompt": "b", "answer": 2}),
            json.dumps(["prompt", "in a list"]),
            json.dumps({"prompt": "c"}),
        ],
    )
    with pytest.warns(UserWarning, match=r"skipped 3 line\(s\) .* \(line 2, 3, 6\)"):
        problems = load_problems(source, 3)
    assert [(p.index, p.prompt, p.answer) for p in problems] == [(0, "a", "1"), (1, "b", "2"), (2, "c", None)]


def test_file_that_is_not_jsonl_is_one_line_error(tmp_path):
    text = write_lines(tmp_path / "notes.txt", ["just some", "notes"])
    with pytest.raises(ValueError, match="is not JSONL") as error:
        load_problems(text, 1)
    assert "\n" not in str(error.value)
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match="is not JSONL"):
        load_problems(str(binary), 1)


def test_bad_sources_and_counts(tmp_path):
    with pytest.raises(ValueError, match="neither 'reasoning-gym:TASK'"):
        load_problems(str(tmp_path / "missing.jsonl"), 1)
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'no_such_task'"):
        load_problems("reasoning-gym:no_such_task", 1)
    source = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "a"})])
    with pytest.raises(ValueError, match="asked for 2 problems but .* has only 1"):
        load_problems(source, 2)
    with pytest.raises(ValueError, match="num must be at least 1, got 0"):
        load_problems(source, 0)


def test_saved_dataset_source(tmp_path):
    datasets.Dataset.from_dict({"question": ["q0", "q1"], "answer": [3, 4]}).save_to_disk(str(tmp_path / "qa"))
    problems = load_problems(str(tmp_path / "qa"), 2)
    assert [(p.prompt, p.answer) for p in problems] == [("q0", "3"), ("q1", "4")]
    datasets.Dataset.from_dict({"prompt": ["p0"]}).save_to_disk(str(tmp_path / "p"))
    assert load_problems(str(tmp_path / "p"), 1)[0].answer is None
    datasets.Dataset.from_dict({"text": ["t"]}).save_to_disk(str(tmp_path / "t"))
    with pytest.raises(ValueError, match="no 'prompt' or 'question' column"):
        load_problems(str(tmp_path / "t"), 1)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["p"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"holds splits \['train'\]"):
        load_problems(str(tmp_path / "dd"), 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a dataset saved with save_to_disk"):
        load_problems(str(tmp_path / "empty"), 1)


def test_mixture_counts_follow_the_weights_by_largest_remainder():
    assert mixture_counts(10, [1, 1]) == [5, 5]
    assert mixture_counts(10, [2, 1]) == [7, 3]  # quotas 6.67, 3.33
    assert mixture_counts(7, [1, 1, 1]) == [3, 2, 2]  # equal remainders: the earlier source
    assert mixture_counts(5, [0.5, 3, 1.5]) == [1, 3, 1]
    for num in range(1, 40):
        assert sum(mixture_counts(num, [3, 1, 2.5])) == num


def test_mixture_order_keeps_every_prefix_near_the_weights():
    assert mixture_order([2, 4]) == [1, 0, 1, 1, 0, 1]
    counts = [7, 3, 5]
    order = mixture_order(counts)
    assert [order.count(s) for s in range(3)] == counts
    for prefix in range(1, len(order) + 1):
        for source, count in enumerate(counts):
            assert abs(order[:prefix].count(source) - count * prefix / sum(counts)) < 1


def test_mixed_sources_take_each_sources_first_problems(tmp_path):
    other = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": f"p{i}", "answer": i}) for i in range(4)])
    gym = "reasoning-gym:basic_arithmetic"
    problems = load_problems(f"{gym}=2,{other}", 6, seed=3)
    assert [p.index for p in problems] == list(range(6))
    assert [p.source for p in problems] == [
        gym,
        str((tmp_path / "p.jsonl").resolve()),
        gym,
        gym,
        recorded_source(other),
        gym,
    ]
    assert [p.prompt for p in problems if p.source == gym] == [p.prompt for p in load_problems(gym, 4, seed=3)]
    assert [p.prompt for p in problems if p.source != gym] == ["p0", "p1"]
    assert check_answer(problems[1], "\\boxed{0}") is True  # each problem is checked by its own source's rule


def test_source_specs_and_their_recorded_form(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_sources("reasoning-gym:lcm") == [WeightedSource("reasoning-gym:lcm", 1.0)]
    assert parse_sources(" a.jsonl=2 , reasoning-gym:gcd=0.5") == [
        WeightedSource("a.jsonl", 2.0),
        WeightedSource("reasoning-gym:gcd", 0.5),
    ]
    assert parse_sources("run=3/p.jsonl") == [WeightedSource("run=3/p.jsonl", 1.0)]  # "=" not before a number
    assert recorded_source("reasoning-gym:lcm") == "reasoning-gym:lcm"
    assert recorded_source("a.jsonl") == str(tmp_path / "a.jsonl")
    assert recorded_source("a.jsonl=1,reasoning-gym:gcd=2.50") == f"{tmp_path / 'a.jsonl'}=1,reasoning-gym:gcd=2.5"
    for spec, message in [
        ("a.jsonl,,b.jsonl", "has an empty entry"),
        ("a.jsonl=0", "weight '0' of prompt source 'a.jsonl' must be a positive number"),
        ("a.jsonl=-1,b.jsonl", "weight '-1' of prompt source 'a.jsonl' must be a positive number"),
        ("a.jsonl=1,a.jsonl=2", "names a source twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_sources(spec)
    with pytest.raises(ValueError, match="2 problems leave none for reasoning-gym:gcd; ask for more problems"):
        load_problems("reasoning-gym:lcm=10,reasoning-gym:gcd=1,reasoning-gym:chain_sum=10", 2)


def test_chat_prompt_ids_applies_template_when_there_is_one():
    assert chat_prompt_ids(char_tokenizer(CHAT_TEMPLATE), "Hi") == [ord(c) for c in "<user>Hi\n<assistant>"]
    assert chat_prompt_ids(char_tokenizer(), "Hi") == [ord("H"), ord("i")]
