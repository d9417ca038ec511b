"""Label kinds other than α (docs/algorithms.md §4, "Label kinds") against slow twins built from an eager
T x T attention: the value-aware score from the attention weights, values and outputs of every head, the
gradient scores (and their magnitudes) from autograd through a per-entry gate on every attention logit, the
removal score from each entry's explicit removal from each row's softmax and autograd's ∂NLL/∂output."""

from __future__ import annotations

import pytest
import torch

from foresight.labels import (
    LabelKind,
    LabelStore,
    compute_golden_labels,
    future_score_table,
    labels_dir,
    load_labels,
    save_labels,
)
from foresight.metrics import low_entropy_tokens
from foresight.models import tiny_model
from foresight.runtime.capture import register_attention

B, L = 12, 4
TWIN_ATTENTION = "label-kinds-twin"


def token_ids(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.2)


def _twin_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, *, twin, **kwargs):
    """Eager attention with `twin["gate"][layer]` added to every logit; records weights, values, outputs."""
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    logits = query @ keys.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    length = query.shape[2]
    logits = logits + twin["gate"][module.layer_idx]
    logits = logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    weights = logits.softmax(-1)
    output = weights @ values
    output.retain_grad()
    twin["layers"].append((weights[0].detach(), value[0].detach(), output))
    return output.transpose(1, 2).contiguous(), weights


register_attention(TWIN_ATTENTION, _twin_attention, full_cache=True)


def removal_change(weights: torch.Tensor, values: torch.Tensor, output: torch.Tensor, grad: torch.Tensor):
    """[Hq, q, i]: ⟨∂NLL/∂o_q, o_q without entry i − o_q⟩, each entry removed from each row's weights in turn
    and the rest renormalised (a row left with no weight moves nothing)."""
    change = torch.zeros_like(weights)
    for entry in range(weights.shape[-1]):
        kept = weights.clone()
        kept[..., entry] = 0
        mass = kept.sum(-1, keepdim=True)
        moved = torch.where(mass > 0, (kept / mass) @ values - output, torch.zeros_like(output))
        change[..., entry] = (grad * moved).sum(-1)
    return change


def twin_block_terms(model, ids: torch.Tensor, kind: LabelKind) -> list[torch.Tensor]:
    """Per layer [Hq, T, T]: a_{q,h,i}·‖v_i − o_{q,h}‖ (value), −∂NLL_low/∂s_{q,h,i} by autograd through a zero
    gate on every logit (gradient, gradient-magnitude) or the first-order loss change of removing entry i from
    row q (removal)."""
    config = model.config
    length = ids.numel()
    gate = torch.zeros(config.num_hidden_layers, config.num_attention_heads, length, length, requires_grad=True)
    twin = {"gate": gate, "layers": []}
    previous = config._attn_implementation
    model.set_attn_implementation(TWIN_ATTENTION)
    try:
        logits = model(ids[None], twin=twin).logits[0, :-1].float()
    finally:
        model.set_attn_implementation(previous)
    log_probs = logits.log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1).detach()
    nll = -log_probs.gather(-1, ids[1:, None])[:, 0]
    nll[low_entropy_tokens(entropy)].sum().backward()
    terms = []
    for layer, (weights, value, output) in enumerate(twin["layers"]):
        if kind in (LabelKind.GRADIENT, LabelKind.GRADIENT_MAGNITUDE):
            terms.append(-gate.grad[layer])
            continue
        group = weights.shape[0] // value.shape[0]
        values = value.repeat_interleave(group, 0)  # [Hq, T, D]
        if kind == LabelKind.REMOVAL:
            terms.append(removal_change(weights, values, output[0].detach(), output.grad[0]))
            continue
        output = output[0].detach()
        distance = (values[:, None, :, :] - output[:, :, None, :]).norm(dim=-1)  # [Hq, q, i]
        terms.append(weights * distance)
    return terms


