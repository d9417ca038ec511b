"""The eviction step reads nothing back from the device when every row evicts at once.

On a GPU a read of a device value (`int(t)`, `.tolist()`, `nonzero`, ...) makes the host wait, so an
eviction step with reads in every layer is host-bound. `HostReads` counts those calls on a CPU too,
so these tests guard, in CI, what tests/test_gpu.py checks under `torch.cuda.set_sync_debug_mode`.
"""

from __future__ import annotations

import pytest
import torch
from helpers import constructible_policies, prompts, random_scorer

from foresight.models import tiny_model
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.host_reads import HostReads

B, L = 12, 4


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", num_hidden_layers=3)


def test_host_reads_counts_the_calls_that_read_a_value():
    values = torch.tensor([3, 0, 5])
    with HostReads() as reads:
        total = values * 2 + 1  # arithmetic stays on the device
        bool(total.any()), int(total.max()), total.tolist(), (values > 0).nonzero(), total.sum().item()
    assert dict(reads.counts) == {"__bool__": 1, "__int__": 1, "tolist": 1, "nonzero": 1, "item": 1}
    with reads:  # entered again, it keeps counting
        values.cpu()
    assert reads.total == 6


def engine_with(name: str, model, **options) -> tuple[EvictionEngine, HostReads]:
    scorer = {"scorer": random_scorer(model)} if name == "foresight" else {}
    reads = HostReads()
    engine = EvictionEngine(model, make_policy(name, **scorer, **options), EvictionConfig(B, L), step_observer=reads)
    return engine, reads


@pytest.mark.parametrize("name", ["foresight", *constructible_policies()])
def test_an_eviction_step_of_rows_in_step_reads_nothing_back(llama, name):
    """Rows of equal prompts evict together: the cadence is decided on the host, the compaction's width
    is known there, and the checks are device asserts."""
    sequences = [torch.tensor(p) for p in prompts([60, 60], seed=3)]
    engine, reads = engine_with(name, llama)
    output = engine.replay(sequences, [8, 8])
    assert output.stats.evictions >= 8
    assert dict(reads.counts) == {}


def test_sampled_rollout_steps_read_nothing_back(llama):
    """The reinforcement stage's rows: one trace, a seeded generator per row, every draw recorded."""
    sequence = torch.tensor(prompts([60], seed=4)[0])
    engine, reads = engine_with("foresight", llama, mode="sampled", row_seeds=(1, 2, 3))
    output = engine.replay([sequence] * 3, [B + L] * 3)
    assert output.stats.evictions >= 8 and len(engine.policy.records) == output.stats.evictions * 3
    assert dict(reads.counts) == {}


def test_rows_out_of_step_read_their_rows_once_per_step(llama):
    """Prompts of different lengths evict at different tokens: such a step finds its rows with one `nonzero`."""
    engine, reads = engine_with("snapkv", llama)
    output = engine.generate(prompts([5, 11], seed=5), 40)
    assert output.stats.evictions >= 8
    assert dict(reads.counts) == {"nonzero": output.stats.evictions}
