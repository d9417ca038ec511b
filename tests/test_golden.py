"""The golden policy replays the stored golden schedule exactly, and refuses settings it was not made for."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from foresight.labels import GoldenLabels, compute_golden_labels
from foresight.models import tiny_model
from foresight.policies import POLICIES, make_policy
from foresight.policies.golden import GoldenSchedule
from foresight.runtime.capture import eviction_attention
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.policy import EvictionContext
from tests import reference_policies as ref

B, L = 16, 4
LENGTHS = (70, 61)  # (T - B) % L != 0, so the forward after every step's p_t lies inside the trace
PROMPT = 5


class _Recorder:
    """Records, for every forward of every layer, the positions processed and the entries held."""

    def __init__(self):
        self.entries: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def __call__(self, module, query, key, value, attention_mask, eviction_cache=None, **kwargs):
        layer = eviction_cache.layers[module.layer_idx]
        self.entries.append((module.layer_idx, layer.pending_positions.clone(), layer.entry_positions().clone()))
        return eviction_attention(module, query, key, value, attention_mask, eviction_cache=eviction_cache, **kwargs)


@pytest.fixture(scope="module")
def model():
    # Larger initial weights sharpen the attention, so heads and layers keep different sets.
    return tiny_model("llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def traces():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (n,), generator=generator) for n in LENGTHS]


@pytest.fixture(scope="module")
def labels(model, traces):
    return [compute_golden_labels(model, ids, B, L, trace_index=i) for i, ids in enumerate(traces)]


def golden_engine(model, labels, attention="foresight", **config):
    return EvictionEngine(
        model, make_policy("golden", labels=labels), EvictionConfig(B, L, **config), attention=attention
    )


def test_replay_reproduces_the_stored_kept_sets(model, traces, labels):
    recorder = _Recorder()
    AttentionInterface.register("golden-recording", recorder)
    golden_engine(model, labels, attention="golden-recording").replay(traces, [PROMPT] * len(traces))
    seen = set()
    for layer, positions, entries in recorder.entries:
        for row, (_ids, label) in enumerate(zip(traces, labels)):
            for step in range(1, label.num_steps + 1):
                start = B + step * L  # the forward that processes p_t + 1 holds step t's kept set
                if start not in positions[row].tolist():
                    continue
                held = entries[row]
                for head in range(held.shape[0]):
                    kept = sorted(p for p in held[head].tolist() if 0 <= p <= start - 1 - L)
                    assert kept == label.kept(step)[layer, head].tolist(), (row, step, layer, head)
                seen.add((row, step, layer))
    expected = {
        (row, step, layer)
        for row, label in enumerate(labels)
        for step in range(1, label.num_steps + 1)
        for layer in range(model.config.num_hidden_layers)
    }
    assert seen == expected
    kept = labels[0].kept_positions()
    assert not torch.equal(kept[:, :, 0], kept[:, :, 1]) and not torch.equal(kept[:, 0], kept[:, 1])
    assert not torch.equal(kept[-1, 0, 0], torch.arange(B - L, B + (labels[0].num_steps - 1) * L)[-(B - L) :])


def test_keep_scores_hand_computed():
    # One layer, two KV heads, B = 4, L = 2, two steps. Step 1's candidates are 0..3.
    # Step 2's candidates are step 1's kept set plus the window it left behind (positions 4, 5).
    candidates = torch.tensor([[[[0, 1, 2, 3], [0, 1, 2, 3]]], [[[1, 2, 4, 5], [0, 1, 4, 5]]]], dtype=torch.int32)
    alpha = torch.tensor(
        [[[[0.1, 0.4, 0.3, 0.2], [0.5, 0.5, 0.1, 0.0]]], [[[0.0, 0.9, 0.8, 0.1], [0.2, 0.1, 0.3, 0.4]]]]
    )
    labels = GoldenLabels(candidates=candidates, alpha=alpha, budget=4, interval=2, num_tokens=9)
    policy = make_policy("golden", labels=[labels])
    for step, expected in ((1, [[0, 1, 1, 0], [1, 1, 0, 0]]), (2, [[0, 1, 1, 0], [0, 0, 1, 1]])):  # ties: lower
        window = torch.tensor([[4, 5], [4, 5]]) + 2 * (step - 1)  # newest position p_t = B + tL - 1
        held = torch.cat([candidates[step - 1, 0].long(), window], dim=-1)
        context = EvictionContext(
            layer_idx=0,
            num_layers=1,
            keys=torch.zeros(1, 2, 6, 8),
            values=torch.zeros(1, 2, 6, 8),
            positions=held[None],
            num_candidates=4,
            scaling=1.0,
        )
        assert policy.keep_scores(context).tolist() == [expected]
        twin = [ref.golden(candidates[step - 1, 0, h].tolist(), alpha[step - 1, 0, h].tolist(), 2) for h in range(2)]
        assert twin == expected
    context.positions = context.positions + 1  # newest position 8: no step evicts after it
    with pytest.raises(ValueError, match="off the golden cadence"):
        policy.keep_scores(context)


def test_step_of_reads_the_cadence():
    labels = GoldenLabels(
        candidates=torch.zeros(3, 1, 1, 16, dtype=torch.int32),
        alpha=torch.zeros(3, 1, 1, 16),
        budget=16,
        interval=4,
        num_tokens=30,
    )
    schedule = GoldenSchedule.stack([labels])
    newest = torch.tensor([19, 23, 27, 31, 18, 20, 15])
    assert schedule.step_of(newest, torch.zeros(7, dtype=torch.long)).tolist() == [1, 2, 3, 4, 0, 0, 0]


def test_rows_past_their_trace_score_zero(model, traces, labels, monkeypatch):
    """Replayed together, the shorter row goes on through padding after its trace ends. At each of
    its labelled steps every row scores 1 on exactly its golden kept set and 0 on the other
    candidates; at the steps past its last label it scores 0 on every candidate."""
    policy = make_policy("golden", labels=labels)
    keep_scores, scored = policy.keep_scores, []

    def recording(context):
        scores = keep_scores(context)
        candidates = context.candidate_positions.clone()  # the cache's own storage: the compaction rewrites it
        scored.append((context.layer_idx, context.positions.amax(dim=(1, 2)), candidates, scores))
        return scores

    monkeypatch.setattr(policy, "keep_scores", recording)
    output = EvictionEngine(model, policy, EvictionConfig(B, L)).replay(traces, [PROMPT] * 2)
    assert output.first_eviction == [B + L, B + L]
    seen = set()
    for layer, newest, candidates, scores in scored:
        for row, label in enumerate(labels):
            step = (int(newest[row]) + 1 - B) // L  # p_t = B + tL - 1
            if step <= label.num_steps:
                kept = label.kept(step)[layer].long()  # [Hkv, B - L]
                expected = (candidates[row, :, :, None] == kept[:, None, :]).any(-1).float()
            else:
                expected = torch.zeros_like(scores[row])
            assert torch.equal(scores[row], expected), (row, step, layer)
            seen.add((row, step))
    last = labels[0].num_steps
    assert labels[1].num_steps < last
    assert seen == {(row, step) for row in range(2) for step in range(1, last + 1)}


def test_bad_settings_are_one_line_errors(model, traces, labels):
    def error(engine, rows=(0,), prompt=PROMPT):
        with pytest.raises(ValueError) as caught:
            engine.replay([traces[r] for r in rows], [prompt] * len(rows))
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert "made for B=16, L=4" in error(
        EvictionEngine(model, make_policy("golden", labels=labels[:1]), EvictionConfig(20, 4))
    )
    assert "made for B=16, L=4" in error(
        EvictionEngine(model, make_policy("golden", labels=labels[:1]), EvictionConfig(16, 2))
    )
    assert "protected prompt" in error(golden_engine(model, labels[:1], protect_prompt=True))
    assert "sinks=0" in error(golden_engine(model, labels[:1], sinks=12))
    assert "labels for 1 trace(s) but 2 row(s)" in error(golden_engine(model, labels[:1]), rows=(0, 1))
    assert "a prefill longer than B + L" in error(golden_engine(model, labels[:1]), prompt=B + L + 2)
    other = tiny_model("llama", num_hidden_layers=3)
    assert "2 layers and 2 KV heads, not 3 and 2" in error(
        EvictionEngine(other, make_policy("golden", labels=labels[:1]), EvictionConfig(B, L))
    )
    with pytest.raises(ValueError, match=r"share one \(B, L\)"):
        make_policy("golden", labels=[labels[0], compute_golden_labels(model, traces[0], 20, 4)])
    with pytest.raises(TypeError):
        POLICIES["golden"]()  # `foresight policies` lists it as needing arguments
