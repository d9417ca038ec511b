"""Our policies against NVIDIA kvpress: one prefill of the same tiny model and prompt is compressed by a
kvpress press and by our engine with the policy set to the same rule; the kept positions must agree
on every layer and KV head. kvpress pins transformers < 5.3, so this runs in its own virtualenv
(docs/kvpress.md); elsewhere it is skipped."""

from __future__ import annotations

import pytest
import torch

from foresight.models import tiny_model
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig
from tests.kvpress_env import engine_prefill_kept, kvpress, kvpress_kept

SINKS, LAG, PARTITIONS = 4, 4, 8
LENGTH = SINKS + PARTITIONS * LAG  # LagKV's partitions then tile the prompt after the sinks exactly
KEPT_PER_PARTITION = 2
BUDGET = SINKS + LAG + KEPT_PER_PARTITION * (PARTITIONS - 1)  # no rank ties across partitions at the cut
ARCHS = ("llama", "qwen3")


def ratio_keeping(length: int, kept: int) -> float:
    """A kvpress compression ratio whose n_kept = int(length * (1 - ratio)) is exactly `kept`."""
    ratio = 1 - (kept + 0.5) / length
    assert kvpress.utils.compute_n_kept(length, ratio) == kept
    return ratio


def prompt(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, LENGTH), generator=torch.Generator().manual_seed(seed))


def eager_model(arch: str):
    model = tiny_model(arch)
    model.set_attn_implementation("eager")  # TOVA reads the returned attention weights
    return model


def our_kept(arch: str, policy: str, config: EvictionConfig, ids: torch.Tensor) -> list[list[list[int]]]:
    return engine_prefill_kept(tiny_model(arch), make_policy(policy), config, ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_streaming_matches_streamingllm_press(arch):
    ids = prompt(1)
    press = kvpress.StreamingLLMPress(compression_ratio=ratio_keeping(LENGTH, BUDGET), n_sink=SINKS)
    ours = our_kept(arch, "streaming", EvictionConfig(BUDGET, LAG, sinks=SINKS), ids)
    assert ours == kvpress_kept(eager_model(arch), press, ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_tova_matches_tova_press(arch):
    """kvpress's TOVA always keeps the last token and ranks the rest by the last query's attention,
    averaged over every head of the layer: our tova with a recent window of L = 1."""
    ids = prompt(2)
    press = kvpress.TOVAPress(compression_ratio=ratio_keeping(LENGTH, BUDGET))
    ours = our_kept(arch, "tova", EvictionConfig(BUDGET, 1), ids)
    assert ours == kvpress_kept(eager_model(arch), press, ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_knorm_matches_knorm_press_on_the_candidates(arch):
    """kvpress's Knorm has no recent window: a key's score depends on the key alone, and a causal
    model gives the first T - L tokens the same keys with or without the last L, so kvpress
    compressing the candidates alone to B - L must keep exactly our kept candidates."""
    ids = prompt(3)
    candidates = LENGTH - LAG
    press = kvpress.KnormPress(compression_ratio=ratio_keeping(candidates, BUDGET - LAG))
    ours = our_kept(arch, "knorm", EvictionConfig(BUDGET, LAG, sinks=0), ids)
    ours_candidates = [[[p for p in head if p < candidates] for head in layer] for layer in ours]
    assert ours_candidates == kvpress_kept(eager_model(arch), press, ids[:, :candidates])
    recent = list(range(candidates, LENGTH))
    assert all(head[-LAG:] == recent for layer in ours for head in layer)


@pytest.mark.parametrize("arch", ARCHS)
def test_lagkv_matches_lagkv_press(arch):
    """kvpress's settings: n_sink sinks, partitions of lag_size after them, the last partition kept
    as the window, scores ranked within partitions. Ours: sinks = n_sink, L = lag_size."""
    ids = prompt(4)
    press = kvpress.LagKVPress(compression_ratio=ratio_keeping(LENGTH, BUDGET), n_sink=SINKS, lag_size=LAG)
    ours = our_kept(arch, "lagkv", EvictionConfig(BUDGET, LAG, sinks=SINKS), ids)
    assert ours == kvpress_kept(eager_model(arch), press, ids)


def test_the_serving_worker_decodes_under_decoding_press_and_stops_past_the_cap(tmp_path):
    """`foresight bench serve --kvpress-python`: the kvpress worker runs DecodingPress on the same model
    and prompt, holds at most B + L entries, and stops a run whose cache passes the cap; our engine
    under the same rule holds the same number of entries."""
    import sys

    from foresight.bench.kvpress_worker import KvpressDecoder
    from foresight.bench.serve import EngineDecoder
    from tests.prompts import char_tokenizer, random_prompts

    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    budget, interval, new_tokens = 16, 4, 40
    ids = random_prompts([10])[0]
    worker = KvpressDecoder(sys.executable, "knorm", budget, interval, str(folder), "cpu", "float32", 1, ids)
    try:
        theirs = worker.run(2, new_tokens, None)
        stopped = worker.run(4, new_tokens, theirs.peak_bytes)
    finally:
        worker.close()
    ours = EngineDecoder("knorm", tiny_model("llama"), make_policy("knorm"), EvictionConfig(budget, interval), ids).run(
        2, new_tokens, None
    )
    assert theirs.fits and theirs.tokens_per_second > 0 and not stopped.fits
    assert theirs.peak_entries == budget + interval - 1  # DecodingPress compresses inside the step that reaches B + L
    assert ours.peak_entries == budget + interval == worker.held_entries(new_tokens)
