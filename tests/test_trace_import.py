"""Importing prompt/completion pairs made by another engine (foresight.data.trace_import, `foresight traces --import`)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

from foresight import cli
from foresight.data.tasks import chat_prompt_ids
from foresight.data.trace_import import (
    BAD_LOGPROBS,
    COMPLETION_DISAGREES,
    EMPTY,
    EMPTY_PROMPT,
    NOT_A_ROW,
    NOT_IDS,
    NOT_ROUND_TRIP,
    PROMPT_DISAGREES,
    import_traces,
)
from foresight.data.trace_store import TraceStore
from foresight.models import tiny_model
from tests.prompts import CHAT_TEMPLATE, char_tokenizer, write_lines

EOS = 2
TOKENIZER = char_tokenizer(CHAT_TEMPLATE)
CONTEXT = 2048  # the tiny models' max_position_embeddings
PAIRS = [
    {"prompt": "What is 2 + 3?", "completion": "2 + 3 = 5, so \\boxed{5}", "finish_reason": "stop", "answer": "5"},
    {"prompt": "What is 4 * 2?", "completion": "4 * 2 = 6\nAnswer: 6", "finish_reason": "stop", "answer": 8},
    {"prompt": "Count to three.", "completion": "one, two, thr", "finish_reason": "length", "source": "counting"},
    {"prompt": "Say hi.", "completion": "hi"},
]
# Rows that cannot be traces, each with the reason the summary must give.
BAD = [
    ("not json at all", NOT_A_ROW),
    (json.dumps({"prompt": "no completion"}), NOT_A_ROW),
    (json.dumps({"prompt": "x", "completion": ""}), EMPTY),
    (json.dumps({"prompt": "x", "completion": " \n "}), EMPTY),
    (json.dumps({"prompt": "x", "completion": "caf\u00e9 au lait"}), NOT_ROUND_TRIP),  # é is not in the vocabulary
    (
        json.dumps({"prompt": "x", "completion": "y" * CONTEXT}),
        f"prompt + completion longer than the model's context of {CONTEXT} tokens",
    ),
    (
        json.dumps({"prompt": "x", "completion": "y", "finish_reason": "abort"}),
        "finish_reason is not one of stop, length",
    ),
]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama", seed=0).eval()


def write_pairs(path: Path, bad: bool = True) -> str:
    """The good pairs, with the bad rows between them: rows 0, 2, 4, 6 good when `bad`."""
    lines = [json.dumps(pair) for pair in PAIRS]
    if bad:
        lines = [lines[0], BAD[0][0], lines[1], BAD[1][0], lines[2], "", *[b for b, _ in BAD[2:]], lines[3]]
    return write_lines(path, lines)


def direct_losses(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    nll = -log_probs.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return nll, -(log_probs.exp() * log_probs).sum(-1)


def test_pairs_become_traces_with_full_cache_losses(model, tmp_path):
    source = write_pairs(tmp_path / "pairs.jsonl", bad=False)
    summary = import_traces(model, TOKENIZER, source, out_dir=tmp_path / "out", progress=False)
    store = TraceStore(tmp_path / "out")
    assert [t.index for t in store] == [0, 1, 2, 3]
    for trace, pair in zip(store, PAIRS):
        prompt = chat_prompt_ids(TOKENIZER, pair["prompt"])
        completion = [ord(c) for c in pair["completion"]] + ([EOS] if pair.get("finish_reason") == "stop" else [])
        assert trace.input_ids.tolist() == prompt + completion and trace.prompt_length == len(prompt)
        assert trace.completion == pair["completion"] and trace.prompt == pair["prompt"]
        assert trace.source == pair.get("source", str(Path(source).resolve()))
        nll, entropy = direct_losses(model, prompt + completion)
        torch.testing.assert_close(trace.token_nll, nll, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(trace.token_entropy, entropy, atol=1e-5, rtol=1e-5)
    assert [t.correct for t in store] == [True, False, None, None]
    counts = summary.counts
    assert (counts.generated, counts.kept, counts.rejected, counts.truncated, counts.checked, counts.correct) == (
        4,
        4,
        0,
        1,
        2,
        1,
    )
    settings = json.loads((tmp_path / "out" / "manifest.json").read_text())["settings"]
    assert settings["source"] == str(Path(source).resolve()) and len(settings["sha256"]) == 64


def test_every_refused_row_is_counted_with_its_reason(model, tmp_path):
    source = write_pairs(tmp_path / "pairs.jsonl")
    summary = import_traces(model, TOKENIZER, source, out_dir=tmp_path / "out", shard_size=4, progress=False)
    rows = len(PAIRS) + len(BAD)
    expected = {NOT_A_ROW: [1, 3]}
    for row, (_, reason) in enumerate(BAD[2:], start=5):
        expected.setdefault(reason, []).append(row)
    assert summary.rejected == expected
    counts = summary.counts
    assert (counts.generated, counts.kept, counts.rejected) == (rows, len(PAIRS), len(BAD))
    assert [t.index for t in TraceStore(tmp_path / "out")] == [0, 2, 4, rows - 1]
    line = summary.describe()
    assert f"kept 4 of {rows} traces" in line and f"{len(BAD)} rejected" in line
    assert f"2 {NOT_A_ROW} (row 1, 3)" in line and f"2 {EMPTY} (row 5, 6)" in line and "\n" not in line
    shards = json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"]
    assert shards[1]["rejected_rows"] == [
        {"row": 5, "reason": EMPTY},
        {"row": 6, "reason": EMPTY},
        {"row": 7, "reason": NOT_ROUND_TRIP},
    ]


def test_filters_apply_as_in_generation(model, tmp_path):
    source = write_pairs(tmp_path / "pairs.jsonl", bad=False)
    lengths = [len(t.input_ids) for t in TraceStore(_imported(model, source, tmp_path / "all"))]
    min_tokens = sorted(lengths)[2]
    summary = import_traces(
        model, TOKENIZER, source, out_dir=tmp_path / "f", min_tokens=min_tokens, only_correct=True, progress=False
    )
    counts = summary.counts
    assert (counts.kept, counts.too_short, counts.incorrect) == (
        sum(n >= min_tokens and i == 0 for i, n in enumerate(lengths)),
        sum(n < min_tokens for n in lengths),
        sum(n >= min_tokens and i != 0 for i, n in enumerate(lengths)),
    )


def _imported(model, source: str, out_dir: Path, **options) -> Path:
    import_traces(model, TOKENIZER, source, out_dir=out_dir, progress=False, **options)
    return out_dir


def test_sharded_and_resumed_imports_equal_one_run_and_a_changed_file_is_refused(model, tmp_path):
    source = write_pairs(tmp_path / "pairs.jsonl")
    whole = TraceStore(_imported(model, source, tmp_path / "whole", shard_size=3))
    _imported(model, source, tmp_path / "parts", shard_size=3, shard=(1, 2))
    assert [t.index for t in TraceStore(tmp_path / "parts")] == [4, 10]  # shards 1 and 3: rows 3-5 and 9-10
    summary = import_traces(model, TOKENIZER, source, out_dir=tmp_path / "parts", shard_size=3, progress=False)
    assert (summary.shards_written, summary.shards_skipped) == (2, 2)
    parts = TraceStore(tmp_path / "parts")
    assert [t.input_ids.tolist() for t in parts] == [t.input_ids.tolist() for t in whole]
    assert all(torch.equal(a.token_nll, b.token_nll) for a, b in zip(parts, whole))
    write_lines(tmp_path / "pairs.jsonl", (tmp_path / "pairs.jsonl").read_text().splitlines()[::-1])
    with pytest.raises(ValueError, match="made with other settings .*sha256"):
        import_traces(model, TOKENIZER, source, out_dir=tmp_path / "parts", shard_size=3, progress=False)


def test_a_saved_dataset_imports_like_the_jsonl(model, tmp_path):
    source = write_pairs(tmp_path / "pairs.jsonl", bad=False)
    columns = {name: [pair.get(name) for pair in PAIRS] for name in ("prompt", "completion", "finish_reason")}
    datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / "pairs"))
    from_jsonl = TraceStore(_imported(model, source, tmp_path / "a"))
    from_folder = TraceStore(_imported(model, str(tmp_path / "pairs"), tmp_path / "b"))
    assert [t.input_ids.tolist() for t in from_folder] == [t.input_ids.tolist() for t in from_jsonl]
    datasets.Dataset.from_dict({"prompt": ["p"]}).save_to_disk(str(tmp_path / "prompts-only"))
    with pytest.raises(ValueError, match="has neither prompt and completion nor prompt_token_ids"):
        import_traces(model, TOKENIZER, tmp_path / "prompts-only", out_dir=tmp_path / "c", progress=False)


def test_files_that_are_not_pairs_are_one_line_errors(model, tmp_path):
    for lines, message in [(["just", "notes"], "is not JSONL of prompt/completion pairs"), ([], "is not JSONL")]:
        path = write_lines(tmp_path / "bad.jsonl", lines)
        with pytest.raises(ValueError, match=message):
            import_traces(model, TOKENIZER, path, out_dir=tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="does not exist"):
        import_traces(model, TOKENIZER, tmp_path / "missing.jsonl", out_dir=tmp_path / "out", progress=False)
    source = write_pairs(tmp_path / "pairs.jsonl", bad=False)
    with pytest.raises(ValueError, match="asked for 9 rows but .* has 4"):
        import_traces(model, TOKENIZER, source, num=9, out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_cli_imports_and_refuses_mixed_options(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("foresight.commands.traces.load_model", lambda name, **options: (model, TOKENIZER))
    source = write_pairs(tmp_path / "pairs.jsonl")
    args = ["traces", "--model", "tiny", "--out", str(tmp_path / "out")]
    assert cli.main([*args, "--import", source]) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"kept 4 of {len(PAIRS) + len(BAD)} traces" in last_line and "rejected:" in last_line
    assert len(TraceStore(tmp_path / "out")) == 4
    assert cli.main([*args, "--import", source, "--max-new-tokens", "8"]) == 2
    assert "--max-new-tokens applies to sampling (--prompts)" in capsys.readouterr().err
    assert cli.main([*args, "--prompts", "reasoning-gym:lcm"]) == 2
    assert "--prompts needs --num and --max-new-tokens" in capsys.readouterr().err
    assert cli.main([*args, "--prompts", "reasoning-gym:lcm", "--logprob-tolerance", "0.1"]) == 2
    assert "--logprob-tolerance applies to imported traces (--import)" in capsys.readouterr().err
    assert cli.main([*args, "--import", source, "--logprob-tolerance", "-1"]) == 2
    assert "--logprob-tolerance must be >= 0 nats, got -1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "--prompts", "reasoning-gym:lcm", "--import", source])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def ids_row(pair: dict, *, texts: bool = True, engine_eos: bool = False, **fields) -> dict:
    """A pair as an engine writes it by token ids: the templated prompt's ids and the sampled ids (the
    stop token included when `engine_eos`), with the texts when `texts`."""
    completion = [ord(c) for c in pair["completion"]] + ([EOS] if engine_eos else [])
    row = {
        "prompt_token_ids": chat_prompt_ids(TOKENIZER, pair["prompt"]),
        "completion_token_ids": completion,
        **{name: pair[name] for name in ("finish_reason", "answer", "source") if name in pair},
    }
    return row | ({"prompt": pair["prompt"], "completion": pair["completion"]} if texts else {}) | fields


def test_rows_by_token_ids_import_like_their_text(model, tmp_path):
    text = TraceStore(_imported(model, write_pairs(tmp_path / "pairs.jsonl", bad=False), tmp_path / "text"))
    rows = [
        ids_row(PAIRS[0], engine_eos=True),  # the engine returned its stop token: kept, not doubled
        ids_row(PAIRS[1], texts=False),  # no texts: EOS appended at "stop", the prompt text decoded from its ids
        ids_row(PAIRS[2], prompt=TOKENIZER.decode(chat_prompt_ids(TOKENIZER, PAIRS[2]["prompt"]))),
        ids_row(PAIRS[3]),
    ]
    source = write_lines(tmp_path / "ids.jsonl", [json.dumps(row) for row in rows])
    summary = import_traces(model, TOKENIZER, source, out_dir=tmp_path / "ids", progress=False)
    assert (summary.counts.kept, summary.counts.rejected) == (4, 0)
    by_ids = TraceStore(tmp_path / "ids")
    for a, b, pair in zip(by_ids, text, PAIRS):
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.prompt_length == b.prompt_length
        assert torch.equal(a.token_nll, b.token_nll) and torch.equal(a.token_entropy, b.token_entropy)
        assert (a.completion, a.correct) == (b.completion, b.correct)
        assert a.source == pair.get("source", str(Path(source).resolve()))
    assert [t.prompt for t in by_ids] == [
        PAIRS[0]["prompt"],
        TOKENIZER.decode(rows[1]["prompt_token_ids"]),
        TOKENIZER.decode(rows[2]["prompt_token_ids"]),
        PAIRS[3]["prompt"],
    ]
    assert summary.logprobs.traces == () and "log-probabilities" not in summary.describe()
    names = ("prompt_token_ids", "completion_token_ids", "prompt", "completion", "finish_reason")
    datasets.Dataset.from_dict({name: [row.get(name) for row in rows] for name in names}).save_to_disk(
        str(tmp_path / "ids-dataset")
    )  # row 1's texts are None there: absent, as in the JSONL
    from_folder = TraceStore(_imported(model, str(tmp_path / "ids-dataset"), tmp_path / "from-folder"))
    assert [t.input_ids.tolist() for t in from_folder] == [t.input_ids.tolist() for t in by_ids]


def test_every_refused_ids_row_is_named_and_the_rest_kept(model, tmp_path):
    good = ids_row(PAIRS[0])
    refused = [
        (
            ids_row(PAIRS[0], completion_token_ids=[ord("1"), 128]),
            "a token id outside the model's vocabulary of 128 ids",
        ),
        (ids_row(PAIRS[0], prompt_token_ids=[-1, 5]), "a token id outside the model's vocabulary of 128 ids"),
        (ids_row(PAIRS[0], completion_token_ids=[ord("1"), "2"]), NOT_IDS),
        (ids_row(PAIRS[0], completion_token_ids=[ord("1"), 2.0]), NOT_IDS),
        (ids_row(PAIRS[0], completion_token_ids=[True]), NOT_IDS),
        (ids_row(PAIRS[0], completion="2 + 3 = 5, so \\boxed{6}"), COMPLETION_DISAGREES),
        (ids_row(PAIRS[0], prompt="What is 2 + 4?"), PROMPT_DISAGREES),
        (ids_row(PAIRS[0], prompt_token_ids=[]), EMPTY_PROMPT),
        (ids_row(PAIRS[0], completion_token_ids=[EOS], completion=""), EMPTY),  # only the stop token
        ({"prompt": "x", "completion": "caf\u00e9", "prompt_token_ids": [5]}, NOT_ROUND_TRIP),  # a text row
        (ids_row(PAIRS[0], completion_logprobs=[-1.0]), BAD_LOGPROBS),
        (ids_row(PAIRS[0], completion_logprobs=[None] * len(good["completion_token_ids"])), BAD_LOGPROBS),
        (
            ids_row(PAIRS[0], completion_token_ids=[ord("y")] * CONTEXT, completion="y" * CONTEXT),
            f"prompt + completion longer than the model's context of {CONTEXT} tokens",
        ),
    ]
    lines = [json.dumps(good), *[json.dumps(row) for row, _ in refused], json.dumps(ids_row(PAIRS[3]))]
    summary = import_traces(
        model, TOKENIZER, write_lines(tmp_path / "ids.jsonl", lines), out_dir=tmp_path / "out", progress=False
    )
    expected = {}
    for row, (_, reason) in enumerate(refused, start=1):
        expected.setdefault(reason, []).append(row)
    assert summary.rejected == expected
    assert [t.index for t in TraceStore(tmp_path / "out")] == [0, len(lines) - 1]
    assert "rejected: " in summary.describe() and COMPLETION_DISAGREES in summary.describe()
    record = json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"][0]["rejected_rows"]
    assert [r["reason"] for r in record] == [reason for _, reason in refused]


def test_engine_logprobs_agree_with_the_pass_and_other_ones_are_flagged(model, tmp_path):
    rows = [ids_row(pair, engine_eos=pair.get("finish_reason") == "stop") for pair in PAIRS]
    for row in rows:
        ids = row["prompt_token_ids"] + row["completion_token_ids"]
        nll, _ = direct_losses(model, ids)  # the engine's own log-probabilities: a float32 forward of its own
        row["completion_logprobs"] = (-nll[len(row["prompt_token_ids"]) - 1 :]).tolist()
    other = tiny_model("llama", seed=1).eval()  # an engine that ran other weights
    ids = rows[1]["prompt_token_ids"] + rows[1]["completion_token_ids"]
    rows[1]["completion_logprobs"] = (-direct_losses(other, ids)[0][len(rows[1]["prompt_token_ids"]) - 1 :]).tolist()
    rows[3]["completion_logprobs"] = [x + 0.1 for x in rows[3]["completion_logprobs"]]  # processed (shifted) ones
    source = write_lines(tmp_path / "ids.jsonl", [json.dumps(row) for row in rows])
    summary = import_traces(model, TOKENIZER, source, out_dir=tmp_path / "out", shard_size=2, progress=False)
    compared = {trace["row"]: trace for trace in summary.logprobs.traces}
    assert sorted(compared) == [0, 1, 2, 3]
    assert [compared[i]["tokens"] for i in range(4)] == [len(row["completion_token_ids"]) for row in rows]
    for row in (0, 2):
        assert compared[row]["max_abs_diff"] < 1e-5  # float32 forwards of one model: rounding only
    assert compared[1]["mean_abs_diff"] > 0.15  # 0.18 nats
    assert compared[3]["mean_abs_diff"] == pytest.approx(0.1, abs=1e-5)
    assert summary.logprobs.flagged == [1, 3]
    line = summary.describe()
    assert "engine log-probabilities of 4 traces" in line and "2 traces over the tolerance of 0.05 nats" in line
    assert "(row 1, 3)" in line and "\n" not in line
    shards = json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"]
    assert [t["row"] for shard in shards for t in shard["logprob_agreement"]] == [0, 1, 2, 3]
    again = import_traces(
        model, TOKENIZER, source, out_dir=tmp_path / "out", shard_size=2, progress=False, logprob_tolerance=0.15
    )
    assert (
        again.shards_written == 0 and again.logprobs.traces == summary.logprobs.traces and again.logprobs.flagged == [1]
    )
