"""Accuracy under eviction (foresight.eval.generation and `foresight eval --prompts`) on a tiny model:
loop detection against a slow twin, the figures against hand-made completions, same-seed sampling,
resuming after a kill, and the command's report and errors."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from foresight import cli
from foresight.artifacts import ArtifactError
from foresight.data.tasks import Problem, load_problems
from foresight.eval.generation import (
    CompletionStore,
    GenerationSettings,
    Job,
    ends_in_loop,
    generate_completions,
    plan_jobs,
    row_seed,
    summarize,
    summarize_sources,
)
from foresight.eval.specs import PolicySpec
from foresight.eval.stats import pass_at_k
from foresight.models import tiny_model
from foresight.runtime.engine import EvictionConfig
from tests.prompts import CHAT_TEMPLATE, DATA, char_tokenizer

B, L = 16, 4
ARITHMETIC = str(DATA / "arithmetic.jsonl")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.2)


def slow_ends_in_loop(tokens, hit_limit, max_period, repeats, min_span):
    """Try every period and every span of the tail, comparing slices."""
    if not hit_limit:
        return False
    n = len(tokens)
    for period in range(1, max_period + 1):
        for span in range(max(repeats * period, min_span), n + 1):
            tail = tokens[n - span :]
            if all(tail[i] == tail[i - period] for i in range(period, span)):
                return True
    return False


def test_ends_in_loop_matches_the_slow_twin():
    rng = random.Random(0)
    cases = []
    for _ in range(300):
        head = [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
        block = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        copies = rng.randrange(0, 6)
        tail = (block * copies)[: rng.randrange(0, len(block) * copies + 1)] if copies else []
        cases.append(head + block * copies + tail)
    for tokens in cases:
        for hit_limit in (True, False):
            expected = slow_ends_in_loop(tokens, hit_limit, max_period=8, repeats=3, min_span=12)
            assert ends_in_loop(tokens, hit_limit, max_period=8, repeats=3, min_span=12) == expected, tokens


def test_ends_in_loop_hand_cases():
    line = list(range(20))
    assert ends_in_loop([7, 8] + line * 4, hit_limit=True)
    assert not ends_in_loop([7, 8] + line * 4, hit_limit=False)  # it stopped by itself
    assert not ends_in_loop([7, 8] + line * 2, hit_limit=True)  # two copies are not a loop
    assert not ends_in_loop([5] * 40, hit_limit=True)  # too short a span
    assert ends_in_loop([5] * 64, hit_limit=True)
    assert not ends_in_loop(list(range(500)), hit_limit=True)


def settings(**overrides) -> GenerationSettings:
    base = dict(model="tiny", sources=(ARITHMETIC,), problems=3, problem_seed=0, samples=2, max_new_tokens=24)
    return GenerationSettings(**{**base, **overrides})


def records_of(store, plans):
    return {job.label: store.load(job) for plan in plans for job in plan.jobs}


def test_a_killed_run_resumes_to_the_same_records(model, tmp_path, monkeypatch):
    problems = load_problems(ARITHMETIC, 3)
    plans, _ = plan_jobs([PolicySpec("h2o"), PolicySpec("streaming")], [B], L)
    tokenizer = char_tokenizer(CHAT_TEMPLATE)
    whole = CompletionStore(tmp_path / "whole", settings())
    assert generate_completions(model, tokenizer, problems, plans, whole, batch_size=4, progress=False) == 18

    killed = CompletionStore(tmp_path / "killed", settings())
    save, saves = CompletionStore.save, []

    def save_then_die(self, job, records):
        if len(saves) == 2:
            raise KeyboardInterrupt  # killed while the third batch was being generated
        saves.append(job)
        save(self, job, records)

    monkeypatch.setattr(CompletionStore, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        generate_completions(model, tokenizer, problems, plans, killed, batch_size=4, progress=False)
    monkeypatch.setattr(CompletionStore, "save", save)
    written = sum(
        len(records) for records in records_of(CompletionStore(tmp_path / "killed", settings()), plans).values()
    )
    assert written == 8  # two batches of four
    resumed = CompletionStore(tmp_path / "killed", settings())
    # Another batch size: each completion draws from its own seed, so the batch layout does not matter.
    assert generate_completions(model, tokenizer, problems, plans, resumed, batch_size=5, progress=False) == 18 - 8
    assert records_of(resumed, plans) == records_of(whole, plans)
    assert generate_completions(model, tokenizer, problems, plans, resumed, progress=False) == 0


def test_eval_prompts_killed_with_sigkill_and_run_again_writes_the_results_of_an_uninterrupted_run(tiny_dir, tmp_path):
    """`foresight eval --prompts reasoning-gym:TASK` killed (SIGKILL: no handler runs) once its first completions
    are on disk, then run again, writes the results.json of a run never interrupted."""

    def argv(out: Path) -> list[str]:
        return [
            "eval",
            "--prompts",
            "reasoning-gym:basic_arithmetic",
            "--num",
            "2",
            "--samples",
            "2",
            "--max-new-tokens",
            "32",
            "--policies",
            "h2o,streaming",
            "--budgets",
            str(B),
            "-L",
            str(L),
            "--batch-size",
            "1",
            "--model",
            str(tiny_dir),
            "--out",
            str(out),
        ]

    killed = tmp_path / "killed"
    run = subprocess.Popen(
        [sys.executable, "-m", "foresight.cli", *argv(killed)],
        cwd=Path(__file__).parents[1],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 180
        while run.poll() is None and not any(killed.rglob("batch-*.json")) and time.monotonic() < deadline:
            time.sleep(0.01)
        run.send_signal(signal.SIGKILL)
    finally:
        run.wait()
    written = sum(len(json.loads(path.read_text())) for path in killed.rglob("batch-*.json"))
    assert run.returncode == -signal.SIGKILL and 0 < written < 12  # 2 problems x 2 samples x (full, h2o, streaming)
    assert not (killed / "results.json").exists()
    assert cli.main(argv(killed)) == 0
    assert cli.main(argv(tmp_path / "whole")) == 0
    resumed, whole = (json.loads((folder / "results.json").read_text()) for folder in (killed, tmp_path / "whole"))
    assert resumed == whole and len(whole) == 3


def test_other_settings_are_refused_not_mixed_in(tmp_path):
    CompletionStore(tmp_path, settings())
    with pytest.raises(ArtifactError, match=r"made with other settings \(samples=2, not 3\)"):
        CompletionStore(tmp_path, settings(samples=3))
    with pytest.raises(ValueError, match="samples per problem k=0 must be at least 1"):
        settings(samples=0)


def test_a_policy_that_never_evicts_samples_exactly_the_full_cache(model, tmp_path):
    """Same seeds: with a budget beyond every sequence the policy's completions are the full cache's."""
    problems = load_problems(ARITHMETIC, 2)
    plans, _ = plan_jobs([PolicySpec("h2o")], [500], L)
    store = CompletionStore(tmp_path, settings(max_new_tokens=16))
    generate_completions(model, char_tokenizer(CHAT_TEMPLATE), problems, plans, store, batch_size=3, progress=False)
    full, h2o = (store.load(job) for job in plans[0].jobs)
    assert {k: r["tokens"] for k, r in full.items()} == {k: r["tokens"] for k, r in h2o.items()}
    assert len({r["seed"] for r in full.values()}) == 4
    assert full[(ARITHMETIC, 1, 0)]["seed"] == row_seed(0, ARITHMETIC, 1, 0)
    rows = summarize(problems, plans, store)
    assert [row["agreement"] for row in rows] == [1.0, 1.0]


def write_records(store, job, texts: dict[tuple[int, int], str], hit_limit=False, tokens=None):
    store.save(
        job,
        [
            {
                "source": "p.jsonl",
                "problem": i,
                "sample": s,
                "seed": 0,
                "tokens": tokens or [1, 2, 3],
                "text": text,
                "hit_limit": hit_limit,
            }
            for (i, s), text in texts.items()
        ],
    )


def test_figures_from_hand_made_completions(tmp_path):
    """Two problems, k = 3: strict and flexible pass@1 and pass@3, agreement with the full cache,
    lengths and loops, against values worked out by hand."""
    problems = [Problem(0, "2 + 1?", "3", "p.jsonl"), Problem(1, "2 * 4?", "8", "p.jsonl")]
    store = CompletionStore(tmp_path, settings(sources=("p.jsonl",), problems=2, samples=3))
    plans, _ = plan_jobs([PolicySpec("knorm")], [B], L)
    full, knorm = plans[0].jobs
    write_records(
        store,
        full,
        {
            (0, 0): "\\boxed{3}",
            (0, 1): "so the answer is 3.",
            (0, 2): "4",
            (1, 0): "\\boxed{8}",
            (1, 1): "\\boxed{8}",
            (1, 2): "Answer: 8",
        },
    )
    write_records(store, knorm, {(0, 0): "the answer is 3", (0, 1): "the answer is 5", (0, 2): "4"})
    loop = [9, 1, 2, 3] + [4, 5] * 40
    write_records(
        store, knorm, {(1, 0): "\\boxed{7}", (1, 1): "7 then 8", (1, 2): "Answer: 8"}, hit_limit=True, tokens=loop
    )
    rows = {row["policy"]: row for row in summarize(problems, plans, store)}
    assert rows["full"]["pass1_strict"] == pytest.approx((1 / 3 + 1) / 2)
    assert rows["full"]["pass1_flexible"] == pytest.approx((2 / 3 + 1) / 2)
    assert rows["full"]["agreement"] == 1.0 and rows["full"]["loops"] == 0.0
    knorm_row = rows["knorm"]
    assert knorm_row["pass1_strict"] == pytest.approx((0 + 1 / 3) / 2)
    assert knorm_row["pass1_flexible"] == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert knorm_row["passk_strict"] == pytest.approx((pass_at_k(3, 0, 3) + pass_at_k(3, 1, 3)) / 2) == 0.5
    assert knorm_row["passk_flexible"] == 1.0
    # answers: problem 0 (3, 5, 4) vs full (3, 3, 4); problem 1 (7, 8, 8) vs (8, 8, 8)
    assert knorm_row["agreement"] == pytest.approx((2 / 3 + 2 / 3) / 2)
    assert knorm_row["loops"] == 0.5 and knorm_row["mean_tokens"] == pytest.approx((3 + len(loop)) / 2)
    assert knorm_row["problems"] == 2 and (knorm_row["budget"], knorm_row["interval"]) == (B, L)
    assert knorm_row["loops_low"] == 0.0 and knorm_row["loops_high"] == 1.0
    assert knorm_row["agreement_low"] == knorm_row["agreement_high"] == pytest.approx(2 / 3)
    (by_source,) = summarize_sources(problems, store)
    assert by_source["source"] == "p.jsonl" and by_source["pass1_flexible"] == rows["full"]["pass1_flexible"]


def test_plans_leave_out_golden_and_a_scorer_at_another_budget():
    plans, notes = plan_jobs([PolicySpec("full"), PolicySpec("golden"), PolicySpec("tova")], [24, B], L)
    assert [plan.eviction.budget for plan in plans] == [B, 24]
    assert [[job.label for job in plan.jobs] for plan in plans] == [["full", f"tova B={B}"], ["full", "tova B=24"]]
    assert notes == ["golden: skipped, it replays stored golden labels, which generation has none of"]
    assert Job(PolicySpec("full")).label == "full"


@pytest.fixture
def patched_load(monkeypatch, model):
    monkeypatch.setattr(
        "foresight.commands._generation.load_model", lambda name, **kw: (model, char_tokenizer(CHAT_TEMPLATE))
    )


def test_eval_prompts_end_to_end(tmp_path, patched_load, capsys):
    out = tmp_path / "gen"
    argv = [
        "eval",
        "--prompts",
        ARITHMETIC,
        "--num",
        "2",
        "--samples",
        "2",
        "--max-new-tokens",
        "20",
        "--policies",
        "h2o,streaming,golden",
        "--budgets",
        f"{B},24",
        "-L",
        str(L),
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    stdout = captured.out
    rows = json.loads((out / "results.json").read_text())
    assert sorted((r["policy"], r["budget"]) for r in rows) == sorted(
        (name, budget) for name in ("full", "h2o", "streaming") for budget in (B, 24)
    )
    assert all(r["problems"] == 2 and r["samples"] == 2 for r in rows)
    assert all(r["agreement"] == 1.0 for r in rows if r["policy"] == "full")
    markdown = (out / "results.md").read_text()
    assert "| policy | B | L | agreement with full | pass@1 flexible | pass@1 strict | pass@2 flexible |" in markdown
    assert "| source (full cache) | pass@1 flexible |" in markdown and f"| {ARITHMETIC} |" in markdown
    for figure in ("pass1_flexible", "agreement", "loops"):
        assert (out / f"{figure}.png").read_bytes()[:4] == b"\x89PNG"
    assert "note: golden: skipped" in captured.err and "note:" not in stdout  # diagnostics on stderr, results on stdout
    assert "generated 20 completions (2 problems x 2 samples x 5 runs" in stdout.splitlines()[-1]
    assert cli.main(argv) == 0  # everything found on disk
    assert "generated 0 completions" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--samples", "0"], "samples per problem k=0 must be at least 1"),
        (["--prompts", "reasoning-gym:no_such_task"], "unknown reasoning-gym task 'no_such_task'"),
        (["--traces", "somewhere"], "give either --traces (teacher-forced) or --prompts (generation), not both"),
        (["--temperature", "-1"], "temperature=-1.0 must be >= 0"),
    ],
)
def test_eval_prompts_bad_input_is_one_line(tmp_path, patched_load, capsys, extra, message):
    argv = [
        "eval",
        "--prompts",
        ARITHMETIC,
        "--num",
        "2",
        "--budgets",
        str(B),
        "-L",
        str(L),
        "--out",
        str(tmp_path / "o"),
        *extra,
    ]
    assert cli.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("foresight eval: error: ") and message in error and "\n" not in error


def test_the_learned_policy_runs_at_its_budget_and_another_scorer_is_not_mixed_in(model, tmp_path):
    """A scorer trained at (B, L) = (16, 4) runs at B = 16 only; completions of another scorer under
    the same name are refused, not counted as this one's."""
    from foresight.eval.specs import ScorerSpec
    from foresight.scorer.model import ForesightScorer, ScorerConfig
    from tests.scorers import scorer_spec

    def learned(seed: int) -> ScorerSpec:
        torch.manual_seed(seed)
        return ScorerSpec(name="foresight", scorer=ForesightScorer(ScorerConfig(**scorer_spec(model))))

    problems = load_problems(ARITHMETIC, 1)
    plans, notes = plan_jobs([learned(0)], [16, 24], 4)
    assert [[job.label for job in plan.jobs] for plan in plans] == [["full", "foresight B=16"], ["full"]]
    assert notes == ["foresight skipped at B=24, L=4: its scorer was trained for B=16, L=4"]
    store = CompletionStore(tmp_path, settings(max_new_tokens=30, samples=1))
    generate_completions(model, char_tokenizer(CHAT_TEMPLATE), problems, plans, store, progress=False)
    assert len(store.load(plans[0].jobs[1])) == 1
    other, _ = plan_jobs([learned(1)], [16], 4)
    with pytest.raises(ArtifactError, match="results of foresight in .*: made with other settings"):
        store.load(other[0].jobs[1])


