"""Replays that reuse another replay's forwards before the first eviction (foresight/runtime/prefix.py)
against replays that run the model on every token."""

from __future__ import annotations

import pytest
import torch

from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.prefix import RecordedForward, ReplayPrefix
from tests.policy_lists import constructible_policies
from tests.scorers import random_scorer

B, L = 12, 4
PREFILL = [B + L, B + L]  # the golden cadence: every row evicts first right after B + L tokens


def sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(1, 128, (n,), generator=generator) for n in (47, 39)]


def engine_for(model, name: str) -> EvictionEngine:
    policy = make_policy("foresight", scorer=random_scorer(model)) if name == "foresight" else make_policy(name)
    return EvictionEngine(model, policy, EvictionConfig(B, L, sinks=0, protect_prompt=False))


class ForwardCounter:
    """Counts the model's forwards (an injected forward does not run the model)."""

    def __init__(self, model) -> None:
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.calls += 1


@pytest.mark.parametrize("name", [*constructible_policies(), "foresight"])
def test_a_reused_prefix_gives_the_replay_of_the_model(llama, name):
    """Recorded under one policy, reused under another: the same losses, first eviction and kept entries
    as running the model, with the forwards up to the first eviction not run again."""
    plain_engine = engine_for(llama, name)
    plain = plain_engine.replay(sequences(), PREFILL)
    prefix = ReplayPrefix()
    engine_for(llama, "streaming").replay(sequences(), PREFILL, prefix=prefix)
    assert len(prefix.forwards) == 1  # the prefill of B + L tokens, after which every row evicts
    counter = ForwardCounter(llama)
    reusing_engine = engine_for(llama, name)
    try:
        reused = reusing_engine.replay(sequences(), PREFILL, prefix=prefix)
    finally:
        counter.handle.remove()
    counter_plain = ForwardCounter(llama)
    try:
        engine_for(llama, name).replay(sequences(), PREFILL)
    finally:
        counter_plain.handle.remove()
    injected = 0 if plain_engine._tap_layers else 1  # a policy that reads hidden states runs the model
    assert counter.calls == counter_plain.calls - injected
    assert reused.first_eviction == plain.first_eviction
    for row in range(2):
        assert torch.equal(reused.nll[row], plain.nll[row])
    for mine, theirs in zip(reusing_engine.last_cache.layers, plain_engine.last_cache.layers):
        assert torch.equal(mine.entry_positions(), theirs.entry_positions())


def test_an_empty_prefix_records_the_forwards_up_to_the_first_eviction(llama):
    """Chunks of L up to B + L after a short prompt: every forward before the first eviction and the
    one that triggers it, with the recorded losses of the replay."""
    prefix = ReplayPrefix()
    output = engine_for(llama, "h2o").replay(sequences(), [6, 6], prefix=prefix)
    sizes = [forward.input_ids.shape[1] for forward in prefix.forwards]
    assert sizes == [6, 4, 4, 2]  # 6 + 4 + 4 + 2 = B + L = 16
    assert all(len(f.queries) == llama.config.num_hidden_layers for f in prefix.forwards)
    recorded = torch.cat([f.nll for f in prefix.forwards], dim=1)
    torch.testing.assert_close(recorded[0, :15], output.nll[0][:15], rtol=0, atol=0)


def test_other_inputs_run_the_model_and_a_full_cache_records_nothing(llama):
    prefix = ReplayPrefix()
    engine_for(llama, "h2o").replay(sequences(), [6, 6], prefix=prefix)
    other_prompts = engine_for(llama, "snapkv").replay(sequences(), PREFILL, prefix=prefix)
    plain = engine_for(llama, "snapkv").replay(sequences(), PREFILL)
    for row in range(2):
        assert torch.equal(other_prompts.nll[row], plain.nll[row])
    full_prefix = ReplayPrefix()
    EvictionEngine(llama, make_policy("full")).replay(sequences(), PREFILL, prefix=full_prefix)
    assert full_prefix.forwards == []


def test_a_recording_of_one_row_per_trace_serves_runs_of_rows():
    """Recorded row i serves rows [i·m, (i + 1)·m): a batch of m rows per recorded row matches and gets each
    row's tensors repeated in place; any other layout or token does not match."""
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    positions, valid = torch.arange(3).expand(2, 3), torch.tensor([3, 3])
    recorded = RecordedForward(
        ids,
        positions,
        valid,
        queries=[torch.arange(2.0).view(2, 1, 1, 1)],
        keys=[],
        values=[],
        scaling=[],
        nll=torch.tensor([[0.5] * 3, [1.5] * 3]),
    )
    spread = ids.repeat_interleave(3, 0)
    assert recorded.matches(spread, positions[:1].expand(6, 3), torch.full((6,), 3))
    assert recorded.matches(ids, positions, valid)  # one to one
    assert not recorded.matches(ids.repeat(3, 1), positions[:1].expand(6, 3), torch.full((6,), 3))  # traces interleaved
    assert not recorded.matches(
        ids[:1].expand(3, 3), positions[:1].expand(3, 3), torch.full((3,), 3)
    )  # 3 rows, 2 recorded
    batch = recorded.for_rows(6)
    assert batch.queries[0].flatten().tolist() == [0.0] * 3 + [1.0] * 3
    assert batch.nll[:, 0].tolist() == [0.5] * 3 + [1.5] * 3
    assert recorded.for_rows(2) is recorded
