"""The eviction step reads nothing back from the device when every row evicts at once.

On a GPU a read of a device value (`int(t)`, `.tolist()`, `nonzero`, ...) makes the host wait, so an
eviction step with reads in every layer is host-bound. `HostReads` counts those calls on a CPU too,
so these tests guard, in CI, what tests/test_gpu.py checks under `torch.cuda.set_sync_debug_mode`.
"""

from __future__ import annotations

import pytest
import torch

from foresight.device_checks import require
from foresight.models import tiny_model
from foresight.policies import foresight as foresight_policy
from foresight.policies import make_policy
from foresight.runtime.device_ops import DeviceOps
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.eviction_step import EvictionStep
from foresight.runtime.host_reads import HostReads
from tests.policy_lists import constructible_policies
from tests.prompts import prompts
from tests.scorers import random_scorer

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
        values[values > 2], values[1:], torch.equal(values, total)  # a boolean mask sizes its result on the host
        values.to(torch.float32), values.to("cpu")  # no copy between host and device
    assert reads.total == 8 and reads.counts["__getitem__"] == 1 and reads.counts["equal"] == 1


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


def test_rows_out_of_step_read_nothing_back(llama):
    """Prompts of different lengths evict at different tokens: such a step takes its rows from the host's cadence
    (no `nonzero` on the device), so it reads nothing back either."""
    engine, reads = engine_with("snapkv", llama)
    output = engine.generate(prompts([5, 11], seed=5), 40)
    assert output.stats.evictions >= 8 and max(output.stats.row_evictions) < output.stats.evictions  # ragged steps
    assert dict(reads.counts) == {}


def test_a_failed_check_is_a_value_error_with_its_message_on_a_cpu():
    require(torch.tensor(True), "never shown")
    with pytest.raises(ValueError, match="^a row has too few$"):
        require(torch.tensor(False), "a row has too few")
    with pytest.raises(ValueError, match=r"one-element condition, got shape \(2,\)"):
        require(torch.tensor([True, False]), "unused")


def test_a_compaction_to_another_width_than_the_mask_keeps_is_refused(llama):
    engine, _ = engine_with("snapkv", llama)
    engine.replay([torch.tensor(prompts([40])[0])], [8])
    cache = engine.last_cache
    keep = torch.stack([torch.ones_like(layer.entry_positions(), dtype=torch.bool) for layer in cache.layers])
    keep[0, :, :, 0] = False  # the first layer keeps one entry fewer: the others keep more than asked
    width = cache.layers[0].get_seq_length() - 1
    with pytest.raises(ValueError, match=f"kept another count than its cadence's {width}"):
        cache.compact(keep, width)


class LengthsAgree:
    """Before every eviction step, the host cadence's lengths against the cache's on the device."""

    def __init__(self, monkeypatch) -> None:
        self.checked = 0
        step = EvictionStep._eviction_step

        def checking(eviction_step, run) -> None:
            assert run.cadence.lengths == run.cache.lengths.tolist()
            self.checked += 1
            step(eviction_step, run)
            assert run.cadence.lengths == run.cache.lengths.tolist()

        monkeypatch.setattr(EvictionStep, "_eviction_step", checking)


@pytest.mark.parametrize("protect_prompt", [None, True, False])
@pytest.mark.parametrize("name", ["snapkv", "h2o", "raas", "streaming"])
def test_the_host_cadence_follows_the_cache_on_the_device(llama, monkeypatch, name, protect_prompt):
    """Ragged prompts, a prompt longer than B + L, padding past a row's end, sinks and short chunks."""
    agree = LengthsAgree(monkeypatch)
    config = EvictionConfig(B, L, sinks=2, protect_prompt=protect_prompt)
    engine = EvictionEngine(llama, make_policy(name), config)
    engine.generate(prompts([3, 9, 25], seed=6), 30)
    sequences = [torch.tensor(p) for p in prompts([70, 45, 60], seed=7)]
    engine.replay(sequences, [20, 5, 12], max_chunk=3)
    assert agree.checked > 20


def test_device_ops_counts_the_operations_that_compute():
    values = torch.arange(6.0)
    with DeviceOps() as ops:
        values.view(2, 3).t(), values[1:], values.unsqueeze(0)  # views: metadata only
    assert ops.total == 0
    with ops:  # entered again, it keeps counting
        total = values * 2 + 1
        total.add_(1), total.sum(), torch.cat([values, total])
    assert ops.total == 5


@pytest.mark.parametrize("sampled", [False, True])
def test_the_learned_step_runs_as_many_operations_whatever_the_layer_count(monkeypatch, sampled):
    """With the layers' block attention in one pass (an accelerator's pass size), the learned policy's part of
    an eviction step (observation, stacked MLPs, the draw) launches the same kernels for 2 layers as for 4:
    one step for the whole model, not one per layer."""
    monkeypatch.setattr(foresight_policy, "STEP_LOGITS", 2**26)
    counted = []
    for layers in (2, 4):
        model = tiny_model("llama", num_hidden_layers=layers)
        options = {"mode": "sampled", "row_seeds": (1, 2)} if sampled else {}
        policy = make_policy("foresight", scorer=random_scorer(model), **options)
        ops = DeviceOps()
        for method in ("step_observe", "step_keep_scores"):
            original = getattr(policy, method)
            monkeypatch.setattr(
                policy, method, lambda contexts, original=original, ops=ops: _counted(ops, original, contexts)
            )
        output = EvictionEngine(model, policy, EvictionConfig(B, L)).replay(
            [torch.tensor(p) for p in prompts([40, 40])], [8, 8]
        )
        counted.append(ops.total / output.stats.evictions)
    assert counted[0] == counted[1] > 0


def _counted(ops: DeviceOps, method, contexts):
    with ops:
        return method(contexts)