def test_a_row_under_other_options_is_not_mixed_in(tmp_path):
    """A row of the same name with another policy or other options has its own identity: its completions
    are refused in a folder made by the first, and the plain policy's identity is its name alone."""
    store = CompletionStore(tmp_path, settings(max_new_tokens=30, samples=1))
    plain = PolicySpec("random-prompt")
    assert Job(plain, EvictionConfig(B, L)).label and store.job_folder(Job(plain, EvictionConfig(B, L))).is_dir()
    assert json.loads((store.job_folder(Job(plain, EvictionConfig(B, L))) / "policy.json").read_text()) == {
        "policy": "random-prompt"
    }
    for other in (
        PolicySpec("random-prompt", protect_prompt=False),
        PolicySpec("random-prompt", options=(("seed", 3),)),
        PolicySpec("random-prompt", policy="random"),
    ):
        with pytest.raises(ArtifactError, match="results of random-prompt in .*: made with other settings"):
            store.job_folder(Job(other, EvictionConfig(B, L)))
    # A resumed run names the same row alike: its default protect_prompt spelled out, or a folder by a
    # relative or an absolute path, is the same row.
    assert store.job_folder(Job(PolicySpec("random-prompt", protect_prompt=True), EvictionConfig(B, L))).is_dir()
    folder = tmp_path / "stats"
    folder.mkdir()
    store.job_folder(Job(PolicySpec("tri", policy="random", options=(("stats", str(folder)),)), EvictionConfig(B, L)))
    relative = Path(os.path.relpath(folder))
    assert store.job_folder(
        Job(PolicySpec("tri", policy="random", options=(("stats", relative),)), EvictionConfig(B, L))
    ).is_dir()
