"""`foresight bench`: the memory benchmark's trace of a real run, the decode benchmark's learned scorer, the
capacity benchmark's batch search and its refusal without a GPU, the labelling benchmark's worker processes,
and the line between the command line and the benchmarks: every one is a sub-command, and no benchmark
module reads argv (foresight.bench.options alone turns their fields into options)."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

import foresight.bench
from foresight.bench.capacity import largest_batch
from foresight.bench.common import random_scorer
from foresight.bench.memory import MemoryTrace, _Sampler
from foresight.cli import main
from foresight.models import random_model
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests.prompts import DATA

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURES = ROOT / "configs" / "models"
# Qwen3-4B's config, shrunk; KV heads and head dim large enough that one cache entry outweighs the
# few hundred bytes each generated token id takes on the heap.
SHRUNK = dict(
    num_hidden_layers=3,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=128,
)


@pytest.fixture(scope="module")
def shrunk_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("configs") / "qwen3-shrunk.json"
    path.write_text(json.dumps({**json.loads((ARCHITECTURES / "qwen3-4b.json").read_text()), **SHRUNK}))
    return path


@pytest.mark.parametrize("name", ["snapkv", "h2o", "full"])
def test_memory_trace_is_flat_from_the_first_eviction(shrunk_config, name):
    model = random_model(shrunk_config)
    policy = make_policy(name)
    engine = EvictionEngine(model, policy, EvictionConfig(48, 16) if policy.evicts else None)
    trace = MemoryTrace(name)
    with tqdm(disable=True) as progress:
        engine.generate([[3] * 20, [4] * 20], 160, on_token=_Sampler(engine, trace, "cpu", progress))
    assert trace.start == (2 if name == "full" else 48 + 16 - 20 + 1)  # sampled after the evicting forward
    assert trace.allocations == 1
    if name == "h2o":  # plus the queries not yet observed, fewer than L: the accounting counts L, their peak
        per_query = 2 * 3 * (8 * 64 * 4 + 4)  # rows x layers x (float32 vector per query head + an int32 position)
        assert 0 < trace.accounted - trace.storage_start <= 16 * per_query
        assert 0 < trace.accounted - trace.storage_end <= 16 * per_query
    else:
        assert trace.storage_start == trace.storage_end == trace.accounted
    assert trace.entry_bytes == 2 * 3 * 4 * (2 * 64 * 4 + 4 + 4 * (name == "h2o"))  # K, V, int32 position, state
    assert trace.held_growth_per_token < trace.entry_bytes / 8


def test_memory_benchmark_writes_its_section(shrunk_config, tmp_path, capsys):
    out = tmp_path / "bench.md"
    argv = [
        "bench",
        "memory",
        "--model",
        str(shrunk_config),
        "--policies",
        "knorm,foresight",
        "-B",
        "32",
        "-L",
        "8",
        "--max-new-tokens",
        "60",
        "--batch-size",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    text = out.read_text()
    assert "<!-- memory-cpu:start -->" in text and f"--model {shrunk_config}" in text
    rows = {
        line.split(" | ")[0]: line.split(" | ")
        for line in text.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    assert list(rows)[1:] == ["| full", "| knorm", "| foresight"]
    assert int(rows["| foresight"][9]) > int(rows["| knorm"][9])  # an entry's bytes: its feature state on top
    for policy in ("| knorm", "| foresight"):  # the accounting equals the storage held (no buffered queries)
        assert rows[policy][5] == rows[policy][4]


def test_decode_runs_the_learned_scorer_beside_the_heuristics(shrunk_config, tmp_path):
    """Shape-only, the learned policy runs a random scorer of the model's shape; its evictions take time."""
    out = tmp_path / "bench.md"
    argv = [
        "bench",
        "decode",
        "--model",
        str(shrunk_config),
        "--policies",
        "snapkv,foresight",
        "-B",
        "32",
        "-L",
        "8",
        "--max-new-tokens",
        "60",
        "--batch-sizes",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    text = out.read_text()
    assert "random weights (seed 0)" in text and "<!-- decode-cpu:start -->" in text
    rows = {
        line.split(" | ")[0]: line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "%" in line
    }
    assert list(rows) == ["| full", "| snapkv", "| foresight"]
    assert float(rows["| full"][4].rstrip("%")) == 0 and float(rows["| foresight"][4].rstrip("%")) > 0


def test_interleaved_bench_reports_every_policy_against_the_first(shrunk_config, tmp_path):
    out = tmp_path / "bench.md"
    decoders = "snapkv,snapkv:pooled:layer,streaming,foresight"  # one on the pooled layout, AdaKV's allocation
    argv = ["bench", "interleaved", "--model", str(shrunk_config), "--policies", decoders]
    argv += ["-B", "32", "-L", "8", "--new-tokens", "96", "--slice-tokens", "8", "--out", str(out)]
    assert main(argv) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    assert [row[0] for row in rows[1:]] == ["| snapkv", "| snapkv:pooled:layer", "| streaming", "| foresight"]
    assert rows[1][2] == "– |" and all("[" in row[2] for row in rows[2:])
    refused = (("snapkv", "96"), ("snapkv,snapkv", "96"), ("snapkv,streaming", "15"), ("all", "96"))
    for policies, tokens in (*refused, ("snapkv,snapkv:heads", "96"), ("snapkv,h2o:pooled", "96")):
        assert main(["bench", "interleaved", "--policies", policies, "--new-tokens", tokens, "--out", str(out)]) == 2
    argv[argv.index("--new-tokens") + 1] = "16"  # two turns, the first with the prefill: one steady round, too few
    assert main(argv) == 2


def test_eviction_step_counts_and_times_every_policys_steps_beside_snapkv(shrunk_config, tmp_path):
    """Each evicting policy's row: operations and host reads per step from the counted run (no read-backs: every
    row evicts together), ms per step and the share from the timed run, the share over SnapKV's (1 for SnapKV)."""
    out = tmp_path / "bench.md"
    argv = ["bench", "eviction-step", "--model", str(shrunk_config), "--policies", "snapkv,h2o,foresight"]
    argv += ["-B", "32", "-L", "8", "--max-new-tokens", "60", "--counted-steps", "2", "--batch-sizes", "1,2"]
    assert main([*argv, "--device", "cpu", "--out", str(out)]) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ") and "%" in line]
    assert [(row[0], row[1]) for row in rows] == [
        (f"| {name}", batch) for batch in ("1", "2") for name in ("snapkv", "h2o", "foresight")
    ]
    for row in rows:
        assert int(row[2].replace(",", "")) > 0 and float(row[3]) == 0 and float(row[4]) > 0
        assert int(row[5]) == 1 + (60 - 1) // 8  # the 64-token prompt's prefill evicts, then every 8 tokens fed
        assert 0 < float(row[6].rstrip("%")) < 100
    assert [row[7].rstrip(" |") for row in rows if row[0] == "| snapkv"] == ["1.00", "1.00"]


def test_runtime_benchmarks_take_policy_options(shrunk_config, tmp_path, capsys):
    """-o ROW.KEY=VALUE reaches the policy: the learned cycle observed in the forward runs no streamed block, so
    fewer operations than the streamed one, and the report's command carries the option. A key the policy lacks, a
    row --policies does not name, and a row-less option among several policies are refused in one line."""
    out = tmp_path / "bench.md"
    random_scorer(random_model(shrunk_config), 32, 8, feature_set="standardised").save_pretrained(tmp_path / "scorer")
    argv = ["bench", "eviction-step", "--model", str(shrunk_config), "--policies", "snapkv,foresight", "-B", "32"]
    argv += ["-L", "8", "--max-new-tokens", "40", "--counted-steps", "2", "--batch-sizes", "1", "--device", "cpu"]
    argv += ["--scorer", str(tmp_path / "scorer")]
    operations = {}
    for observation in ("stream", "forward"):
        section = ["--out", str(out), "--section", observation]
        assert main([*argv, "-o", f"foresight.observation={observation}", *section]) == 0
        text = out.read_text().split(f"<!-- {observation}:start -->")[1]
        assert f"--option foresight.observation={observation}" in text
        rows = {line.split(" | ")[0]: line.split(" | ") for line in text.splitlines() if "%" in line}
        operations[observation] = int(rows["| foresight"][2].replace(",", ""))
    assert operations["forward"] < operations["stream"]
    for option, message in (
        ("foresight.nope=1", "policy 'foresight' has no option 'nope'"),
        ("h2o.window=8", "names no policy of --policies"),
        ("observation=forward", "name its policy"),
    ):
        assert main([*argv, "-o", option, "--out", str(out)]) == 2
        assert message in capsys.readouterr().err


def test_a_scorer_trained_for_another_cadence_is_refused_in_one_line(shrunk_config, tmp_path, capsys):
    scorer = random_scorer(random_model(shrunk_config), 48, 16)
    scorer.save_pretrained(tmp_path / "scorer")
    argv = [
        "bench",
        "memory",
        "--model",
        str(shrunk_config),
        "--scorer",
        str(tmp_path / "scorer"),
        "-B",
        "32",
        "-L",
        "8",
        "--out",
        str(tmp_path / "bench.md"),
    ]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert "was trained for B = 48, L = 16; run with --budget 48 --interval 16" in error and "\n" not in error


def test_capacity_refuses_to_run_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "capacity"]) == 2
    error = capsys.readouterr().err.strip()
    assert "needs a CUDA device" in error and "\n" not in error


