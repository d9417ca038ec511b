"""The runtime on a CUDA device, in bf16: batches, agreement with transformers, keep sets equal to the
CPU's, flat cache memory, no host synchronisation per layer. Run on a GPU machine with
`pytest -m gpu`; every test is skipped where CUDA is not available."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import foresight.runtime.capture as capture
from foresight.cadence import top_k_mask
from foresight.data.sampler import Request, _Slots
from foresight.models import random_model, tiny_model
from foresight.policies import EvictionContext, make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.sampling import REASONING_SAMPLING, Draws
from tests.decoding import assert_batch_decodes_as_each_row_alone, assert_decodes_alike
from tests.eviction_steps import GROUP, keep_scores, random_context
from tests.policy_lists import SCORED, make
from tests.pooled_runs import assert_replays_alike
from tests.prompts import prompts
from tests.scorers import random_scorer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")
QWEN3_4B = Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3-4b.json"
NOT_IN_THE_ENGINE = {  # what the engine tests below leave out of SCORED (which says what it leaves out), and why
    "triattention": "needs query centres calibrated on the model (`foresight calibrate`); the tests' random "
    "statistics fit the random eviction step's shape only",
}
EVICTING = tuple(name for name in SCORED if name not in NOT_IN_THE_ENGINE)
"""Every registered policy that evicts, less those two lists: foresight with a random scorer."""
if unknown := set(NOT_IN_THE_ENGINE) - set(SCORED):  # fails the collection, on a CPU too
    raise ValueError(f"NOT_IN_THE_ENGINE names policies SCORED does not hold: {', '.join(sorted(unknown))}")


def paper_shaped(layers: int = 2) -> torch.nn.Module:
    """Qwen3-4B's layers (32 query / 8 KV heads x 128 dims, hidden 2560), few of them, a small vocabulary,
    random bf16 weights on the GPU."""
    return random_model(QWEN3_4B, dtype=torch.bfloat16, device=CUDA, num_hidden_layers=layers, vocab_size=4096)


def tiny_on_cuda(arch: str = "qwen3") -> torch.nn.Module:
    return tiny_model(arch).to(device=CUDA, dtype=torch.bfloat16)


# -- batches and transformers -------------------------------------------------------------------------
# Batching, not the policies, is under test: two whose keep sets do not hinge on near-equal scores under bf16
# rounding (tests/test_half_precision.py); the per-policy tests below take every registered policy.
@pytest.mark.parametrize("build", [tiny_on_cuda, paper_shaped], ids=["tiny", "qwen3-4b-shaped"])
@pytest.mark.parametrize("name", ["full", "streaming"])
def test_bf16_batch_decodes_as_each_row_alone(build, name):
    """Left padding on CUDA (SDPA's kernels, or flash-attn's with `cache_leftpad` when installed)."""
    assert_batch_decodes_as_each_row_alone(build(), name, prompts([5, 11, 20], seed=1), 40)


@pytest.mark.parametrize("build", [tiny_on_cuda, paper_shaped], ids=["tiny", "qwen3-4b-shaped"])
def test_full_cache_logits_equal_transformers_own_in_bf16(build):
    """Every decode step's logits equal those of one transformers forward over the whole sequence
    (its own SDPA attention, no cache), and greedy tokens equal transformers' generate up to a near-tie."""
    model = build()
    prompt = prompts([9])[0]
    output = EvictionEngine(model, make_policy("full")).generate([prompt], 48, return_logits=True)
    tokens = output.tokens[0]
    with torch.no_grad():
        forward = model(torch.tensor([prompt + tokens], device=CUDA)).logits[0, len(prompt) - 1 : -1]
    assert_decodes_alike(tokens, output.logits[0], tokens, forward, torch.bfloat16)
    reference = model.generate(
        torch.tensor([prompt], device=CUDA),
        max_new_tokens=48,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    expected_tokens = reference.sequences[0, len(prompt) :].tolist()
    assert_decodes_alike(tokens, output.logits[0], expected_tokens, torch.stack(reference.logits, 1)[0], torch.bfloat16)


@pytest.mark.skipif(not capture.HAS_FLASH_ATTENTION, reason="flash-attn is not installed")
@pytest.mark.parametrize("name", ["full", "streaming"])
def test_flash_attention_decodes_as_sdpa(monkeypatch, name):
    model = paper_shaped()
    batch = prompts([5, 11, 20], seed=1)
    engine = EvictionEngine(model, make_policy(name), EvictionConfig(12, 4) if name != "full" else None)
    flash = engine.generate(batch, 40, return_logits=True)
    monkeypatch.setattr(capture, "HAS_FLASH_ATTENTION", False)
    sdpa = engine.generate(batch, 40, return_logits=True)
    for row in range(len(batch)):
        assert_decodes_alike(flash.tokens[row], flash.logits[row], sdpa.tokens[row], sdpa.logits[row], torch.bfloat16)


@pytest.mark.parametrize("name", ["full", "snapkv"])
def test_unpadded_batches_run_on_the_sdpa_flash_kernel_alone(monkeypatch, name):
    """Rows of one length have no padding: SDPA gets no mask for one query and a lower-right causal bias for a
    chunk, both of which its flash kernel runs. With that kernel alone allowed (a path that needed a mask
    would find no kernel and raise), a decode and a chunked replay give the default kernels' results."""
    monkeypatch.setattr(capture, "HAS_FLASH_ATTENTION", False)  # SDPA's kernels, even where flash-attn is installed
    model = paper_shaped()
    batch = prompts([24, 24], seed=2, vocab=4096)
    policy = make_policy(name)
    engine = EvictionEngine(model, policy, EvictionConfig(16, 4) if policy.evicts else None)

    def run() -> tuple:
        output = engine.generate(batch, 32, return_logits=True)
        sequences = [torch.tensor(prompt + tokens, device=CUDA) for prompt, tokens in zip(batch, output.tokens)]
        return output, engine.replay(sequences, [len(batch[0])] * len(batch), max_chunk=8)

    expected, expected_replay = run()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash, flash_replay = run()
    assert not policy.evicts or flash.stats.evictions > 0
    for row in range(len(batch)):
        assert_decodes_alike(
            flash.tokens[row], flash.logits[row], expected.tokens[row], expected.logits[row], torch.bfloat16
        )
    if flash.tokens == expected.tokens:  # the same sequences replayed: the same losses up to rounding
        for got, want in zip(flash_replay.nll, expected_replay.nll):
            torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.05)


