"""Trace generation and storage (foresight.data.trace_store) and the `foresight traces` verb."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from foresight import cli
from foresight.data.tasks import chat_prompt_ids, check_answer, load_problems
from foresight.data.trace_generation import generate_traces, token_losses
from foresight.data.trace_store import Trace, TraceStore, describe_traces, folder_sources
from foresight.models import tiny_model
from tests.decoding import eos_prone_model
from tests.prompts import CHAT_TEMPLATE, DATA, char_tokenizer, write_lines

REPO = Path(__file__).resolve().parents[1]
EOS = 2
PROMPTS = str(DATA / "arithmetic.jsonl")
TOKENIZER = char_tokenizer(CHAT_TEMPLATE)
# 7 problems in shards of 3 (3 + 3 + 1), generated 2 at a time.
RUN = dict(num=7, max_new_tokens=16, shard_size=3, batch_size=2, progress=False)


def generate(out_dir: Path, **overrides):
    return generate_traces(eos_prone_model(), TOKENIZER, PROMPTS, out_dir=out_dir, **{**RUN, **overrides})


def shard_files(out_dir: Path) -> list[str]:
    """Every file of every complete shard, by path relative to the folder."""
    return [str(path.relative_to(out_dir)) for path in sorted(out_dir.glob("shard-*/*"))]


def assert_same_traces(out_dir: Path, expected_dir: Path) -> None:
    """Same manifest, same files and the same traces: every column equal, the losses up to the rounding
    of batched kernels (rows that shared a batch with other rows)."""
    assert manifest(out_dir) == manifest(expected_dir)
    assert shard_files(out_dir) == shard_files(expected_dir)
    assert_same_rows(TraceStore(out_dir), TraceStore(expected_dir))


def assert_same_rows(got, expected) -> None:
    assert len(got) == len(expected)
    for trace, reference in zip(got, expected):
        for name in ("index", "source", "prompt_length", "answer", "correct", "prompt", "completion"):
            assert getattr(trace, name) == getattr(reference, name)
        assert torch.equal(trace.input_ids, reference.input_ids)
        torch.testing.assert_close(trace.token_nll, reference.token_nll)  # float32 rounding: rtol 1.3e-6, atol 1e-5
        torch.testing.assert_close(trace.token_entropy, reference.token_entropy)


def manifest(out_dir: Path) -> dict:
    return json.loads((out_dir / "manifest.json").read_text())


def leftovers(out_dir: Path) -> list[str]:
    return sorted(path.name for path in out_dir.glob(".*.tmp*"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted, unsharded, unfiltered run."""
    out_dir = tmp_path_factory.mktemp("reference")
    generate(out_dir)
    return out_dir