def twin_table(model, ids: torch.Tensor, kind: LabelKind) -> torch.Tensor:
    """[M, layers, Hkv, N]: each block's mean over its queries and the group's heads (its magnitude for
    gradient-magnitude), then the max (value) or the sum (the others) over blocks j >= t, block by block."""
    length = ids.numel()
    steps = (length - B) // L
    width = B + (steps - 1) * L
    kv_heads = model.config.num_key_value_heads
    table = torch.zeros(steps, model.config.num_hidden_layers, kv_heads, width)
    for layer, terms in enumerate(twin_block_terms(model, ids, kind)):
        group = terms.shape[0] // kv_heads
        blocks = []
        for j in range(1, steps + 1):
            rows = [q for q in range(B + j * L, B + (j + 1) * L) if q < length]
            if not rows:
                blocks.append(torch.zeros(kv_heads, width))
                continue
            block = terms[:, rows, :width].double().mean(1)  # [Hq, N]
            block = block.view(kv_heads, group, width).mean(1).float()
            blocks.append(block.abs() if kind == LabelKind.GRADIENT_MAGNITUDE else block)
        for t in range(1, steps + 1):
            future = torch.stack(blocks[t - 1 :])
            table[t - 1, layer] = future.max(0).values if kind == LabelKind.VALUE else future.sum(0)
    return table


@pytest.mark.parametrize("kind", [LabelKind.VALUE, LabelKind.GRADIENT, LabelKind.GRADIENT_MAGNITUDE, LabelKind.REMOVAL])
@pytest.mark.parametrize("length", [50, 48])  # the last block holds 2 of its 4 queries; none
def test_label_kinds_match_their_eager_twins(model, kind, length):
    ids = token_ids(length)
    table = future_score_table(model, ids, B, L, chunk_size=7, kind=kind)
    expected = twin_table(model, ids, kind)
    assert table.shape == expected.shape
    scale = float(expected.abs().max())
    assert scale > 0
    torch.testing.assert_close(table, expected, rtol=1e-4, atol=1e-5 * scale)


def test_label_kinds_rank_differently_from_alpha(model):
    ids = token_ids(60)
    alpha = future_score_table(model, ids, B, L)
    for kind in (LabelKind.VALUE, LabelKind.GRADIENT, LabelKind.GRADIENT_MAGNITUDE, LabelKind.REMOVAL):
        other = future_score_table(model, ids, B, L, kind=kind)
        assert not torch.equal(alpha.argsort(-1), other.argsort(-1)), kind
    gradient = future_score_table(model, ids, B, L, kind=LabelKind.GRADIENT)
    removal = future_score_table(model, ids, B, L, kind=LabelKind.REMOVAL)
    assert not torch.equal(gradient.argsort(-1), removal.argsort(-1))  # 1 / (1 − a) reorders the entries


def test_the_kind_is_in_the_metadata_and_the_folder_name(model, tmp_path):
    ids = token_ids(50)
    assert labels_dir(tmp_path, B, L) == tmp_path / f"labels-B{B}-L{L}"
    assert labels_dir(tmp_path, B, L, "value") == tmp_path / f"labels-B{B}-L{L}-value"
    store = LabelStore(tmp_path, B, L, "gradient")
    labels = compute_golden_labels(model, ids, B, L, trace_index=3, kind="gradient")
    save_labels(labels, store.path(3))
    loaded = store.load(3, num_tokens=50)
    assert loaded.kind == LabelKind.GRADIENT and torch.equal(loaded.alpha, labels.alpha)
    assert 3 in store and store.problem(3, num_tokens=50) is None
    with pytest.raises(Exception, match="kind='gradient', not 'value'"):
        load_labels(
            store.path(3),
            expect_budget=B,
            expect_interval=L,
            expect_num_tokens=50,
            expect_trace_index=3,
            expect_kind="value",
        )
    assert labels_dir(tmp_path, B, L, "gradient-magnitude") == tmp_path / f"labels-B{B}-L{L}-gradient-magnitude"
    allowed = "'alpha', 'value', 'gradient', 'gradient-magnitude', 'removal'"
    with pytest.raises(ValueError, match=f"unknown label kind 'norm'; allowed: {allowed}"):
        LabelKind.parse("norm")


