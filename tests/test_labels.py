"""Golden Eviction labels against a dense, loop-based reference built from the full T x T attention, and the
batched block attention and schedule against their per-block, per-layer loop twins."""

from __future__ import annotations

import pytest
import torch

from foresight import cli
from foresight.cadence import TraceTooShort, eviction_steps, keep_top
from foresight.data.trace_store import TraceStore
from foresight.labels import (
    GoldenLabels,
    LabelStore,
    _capture_forward,
    compute_golden_labels,
    future_score_table,
    future_scores,
    golden_schedule,
    labels_dir,
    load_labels,
    save_labels,
)
from foresight.models import ModelShape, tiny_model
from foresight.runtime.capture import attention_logits
from tests.prompts import CHAT_TEMPLATE, arithmetic_traces, char_tokenizer

BLOCK_MEAN_RTOL = 1e-6  # a product of several blocks sums each block's mean in another float32 order


def sharp_model(arch: str) -> torch.nn.Module:
    """A tiny GQA model whose larger initial weights sharpen its attention, so that later blocks often
    outscore earlier ones and the suffix max of Eq. 5 matters."""
    return tiny_model(arch, initializer_range=0.2)


def token_ids(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed))


def reference_labels(model, ids: torch.Tensor, budget: int, interval: int) -> tuple[list, list]:
    """Slow twin: eager T x T attention, block scores by loops, greedy schedule on Python lists.

    Returns candidates[layer][head][step] and alpha[layer][head][step] as lists.
    """
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(ids[None], output_attentions=True).attentions
    model.set_attn_implementation(previous)
    length = ids.numel()
    steps = (length - budget) // interval
    all_candidates, all_alpha = [], []
    for attention in attentions:
        attention = attention[0].float()  # [Hq, T, T]
        group = attention.shape[0] // model.config.num_key_value_heads
        layer_candidates, layer_alpha = [], []
        for head in range(model.config.num_key_value_heads):
            heads = attention[head * group : (head + 1) * group]
            block = {}
            for j in range(1, steps + 1):
                rows = [q for q in range(budget + j * interval, budget + (j + 1) * interval) if q < length]
                block[j] = [
                    sum(heads[g, q, i].item() for g in range(group) for q in rows) / (group * len(rows))
                    if rows
                    else 0.0
                    for i in range(length)
                ]
            kept, head_candidates, head_alpha = [], [], []
            for t in range(1, steps + 1):
                alpha = [max(block[j][i] for j in range(t, steps + 1)) for i in range(length)]
                window_left = (
                    range(0, budget) if t == 1 else range(budget + (t - 2) * interval, budget + (t - 1) * interval)
                )
                candidates = sorted(kept + list(window_left))
                head_candidates.append(candidates)
                head_alpha.append([alpha[i] for i in candidates])
                kept = sorted(sorted(candidates, key=lambda i: (-alpha[i], i))[: budget - interval])
            layer_candidates.append(head_candidates)
            layer_alpha.append(head_alpha)
        all_candidates.append(layer_candidates)
        all_alpha.append(layer_alpha)
    return all_candidates, all_alpha


@pytest.mark.parametrize(
    "arch, length, budget, interval, chunk_size",
    [
        ("llama", 50, 12, 4, 7),  # last block holds 2 of its 4 queries
        ("llama", 48, 12, 4, 48),  # L divides T - B: the last block is empty, every α of step M is 0
        ("qwen3", 45, 10, 3, 16),  # last block holds 2 of 3
        ("qwen3", 31, 24, 6, 5),  # a single step (M = 1)
    ],
)
def test_labels_match_dense_reference(arch, length, budget, interval, chunk_size):
    model = sharp_model(arch)
    ids = token_ids(length)
    labels = compute_golden_labels(model, ids, budget, interval, trace_index=3, chunk_size=chunk_size)
    expected_candidates, expected_alpha = reference_labels(model, ids, budget, interval)
    steps = eviction_steps(length, budget, interval)
    assert labels.candidates.shape == (steps, 2, 2, budget)
    assert labels.candidates.dtype == torch.int32 and labels.alpha.dtype == torch.float32
    assert labels.candidates.permute(1, 2, 0, 3).tolist() == expected_candidates
    torch.testing.assert_close(labels.alpha.permute(1, 2, 0, 3), torch.tensor(expected_alpha), atol=1e-5, rtol=0)
    assert (labels.num_tokens, labels.trace_index, labels.budget, labels.interval) == (length, 3, budget, interval)
    assert labels.model_shape == ModelShape(num_layers=2, num_query_heads=4, num_kv_heads=2, head_dim=16)
    assert model.config._attn_implementation == "sdpa"  # restored


