"""`foresight bench`: the memory benchmark's trace of a real run, the capacity benchmark's batch search,
and its refusal without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

from foresight.cli import main
from foresight.commands._bench_capacity import largest_batch
from foresight.commands._bench_memory import MemoryTrace, _Sampler
from foresight.models import random_model
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine

GIB = 2**30
ARCHITECTURES = Path(__file__).resolve().parents[1] / "configs" / "models"
# Qwen3-4B's config, shrunk; KV heads and head dim large enough that one cache entry outweighs the
# few hundred bytes each generated token id takes on the heap.
SHRUNK = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, vocab_size=128)


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
    assert trace.allocations == 1 and trace.storage_start == trace.storage_end
    assert trace.entry_bytes == 2 * 3 * 4 * (2 * 64 * 4 + 8 + 4 * (name == "h2o"))
    assert trace.held_growth_per_token < trace.entry_bytes / 8


def test_memory_benchmark_writes_its_section(shrunk_config, tmp_path, capsys):
    out = tmp_path / "bench.md"
    argv = ["bench", "memory", "--model", str(shrunk_config), "--policies", "knorm", "-B", "32", "-L", "8",
            "--max-new-tokens", "60", "--batch-size", "2", "--out", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    assert "<!-- memory-cpu:start -->" in text and f"--model {shrunk_config}" in text
    rows = [line for line in text.splitlines() if line.startswith("| full ") or line.startswith("| knorm ")]
    assert len(rows) == 2


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