# -- keep sets: CUDA equals CPU ---------------------------------------------------------------------
def on_device(context: EvictionContext, device: torch.device) -> EvictionContext:
    tensors = {
        f.name: value.to(device)
        for f in dataclasses.fields(context)
        if isinstance(value := getattr(context, f.name), torch.Tensor)
    }
    state = {name: value.to(device) for name, value in context.state.items()}
    return dataclasses.replace(context, **tensors, state=state)


def keep_set(name: str, context: EvictionContext) -> torch.Tensor:
    """[batch, Hkv, C] the candidates an eviction step keeps (top C - 4 by keep score, ties: older first)."""
    scores = keep_scores(make(name), context).masked_fill(context.candidate_positions < 0, float("-inf"))
    counts = torch.full((scores.shape[0],), context.num_candidates - 4, device=scores.device)
    return top_k_mask(scores, counts[:, None, None]).cpu()


@pytest.mark.parametrize("name", SCORED)
def test_keep_sets_on_cuda_equal_cpu_in_float32(name):
    for seed in range(3):
        context = random_context(GROUP, seed=seed)
        if name == "foresight":  # its scorer was trained for B = 14 valid candidates in every row
            context.positions = context.positions.clamp(min=0)
        assert torch.equal(keep_set(name, on_device(context, CUDA)), keep_set(name, context)), f"seed {seed}"


# -- memory and host synchronisation -----------------------------------------------------------------
def test_cache_memory_is_flat_after_the_first_eviction():
    model = paper_shaped()
    budget, interval, prompt_length, batch = 64, 16, 20, 4
    engine = EvictionEngine(model, make_policy("snapkv"), EvictionConfig(budget, interval))
    pointers, peaks = [], []

    def record(count: int) -> None:
        layers = engine.last_cache.layers
        pointers.append(tuple(b.data_ptr() for layer in layers for b in layer.storage.buffers.values()))
        peaks.append(torch.cuda.max_memory_allocated())

    torch.cuda.reset_peak_memory_stats()
    output = engine.generate(prompts([prompt_length] * batch), 400, on_token=record)
    assert output.stats.evictions > 10
    first = budget + interval - prompt_length  # the decode step whose forward evicts first
    assert len(set(pointers)) == 1  # allocated once, at the prefill
    layer = engine.last_cache.layers[0]
    entry_bytes = layer.storage.nbytes // layer.storage.slots  # one entry, all rows and layers (stacked)
    steps = len(peaks) - (first + 1)
    # The generated token ids (one small tensor per step) are all that may still grow.
    assert (peaks[-1] - peaks[first + 1]) / steps < entry_bytes / 16