# -- the batched block attention and schedule against their loop twins ------------------------------
def loop_block_scores(queries: torch.Tensor, keys: torch.Tensor, start: int, scaling: float) -> torch.Tensor:
    """Slow twin of one block's ã: the whole causal mask, the softmax and the mean over queries and heads."""
    length, n = keys.shape[1], queries.shape[1]
    logits = attention_logits(queries[None], keys[None], scaling)[0]
    query_pos = torch.arange(start, start + n, device=keys.device)
    future_key = torch.arange(length, device=keys.device) > query_pos[:, None]
    weights = logits.masked_fill(future_key, float("-inf")).softmax(dim=-1)
    return weights.mean(dim=(1, 2))


def loop_future_scores(
    queries: torch.Tensor, keys: torch.Tensor, budget: int, interval: int, scaling: float
) -> torch.Tensor:
    """Slow twin of `future_scores`: one block at a time from the last, the suffix max built in place."""
    num_tokens = keys.shape[1]
    num_steps = eviction_steps(num_tokens, budget, interval)
    width = budget + (num_steps - 1) * interval
    future = torch.zeros(num_steps, keys.shape[0], width, device=keys.device)
    for step in range(num_steps, 0, -1):
        start = budget + step * interval
        end = min(start + interval, num_tokens)
        if start < end:
            scores = loop_block_scores(queries[:, start:end], keys[:, :end], start, scaling)
            future[step - 1, :, : min(end, width)] = scores[:, :width]
        if step < num_steps:
            future[step - 1] = torch.maximum(future[step - 1], future[step])
    return future