def test_alpha_files_without_a_kind_still_load_as_alpha(model, tmp_path):
    """Labels written before the kinds existed carry no kind: they hold α."""
    from foresight.artifacts import read_tensors, save_tensors

    store = LabelStore(tmp_path, B, L)
    save_labels(compute_golden_labels(model, token_ids(50), B, L, trace_index=0), store.path(0))
    metadata, tensors = read_tensors(store.path(0), "remake", names=("candidates", "alpha"))
    save_tensors(store.path(0), tensors, {k: v for k, v in metadata.items() if k != "kind"})
    assert store.problem(0, num_tokens=50) is None
    assert store.load(0, num_tokens=50).kind == LabelKind.ALPHA
    assert LabelStore(tmp_path, B, L, "value").problem(0, num_tokens=50) is not None


def test_the_example_cache_key_names_any_kind_but_alpha(tmp_path):
    """α caches keep the key they had before the kinds; another kind's key refuses them, and theirs α."""
    from dataclasses import replace

    from trainers.example_cache import ExampleCache, ExampleKey

    key = ExampleKey("tiny", "float32", B, L, "paper", "float16")
    assert "label_kind" not in key.metadata()
    ExampleCache(tmp_path, tmp_path, key).claim()
    value = ExampleCache(tmp_path, tmp_path, replace(key, label_kind="value"))
    assert "--label-kind value" in value.remake_command
    with pytest.raises(ValueError, match="label_kind 'alpha' \\(asked: 'value'\\)"):
        value.check_key()
    ExampleCache(tmp_path / "value", tmp_path, replace(key, label_kind="value")).claim()
    with pytest.raises(ValueError, match="label_kind 'value' \\(asked: 'alpha'\\)"):
        ExampleCache(tmp_path / "value", tmp_path, key).check_key()
    with pytest.raises(ValueError, match="unknown label kind 'norm'"):
        replace(key, label_kind="norm")


@pytest.fixture(scope="module")
def labelled_traces(tmp_path_factory, model):
    """Three traces of the tiny model with α and value labels at (B, L)."""
    from foresight.data.trace_generation import generate_traces
    from foresight.data.trace_store import TraceStore
    from tests.prompts import CHAT_TEMPLATE, DATA, char_tokenizer

    out = tmp_path_factory.mktemp("traces")
    tokenizer = char_tokenizer(CHAT_TEMPLATE)
    generate_traces(
        model,
        tokenizer,
        str(DATA / "arithmetic.jsonl"),
        out_dir=out,
        num=3,
        max_new_tokens=24,
        progress=False,
        model_name="tiny",
    )
    for kind in (LabelKind.ALPHA, LabelKind.VALUE):
        store = LabelStore(out, B, L, kind)
        for trace in TraceStore(out):
            labels = compute_golden_labels(model, trace.input_ids, B, L, trace_index=trace.index, kind=kind)
            save_labels(labels, store.path(trace.index))
    return out


def test_golden_replays_the_schedule_of_the_kind_eval_is_given(model, labelled_traces):
    """`foresight eval --label-kind value`: golden's row is the replay of the value labels' schedule, one trace
    at a time; with α's it is another row."""
    from foresight.data.trace_store import TraceStore
    from foresight.eval.replay import evaluate
    from foresight.eval.specs import resolve_policies
    from foresight.policies import make_policy
    from foresight.runtime.engine import EvictionConfig, EvictionEngine

    specs, _ = resolve_policies("golden")
    traces = list(TraceStore(labelled_traces))
    rows = {
        kind: evaluate(model, traces, specs, [B], L, labels_root=labelled_traces, label_kind=kind, progress=False).rows[
            0
        ]
        for kind in ("alpha", "value")
    }
    store = LabelStore(labelled_traces, B, L, "value")
    evicted = full = 0.0
    for trace in traces:
        policy = make_policy("golden", labels=[store.load(trace.index, num_tokens=trace.input_ids.numel())])
        engine = EvictionEngine(model, policy, EvictionConfig(B, L, sinks=0, protect_prompt=False))
        output = engine.replay([trace.input_ids], [min(trace.prompt_length, B + L)])
        first = output.first_eviction[0]
        evicted += float(output.nll[0][first:].double().sum())
        full += float(trace.token_nll[first:].double().sum())
    assert rows["value"]["loss_ratio"] == pytest.approx(evicted / full, abs=1e-5)
    assert rows["value"]["loss_ratio"] != rows["alpha"]["loss_ratio"]
    assert rows["value"]["golden_overlap"] == 1.0