def direct_losses(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: one plain forward, log_softmax over the whole [T, vocab] logits."""
    log_probs = torch.log_softmax(model(input_ids[None]).logits[0, :-1].float(), dim=-1)
    nll = -log_probs.gather(-1, input_ids[1:, None]).squeeze(-1)
    return nll, -(log_probs.exp() * log_probs).sum(-1)


def test_token_losses_hand_checked():
    """Logits fixed by a bias to p = (1/2, 1/4, 1/8, 1/8): entropy 1.75 ln 2, loss -ln p(next)."""
    model = tiny_model("llama", vocab_size=4)
    model.lm_head = torch.nn.Linear(model.lm_head.in_features, 4, bias=True)
    torch.nn.init.zeros_(model.lm_head.weight)
    model.lm_head.bias.data = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    nll, entropy = token_losses(model, torch.tensor([0, 1, 2, 3, 3, 0]), chunk_size=2)
    ln2 = math.log(2)
    assert nll.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(nll, torch.tensor([2, 3, 3, 3, 1]) * ln2)
    torch.testing.assert_close(entropy, torch.full((5,), 1.75 * ln2))


def test_token_losses_equal_one_forward_whatever_the_chunk():
    model = tiny_model("llama", seed=1)
    ids = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(0))
    expected = direct_losses(model, ids)
    for chunk_size in (1, 5, 36, 1024):
        torch.testing.assert_close(token_losses(model, ids, chunk_size=chunk_size), expected, atol=1e-5, rtol=1e-5)


def test_stored_traces(reference):
    store = TraceStore(reference)
    problems = load_problems(PROMPTS, RUN["num"])
    model = eos_prone_model()
    assert len(store) == RUN["num"] and len(store.dataset()) == RUN["num"]
    ended = 0
    for trace, problem in zip(store, problems):
        assert isinstance(trace, Trace) and trace.index == problem.index
        assert trace.input_ids.dtype == torch.int64
        prompt = chat_prompt_ids(TOKENIZER, problem.prompt)
        assert trace.prompt_length == len(prompt) and trace.input_ids[: len(prompt)].tolist() == prompt
        completion = trace.completion_ids.tolist()
        assert 1 <= len(completion) <= RUN["max_new_tokens"] and EOS not in completion[:-1]
        ended += completion[-1] == EOS
        if completion[-1] != EOS:
            assert len(completion) == RUN["max_new_tokens"]
        assert trace.completion == TOKENIZER.decode(completion, skip_special_tokens=True)
        assert trace.correct == check_answer(problem, trace.completion) and trace.answer == problem.answer
        nll, entropy = direct_losses(model, trace.input_ids)
        assert trace.token_nll.dtype == torch.float32 and trace.token_nll.shape == (len(trace.input_ids) - 1,)
        torch.testing.assert_close(trace.token_nll, nll, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(trace.token_entropy, entropy, atol=1e-5, rtol=1e-5)
    assert 0 < ended < RUN["num"]  # both ways of ending are exercised
    record = manifest(reference)
    assert record["settings"]["num"] == 7 and record["settings"]["temperature"] == 0.6
    assert record["num_shards"] == 3 and record["complete"]
    assert [s["indices"] for s in record["shards"]] == [[0, 3], [3, 6], [6, 7]]
    total = record["total"]
    assert (total["generated"], total["kept"], total["truncated"]) == (7, 7, RUN["num"] - ended)
    assert total["tokens"] == sum(len(t.input_ids) for t in store)


def test_batched_greedy_generation_equals_one_at_a_time(tmp_path):
    generate(tmp_path / "batched", temperature=0, batch_size=3)
    generate(tmp_path / "single", temperature=0, batch_size=1)
    batched, single = TraceStore(tmp_path / "batched"), TraceStore(tmp_path / "single")
    assert [t.input_ids.tolist() for t in batched] == [t.input_ids.tolist() for t in single]


def test_sampled_traces_do_not_depend_on_batch_size_or_shard_size(reference, tmp_path):
    """Each problem samples with its own generator: the reference (batch 2, shards of 3) is found again
    with one row at a time, with every problem in one batch, and with other shard boundaries."""
    lengths = {len(t.completion_ids) for t in TraceStore(reference)}
    assert len(lengths) > 1  # rows end at different steps, so batches are refilled mid-run
    for name, overrides in [("one", {"batch_size": 1}), ("all", {"batch_size": 7}), ("shards", {"shard_size": 2})]:
        generate(tmp_path / name, **overrides)
        assert_same_rows(TraceStore(tmp_path / name), TraceStore(reference))


def test_a_mixture_of_sources_is_interleaved_and_recorded_per_source(tmp_path):
    other = write_lines(
        tmp_path / "other.jsonl", [json.dumps({"prompt": f"{n} + {n} =", "answer": 2 * n}) for n in range(5)]
    )
    spec = f"{PROMPTS}=1,{other}=2"
    summary = generate_traces(
        eos_prone_model(), TOKENIZER, spec, out_dir=tmp_path / "mix", **{**RUN, "num": 6, "shard_size": 4}
    )
    first, second = str(Path(PROMPTS).resolve()), str(Path(other).resolve())
    store = TraceStore(tmp_path / "mix")
    assert [t.source for t in store] == [second, first, second, second, first, second]
    assert [t.prompt for t in store if t.source == second] == [f"{n} + {n} =" for n in range(4)]
    assert [t.prompt for t in store if t.source == first] == [p.prompt for p in load_problems(PROMPTS, 2)]
    record = manifest(tmp_path / "mix")
    assert record["settings"]["source"] == f"{first}=1,{second}=2"
    assert {name: counts["generated"] for name, counts in record["sources"].items()} == {first: 2, second: 4}
    assert record["shards"][1]["sources"][second]["generated"] == 1
    assert summary.by_source[second].kept == 4
    by_name = sorted([(first, "2/2"), (second, "4/4")])
    assert "by source: " + ", ".join(f"{name} {kept}" for name, kept in by_name) in summary.describe()
    assert folder_sources(tmp_path / "mix") == sorted([first, second])
    lengths = sorted(len(t.input_ids) for t in store)
    assert describe_traces(list(store)) == (
        f"6 traces, {sum(lengths)} tokens (length {lengths[0]} / {lengths[3]} / {lengths[-1]} min / median / max), "
        "from " + ", ".join(f"{name} ({kept.split('/')[0]})" for name, kept in by_name)
    )


def test_resume_after_a_failed_write_gives_identical_shards(reference, tmp_path, monkeypatch):
    save = datasets.Dataset.save_to_disk
    calls = []

    def save_then_fail_on_second(self, path, **kwargs):
        calls.append(path)
        save(self, path, **kwargs)
        if len(calls) == 2:
            raise RuntimeError("killed while writing")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", save_then_fail_on_second)
    with pytest.raises(RuntimeError, match="killed while writing"):
        generate(tmp_path)
    assert shard_files(tmp_path) == [n for n in shard_files(reference) if n.startswith("shard-00000/")]
    assert leftovers(tmp_path) == []  # the failed write removed its staging folder
    assert [s["shard"] for s in manifest(tmp_path)["shards"]] == [0] and not manifest(tmp_path)["complete"]
    monkeypatch.undo()
    summary = generate(tmp_path)
    assert (summary.shards_written, summary.shards_skipped) == (2, 1)
    assert leftovers(tmp_path) == []
    assert_same_traces(tmp_path, reference)


KILLED_RUN = """
import sys, time
import datasets
from tests.test_traces import generate

save = datasets.Dataset.save_to_disk
def save_then_hang(self, path, **kwargs):
    save(self, path, **kwargs)
    if "shard-00001" in path:
        print("saved", flush=True)
        time.sleep(600)
datasets.Dataset.save_to_disk = save_then_hang
generate(sys.argv[1])
"""


def test_sigkill_mid_run_then_rerun_gives_identical_shards(reference, tmp_path):
    """A real kill -9 while shard 1 sits half-published in its temporary folder."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_RUN), str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "saved"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    (leftover,) = leftovers(tmp_path)
    assert leftover.startswith(f".shard-00001.tmp-{child.pid}.")
    assert [name.split("/")[0] for name in shard_files(tmp_path)] == ["shard-00000"] * 4
    summary = generate(tmp_path)
    assert (summary.shards_written, summary.shards_skipped) == (2, 1) and leftovers(tmp_path) == []
    assert_same_traces(tmp_path, reference)


def test_two_shard_processes_together_equal_one_run(reference, tmp_path):
    first = generate(tmp_path, shard=(0, 2))
    assert (first.shards_written, first.counts.generated) == (2, 4)  # shards 0 and 2: problems 0-2 and 6
    assert [s["shard"] for s in manifest(tmp_path)["shards"]] == [0, 2] and not manifest(tmp_path)["complete"]
    partial = TraceStore(tmp_path)
    assert [t.index for t in partial] == [0, 1, 2, 6]
    generate(tmp_path, shard=(1, 2))
    assert_same_traces(tmp_path, reference)


def test_rerun_skips_complete_shards_and_refuses_other_settings(reference, tmp_path):
    out_dir = tmp_path / "copy"
    shutil.copytree(reference, out_dir)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = (
        out_dir / f".shard-00002.tmp-{int(dead.stdout)}"
    )  # a writer whose process is gone (no fixed pid: it may be alive)
    leftover.mkdir()
    (leftover / "data-00000-of-00001.arrow").write_bytes(b"partial")
    before = {path: path.stat().st_mtime_ns for path in out_dir.glob("shard-*/*")}
    summary = generate(out_dir)
    assert (summary.shards_written, summary.shards_skipped, summary.counts.kept) == (0, 3, 7)
    assert leftovers(out_dir) == []
    assert {path: path.stat().st_mtime_ns for path in out_dir.glob("shard-*/*")} == before
    others = [({"seed": 1}, "seed=0, not 1"), ({"num": 8}, "num=7, not 8"), ({"top_p": 0.9}, "top_p=0.95, not 0.9")]
    for override, expected in others:
        with pytest.raises(ValueError, match=expected) as error:
            generate(out_dir, **override)
        assert "\n" not in str(error.value)
    assert manifest(out_dir) == manifest(reference)


def test_a_folder_made_before_draws_were_recorded_resumes_as_generator_draws(reference, tmp_path):
    """Old manifests have no "draws": they were sampled from per-problem generators, so a rerun with
    those is accepted and one with counter draws (other traces) is refused."""
    out_dir = tmp_path / "old"
    shutil.copytree(reference, out_dir)
    old = manifest(out_dir)
    assert old["settings"].pop("draws") == "generator"
    (out_dir / "manifest.json").write_text(json.dumps(old))
    assert generate(out_dir).shards_skipped == 3
    with pytest.raises(ValueError, match=r"draws='generator', not 'counter'.*\(--draws generator keeps its draws\)"):
        generate(out_dir, draws="counter")
    greedy = tmp_path / "greedy"
    generate(greedy, draws="counter", temperature=0.0)
    assert manifest(greedy)["settings"]["draws"] == "generator"  # greedy decoding draws nothing


def test_counter_draws_do_not_depend_on_batch_size_and_differ_from_generator_draws(reference, tmp_path):
    for batch_size in (1, 5):
        generate(tmp_path / f"counter-{batch_size}", draws="counter", batch_size=batch_size)
    one, five = (TraceStore(tmp_path / f"counter-{batch_size}") for batch_size in (1, 5))
    assert_same_rows(five, one)
    assert manifest(tmp_path / "counter-1")["settings"]["draws"] == "counter"
    assert [t.input_ids.tolist() for t in one] != [t.input_ids.tolist() for t in TraceStore(reference)]


def test_filters_count_what_they_drop(reference, tmp_path, monkeypatch):
    full = {t.index: t.input_ids.tolist() for t in TraceStore(reference)}
    min_tokens = sorted(map(len, full.values()))[3]
    long_enough = {i for i, ids in full.items() if len(ids) >= min_tokens}
    assert 0 < len(long_enough) < len(full)
    summary = generate(tmp_path / "min", min_tokens=min_tokens)
    counts = summary.counts
    assert (counts.kept, counts.too_short, counts.incorrect) == (len(long_enough), 7 - len(long_enough), 0)
    assert {t.index: t.input_ids.tolist() for t in TraceStore(tmp_path / "min")} == {i: full[i] for i in long_enough}

    monkeypatch.setattr(
        "foresight.data.trace_generation.check_answer", lambda problem, completion: problem.index % 3 == 0
    )
    summary = generate(tmp_path / "both", min_tokens=min_tokens, only_correct=True)
    kept = {i for i in long_enough if i % 3 == 0}
    counts = summary.counts
    assert [t.index for t in TraceStore(tmp_path / "both")] == sorted(kept)
    expected = (len(kept), 7 - len(long_enough), len(long_enough - kept))
    assert (counts.kept, counts.too_short, counts.incorrect) == expected
    assert (counts.checked, counts.correct, counts.accuracy) == (7, 3, 3 / 7)
    assert manifest(tmp_path / "both")["total"]["incorrect"] == len(long_enough - kept)


def test_split_is_keyed_by_problem_index(reference, tmp_path):
    store = TraceStore(reference)
    train, held = store.split(0.4, seed=1)
    assert sorted([t.index for t in train] + [t.index for t in held]) == list(range(7))
    assert 0 < len(held) < 7
    assert torch.equal(held[0].token_nll, store[held[0].index].token_nll)
    generate(tmp_path, shard=(1, 2))  # a folder holding problems 3-5 only
    part_train, part_held = TraceStore(tmp_path).split(0.4, seed=1)
    assert [t.index for t in part_held] == [t.index for t in held if 3 <= t.index < 6]
    assert [t.index for t in part_train] == [t.index for t in train if 3 <= t.index < 6]
    assert (len(store.split(0.0)[1]), len(store.split(1.0)[0])) == (0, 0)
    with pytest.raises(ValueError, match="holdout must be a fraction in"):
        store.split(1.5)


def test_bad_options_are_refused_before_writing(tmp_path):
    for override, expected in [
        ({"shard": (2, 2)}, "shard must be i/n with 0 <= i < n, got 2/2"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1, got 0"),
        ({"temperature": -1}, "temperature must be >= 0, got -1"),
    ]:
        with pytest.raises(ValueError, match=expected):
            generate(tmp_path / "out", **override)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="is not a trace folder"):
        TraceStore(tmp_path)


def test_cli_writes_the_same_shards_and_states_the_result(reference, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("trainers.data_stage.load_model", lambda name, **options: (eos_prone_model(), TOKENIZER))
    args = ["traces", "--model", "tiny", "--prompts", PROMPTS, "--num", "7", "--max-new-tokens", "16"]
    args += ["--out", str(tmp_path)]
    assert cli.main([*args, "--shard-size", "3", "--batch-size", "2"]) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"{tmp_path}: kept 7 of 7 traces" in last_line and "3 shard(s) written" in last_line
    assert manifest(tmp_path)["settings"]["model"] == "tiny"
    assert [t.input_ids.tolist() for t in TraceStore(tmp_path)] == [t.input_ids.tolist() for t in TraceStore(reference)]

    notes = write_lines(tmp_path / "notes.txt", ["not", "json"])
    assert cli.main([*args[:4], notes, *args[5:-1], str(tmp_path / "other")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("foresight traces: error: prompt file") and "is not JSONL" in error and "\n" not in error
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "--shard", "3/2"])
    assert exit_info.value.code == 2 and "expected i/n with 0 <= i < n, got '3/2'" in capsys.readouterr().err
    for bad in ("0", "many"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*args, "--batch-size", bad])
        assert (
            exit_info.value.code == 2 and f"a positive number of rows or 'auto', got '{bad}'" in capsys.readouterr().err
        )


@pytest.mark.slow
def test_default_model_reasoning_gym_traces(tmp_path):
    from foresight.models import load_model

    model, tokenizer = load_model("default")
    summary = generate_traces(
        model, tokenizer, "reasoning-gym:basic_arithmetic", num=2, max_new_tokens=24, out_dir=tmp_path, progress=False
    )
    assert (summary.counts.generated, summary.counts.checked) == (2, 2)
    store = TraceStore(tmp_path)
    assert len(store) == 2
    trace = store[0]
    assert "<|im_start|>assistant" in tokenizer.decode(trace.input_ids[: trace.prompt_length])
    assert trace.completion == tokenizer.decode(trace.completion_ids, skip_special_tokens=True)
    assert isinstance(trace.correct, bool)
    nll, entropy = direct_losses(model, trace.input_ids)
    torch.testing.assert_close(trace.token_nll, nll, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(trace.token_entropy, entropy, atol=1e-4, rtol=1e-4)
    assert np.isfinite(store.dataset()["token_nll"][1]).all()