def loop_labels(
    model, ids: torch.Tensor, budget: int, interval: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slow twin of `compute_golden_labels` and `future_score_table`: the loop future scores and the greedy
    schedule of one layer at a time. Returns candidates, alpha [M, layers, Hkv, B] and the table [M, layers, Hkv, N]."""
    capture = _capture_forward(model, ids, chunk_size=256)
    tables, candidates, alpha = [], [], []
    for layer in range(len(capture.queries)):
        future = loop_future_scores(
            capture.queries[layer], capture.keys[layer], budget, interval, capture.scaling[layer]
        )
        layer_candidates, layer_alpha = golden_schedule(future, budget, interval)
        tables.append(future)
        candidates.append(layer_candidates.int())
        alpha.append(layer_alpha)
    return torch.stack(candidates, dim=1), torch.stack(alpha, dim=1), torch.stack(tables, dim=1)


@pytest.mark.parametrize(
    "length, budget, interval, query_heads, kv_heads, dtype",
    [
        (50, 12, 4, 4, 2, torch.float32),  # last block holds 2 of its 4 queries
        (48, 12, 4, 4, 2, torch.float32),  # L divides T - B: the last block is empty
        (31, 24, 6, 4, 1, torch.float32),  # a single step (M = 1)
        (700, 64, 16, 12, 4, torch.bfloat16),  # many steps, several blocks per product
    ],
)
@pytest.mark.parametrize("max_elements", [1, 2**12, None, 2**30])
def test_future_scores_match_the_per_block_loop(length, budget, interval, query_heads, kv_heads, dtype, max_elements):
    """One block per product (max_elements=1) is bit-identical to the loop; several per product sum the
    block means in another order, within BLOCK_MEAN_RTOL."""
    generator = torch.Generator().manual_seed(length)
    queries = (torch.randn(query_heads, length, 16, generator=generator) * 2).to(dtype)
    keys = (torch.randn(kv_heads, length, 16, generator=generator) * 2).to(dtype)
    batched = future_scores(queries, keys, budget, interval, 0.25, max_elements=max_elements)
    expected = loop_future_scores(queries, keys, budget, interval, 0.25)
    if max_elements == 1:
        assert torch.equal(batched, expected)
    else:
        torch.testing.assert_close(batched, expected, rtol=BLOCK_MEAN_RTOL, atol=1e-12)
    assert batched.shape == (
        eviction_steps(length, budget, interval),
        kv_heads,
        budget + (batched.shape[0] - 1) * interval,
    )


def test_golden_schedule_batched_over_layers_equals_one_layer_at_a_time():
    generator = torch.Generator().manual_seed(3)
    future = torch.rand(6, 3, 2, 40, generator=generator).flip(0).cummax(0).values.flip(0)  # [M, layers, Hkv, N]
    future[:, :, :, ::5] = future[:, :, :, 1::5]  # ties, which keep the lower position
    candidates, alpha = golden_schedule(future.view(6, 6, 40), budget=20, interval=4)
    for layer in range(3):
        layer_candidates, layer_alpha = golden_schedule(future[:, layer], budget=20, interval=4)
        assert torch.equal(candidates.view(6, 3, 2, 20)[:, layer], layer_candidates)
        assert torch.equal(alpha.view(6, 3, 2, 20)[:, layer], layer_alpha)


def test_labels_and_table_of_a_trace_match_the_loop_twin(llama, traces_dir):
    trace = max(TraceStore(traces_dir), key=lambda trace: trace.input_ids.numel())
    budget, interval = 16, 4
    labels = compute_golden_labels(llama, trace.input_ids, budget, interval)
    table = future_score_table(llama, trace.input_ids, budget, interval)
    candidates, alpha, expected_table = loop_labels(llama, trace.input_ids, budget, interval)
    assert labels.num_steps > 10
    assert torch.equal(labels.candidates, candidates)
    torch.testing.assert_close(labels.alpha, alpha, rtol=BLOCK_MEAN_RTOL, atol=1e-12)
    torch.testing.assert_close(table, expected_table, rtol=BLOCK_MEAN_RTOL, atol=1e-12)
    assert table.device.type == "cpu" and table.dtype == torch.float32


def test_empty_last_block_keeps_lowest_positions():
    labels = compute_golden_labels(sharp_model("llama"), token_ids(48), 12, 4)
    assert torch.all(labels.alpha[-1] == 0)
    assert torch.equal(labels.kept(labels.num_steps), labels.candidates[-1, ..., :8])


@pytest.fixture(scope="module")
def labels() -> GoldenLabels:
    return compute_golden_labels(sharp_model("qwen3"), token_ids(90, seed=5), 16, 4, trace_index=7)


def test_schedule_invariants(labels):
    budget, interval = labels.budget, labels.interval
    candidates, alpha, kept = labels.candidates.long(), labels.alpha, labels.kept_positions().long()
    assert candidates.shape[-1] == budget and kept.shape[-1] == budget - interval
    assert torch.all(candidates.diff(dim=-1) > 0)  # sorted and unique
    assert torch.all(kept.diff(dim=-1) > 0)
    assert torch.equal(candidates[0], torch.arange(budget).expand_as(candidates[0]))
    for step in range(1, labels.num_steps + 1):
        index = step - 1
        assert torch.equal(kept[index], labels.kept(step).long())
        is_kept = (candidates[index][..., :, None] == kept[index][..., None, :]).any(-1)
        assert torch.equal(is_kept.sum(-1), torch.full(is_kept.shape[:-1], budget - interval))  # kept ⊂ candidates
        lowest_kept = alpha[index].masked_fill(~is_kept, float("inf")).min(-1).values
        highest_evicted = alpha[index].masked_fill(is_kept, float("-inf")).max(-1).values
        assert torch.all(lowest_kept >= highest_evicted)  # kept are the top B - L by α
        if index > 0:
            left_window = torch.arange(budget + (step - 2) * interval, budget + (step - 1) * interval)
            previous = torch.cat([kept[index - 1], left_window.expand(*kept.shape[1:3], -1)], dim=-1)
            assert torch.equal(candidates[index], previous)


def test_alpha_non_increasing_for_entries_that_stay(labels):
    for index in range(1, labels.num_steps):
        before, after = labels.candidates[index - 1].long(), labels.candidates[index].long()
        same = before[..., :, None] == after[..., None, :]  # [layers, Hkv, B, B]
        earlier = labels.alpha[index - 1][..., :, None].expand_as(same)[same]
        later = labels.alpha[index][..., None, :].expand_as(same)[same]
        assert same.any() and torch.all(later <= earlier)


def test_keep_top_breaks_ties_towards_lower_position():
    candidates = torch.tensor([2, 5, 7, 9, 11])
    alpha = torch.tensor([0.1, 0.3, 0.1, 0.3, 0.1])
    assert keep_top(candidates, alpha, 3).tolist() == [2, 5, 9]


def test_golden_schedule_hand_computed():
    # B = 3, L = 1, M = 2: step 1 candidates 0,1,2 keep 2; step 2 adds position 3.
    future = torch.tensor([[[0.5, 0.2, 0.4, 0.9, 0.0]], [[0.1, 0.2, 0.05, 0.3, 0.0]]])
    candidates, alpha = golden_schedule(future, budget=3, interval=1)
    assert candidates.tolist() == [[[0, 1, 2]], [[0, 2, 3]]]
    torch.testing.assert_close(alpha, torch.tensor([[[0.5, 0.2, 0.4]], [[0.1, 0.05, 0.3]]]))


def test_trace_too_short():
    model = sharp_model("llama")
    with pytest.raises(TraceTooShort, match="shorter than B \\+ L = 16"):
        compute_golden_labels(model, token_ids(15), 12, 4)
    assert compute_golden_labels(model, token_ids(16), 12, 4).num_steps == 1


@pytest.mark.parametrize("budget, interval, message", [(4, 4, "B=4 must be larger"), (8, 0, "L=0 must be at least 1")])
def test_bad_budget_or_interval(budget, interval, message):
    with pytest.raises(ValueError, match=message):
        eviction_steps(100, budget, interval)


def test_save_load_round_trip_is_bit_exact(labels, tmp_path):
    store = LabelStore(tmp_path, 16, 4)
    assert store.path(7) == tmp_path / "labels-B16-L4" / "trace-000007.safetensors"
    assert 7 not in store
    save_labels(labels, store.path(7))
    assert 7 in store and [p.name for p in store.directory.iterdir()] == ["trace-000007.safetensors"]
    loaded = store.load(7, num_tokens=90)
    assert torch.equal(loaded.candidates, labels.candidates) and torch.equal(loaded.alpha, labels.alpha)
    assert loaded.alpha.view(torch.int32).equal(labels.alpha.view(torch.int32))
    assert loaded.model_shape == labels.model_shape and loaded.model_name == labels.model_name
    assert torch.equal(loaded.kept_positions(), labels.kept_positions())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"expect_budget": 32}, "budget='16', not '32'"),
        ({"expect_interval": 8}, "interval='4', not '8'"),
        ({"expect_num_tokens": 91}, "num_tokens='90', not '91'"),
        ({"expect_trace_index": 8}, "trace_index='7', not '8'"),
    ],
)
def test_load_rejects_labels_made_for_something_else(labels, tmp_path, change, message):
    path = tmp_path / "labels.safetensors"
    save_labels(labels, path)
    expect = dict(expect_budget=16, expect_interval=4, expect_num_tokens=90, expect_trace_index=7) | change
    with pytest.raises(ValueError, match=message):
        load_labels(path, **expect)


def test_missing_labels_name_the_path_and_the_command(tmp_path):
    store = LabelStore(tmp_path, 16, 4)
    with pytest.raises(ValueError) as error:
        store.load(3, num_tokens=90)
    message = str(error.value)
    assert str(store.path(3)) in message
    assert f"foresight labels --traces {tmp_path} --budget 16 --interval 4" in message
    assert "\n" not in message


def test_labels_dir_layout(tmp_path):
    assert labels_dir(tmp_path, 128, 32) == tmp_path / "labels-B128-L32"


def test_cli_labels_a_traces_folder_and_resumes(tmp_path, monkeypatch, capsys):
    model, tokenizer = tiny_model("llama"), char_tokenizer(CHAT_TEMPLATE)
    arithmetic_traces(model, tmp_path, num=6, max_new_tokens=12)
    lengths = {trace.index: trace.input_ids.numel() for trace in TraceStore(tmp_path)}
    interval = 4
    budget = sorted(set(lengths.values()))[1] - interval  # the shortest traces have no eviction step
    short = sum(length < budget + interval for length in lengths.values())
    loads = []
    monkeypatch.setattr(
        "trainers.data_stage.load_model", lambda name, **kwargs: (loads.append(name), (model, tokenizer))[1]
    )
    args = ["labels", "--traces", str(tmp_path), "--budget", str(budget), "--interval", str(interval)]
    assert cli.main(args) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert last_line.startswith(
        f"{tmp_path / f'labels-B{budget}-L{interval}'}: labelled {6 - short} traces, skipped {short} too short "
        f"(< B + L = {budget + interval} tokens), 0 already labelled; "
    )
    assert last_line.endswith(" s") and loads == ["tiny"]
    store = LabelStore(tmp_path, budget, interval)
    for trace in TraceStore(tmp_path):
        assert (trace.index in store) == (lengths[trace.index] >= budget + interval)
        if trace.index in store:
            stored = store.load(trace.index, num_tokens=lengths[trace.index])
            direct = compute_golden_labels(model, trace.input_ids, budget, interval)
            assert torch.equal(stored.candidates, direct.candidates) and torch.equal(stored.alpha, direct.alpha)
            assert stored.model_name == "tiny"

    assert cli.main([*args, "--model", "tiny"]) == 0
    assert f"labelled 0 traces, skipped {short} too short" in capsys.readouterr().out
    assert loads == ["tiny"]  # nothing left to do: the model is not even loaded

    assert cli.main([*args, "--model", "other"]) == 2
    error = capsys.readouterr().err.strip()
    assert (
        error
        == f"foresight labels: error: --model 'other' is not the model that made the traces in {tmp_path} ('tiny')"
    )
    assert cli.main(["labels", "--traces", str(tmp_path), "-B", "6", "-L", "6"]) == 2
    assert "budget B=6 must be larger than the interval L=6" in capsys.readouterr().err


def test_labels_built_by_hand_without_a_model_shape_are_not_saved(labels, tmp_path):
    by_hand = GoldenLabels(labels.candidates, labels.alpha, labels.budget, labels.interval, labels.num_tokens)
    with pytest.raises(ValueError, match="without a model shape cannot be saved"):
        save_labels(by_hand, tmp_path / "labels.safetensors")
    assert not any(tmp_path.iterdir())


def test_sliding_window_layers_are_refused_and_attention_is_restored():
    model = tiny_model("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="layer 0 uses a sliding window of 8"):
        compute_golden_labels(model, token_ids(40), 12, 4)
    assert model.config._attn_implementation == "sdpa"


def test_a_damaged_label_file_is_named_with_its_command_and_relabelled(tmp_path, monkeypatch, capsys):
    model, tokenizer = tiny_model("llama"), char_tokenizer(CHAT_TEMPLATE)
    arithmetic_traces(model, tmp_path, num=2, max_new_tokens=12)
    monkeypatch.setattr("trainers.data_stage.load_model", lambda name, **kwargs: (model, tokenizer))
    budget, interval = 8, 4
    args = ["labels", "--traces", str(tmp_path), "--budget", str(budget), "--interval", str(interval)]
    assert cli.main(args) == 0
    store, trace = LabelStore(tmp_path, budget, interval), TraceStore(tmp_path)[0]
    path = store.path(trace.index)
    path.write_bytes(path.read_bytes()[:-64])  # a truncated copy, a full disk
    assert trace.index not in store
    with pytest.raises(ValueError) as error:
        store.load(trace.index, num_tokens=trace.input_ids.numel())
    message = str(error.value)
    assert "\n" not in message and str(path) in message and "damaged" in message
    assert message.endswith(f"`foresight labels --traces {tmp_path} --budget {budget} --interval {interval}`")
    capsys.readouterr()
    assert cli.main(args) == 0
    assert "labelled 1 traces (1 replacing damaged files), skipped 0 too short" in capsys.readouterr().out
    relabelled = store.load(trace.index, num_tokens=trace.input_ids.numel())
    direct = compute_golden_labels(model, trace.input_ids, budget, interval)
    assert torch.equal(relabelled.candidates, direct.candidates) and torch.equal(relabelled.alpha, direct.alpha)