class FakeGpu:
    """Peak memory linear in the batch, running out of memory above `limit` rows; extra bytes per row
    above `bend` (fragmentation the line does not see)."""

    def __init__(self, limit: int, bend: int = 10**9):
        self.limit, self.bend, self.probed = limit, bend, []

    def __call__(self, batch: int) -> int | None:
        self.probed.append(batch)
        if batch > self.limit:
            return None
        return 10 * GIB + batch * GIB // 4 + max(batch - self.bend, 0) * GIB // 8


def test_largest_batch_follows_the_fitted_line():
    gpu = FakeGpu(limit=10**6)
    assert largest_batch(gpu, 40 * GIB) == (120, 40 * GIB)  # (40 - 10) GiB / 0.25 GiB per row
    assert gpu.probed == [4, 8, 120]


def test_largest_batch_steps_down_when_the_line_overshoots():
    gpu = FakeGpu(limit=100, bend=80)
    batch, peak = largest_batch(gpu, 40 * GIB)
    assert gpu.probed[:3] == [4, 8, 120] and batch == gpu.probed[-1] <= 100 and peak <= 40 * GIB
    assert batch == 96  # 120 -> 114 -> 108 -> 102 -> 96: the first that fits


def test_largest_batch_says_when_even_a_small_batch_does_not_fit():
    with pytest.raises(ValueError, match="a batch of 8 does not fit the memory budget of 11.0 GiB"):
        largest_batch(FakeGpu(limit=7), 11 * GIB)


