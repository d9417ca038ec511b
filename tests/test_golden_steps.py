"""The supervised stage's training examples (`trainers.examples`) against a dense reference: one eager
forward of the whole trace whose attention is masked to the cache the golden schedule leaves each query."""

from __future__ import annotations

import itertools

import torch

from foresight.data.trace_store import TraceStore
from foresight.labels import compute_golden_labels
from foresight.models import describe, tiny_model
from foresight.scorer.attention_features import DECAY, FEATURE_NAMES, FeatureSet
from tests.masked_attention import masked_forward
from trainers.examples import golden_steps

B, L_ = 16, 4
WINDOWS = {"last_8": 8, "last_16": 16, "last_32": 32}


def masked_reference(model, input_ids: torch.Tensor, labels) -> dict[int, tuple[torch.Tensor, ...]]:
    """One eager forward of the whole trace in which each query sees exactly the cache the golden
    schedule leaves it: after step t (position p_t = B + tL - 1) the kept set of step t plus the
    positions after p_t - L. Returns per layer (keys [Hkv, T, D], values, attention [Hq, T, T])."""
    total, (layers, kv_heads) = len(input_ids), labels.candidates.shape[1:3]
    budget, interval = labels.budget, labels.interval
    allowed = torch.ones(total, total, dtype=torch.bool).tril().repeat(layers, kv_heads, 1, 1)
    for step in range(1, labels.num_steps + 1):
        newest, kept = budget + step * interval - 1, labels.kept(step).long()
        for query in range(newest + 1, min(newest + interval, total - 1) + 1):
            allowed[:, :, query, :] = False
            allowed[:, :, query, newest - interval + 1 : query + 1] = True
            for layer, head in itertools.product(range(layers), range(kv_heads)):
                allowed[layer, head, query, kept[layer, head]] = True
    return masked_forward(model, input_ids, allowed)[1]


def reference_features(
    weights: torch.Tensor, candidates: torch.Tensor, step: int, budget: int, interval: int, group: int
) -> torch.Tensor:
    """The paper's features of `candidates` [B] for one KV head at `step`, by loops over query heads and
    blocks: window sums of this step's block, cumulative and decayed sums over the blocks so far."""
    per_head = []
    for g in range(group):
        received = [
            weights[g, budget + j * interval - interval : budget + j * interval, candidates] for j in range(1, step + 1)
        ]
        block = received[-1]  # [L queries, B]
        values = {name: block[-min(size, interval) :].sum(0) for name, size in WINDOWS.items()}
        values["last_L"] = block.sum(0)
        values["cumulative"] = sum(r.sum(0) for r in received)
        values["decayed"] = sum(DECAY ** (step - j) * r.sum(0) for j, r in enumerate(received, start=1))
        per_head.append(torch.stack([values[name] for name in FEATURE_NAMES[FeatureSet.PAPER]], -1))
    return torch.log1p(torch.cat(per_head, -1))


def test_examples_equal_a_dense_masked_reference(traces_dir):
    """Keys, values, features and α recorded along the golden schedule, for a batch of traces of
    different lengths, equal a full-sequence forward masked to the golden caches."""
    model = tiny_model("llama")
    by_length = {trace.input_ids.numel(): trace for trace in TraceStore(traces_dir)}
    traces = [by_length[length] for length in sorted(by_length)[-3:]]
    assert len(traces) == 3
    labels = [compute_golden_labels(model, trace.input_ids, B, L_) for trace in traces]
    examples = golden_steps(model, traces, labels, storage_dtype=torch.float32)
    shape = describe(model)
    for trace, label, example in zip(traces, labels, examples):
        reference = masked_reference(model, trace.input_ids, label)
        assert example["alpha"].shape == (label.num_steps, shape.num_layers, shape.num_kv_heads, B)
        torch.testing.assert_close(example["alpha"], label.alpha, rtol=0, atol=0)
        for step, layer, head in itertools.product(
            range(1, label.num_steps + 1), range(shape.num_layers), range(shape.num_kv_heads)
        ):
            keys, values, weights = reference[layer]
            candidates = label.candidates[step - 1, layer, head].long()
            group = shape.group_size
            recorded = {name: example[name][step - 1, layer, head] for name in ("keys", "values", "features")}
            torch.testing.assert_close(recorded["keys"], keys[head, candidates], rtol=0, atol=1e-5)
            torch.testing.assert_close(recorded["values"], values[head, candidates], rtol=0, atol=1e-5)
            expected = reference_features(weights[head * group : (head + 1) * group], candidates, step, B, L_, group)
            torch.testing.assert_close(recorded["features"], expected, rtol=0, atol=1e-5)