def count_syncs(model, name: str, new_tokens: int) -> tuple[int, int]:
    """Host synchronisations during a decode of `new_tokens`, and its eviction steps."""
    policy = make_policy(
        name, **({"scorer": random_scorer(model, budget=32, interval=8)} if name == "foresight" else {})
    )
    engine = EvictionEngine(model, policy, EvictionConfig(32, 8) if policy.evicts else None)
    engine.generate(prompts([6, 6]), 2)  # warm-up: kernels and allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            output = engine.generate(prompts([6, 6]), new_tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    return syncs, output.stats.evictions


def test_sampler_reads_back_once_per_decode_step():
    """Counter draws in fixed slots: a decode step (sample, release, forward) synchronises with the host
    once, for the tokens and losses it reads back, however many rows it holds."""
    model = tiny_on_cuda("llama")
    batch = _Slots(model, REASONING_SAMPLING, Draws.COUNTER, 8, max_new_tokens=64, eos=set())
    batch.admit([(slot, Request(slot, list(range(3, 10 + slot)), seed=slot)) for slot in range(8)])
    counts = []
    for _ in range(10):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                list(batch.release_ended(batch.sample()))
                batch.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchronizing" in str(w.message) for w in caught))
    assert counts == [1] * 10


@pytest.mark.parametrize("name", ["full", *EVICTING])
def test_no_host_synchronisation_per_layer(name):
    """Doubling the layers adds no sync, per token or per eviction step (the compacted cache's width comes
    from the host's cadence)."""
    shallow, evictions = count_syncs(paper_shaped(layers=2), name, 100)
    deep, deep_evictions = count_syncs(paper_shaped(layers=4), name, 100)
    assert deep_evictions == evictions
    assert deep == shallow


class SyncsRaise:
    """An eviction-step observer under which any host synchronisation raises."""

    def __enter__(self) -> None:
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", [*EVICTING, "sampled"])
def test_eviction_step_of_rows_in_step_never_synchronises(name):
    """Zero host syncs inside the eviction step (tests/test_host_reads.py counts the same reads on a CPU). The
    scorer starts on the GPU: a scorer loaded on the CPU is copied over once, at its first step, and that copy
    synchronises. EpiKV, RaaS and random-prompt run 3 eviction steps here (the same on a CPU), the others 7."""
    model = paper_shaped()
    sequence = torch.tensor(prompts([200], vocab=4096)[0], device=CUDA)
    if name in ("foresight", "sampled"):
        scorer = random_scorer(model, budget=64, interval=16).to(CUDA)
        options = {"mode": "sampled", "row_seeds": (1, 2, 3, 4)} if name == "sampled" else {}
        policy = make_policy("foresight", scorer=scorer, **options)
    else:
        policy = make_policy(name)
    engine = EvictionEngine(model, policy, EvictionConfig(64, 16, sinks=0), step_observer=SyncsRaise())
    output = engine.replay([sequence] * 4, [80] * 4)
    assert output.stats.evictions >= (3 if name in ("epikv", "raas", "random-prompt") else 7)


def test_decoding_never_calls_cudnn_attention():
    """cuDNN's SDPA builds a graph for every new key length, about 1 ms of host time per call in a Qwen3-4B
    decode step on an H200 (docs/notes/gpu-acceptance.md): the runtime runs SDPA's other kernels."""
    engine = EvictionEngine(paper_shaped(), make_policy("full"), None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        engine.generate([list(range(3, 40))] * 2, 8)
    names = {event.key for event in profiler.key_averages()}
    assert any(name.startswith("aten::_scaled_dot_product") for name in names)
    assert not [name for name in names if "cudnn_attention" in name]


@pytest.mark.parametrize("name", ["snapkv", "foresight"])
def test_a_cuda_graph_decodes_as_the_eager_engine(name):
    """The static step captured in a CUDA graph and replayed at every token (float32, ragged rows evicting at
    different forwards): the eager engine's tokens and evictions, logits within float32 rounding."""
    model = tiny_on_cuda("llama").float()
    options = {"scorer": random_scorer(model, feature_set="standardised")} if name == "foresight" else {}
    outputs = [
        EvictionEngine(model, make_policy(name, **options), EvictionConfig(12, 4), decode_step=step).generate(
            prompts([7, 19, 12], seed=1), 40, return_logits=True
        )
        for step in ("eager", "graph")
    ]
    assert outputs[1].tokens == outputs[0].tokens
    assert outputs[1].stats.row_evictions == outputs[0].stats.row_evictions
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["snapkv", "tova"])
def test_the_pooled_layout_replays_as_the_per_head_one_on_cuda(name):
    """The pooled layout's owner-masked SDPA and its step's views on CUDA, float32: the per-head layout's kept sets and
    token losses (the CPU twin's, tests/test_pooled_layout.py)."""
    assert_replays_alike(tiny_model("llama").to(CUDA), lambda: make_policy(name))