BENCHMARKS = (
    "decode",
    "interleaved",
    "memory",
    "capacity",
    "serve",
    "eval-prefix",
    "labels-memory",
    "trace-generation",
)


def test_bench_help_lists_every_benchmark(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    listed = capsys.readouterr().out.split("positional arguments:")[1]
    assert all(f"    {name} " in listed or f"    {name}\n" in listed for name in BENCHMARKS), listed


def test_no_benchmark_module_reads_a_command_line():
    """argparse objects stay in foresight.commands and foresight.bench.options: the benchmarks take settings."""
    for path in sorted(Path(foresight.bench.__file__).parent.glob("*.py")):
        if path.name == "options.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [name for name in imported if name.split(".")[0] == "argparse"], path
        assert not [name for name in imported if name.startswith(("foresight.commands", "foresight.cli"))], path


def test_labels_memory_measures_each_length_in_a_worker(shrunk_config, tmp_path, capsys):
    out = tmp_path / "bench.md"
    argv = [
        "bench",
        "labels-memory",
        "--model",
        str(shrunk_config),
        "--lengths",
        "64",
        "96",
        "-B",
        "16",
        "-L",
        "8",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    text = out.read_text()
    assert "<!-- labels-memory-qwen3-shrunk-cpu:start -->" in text
    assert f"--model {shrunk_config} --lengths 64,96 --budget 16 --interval 8" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 64 ") or line.startswith("| 96 ")]
    assert [int(row[1]) for row in rows] == [(64 - 16) // 8, (96 - 16) // 8]  # eviction steps M of each length


def test_eval_prefix_times_both_evaluations_of_the_same_table(traces_dir, tmp_path):
    out = tmp_path / "bench.md"
    argv = [
        "bench",
        "eval-prefix",
        "--traces",
        str(traces_dir),
        "--holdout",
        "1.0",
        "--policies",
        "h2o,streaming",
        "-B",
        "16",
        "-L",
        "4",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    text = out.read_text()
    assert "<!-- eval-prefix-cpu:start -->" in text and "Both runs gave the same table" in text
    assert "| ratio (plain / shared) |" in text and f"--traces {traces_dir} --holdout 1.0" in text


def test_trace_generation_samples_the_same_completions_in_every_mode(tiny_dir, tmp_path):
    out = tmp_path / "bench.md"
    argv = [
        "bench",
        "trace-generation",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(DATA / "arithmetic.jsonl"),
        "--num",
        "3",
        "--max-new-tokens",
        "6",
        "--batch-sizes",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    text = out.read_text()
    assert "<!-- trace-generation-cpu:start -->" in text and "produced the same completions" in text
    modes = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ") and "tokens/s" not in line]
    assert modes == ["| batch 1", "| static 2", "| continuous 2"]


def test_rl_step_runs_what_foresight_rl_runs(tmp_path):
    """The reinforcement benchmark's LightningCLI arguments are those of `foresight rl` on the same config,
    scorer, traces and overrides."""
    import argparse

    from foresight.commands import rl
    from studies.rl_step.run import RL_CONFIG, Settings
    from trainers.reinforcement.stage import lightning_args

    settings = Settings(traces=tmp_path, scorer=("checkpoints/default",), steps=3, group_size=4)
    parser = argparse.ArgumentParser()
    rl.add_arguments(parser)
    overrides = [
        "trainer.max_steps=3",
        "data.batch_size=1",
        "model.group_size=4",
        "trainer.enable_progress_bar=false",
        "trainer.logger=false",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        "model.dtype=float32",
    ]
    argv = [
        "--config",
        str(RL_CONFIG),
        "--scorer",
        "checkpoints/default",
        "--out",
        str(tmp_path / "s"),
        "--traces",
        str(tmp_path),
        *(word for text in overrides for word in ("--set", text)),
    ]
    assert settings.lightning_args(tmp_path / "s") == lightning_args(rl.request(parser.parse_args(argv)))[1:]


@pytest.mark.slow
def test_rl_step_study_times_a_step_of_each_rollout_kind(tmp_path):
    """`python -m studies rl-step` runs one optimisation step per rollout kind on the default model's traces
    and reports each kind's row."""
    from studies.__main__ import main as studies_main

    traces = shutil.copytree(ROOT / "data" / "corpus" / "gsm-main", tmp_path / "traces")
    out = tmp_path / "rl-step.md"
    argv = ["rl-step", "--traces", str(traces), "--steps", "1", "--group-size", "2", "--rollout", "episode"]
    assert studies_main([*argv, "--rollout", "branch", "--branch", "branch_rows=2", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0].strip("| ") for row in rows[1:]] == ["episode", "episode", "branch", "branch"], rows
    assert all(float(row.split(" | ")[3]) > 0 for row in rows[1:]), rows  # tokens fed per second