def reference_standardised(
    weights: torch.Tensor, candidates: torch.Tensor, step: int, budget: int, interval: int, group: int
) -> torch.Tensor:
    """The standardised set's features of `candidates` [B] for one KV head at `step`, from the dense attention
    weights [G, T, T]: every query from position B (the first block's) up to the step's newest, each weighted
    per token of its age; then (x - mean) / (std + 0.01) over the B candidates."""
    newest = budget + step * interval - 1
    queries = torch.arange(budget, newest + 1)
    age = (newest - candidates).double()
    observed = (newest - candidates.clamp_min(budget) + 1).double()
    per_head = []
    for g in range(group):
        received = weights[g, budget : newest + 1][:, candidates].double()  # [queries, B]
        values = {name: received[-min(size, interval) :].sum(0) for name, size in WINDOWS.items()}
        values["recent_128"] = (0.5 ** ((newest - queries) / 128)).double() @ received
        values["decayed"] = (0.9 ** ((newest - queries) / 256)).double() @ received
        values["cumulative_rate"] = received.sum(0) / observed
        columns = [torch.log(values[name] + 1e-6) for name in FEATURE_NAMES[FeatureSet.STANDARDISED][:-1]]
        per_head.append(torch.stack([*columns, torch.log1p(age)], -1))
    features = torch.cat(per_head, -1)
    return (features - features.mean(0)) / (features.std(0, unbiased=False) + 1e-2)


def test_standardised_examples_equal_a_dense_masked_reference(traces_dir):
    """The standardised set's recorded features, standardised over the candidates as the policy does."""
    model = tiny_model("llama")
    trace = max(TraceStore(traces_dir), key=lambda trace: trace.input_ids.numel())
    label = compute_golden_labels(model, trace.input_ids, B, L_)
    (example,) = golden_steps(model, [trace], [label], feature_set="standardised", storage_dtype=torch.float32)
    shape, reference = describe(model), masked_reference(model, trace.input_ids, label)
    group = shape.group_size
    assert example["features"].shape == (label.num_steps, shape.num_layers, shape.num_kv_heads, B, 7 * group)
    for step, layer, head in itertools.product(
        range(1, label.num_steps + 1), range(shape.num_layers), range(shape.num_kv_heads)
    ):
        weights = reference[layer][2][head * group : (head + 1) * group]
        candidates = label.candidates[step - 1, layer, head].long()
        expected = reference_standardised(weights, candidates, step, B, L_, group).float()
        torch.testing.assert_close(example["features"][step - 1, layer, head], expected, rtol=0, atol=5e-4)


def test_making_examples_allocates_no_gradient_for_the_model(traces_dir):
    model = tiny_model("llama").requires_grad_(True)  # even a model left trainable gets no graph
    trace = next(iter(TraceStore(traces_dir)))
    labels = compute_golden_labels(model, trace.input_ids, B, L_)
    with torch.enable_grad():
        (example,) = golden_steps(model, [trace], [labels])
    assert all(not tensor.requires_grad and tensor.grad_fn is None for tensor in example.values())
    assert all(parameter.grad is None for parameter in model.parameters())
