"""The eviction runtime against references: HF generate, a masked full-cache forward, single rows,
token-by-token decoding, and the cadence's invariants."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, DynamicCache

from foresight.cache_argument import cache_argument
from foresight.models import tiny_model
from foresight.policies import make_policy
from foresight.runtime.capture import ATTENTION_NAME, attention_implementation, eviction_attention
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.sampling import SamplingConfig
from tests.policy_lists import constructible_policies
from tests.prompts import prompts

ARCHS = ("llama", "qwen2", "qwen3")
B, L = 12, 4


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_everything_matches_hf_generate(arch):
    model = tiny_model(arch)
    prompt = prompts([9])[0]
    reference = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=24,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    output = EvictionEngine(model, make_policy("full")).generate([prompt], 24, return_logits=True)
    assert output.tokens[0] == reference.sequences[0, len(prompt) :].tolist()
    torch.testing.assert_close(output.logits, torch.stack(reference.logits, 1), atol=1e-5, rtol=0)


class _Recorder:
    """Records, for every forward of every layer, the positions each KV head attended to."""

    def __init__(self):
        self.entries: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, query positions, entry positions)

    def __call__(self, module, query, key, value, attention_mask, eviction_cache=None, **kwargs):
        layer = eviction_cache.layers[module.layer_idx]
        output = eviction_attention(module, query, key, value, attention_mask, eviction_cache=eviction_cache, **kwargs)
        self.entries.append((module.layer_idx, layer.pending_positions.clone(), layer.entry_positions().clone()))
        return output


def _masked_reference_attention(allowed):
    """Eager attention over the full sequence where query p of (layer, KV head) sees only `allowed`."""

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        mask = allowed[module.layer_idx]  # [Hkv, T, T]
        group = query.shape[1] // key.shape[1]
        logits = torch.einsum("bhqd,bhkd->bhqk", query, key.repeat_interleave(group, 1)) * scaling
        logits = logits.masked_fill(~mask.repeat_interleave(group, 0)[None], float("-inf"))
        output = torch.softmax(logits, -1) @ value.repeat_interleave(group, 1)
        return output.transpose(1, 2).contiguous(), None

    return attend


@pytest.mark.parametrize("policy_name", ["knorm", "random", "streaming", "h2o", "snapkv"])
def test_per_head_eviction_equals_full_cache_with_evicted_entries_masked(peaked_llama, policy_name):
    llama = peaked_llama
    prompt = prompts([7])[0]
    recorder = _Recorder()
    AttentionInterface.register("foresight-recording", recorder)
    engine = EvictionEngine(llama, make_policy(policy_name), EvictionConfig(B, L), attention="foresight-recording")
    output = engine.generate([prompt], 30, return_logits=True)
    assert output.stats.evictions > 3
    tokens = prompt + output.tokens[0]
    total = len(tokens)
    kv_heads = llama.config.num_key_value_heads
    # The diagonal keeps rows of never-processed tokens (the last one) finite: 0 * NaN would leak.
    allowed = torch.eye(total, dtype=torch.bool).repeat(llama.config.num_hidden_layers, kv_heads, 1, 1)
    for layer, query_positions, entry_positions in recorder.entries:
        for q in query_positions[0].tolist():
            for head in range(kv_heads):
                visible = [p for p in entry_positions[0, head].tolist() if 0 <= p <= q]
                allowed[layer, head, q, visible] = True
    # Different heads must really have kept different sets, or the test proves little.
    assert policy_name in ("streaming",) or not torch.equal(allowed[:, 0], allowed[:, 1])
    AttentionInterface.register("masked-reference", _masked_reference_attention(allowed))
    llama.set_attn_implementation("masked-reference")
    try:
        reference = llama(torch.tensor([tokens])).logits[0]
    finally:
        llama.set_attn_implementation("sdpa")
    steps = output.logits.shape[1]
    expected = reference[len(prompt) - 1 : len(prompt) - 1 + steps]
    torch.testing.assert_close(output.logits[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("policy_name", "options", "kept"), [("snapkv", {"window": 2}, 2), ("tova", {}, 1)])
def test_a_window_policy_keeps_only_the_latest_queries_it_reads(llama, monkeypatch, policy_name, options, kept):
    """The query buffer holds `latest_queries` (< L) queries per layer, and decoding is exactly what it is
    with all L queries kept."""
    prompt = prompts([7])[0]
    engine = EvictionEngine(llama, make_policy(policy_name, **options), EvictionConfig(B, L))
    windowed = engine.generate([prompt], 30, return_logits=True)
    assert windowed.stats.evictions > 3
    assert {layer.queries.shape[2] for layer in engine.last_cache.layers} == {kept}
    monkeypatch.setattr(type(engine.policy), "latest_queries", property(lambda self: None))
    every = EvictionEngine(llama, make_policy(policy_name, **options), EvictionConfig(B, L))
    reference = every.generate([prompt], 30, return_logits=True)
    assert {layer.queries.shape[2] for layer in every.last_cache.layers} == {L}
    assert windowed.tokens == reference.tokens
    torch.testing.assert_close(windowed.logits, reference.logits, atol=0, rtol=0)


# VaSE's keep keys log(u) / w divide a hashed uniform by an attention weight: the batch kernels' rounding of
# w (~1e-7 relative, which differs by CPU) moves a key past its neighbour at the top-k boundary on some x86
# CPUs (an Intel Xeon here, not an AMD EPYC), and one flipped entry changes a later greedy token. Its rows'
# evictions are still each row's own: the hash reads only (seed, layer, head, position, newest position).
BATCH_INVARIANT = [name for name in constructible_policies() if name != "vase"]


@pytest.mark.parametrize("policy_name", BATCH_INVARIANT)
def test_left_padded_batch_decodes_as_each_row_alone(llama, policy_name):
    batch = prompts([5, 11, 20], seed=1)
    engine = EvictionEngine(llama, make_policy(policy_name), EvictionConfig(B, L))
    together = engine.generate(batch, 30, return_logits=True)
    for row, prompt in enumerate(batch):
        alone = engine.generate([prompt], 30, return_logits=True)
        assert together.tokens[row] == alone.tokens[0]
        torch.testing.assert_close(together.logits[row], alone.logits[0], atol=5e-4, rtol=0)
        assert together.stats.row_evictions[row] == alone.stats.evictions  # each row's own eviction steps
    if not engine.protect_prompt:  # rows of unequal prompts evict on schedules of their own
        assert len(set(together.stats.row_evictions)) > 1


def test_row_seeds_make_each_row_sample_as_it_would_alone(llama):
    batch = prompts([5, 11, 20], seed=4)
    engine = EvictionEngine(llama, make_policy("h2o"), EvictionConfig(B, L))
    sampling = SamplingConfig(temperature=1.0, top_k=20, top_p=0.95)
    together = engine.generate(batch, 40, sampling, row_seeds=[7, 8, 9])
    for row, prompt in enumerate(batch):
        alone = engine.generate([prompt], 40, sampling, row_seeds=[7 + row])
        assert together.tokens[row] == alone.tokens[0]
    reseeded = engine.generate(batch, 40, sampling, row_seeds=[7, 8, 10])
    assert reseeded.tokens[:2] == together.tokens[:2] and reseeded.tokens[2] != together.tokens[2]
    with pytest.raises(ValueError, match="got 2 row seeds for 3 prompts"):
        engine.generate(batch, 4, sampling, row_seeds=[1, 2])


@pytest.mark.parametrize("policy_name", constructible_policies())
def test_chunked_replay_equals_token_by_token(llama, policy_name):
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(1, 128, (n,), generator=generator) for n in (45, 38)]
    engine = EvictionEngine(llama, make_policy(policy_name), EvictionConfig(B, L))
    chunked = engine.replay(sequences, [6, 9])
    for row, (sequence, prompt_length) in enumerate(zip(sequences, [6, 9])):
        stepwise = engine.replay([sequence], [prompt_length], max_chunk=1)
        # Float reassociation between chunk sizes moves losses by ~1e-4; a different kept set moves them by far more.
        torch.testing.assert_close(chunked.nll[row], stepwise.nll[0], atol=2e-3, rtol=0)
        assert chunked.first_eviction[row] == stepwise.first_eviction[0]


def test_replay_with_full_cache_matches_a_plain_forward(llama):
    sequence = torch.randint(1, 128, (30,), generator=torch.Generator().manual_seed(3))
    output = EvictionEngine(llama, make_policy("full")).replay([sequence], [4])
    log_probs = torch.log_softmax(llama(sequence[None]).logits[0, :-1], -1)
    expected = -log_probs.gather(-1, sequence[1:, None]).squeeze(-1)
    torch.testing.assert_close(output.nll[0], expected, atol=1e-5, rtol=0)
    assert output.first_eviction == [None]


@pytest.mark.parametrize("protect_prompt", [False, True])
@pytest.mark.parametrize("sinks", [0, 3])
def test_cadence_invariants(llama, sinks, protect_prompt):
    prompt = prompts([6])[0]
    config = EvictionConfig(B, L, sinks=sinks, protect_prompt=protect_prompt)
    recorder = _Recorder()
    AttentionInterface.register("foresight-recording", recorder)
    engine = EvictionEngine(llama, make_policy("knorm"), config, attention="foresight-recording")
    output, entries = engine.generate([prompt], 40), recorder.entries
    limit = B + L + (len(prompt) if protect_prompt else 0)
    assert output.stats.max_entries == limit
    for _layer, query_positions, entry_positions in entries:
        held = entry_positions[0]  # [Hkv, N] at attention time
        newest = int(query_positions.max())
        assert held.shape[-1] <= limit
        # The most recent L entries (and the new token) are always there, on every head.
        recent = torch.arange(max(0, newest - L + 1), newest + 1)
        assert all(torch.isin(recent, h).all() for h in held)
        if newest >= limit:
            protected = torch.arange(len(prompt) if protect_prompt else sinks)
            assert all(torch.isin(protected, h).all() for h in held)
        # Entries stay in position order with unique positions.
        assert (held[:, 1:] > held[:, :-1]).all()


def test_kept_entries_keep_their_positions_and_keys(llama):
    """Each kept key of layer 0 (whose keys depend only on the token and its position) is exactly the
    full-cache key of the token at its recorded position."""
    prompt = prompts([8])[0]
    engine = EvictionEngine(llama, make_policy("knorm"), EvictionConfig(B, L))
    output = engine.generate([prompt], 25)
    tokens = prompt + output.tokens[0]
    reference = DynamicCache()
    llama(torch.tensor([tokens]), **cache_argument(llama, reference), use_cache=True)
    layer = engine.last_cache.layers[0]
    full_keys = reference.layers[0].keys[0]  # [Hkv, T, D]
    positions = layer.positions[0]
    expected = full_keys.gather(1, positions[..., None].expand(-1, -1, full_keys.shape[-1]))
    torch.testing.assert_close(layer.keys[0], expected, atol=1e-5, rtol=0)


def test_short_sequences_run_without_eviction(llama):
    engine = EvictionEngine(llama, make_policy("knorm"), EvictionConfig(64, 16))
    output = engine.generate(prompts([5]), 10)
    assert output.stats.evictions == 0 and output.stats.max_entries == 14  # 5 prompt + 9 fed tokens
    replay = engine.replay([torch.arange(1, 30)], [3])
    assert replay.first_eviction == [None]


@pytest.mark.parametrize(
    ("budget", "interval", "message"),
    [(32, 32, "budget B=32 must be larger than the interval L=32"), (8, 0, "interval L=0 must be at least 1")],
)
def test_bad_budget_or_interval_is_one_line(budget, interval, message):
    with pytest.raises(ValueError, match=message) as error:
        EvictionConfig(budget, interval)
    assert "\n" not in str(error.value)


def test_unknown_policy_is_one_line():
    with pytest.raises(ValueError, match="unknown policy 'h3o'; choose one of: .*knorm") as error:
        make_policy("h3o")
    assert "\n" not in str(error.value)


def test_sdpa_mask_matches_eager_with_padding(llama):
    """The attention function's padding-aware causal mask gives the same output as explicit eager math."""
    torch.manual_seed(0)
    query = torch.randn(2, 4, 3, 16)
    key, value = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)

    class Module(torch.nn.Module):
        layer_idx = 0

    from foresight.runtime.cache import EvictionCache

    cache = EvictionCache(1)
    cache.begin_forward(torch.tensor([[0, 1, 2, 3, 4, 5, 6], [-1, -1, 0, 1, 2, 3, 4]]), torch.tensor([7, 5]), [7, 5])
    cache.update(key, value, 0)
    output, _ = eviction_attention(Module(), query, key, value, None, scaling=0.25, eviction_cache=cache)
    valid = torch.tensor([[True] * 7, [False] * 2 + [True] * 5])
    causal = torch.ones(3, 7, dtype=torch.bool).tril(4)
    mask = (causal[None] & valid[:, None, :])[:, None]
    expected = F.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=mask, scale=0.25
    )
    torch.testing.assert_close(output, expected.transpose(1, 2), atol=1e-6, rtol=0)


@pytest.mark.parametrize("restricted", [None, [SDPBackend.FLASH_ATTENTION], [SDPBackend.CUDNN_ATTENTION]])
def test_the_runtime_leaves_cudnn_attention_out_and_keeps_the_users_choice(llama, restricted):
    """Inside the runtime's attention context cuDNN's SDPA is off (it rebuilds a graph per key length) and
    the other backends are as the caller left them; afterwards everything is as before."""
    backends = torch.backends.cuda
    flags = (backends.flash_sdp_enabled, backends.mem_efficient_sdp_enabled, backends.math_sdp_enabled)
    with sdpa_kernel(restricted) if restricted else contextlib.nullcontext():
        outside = [flag() for flag in (*flags, backends.cudnn_sdp_enabled)]
        with attention_implementation(llama, ATTENTION_NAME):
            inside = [flag() for flag in (*flags, backends.cudnn_sdp_enabled)]
        assert [flag() for flag in (*flags, backends.cudnn_sdp_enabled)] == outside
    expected = [False, False, True] if restricted == [SDPBackend.CUDNN_ATTENTION] else outside[:3]
    assert inside == [*expected, False]
